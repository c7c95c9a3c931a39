"""The speculative decoding loop: draft -> one target forward -> verify -> commit -> roll back.

`_decode` is the algorithm (speculative decoding, arXiv 2211.17192; its sampling rule also arXiv
2302.01318): prefill the prompt, then per round draft up to gamma tokens, verify them with one forward of
the target, commit the accepted ones and the target's next token, and deliver them. A request's state is
one `_Request`; a round's lazy result one `_Round`; its times, counters and the policy's learning sit
beside the loop in feedback.py, called once per round.

Cache convention (target): between rounds the target's KV cache holds every committed token except the
last one, the *pending* token, whose KV the next round's forward computes: offset == len(prompt) +
committed - 1. The same holds when the token generator stops for any reason (exhausted at max_tokens,
closed by the consumer mid-round after EOS or a stop string): offset == len(prompt) + yielded - 1, where
`yielded` counts the tokens the consumer received, exactly the state of plain decoding with the last
yielded token still pending. Rejected draft tokens are never kept: the cache is trimmed through mlx-lm's
trim protocol and the trimmed count is checked.

When a plain round (no draft) is to be followed by another plain round whatever token it commits (the
scheduler decides so before the token is known: `plain_next`), the next round's forward is built on the
lazy token and launched before the current one is read back, as plain decoding does; building a forward's
graph then overlaps the previous one's computation. A round launched so drafts nothing, whatever proposal
the new token brings. A consumer that stops meanwhile gets the launched round trimmed too. Every round's
forward (plain or verify) replays a compiled graph where one applies (`compiled`, generation/compiled.py):
a round that waits for the read-back builds its forward on the critical path, and a replay costs a fraction
of what the model's Python does.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from ..defaults import CLEAR_CACHE_ROUNDS, MAX_VERIFY_WIDTH, PREFILL_STEP_SIZE
from ..errors import MlxInferError
from ..generation.compiled import CompiledDecode
from ..generation.decode import decode_stream
from ..generation.logprobs import LogprobQueue
from ..generation.sampling import SamplingParams, build_logits_processors
from ..structured.grammar import GrammarState
from .capture import TargetTaps
from .constrained import GrammarDraft, build_draft, commit as grammar_commit
from .drafters.base import Draft, Drafter
from .feedback import RoundClock, RoundReport, SpecStats, learn
from .schedule import DraftPolicy, FixedGamma
from .target import output_vocab
from .verify import verify_round


def check_rollback(cache: Sequence, needed: int) -> None:
    """Raise MlxInferError (before generation) unless every layer cache can roll back for a whole request.

    Args:
        cache: the target's per-layer caches (mlx-lm cache objects).
        needed: the most tokens the cache will ever hold (prompt + max_tokens + max draft).
    """
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise MlxInferError(
            f"speculative decoding needs a KV cache that can roll back; this model uses {', '.join(kinds)}: "
            "use speculative='off'"
        )
    for c in cache:
        if isinstance(c, RotatingKVCache) and needed > c.max_size:
            raise MlxInferError(
                f"speculative decoding cannot roll back this model's sliding-window cache past {c.max_size} "
                f"tokens (this request may need {needed}); shorten it or use speculative='off'"
            )


def _trim(cache: Sequence, n: int) -> None:
    """Drop the last n tokens of every layer cache; raise if a layer did not drop exactly n."""
    if n < 0:
        raise ValueError(f"cannot trim {n} tokens")
    if n == 0:
        return
    for c in cache:
        if not 0 <= n <= c.offset:
            raise RuntimeError(f"cannot trim {n} tokens from a cache holding {c.offset}")
        got = c.trim(n)
        if got != n:
            raise RuntimeError(f"KV rollback trimmed {got} tokens, expected {n}")


def _fit_vocab(q: mx.array, vocab: int) -> mx.array:
    """Pad with zeros or cut a [g, V'] draft distribution to the target's V (a draft token outside the
    target's vocabulary has target probability 0: its q mass drops out of every residual)."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:, :vocab]
    return mx.concatenate([q, mx.zeros((q.shape[0], vocab - q.shape[-1]), q.dtype)], axis=-1)


def _in_vocab(tokens: List[int], vocab: int) -> int:
    """How many leading draft tokens lie inside the target's vocabulary [0, vocab)."""
    return next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), len(tokens))


