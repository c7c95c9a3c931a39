"""Speculative decoding in lockstep over a group: rank 0 drafts and verifies, every rank runs each verify forward.

    for token in spec_lockstep_tokens(shard, prompt_ids if rank 0 else None, params, max_draft=8):
        ...                                     # the same token ids on every rank, as lockstep_tokens'

A round, after the prompt's prefill (generate.py's chunks):

1. rank 0 verifies the logits of the last forward (verify.verify_round, the one-process loop's verify: greedy
   the longest draft prefix equal to the argmax, sampling exact speculative sampling), cuts the committed
   tokens at EOS, a stop string or max_tokens, and drafts the next round from the history (prompt lookup:
   drafters/lookup.py's LookupDrafter over the prompt and the tokens so far);
2. one broadcast (an int32 all_sum of a fixed width, group.broadcast_ints) carries to every rank whether the
   generation ends, the accepted count, the committed tokens and the next draft;
3. every rank yields the committed tokens, trims its KV cache by the rejected draft tokens (the cache then
   holds every committed token but the last, the pending one) and runs one forward over [pending] + draft on
   its shard: tensor parallel's all_sums and pipeline's gather give every rank the same logits [g + 1, V].

The drafter runs on rank 0 only, its tokens broadcast with the round's result: prompt lookup is a substring
search over the history (microseconds), so one rank drafting costs nothing, and the draft travels in the
broadcast each round makes anyway (plain lockstep also broadcasts once per forward). A round with no draft is
a plain step (one token). The draft length is fixed (`max_draft`, at most MAX_VERIFY_WIDTH - 1): the
one-process DraftScheduler's cost curves are not measured sharded.

Greedy output equals plain lockstep decoding's (lockstep_tokens) where a verify forward's row equals a
one-token step's: up to MAX_VERIFY_WIDTH positions the attention runs on the decode kernels, and pipeline
parallel computes each layer as one process does. The followers need nothing but rank 0's broadcasts (no
sampling parameters, EOS ids or stop strings), so any rank 0 request can be followed by `follow_spec_request`.
"""

import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..defaults import DEFAULT_MAX_DRAFT, MAX_VERIFY_WIDTH
from ..errors import MlxInferError
from ..generation.results import GenerationStep
from ..generation.sampling import SamplingParams, build_logits_processors
from ..speculative.drafters.base import Drafter
from ..speculative.drafters.lookup import LookupDrafter
from ..speculative.verify import verify_round
from .generate import PREFILL_CHUNK, LockstepStats, forward_logits, lockstep_steps
from .group import broadcast_ints, broadcast_list
from .load import Shard

__all__ = ["SPEC_MODES", "SpecLockstepStats", "check_rollback", "follow_spec_request", "spec_lockstep_steps",
           "spec_lockstep_tokens"]

#: The speculative modes that run sharded ("off": plain lockstep decoding).
SPEC_MODES = ("off", "lookup")


