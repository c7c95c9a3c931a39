"""The speculative decoding loop: draft -> one target forward -> verify -> commit -> roll back.

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
a round that waits for the read-back builds its forward on the critical path, and a replay costs about a
third of what the model's Python does (0.5 against 1.6 ms for the default model on a Zen 5 VM).
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from ..defaults import CLEAR_CACHE_ROUNDS, MAX_VERIFY_WIDTH, PREFILL_STEP_SIZE
from ..errors import MlxInferError
from ..generation.compiled import CompiledDecode
from ..generation.decode import decode_stream
from ..generation.sampling import SamplingParams, build_logits_processors
from .capture import TargetTaps
from .drafters.base import Drafter
from .schedule import DraftPolicy, FixedGamma
from .target import output_vocab
from .verify import probabilities, process_logits, sample_plain, verify_greedy, verify_sampling


@dataclass
class SpecStats:
    """Counters of one speculative request (mutated by the loop while it runs).

    Attributes:
        mode: the drafter used ("lookup", "draft", ...).
        rounds: target forwards (one per round).
        committed: tokens committed by the rounds and delivered (a round's tokens past the point where the
            consumer stopped, e.g. after EOS inside an accepted block, are not counted).
        draft_s: seconds spent proposing (including the draft model's forwards).
        verify_s: seconds spent in the target forward + accept/reject (including the host sync).
        proposed: proposed[i] = rounds that proposed a draft token at position i (0-based).
        accepted: accepted[i] = rounds whose draft token at position i was accepted.
    """

    mode: str = ""
    rounds: int = 0
    committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: List[int] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Committed tokens per target forward."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> List[float]:
        """Per-position acceptance rates: accepted[i] / proposed[i]."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def record(self, n_proposed: int, n_accepted: int, n_committed: int) -> None:
        self.rounds += 1
        self.committed += n_committed
        while len(self.proposed) < n_proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for i in range(n_proposed):
            self.proposed[i] += 1
            self.accepted[i] += i < n_accepted


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


def _verify(logits: mx.array, history, tokens: List[int], params: SamplingParams, processors, q,
            rejected_q: Optional[mx.array] = None):
    """Lazy (accepted count, next token) of one round: logits [g+1, V] of [pending] + tokens (g ints),
    q the draft's [g, V] probabilities or None (deterministic drafter); rejected_q: [V] q row of a next
    draft token outside the target's vocabulary (verify.verify_sampling)."""
    processed = process_logits(logits, history, tokens, params, processors)  # [g+1, V]
    draft_arr = mx.array(tokens, dtype=mx.int32)  # [g]
    if params.greedy:
        return verify_greedy(draft_arr, processed)
    if not tokens and rejected_q is None:
        return sample_plain(processed)
    return verify_sampling(draft_arr, probabilities(processed), q, rejected_q=rejected_q)


def _plain_round(model, cache, taps, token: mx.array, params: SamplingParams):
    """Build (lazily) a plain round on a pending token that is not yet evaluated: [1] uint32 -> (n, next
    token, taps rows), as the verify of an empty draft (no logits processors: they need the history)."""
    logits = model(token.astype(mx.uint32).reshape(1, 1), cache=cache)[0].astype(mx.float32)  # [1, V]
    rows = taps.features() if taps is not None else None
    return (*_verify(logits, (), [], params, None, None), rows)


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
    args = (model, prompt_ids, params, max_tokens, drafter, policy, stats, cache, start, progress, compiled)
    with mx.stream(decode_stream()):
        if taps is None:
            return (yield from _rounds(*args, None))
        with taps:
            return (yield from _rounds(*args, taps))


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


def _rounds(model, prompt_ids, params, max_tokens, drafter: Drafter, policy: DraftPolicy, stats, cache, start,
            progress, compiled: Optional[CompiledDecode], taps: Optional[TargetTaps]) -> Iterator[int]:
    """The rounds of `speculative_tokens` (same arguments); taps: installed TargetTaps, or None."""
    stats = stats if stats is not None else SpecStats()
    stats.mode = drafter.name
    if cache is None:
        cache, start = make_prompt_cache(model), 0
    check_rollback(cache, len(prompt_ids) + max_tokens + policy.limit)
    if taps is not None and start:
        _trim(cache, start)  # the drafter needs the taps of the whole prompt
        start = 0
    if not 0 <= start < len(prompt_ids) or cache[0].offset != start:
        raise ValueError(f"the cache holds {cache[0].offset} tokens, expected the prompt's first {start}")
    if params.seed is not None:
        mx.random.seed(params.seed)
    processors = build_logits_processors(params)
    vocab = output_vocab(model)

    # Prefill all but the last prompt token (the first pending token), as mlx-lm's generate_step; progress
    # as plain decoding reports it: (start, total) first, after each chunk, (total, total) with the first token
    total = len(prompt_ids)
    if progress is not None:
        progress(start, total)
    feats = _prefill(model, cache, prompt_ids[start:-1], taps, start, total, progress)
    # the rounds' forwards: replayed traces where they apply (a tapped layer is seen only by the model's Python)
    forward = compiled if compiled is not None and taps is None and CompiledDecode.applies(model, cache) else model
    if taps is None:
        drafter.begin(prompt_ids, params)
    else:
        drafter.begin(prompt_ids, params, hidden=mx.concatenate(feats, axis=1) if feats else None)

    history = list(prompt_ids)  # prompt + committed; history[-1] is pending (not in the cache)
    produced = 0
    ahead = None  # a plain round launched before the previous round was synced: (n, nxt, rows)
    last_sync = time.perf_counter()  # the previous round's read-back
    while produced < max_tokens:
        t0 = time.perf_counter()
        launched = ahead is not None
        if launched:
            draft, tokens, outside = None, [], 0
            (n_arr, nxt_arr, rows), ahead = ahead, None
            t1 = t0
        else:
            gamma = max(0, min(int(policy.gamma()), max_tokens - produced - 1, MAX_VERIFY_WIDTH - 1))
            draft = drafter.propose(history, gamma, policy.worth) if gamma > 0 else None
            tokens = list(draft.tokens[:gamma]) if draft else []
            if tokens:  # a free drafter proposed the most; keep what pays
                tokens = tokens[: policy.cut(draft)]
            # A draft token outside the target's vocabulary has target probability 0: it is rejected for
            # certain, so the forward stops before it and its q row shapes the residual (verify_sampling).
            inside = _in_vocab(tokens, vocab)
            outside, tokens = len(tokens) - inside, tokens[:inside]
            t1 = time.perf_counter()

            block = mx.array([history[-1]] + tokens, dtype=mx.uint32)  # [g+1]
            logits = forward(block[None], cache=cache)[0].astype(mx.float32)  # [g+1, V]
            rows = taps.features() if taps is not None else None  # [1, g+1, n*H]
            q = rejected_q = None
            if not params.greedy and draft is not None and draft.q is not None:
                q_all = _fit_vocab(draft.q[: len(tokens) + (outside > 0)], vocab)  # [g (+1), V]
                q = q_all[: len(tokens)]
                rejected_q = q_all[len(tokens)] if outside else None
            n_arr, nxt_arr = _verify(logits, history, tokens, params, processors, q, rejected_q)
        g = len(tokens)
        if not tokens and not processors and produced + 1 < max_tokens and policy.plain_next(
                drafter.possible_keys(history) if drafter.free else None):
            # This round and the next are plain steps: build the next one on this one's lazy token while
            # this one computes (as mlx-lm's generate_step), so that building the graph costs no time.
            mx.async_eval(n_arr, nxt_arr)
            ahead = _plain_round(forward, cache, taps, nxt_arr, params)
            mx.async_eval(ahead[0], ahead[1])
        mx.eval(n_arr, nxt_arr)  # the round's one host sync
        if progress is not None:  # the first round's forward ends the prompt's prefill
            progress(total, total)
            progress = None
        n, nxt = int(n_arr.item()), int(nxt_arr.item())
        t2 = time.perf_counter()
        round_s, last_sync = t2 - last_sync, t2

        committed = tokens[:n] + [nxt]
        # the forward appended g+1 tokens; keep history[-1] + tokens[:n] (nxt becomes pending)
        _trim(cache, g - n)
        if drafter.free:  # (launched ahead or not) how often each bucket has a proposal: plain_next weighs it
            policy.offered(drafter.offer_key(history))
        history.extend(committed)
        if taps is None:
            drafter.update(n, committed)
        else:  # only committed positions: the old pending token and the accepted drafts
            drafter.update(n, committed, hidden=rows[:, : n + 1])
        stats.record(g + (outside > 0), n, len(committed))
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        policy.observe(g, n, t1 - t0, t2 - t1, key=draft.key if draft is not None else None, ahead=launched,
                       round_s=round_s)
        if stats.rounds % CLEAR_CACHE_ROUNDS == 0:
            mx.clear_cache()  # as mlx-lm's generate_step: return freed buffers to the system now and then

        for i, tok in enumerate(committed):
            try:
                yield tok
            except GeneratorExit:
                # consumer stopped: keep only the tokens it received (the last of them stays pending),
                # dropping the round launched ahead too
                _trim(cache, len(committed) - (i + 1) + (ahead is not None))
                stats.committed -= len(committed) - (i + 1)  # tau counts delivered tokens only
                raise
            produced += 1
            if produced >= max_tokens:
                _trim(cache, len(committed) - (i + 1) + (ahead is not None))
                stats.committed -= len(committed) - (i + 1)
                return