@dataclass
class _Proposal:
    """A round's draft as the target verifies it.

    Attributes:
        tokens: the draft tokens to verify (g ints, all inside the target's vocabulary; [] for a plain round).
        outside: tokens the drafter proposed after them that lie outside the target's vocabulary (the first
            is rejected for certain, so the forward stops before it and its q row shapes the residual).
        draft: the drafter's Draft (its q and key), None when nothing was asked for.
        grammar: the draft built under the request's grammar (its forced tokens, masks and q rows; tokens
            is its tokens), None without a grammar.
    """

    tokens: List[int] = field(default_factory=list)
    outside: int = 0
    draft: Optional[Draft] = None
    grammar: Optional[GrammarDraft] = None


@dataclass
class _Round:
    """One round's target forward, lazy until read back.

    Attributes:
        proposal: what it verifies.
        n, nxt: lazy scalars: the accepted draft tokens (n <= g) and the target's next token.
        rows: the taps of the forward's g+1 positions ([1, g+1, n*H]), None without taps.
        ahead: launched before the previous round was read back (then it drafts nothing).
        logits: the forward's raw logits [g+1, V] (the committed rows' log-softmax are the logprobs).
    """

    proposal: _Proposal
    n: mx.array
    nxt: mx.array
    rows: Optional[mx.array] = None
    ahead: bool = False
    logits: Optional[mx.array] = None


@dataclass
class _Request:
    """One speculative request: what `speculative_tokens` was given (see there) and the state its rounds share.

    Attributes (state, set by `_prefill_prompt` and the rounds):
        forward: what runs the rounds' forwards: `compiled` where it applies, else the model
            ([1, g+1] uint32 tokens -> [1, g+1, V] logits).
        processors: the logits processors of `params` (mlx-lm's; they need the history).
        vocab: the target's output vocabulary size V.
        history: prompt + committed tokens; history[-1] is the pending token (not in the cache).
        produced: tokens delivered to the consumer.
        ahead: a plain round launched before the previous round was read back, or None.
        forced_left: forced tokens the previous round's draft left for this one (constrained.commit).
        grammar_mark: (the grammar's consumed count before the last round's commit, that round's committed
            count), to leave the grammar after the tokens delivered when the request stops mid-round.
    """

    model: nn.Module
    prompt_ids: List[int]
    params: SamplingParams
    max_tokens: int
    drafter: Drafter
    policy: DraftPolicy
    stats: SpecStats
    cache: Optional[list]
    start: int
    progress: Optional[Callable[[int, int], None]]
    compiled: Optional[CompiledDecode]
    taps: Optional[TargetTaps]
    grammar: Optional[GrammarState] = None
    logprobs: Optional[LogprobQueue] = None
    forward: Any = None
    processors: list = field(default_factory=list)
    vocab: int = 0
    history: List[int] = field(default_factory=list)
    produced: int = 0
    ahead: Optional[_Round] = None
    forced_left: List[int] = field(default_factory=list)
    grammar_mark: Tuple[int, int] = (0, 0)