@dataclass
class SpecLockstepStats(LockstepStats):
    """LockstepStats of a speculative generation, plus its rounds (on rank 0; the other ranks count the same
    rounds and committed tokens, but not the drafted ones).

    Attributes:
        rounds: decode forwards (verify rounds; one with no draft is a plain step).
        drafted: draft tokens verified. accepted: draft tokens kept.
        committed: tokens the decode forwards committed and were delivered (the first token, picked from the
            prefill's logits, is not one).
        draft_s, verify_s: rank 0's drafting and accept / reject time, seconds.
        proposed, kept: proposed[i] = rounds that verified a draft token at position i (0-based), kept[i] =
            rounds that accepted it (rank 0).
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: List[int] = field(default_factory=list)
    kept: List[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Committed tokens per decode forward (1.0: plain decoding)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> List[float]:
        """Per-position acceptance rates, kept[i] / proposed[i] (as speculative.feedback.SpecStats')."""
        return [k / p if p else 0.0 for k, p in zip(self.kept, self.proposed)]

    def record(self, drafted: int, accepted: int) -> None:
        """Count a verified draft of `drafted` tokens of which the first `accepted` were kept."""
        self.drafted += drafted
        self.accepted += accepted
        while len(self.proposed) < drafted:
            self.proposed.append(0)
            self.kept.append(0)
        for i in range(drafted):
            self.proposed[i] += 1
            self.kept[i] += i < accepted


def check_rollback(cache: Sequence) -> None:
    """Raise MlxInferError unless every layer cache of the rank (mlx-lm's, make_prompt_cache) can roll back
    whatever the request's length: no recurrent state and no sliding window (a RotatingKVCache cannot trim once
    it has wrapped). Every rank decides the same from the same model: check it before a job starts, so that a
    model that cannot speculate fails at once on every rank."""
    if not can_trim_prompt_cache(cache) or any(isinstance(c, RotatingKVCache) for c in cache):
        raise MlxInferError("speculative decoding over mlx.launch ranks needs a KV cache that can roll back (no "
                            "recurrent state, no sliding window); this model's cannot: use --spec off")


def _trim(cache: Sequence, n: int) -> None:
    """Drop the last n tokens of every layer cache of the rank (mlx-lm's trim); RuntimeError if one did not."""
    if n <= 0:
        return
    for c in cache:
        got = c.trim(n)
        if got != n:
            raise RuntimeError(f"KV rollback trimmed {got} tokens, expected {n}")


def _cut(tokens: Sequence[int], eos: set, stop: Optional[Callable[[int], bool]], room: int) -> Tuple[List[int], bool]:
    """Rank 0: the committed tokens to deliver, and whether the generation ends with them: cut before an EOS
    token (not delivered), after a token `stop` says ends it (called once per delivered token, in order, as
    lockstep_tokens calls it), or at `room` tokens (what max_tokens leaves)."""
    out: List[int] = []
    if room <= 0:
        return out, True
    for token in tokens:
        if token in eos:
            return out, True
        out.append(token)
        if stop is not None and stop(token):
            return out, True
        if len(out) == room:
            return out, True
    return out, False


def _pack(end: bool, accepted: int, deliver: List[int], draft: List[int], gamma: int) -> List[int]:
    """Rank 0's round message, 2 * gamma + 5 ints: [end, accepted, len(deliver), deliver (padded to gamma + 1),
    len(draft), draft (padded to gamma)]."""
    return ([int(end), accepted, len(deliver)] + deliver + [0] * (gamma + 1 - len(deliver))
            + [len(draft)] + draft + [0] * (gamma - len(draft)))


def _unpack(message: List[int], gamma: int) -> Tuple[bool, int, List[int], List[int]]:
    """(end, accepted, deliver, draft) of a _pack message."""
    end, accepted, k = message[:3]
    deliver = message[3:3 + k]
    g = message[gamma + 4]
    return bool(end), accepted, deliver, message[gamma + 5:gamma + 5 + g]


def message_width(max_draft: int) -> int:
    """Ints of one round's broadcast for a draft of at most `max_draft` tokens (capped like the loop)."""
    return 2 * min(max_draft, MAX_VERIFY_WIDTH - 1) + 5


def spec_lockstep_tokens(shard: Shard, prompt_ids: Optional[Sequence[int]], params: SamplingParams,
                         eos_ids: Sequence[int] = (), stats: Optional[SpecLockstepStats] = None,
                         stop: Optional[Callable[[int], bool]] = None, max_draft: int = DEFAULT_MAX_DRAFT,
                         drafter: Optional[Drafter] = None, prefill_chunk: int = PREFILL_CHUNK) -> Iterator[int]:
    """Speculative decoding on every rank of `shard.group` at once; yields the same token ids on every rank,
    the tokens lockstep_tokens yields under greedy decoding (see the module docstring).

    Args:
        shard: the rank's Shard (load_sharded).
        prompt_ids: the prompt's token ids on rank 0 (None elsewhere: they are broadcast).
        params: rank 0's sampling parameters (the other ranks' are not read).
        eos_ids: rank 0's token ids that end generation (not yielded).
        stats: filled in when given.
        stop: rank 0's test of each delivered token, as lockstep_tokens'.
        max_draft: draft tokens per round, 0 <= max_draft; every rank must pass the same (it sizes the
            broadcast); at most MAX_VERIFY_WIDTH - 1 are used.
        drafter: rank 0's deterministic drafter (None: LookupDrafter()); its proposals must be token ids.
        prefill_chunk: prompt tokens per forward.

    Yields:
        token ids, at most params.max_tokens.

    Raises:
        MlxInferError: a model whose KV cache cannot roll back (every rank decides the same from its model).
        DistributedError: a peer lost (watchdog.guarded).
    """
    group = shard.group
    stats = stats if stats is not None else SpecLockstepStats()
    gamma = min(max(int(max_draft), 0), MAX_VERIFY_WIDTH - 1)
    width = message_width(gamma)
    cache = make_prompt_cache(shard.model)
    check_rollback(cache)
    ids = broadcast_list(group, prompt_ids, "the prompt's token ids")
    stats.prompt_tokens = len(ids)
    root = group.is_root
    if root and params.seed is not None:
        mx.random.seed(params.seed)
    processors = build_logits_processors(params) if root else []
    drafter = (drafter or LookupDrafter()) if root else None
    start = time.perf_counter()
    for lo in range(0, len(ids), prefill_chunk):
        logits = forward_logits(shard, ids[lo:lo + prefill_chunk], cache, f"the prompt's tokens from {lo}")
    stats.prefill_s = time.perf_counter() - start
    history, eos, draft = list(ids), set(eos_ids), []
    while True:
        t0 = time.perf_counter()
        left = params.max_tokens - (len(history) - len(ids))  # (history: the prompt and the tokens delivered)
        message = _lead_round(stats, logits, history, draft, params, processors, eos, stop, drafter, gamma, left) \
            if root else None
        t1 = time.perf_counter()
        end, accepted, deliver, next_draft = _unpack(
            broadcast_ints(group, message, width, f"round {stats.rounds} (tokens and draft)"), gamma)
        t2 = time.perf_counter()
        stats.broadcast_s += t2 - t1
        for token in deliver:
            stats.generated_tokens += 1
            yield token
        if stats.rounds:
            stats.committed += len(deliver)
        if end:
            return
        _trim(cache, len(draft) - accepted)
        draft = next_draft
        t3 = time.perf_counter()
        logits = forward_logits(shard, [deliver[-1]] + draft, cache, f"decode round {stats.rounds + 1}", rows=True)
        t4 = time.perf_counter()
        stats.rounds += 1
        stats.decode_s += t4 - t3
        stats.step_s.append((t2 - t0) + (t4 - t3))  # (the caller's time between the two not counted)


def _lead_round(stats: SpecLockstepStats, logits: mx.array, history: List[int], draft: List[int],
                params: SamplingParams, processors, eos: set, stop, drafter: Drafter, gamma: int,
                left: int) -> List[int]:
    """Rank 0's part of a round: verify the last forward's logits [len(draft) + 1, V] against `draft`, deliver
    at most `left` tokens (extending `history`), draft the next round; the round's message (_pack)."""
    t0 = time.perf_counter()
    n, nxt = verify_round(logits, history, draft, params, processors, None)
    mx.eval(n, nxt)
    n, nxt = int(n.item()), int(nxt.item())
    deliver, end = _cut(draft[:n] + [nxt], eos, stop, left)
    history.extend(deliver)
    stats.record(len(draft), n)
    t1 = time.perf_counter()
    room = left - len(deliver) - 1  # the next round commits one more
    proposal = [] if end or room <= 0 else drafter.propose(history, min(gamma, room)).tokens[:gamma]
    stats.verify_s += t1 - t0
    stats.draft_s += time.perf_counter() - t1
    return _pack(end, n, deliver, [int(t) for t in proposal], gamma)


def follow_spec_request(shard: Shard, max_draft: int = DEFAULT_MAX_DRAFT) -> int:
    """The other ranks' side of one request that rank 0 runs with spec_lockstep_tokens (the same max_draft):
    every forward and broadcast to its end; the number of tokens stepped. Raises DistributedError."""
    return sum(1 for _ in spec_lockstep_tokens(shard, None, SamplingParams(), max_draft=max_draft))


def spec_lockstep_steps(shard: Shard, prompt_ids: Sequence[int], params: SamplingParams,
                        detokenizer: StreamingDetokenizer, eos_ids: Sequence[int],
                        cancel: Optional[threading.Event] = None,
                        max_draft: int = DEFAULT_MAX_DRAFT) -> Iterator[GenerationStep]:
    """Rank 0's side of one speculative request, as generate.lockstep_steps (text, EOS, stop strings, max_tokens
    and cancel decided the same way) over spec_lockstep_tokens; the last step's stats carry spec_mode "lookup",
    tau, rounds, draft_s and verify_s (the verify forwards and the accept / reject). The other ranks run
    follow_spec_request(shard, max_draft) meanwhile (commands.SPEC_REQUEST).

    Raises:
        DistributedError: a peer lost. MlxInferError: a model whose KV cache cannot roll back.
    """
    run = SpecLockstepStats()
    tokens = partial(spec_lockstep_tokens, max_draft=max_draft)
    for step in lockstep_steps(shard, prompt_ids, params, detokenizer, eos_ids, cancel, tokens=tokens, run=run):
        if step.stats is not None:
            step.stats = replace(step.stats, spec_mode="lookup", tau=run.tau, rounds=run.rounds, draft_s=run.draft_s,
                                 verify_s=run.decode_s + run.verify_s, acceptance=run.acceptance)
        yield step