def speculative_tokens(
    model: nn.Module,
    prompt_ids: List[int],
    params: SamplingParams,
    max_tokens: int,
    drafter: Drafter,
    max_draft: Union[int, DraftPolicy],
    stats: Optional[SpecStats] = None,
    cache: Optional[list] = None,
    start: int = 0,
    progress: Optional[Callable[[int, int], None]] = None,
    compiled: Optional[CompiledDecode] = None,
    *,
    grammar: Optional[GrammarState] = None,
    logprobs: Optional[LogprobQueue] = None,
) -> Iterator[int]:
    """Token ids of speculative decoding: the same tokens as plain decoding (greedy), or tokens with the same
    distribution (sampling; arXiv 2211.17192, 2302.01318).

    Args:
        model: the target, an mlx-lm model.
        prompt_ids: the prompt, token ids (non-empty).
        params: sampling parameters (validated).
        max_tokens: most tokens to yield (>= 1); no round drafts past it.
        drafter: proposes draft tokens.
        max_draft: gamma, an int >= 0 (schedule.FixedGamma), or a schedule.DraftPolicy asked every round.
        stats: SpecStats to fill in (optional).
        cache: the target's per-layer caches to use (made with make_prompt_cache when None); see the
            module docstring for the offset convention.
        start: prompt tokens the cache already holds (prompt_ids[:start], a kept prefix; 0 for a fresh
            cache); at most len(prompt_ids) - 1. A drafter fed the target's taps needs them for the whole
            prompt, so the cache is then trimmed to empty and the prompt prefilled whole.
        progress: callable(done, total) during prefill, prompt tokens, as plain decoding calls it: (start,
            total) first, after each prefill chunk, and (total, total) once the first token is computed.
        compiled: the target's CompiledDecode of verify widths (SpecState.forward: its traces serve every
            request), which runs the rounds' forwards (the prefill stays the model's) where
            CompiledDecode.applies and the drafter taps no layers; None: the model builds each forward.
        grammar: the request's GrammarState (None: unconstrained), in its initial state: every row is
            picked / verified under its mask, the committed tokens are consumed into it, and drafts are built
            under it with its forced tokens (constrained.py); greedy output equals plain constrained decoding
            (generation/decode.plain_tokens with the same grammar), sampled output has its distribution.
        logprobs: the request's LogprobQueue (None: none): each round adds the raw logits rows of its
            committed tokens before yielding them.

    Yields:
        int token ids, one at a time (close the generator to stop early; the cache is then rolled back to
        the tokens yielded).

    Raises:
        MlxInferError: the target's cache cannot roll back, or the drafter taps layers the target lacks
            (raised at the first `next`, before any forward).

    A drafter with `wants_hidden` (DFlash, DSpark) gets the target's taps of the committed positions: the
    tapped layers are wrapped (capture.TargetTaps) for the request and restored when the generator ends.
    """
    policy = FixedGamma(max_draft) if isinstance(max_draft, int) else max_draft
    taps = TargetTaps(model, drafter.target_layer_ids) if drafter.wants_hidden else None
    req = _Request(model, prompt_ids, params, max_tokens, drafter, policy,
                   stats if stats is not None else SpecStats(), cache, start, progress, compiled, taps,
                   grammar, logprobs)
    with mx.stream(decode_stream()):
        if taps is None:
            return (yield from _decode(req))
        with taps:
            return (yield from _decode(req))


def _decode(req: _Request) -> Iterator[int]:
    """The algorithm: prefill, then rounds of draft -> verify (one target forward) -> commit -> deliver.

    Each round verifies [pending] + g draft tokens in one forward and commits the n accepted ones and the
    target's own next token (n + 1 >= 1 tokens a round: greedy, the same as plain decoding; sampling, the
    same distribution, arXiv 2211.17192 / 2302.01318). The clock, the stats and the policy learn from each
    round beside it (feedback.py); a round after which the next is plain anyway launches that one ahead.
    """
    _prefill_prompt(req)
    clock = RoundClock()
    while req.produced < req.max_tokens:
        clock.start()
        if req.ahead is not None:  # launched during the previous round: it drafts nothing
            rnd, req.ahead = req.ahead, None
        else:
            proposal = _draft(req)
            clock.drafted()
            rnd = _verify_round(req, proposal)
        if _plain_next(req, rnd):
            req.ahead = _launch_ahead(req, rnd)
        n, nxt = _read_back(req, rnd)
        clock.synced()
        learn(req.stats, req.policy, _report(req, rnd, n), clock)
        committed = _commit(req, rnd, n, nxt)
        yield from _deliver(req, committed)


def _check_request(req: _Request) -> None:
    """Make or check the cache before any forward: a fresh cache when none was given, one that can roll back
    the whole request, and emptied for a drafter that needs the whole prompt's taps.

    Raises:
        MlxInferError: the cache cannot roll back (check_rollback).
        ValueError: the cache does not hold exactly prompt_ids[:start], or start is past the prompt's end.
    """
    if req.cache is None:
        req.cache, req.start = make_prompt_cache(req.model), 0
    check_rollback(req.cache, len(req.prompt_ids) + req.max_tokens + req.policy.limit)
    if req.taps is not None and req.start:
        _trim(req.cache, req.start)  # the drafter needs the taps of the whole prompt
        req.start = 0
    if not 0 <= req.start < len(req.prompt_ids) or req.cache[0].offset != req.start:
        raise ValueError(f"the cache holds {req.cache[0].offset} tokens, expected the prompt's first {req.start}")


def _prefill_prompt(req: _Request) -> None:
    """Check the request, then prefill all but the last prompt token (the first pending token), as mlx-lm's
    generate_step, and start the drafter; progress as plain decoding reports it: (start, total) first, after
    each chunk, (total, total) with the first token (`_read_back`)."""
    req.stats.mode = req.drafter.name
    _check_request(req)
    if req.params.seed is not None:
        mx.random.seed(req.params.seed)
    req.processors = build_logits_processors(req.params)
    req.vocab = output_vocab(req.model)
    total = len(req.prompt_ids)
    if req.progress is not None:
        req.progress(req.start, total)
    feats = _prefill(req.model, req.cache, req.prompt_ids[req.start:-1], req.taps, req.start, total, req.progress)
    # the rounds' forwards: replayed traces where they apply (a tapped layer is seen only by the model's Python)
    compiled = req.compiled
    applies = compiled is not None and req.taps is None and CompiledDecode.applies(req.model, req.cache)
    req.forward = compiled if applies else req.model
    if req.taps is None:
        req.drafter.begin(req.prompt_ids, req.params)
    else:
        req.drafter.begin(req.prompt_ids, req.params, hidden=mx.concatenate(feats, axis=1) if feats else None)
    req.history = list(req.prompt_ids)


def _prefill(model, cache, tokens: List[int], taps: Optional[TargetTaps], done: int, total: int,
             progress: Optional[Callable[[int, int], None]]) -> List[mx.array]:
    """Run `tokens` through the target into the cache in PREFILL_STEP_SIZE chunks; returns the taps of each
    chunk ([1, rows, n*H], taps only). done / total: prompt tokens before these / in all, for `progress`."""
    feats = []
    for s in range(0, len(tokens), PREFILL_STEP_SIZE):
        chunk = tokens[s : s + PREFILL_STEP_SIZE]
        model(mx.array(chunk)[None], cache=cache)
        mx.eval([c.state for c in cache])
        if taps is not None:
            feats.append(taps.features())
        if progress is not None:
            progress(done + s + len(chunk), total)
    return feats


def _draft(req: _Request) -> _Proposal:
    """Draft: ask the policy for gamma (bounded by the tokens left and MAX_VERIFY_WIDTH) and the drafter for
    that many tokens after the history; a free drafter proposes the most and the policy keeps what pays. A
    draft token outside the target's vocabulary ends what is verified (`_Proposal.outside`)."""
    gamma = max(0, min(int(req.policy.gamma()), req.max_tokens - req.produced - 1, MAX_VERIFY_WIDTH - 1))
    if req.grammar is not None:
        return _draft_constrained(req, gamma)
    draft = req.drafter.propose(req.history, gamma, req.policy.worth) if gamma > 0 else None
    tokens = list(draft.tokens[:gamma]) if draft else []
    if tokens:
        tokens = tokens[: req.policy.cut(draft)]
    inside = _in_vocab(tokens, req.vocab)
    return _Proposal(tokens[:inside], len(tokens) - inside, draft)


def _draft_constrained(req: _Request, gamma: int) -> _Proposal:
    """Draft under the request's grammar (constrained.build_draft): its forced tokens (certain accepts) and
    the drafter's tokens it allows, at most gamma of the drafter's, the whole within the verify width and the
    tokens left; the grammar is left after the draft."""
    limit = max(0, min(req.max_tokens - req.produced - 1, MAX_VERIFY_WIDTH - 1))
    sampled = not req.params.greedy

    def ask(context: List[int], room: int):
        draft = req.drafter.propose(context, room, req.policy.worth)
        tokens = list(draft.tokens[:room])
        if tokens:
            tokens = tokens[: req.policy.cut(draft)]
        q = _fit_vocab(draft.q[: len(tokens)], req.vocab) if sampled and draft.q is not None and tokens else None
        return draft, tokens, q

    built = build_draft(req.grammar, req.vocab, req.drafter, req.history, ask, limit, gamma, req.forced_left)
    req.forced_left = []
    return _Proposal(built.tokens, int(built.refused), built.draft, built)


def _verify_round(req: _Request, proposal: _Proposal) -> _Round:
    """Verify (lazily): one target forward over [pending] + the g draft tokens, appending their g+1 tokens to
    the cache, and the accept / reject of the drafts against its logits (verify.verify_round)."""
    tokens = proposal.tokens
    block = mx.array([req.history[-1]] + tokens, dtype=mx.uint32)  # [g+1]
    logits = req.forward(block[None], cache=req.cache)[0].astype(mx.float32)  # [g+1, V]
    rows = req.taps.features() if req.taps is not None else None  # [1, g+1, n*H]
    if proposal.grammar is not None:
        return _verify_constrained(req, proposal, logits, rows)
    q = rejected_q = None
    draft = proposal.draft
    if not req.params.greedy and draft is not None and draft.q is not None:
        q_all = _fit_vocab(draft.q[: len(tokens) + (proposal.outside > 0)], req.vocab)  # [g (+1), V]
        q = q_all[: len(tokens)]
        rejected_q = q_all[len(tokens)] if proposal.outside else None
    n, nxt = verify_round(logits, req.history, tokens, req.params, req.processors, q, rejected_q)
    return _Round(proposal, n, nxt, rows, logits=logits)


def _verify_constrained(req: _Request, proposal: _Proposal, logits: mx.array, rows) -> _Round:
    """The verify of a draft built under the grammar: row i masked by the draft's mask i, the last row by the
    mask after the whole draft (read from the grammar's mask thread once the forward is launched)."""
    built = proposal.grammar
    mx.async_eval(logits)  # the forward runs while the bonus row's mask is computed
    bonus = built.bonus if built.bonus is not None else req.grammar.mask()
    q = built.q if not req.params.greedy else None
    rejected_q = built.refused_q if not req.params.greedy else None
    n, nxt = verify_round(logits, req.history, proposal.tokens, req.params, req.processors, q, rejected_q,
                     masks=built.masks + [bonus])
    return _Round(proposal, n, nxt, rows, logits=logits)


def _plain_next(req: _Request, rnd: _Round) -> bool:
    """Whether the round after `rnd` is plain whatever token `rnd` commits: `rnd` drafts nothing, no logits
    processor needs the history, no grammar (its mask and forced tokens need the token), a token is left
    after it, and the policy says so (DraftPolicy.plain_next)."""
    if rnd.proposal.tokens or req.processors or req.grammar is not None or req.produced + 1 >= req.max_tokens:
        return False  # a grammar's mask needs the token
    return req.policy.plain_next(req.drafter.possible_keys(req.history) if req.drafter.free else None)


def _launch_ahead(req: _Request, rnd: _Round) -> _Round:
    """Launch the next (plain) round on `rnd`'s lazy token while `rnd` computes (as mlx-lm's generate_step),
    so that building its graph costs no time; its forward appends one token to the cache."""
    mx.async_eval(rnd.n, rnd.nxt)
    token = rnd.nxt.astype(mx.uint32).reshape(1, 1)
    logits = req.forward(token, cache=req.cache)[0].astype(mx.float32)  # [1, V]
    rows = req.taps.features() if req.taps is not None else None
    # the verify of an empty draft (no logits processors: they need the history)
    n, nxt = verify_round(logits, (), [], req.params, None, None)
    mx.async_eval(n, nxt)
    return _Round(_Proposal(), n, nxt, rows, ahead=True, logits=logits)


def _read_back(req: _Request, rnd: _Round) -> Tuple[int, int]:
    """The round's one host sync: (accepted count n, next token). The first one ends the prompt's prefill."""
    mx.eval(rnd.n, rnd.nxt)
    if req.progress is not None:
        req.progress(len(req.prompt_ids), len(req.prompt_ids))
        req.progress = None
    return int(rnd.n.item()), int(rnd.nxt.item())


def _report(req: _Request, rnd: _Round, n: int) -> RoundReport:
    """What a read-back round did, for feedback.learn (before its commit: a free drafter's offer is that of
    the context the round drafted after)."""
    proposal, free = rnd.proposal, req.drafter.free
    verified, accepted, forced = len(proposal.tokens), n, 0
    if proposal.grammar is not None:  # the drafter's tokens, and the forced ones committed beside them
        verified = proposal.grammar.drafted
        accepted, forced = proposal.grammar.split(n)
    return RoundReport(verified=verified, accepted=accepted, outside=proposal.outside > 0,
                       key=proposal.draft.key if proposal.draft is not None else None, ahead=rnd.ahead,
                       offered=free, offer_key=req.drafter.offer_key(req.history) if free else None,
                       forced=forced)


def _commit(req: _Request, rnd: _Round, n: int, nxt: int) -> List[int]:
    """Commit: keep [pending] + the n accepted drafts in the cache (the forward appended g+1 tokens: roll back
    g - n), append them and nxt to the history (nxt becomes pending), leave the grammar after them, record
    their logprobs (raw rows 0..n), tell the drafter. Returns the n + 1 committed tokens."""
    tokens = rnd.proposal.tokens
    committed = tokens[:n] + [nxt]
    _trim(req.cache, len(tokens) - n)
    if rnd.proposal.grammar is not None:
        req.grammar_mark = (req.grammar.consumed - len(tokens), len(committed))  # the draft is consumed
        req.forced_left = grammar_commit(req.grammar, rnd.proposal.grammar, n, nxt)
    elif req.grammar is not None:  # a round with no draft built under the grammar (none is launched ahead)
        raise RuntimeError("a constrained round without a constrained draft")
    if req.logprobs is not None:
        req.logprobs.add(rnd.logits[: n + 1], committed)
    req.history.extend(committed)
    if req.taps is None:
        req.drafter.update(n, committed)
    else:  # only committed positions: the old pending token and the accepted drafts
        req.drafter.update(n, committed, hidden=rnd.rows[:, : n + 1])
    if req.stats.rounds % CLEAR_CACHE_ROUNDS == 0:
        mx.clear_cache()  # as mlx-lm's generate_step: return freed buffers to the system now and then
    return committed


def _deliver(req: _Request, committed: List[int]) -> Iterator[int]:
    """Yield a round's committed tokens up to max_tokens. Where the consumer stops (closes the generator) or
    max_tokens ends the request, roll the cache back to the tokens delivered (`_keep_delivered`)."""
    for i, tok in enumerate(committed):
        try:
            yield tok
        except GeneratorExit:
            _keep_delivered(req, len(committed) - (i + 1))
            raise
        req.produced += 1
        if req.produced >= req.max_tokens:
            _keep_delivered(req, len(committed) - (i + 1))
            return


def _keep_delivered(req: _Request, undelivered: int) -> None:
    """The request ends with `undelivered` of its last round's tokens not delivered: drop them from the cache
    (and the round launched ahead, if any) so that it holds the tokens delivered, the last one pending, and
    from the stats' committed count; the grammar is left after the tokens delivered (a batch takes a lone
    request back from speculative decoding this way and goes on with its grammar)."""
    _trim(req.cache, undelivered + (req.ahead is not None))
    if req.grammar is not None and undelivered:
        base, committed = req.grammar_mark
        req.grammar.rollback(max(0, req.grammar.consumed - (base + committed - undelivered)))
    req.stats.undeliver(undelivered)
