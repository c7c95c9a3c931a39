"""Generation over a group, in lockstep: rank 0 decides every forward's input, all ranks run it.

    for token in lockstep_tokens(shard, prompt_ids if rank 0 else None, params):
        ...                                     # the same token ids on every rank

Each rank runs the same forwards in the same order: the prompt (rank 0's token ids, broadcast) in chunks,
then one token per step. Every rank computes the logits (tensor parallel: the all_sums make them whole;
pipeline: the last rank's hidden state is gathered), rank 0 picks the next token (generation/sampling.py's
pick_token: greedy or mlx-lm's sampler) and broadcasts it, so that sampling needs no agreement between the
ranks' random generators and a rank whose logits differ in the last bit still follows rank 0. Every
evaluation of a forward and every broadcast is `guarded` (watchdog.py): a lost peer fails the step with
DistributedError, a silent one ends the process after the step timeout.

The KV cache is mlx-lm's per-layer cache of the rank's shard (make_prompt_cache): its own heads under tensor
parallel, its own layers under pipeline parallel; fresh for each request, or kept from one to the next (a
chat's turns: kept.py), when the prompt's leading tokens are those it holds.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Deque, Iterator, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..errors import DistributedError
from ..generation.assemble import StepAssembler, with_tool_calls
from ..generation.logprobs import LogprobQueue
from ..generation.results import GenerationStats, GenerationStep
from ..generation.sampling import SamplingParams, build_logits_processors, build_sampler, pick_token
from ..structured.grammar import GrammarState
from .group import broadcast_ints, broadcast_list
from .kept import KeptCache
from .load import Shard
from .structured import LeadPick
from .watchdog import guarded

__all__ = ["LockstepStats", "follow_request", "lockstep_steps", "lockstep_tokens"]

#: Prompt tokens per prefill forward (every rank runs the same chunks).
PREFILL_CHUNK = 512


@dataclass
class LockstepStats:
    """What a lockstep generation measured on this rank (seconds; wall clock of each phase).

    Attributes:
        prompt_tokens, generated_tokens: counts. cached_tokens: the prompt's leading tokens a kept KV cache gave
            (not prefilled).
        prefill_s: the prompt's forwards. decode_s: the decode steps' forwards (eval of the logits).
        broadcast_s: the broadcasts of the sampled tokens (one int32 all_sum per step).
        step_s: each decode step's whole time (forward, pick, broadcast).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    broadcast_s: float = 0.0
    step_s: List[float] = field(default_factory=list)


def forward_logits(shard: Shard, ids: Sequence[int], cache, what: str, rows: bool = False) -> mx.array:
    """The model's logits of the last position for `ids` (appended to `cache`): [1, V] float32, evaluated;
    rows: those of every position, [len(ids), V]."""
    out = shard.model(mx.array([list(ids)], dtype=mx.uint32), cache=cache)[0]
    logits = (out if rows else out[-1:]).astype(mx.float32)
    guarded(lambda: mx.eval(logits), what, shard.group.rank)
    return logits


def _until_stop(picked: List[int], eos: Set[int], stop: Optional[Callable[[int], bool]]) -> Tuple[List[int], int]:
    """Rank 0: the picked tokens up to the first that ends the generation (EOS, or `stop` true: then 1)."""
    for i, token in enumerate(picked):
        if token in eos:
            return picked[:i + 1], 0
        if stop is not None and stop(token):
            return picked[:i + 1], 1
    return picked, 0


def lockstep_tokens(shard: Shard, prompt_ids: Optional[Sequence[int]], params: SamplingParams,
                    eos_ids: Sequence[int] = (), stats: Optional[LockstepStats] = None,
                    stop: Optional[Callable[[int], bool]] = None,
                    prefill_chunk: int = PREFILL_CHUNK, picker: Optional[LeadPick] = None,
                    kept: Optional[KeptCache] = None) -> Iterator[int]:
    """Generate on every rank of `shard.group` at once; yields the same token ids on every rank.

    Args:
        shard: the rank's Shard (load_sharded).
        prompt_ids: the prompt's token ids on rank 0 (None elsewhere: they are broadcast).
        params: sampling parameters (rank 0's are the ones used; seed: rank 0's generator).
        eos_ids: token ids that end generation (not yielded).
        stats: filled in when given.
        stop: rank 0's test of each picked token (a stop string its text completes): True ends the
            generation on every rank after that token (yielded); the decision travels with the token.
        prefill_chunk: prompt tokens per forward.
        picker: rank 0's LeadPick of a request with a grammar or logprobs (structured.py; None: the logits
            processors and pick_token). The tokens its grammar forces after a pick travel with it and go into
            the next forward together.
        kept: the rank's KeptCache (kept.py; None: a fresh cache per call, nothing kept): the prompt's leading
            tokens it holds (rank 0 decides how many, broadcast) are not prefilled again, and it keeps this
            call's cache and ids. Every rank passes one, or none does.

    Yields:
        token ids, at most params.max_tokens.

    Raises:
        DistributedError: a peer lost (watchdog.guarded).
    """
    group = shard.group
    stats = stats if stats is not None else LockstepStats()
    ids = broadcast_list(group, prompt_ids, "the prompt's token ids")
    stats.prompt_tokens = len(ids)
    if group.is_root and params.seed is not None:
        mx.random.seed(params.seed)
    sampler, processors = build_sampler(params), build_logits_processors(params)
    mine = [kept.reusable(ids) if kept is not None else 0] if group.is_root else None
    (reuse,) = broadcast_ints(group, mine, 1, "the length of the prompt's kept prefix")
    if reuse and kept is None:
        raise DistributedError(f"rank {group.rank}: rank 0 reuses a kept KV cache this rank does not keep; the "
                               "job ends")
    cache = kept.take(shard.model, reuse) if kept is not None else make_prompt_cache(shard.model)
    stats.cached_tokens = reuse
    start = time.perf_counter()
    for lo in range(reuse, len(ids), prefill_chunk):
        logits = forward_logits(shard, ids[lo:lo + prefill_chunk], cache, f"the prompt's tokens from {lo}")
    stats.prefill_s = time.perf_counter() - start
    held = list(ids)  # the ids the cache holds
    if kept is not None:
        kept.keep(cache, held)
    history = list(ids)
    eos = set(eos_ids)
    step = made = 0
    while made < params.max_tokens:
        t0 = time.perf_counter()
        decided, picked = None, []
        if group.is_root:
            if picker is not None:
                picked = picker.pick(logits, history, params.max_tokens - made - 1)
            else:
                for p in processors:
                    logits = p(mx.array(history), logits)
                picked = [int(pick_token(logits, params, sampler).item())]
            picked, stopping = _until_stop(picked, eos, stop)
            decided = [picked[0], stopping, len(picked) - 1]
        t1 = time.perf_counter()
        token, stopping, extra = broadcast_ints(group, decided, 3, f"token {step}")
        more = broadcast_ints(group, picked[1:] or None, extra, f"the tokens forced after {step}") if extra else []
        t2 = time.perf_counter()
        stats.broadcast_s += t2 - t1
        seq = [token] + more
        last = bool(stopping) or made + len(seq) >= params.max_tokens
        for i, token in enumerate(seq):
            if token in eos:
                return
            stats.generated_tokens += 1
            made += 1
            history.append(token)
            yield token
            if i == 0 and not last:  # the next forward (the forced tokens with it) before those are yielded
                t3 = time.perf_counter()
                rows = forward_logits(shard, seq, cache, f"decode step {step + 1}", rows=len(seq) > 1)
                held.extend(seq)
                t4 = time.perf_counter()
                if picker is not None:
                    picker.forced_rows(rows[:-1], more)
                logits = rows[-1:]
                stats.decode_s += t4 - t3
                stats.step_s.append((t2 - t0) + (t4 - t3))  # (the caller's time between the two not counted)
        if last:
            return
        step += 1


def lockstep_steps(shard: Shard, prompt_ids: Sequence[int], params: SamplingParams, detokenizer: StreamingDetokenizer,
                   eos_ids: Sequence[int], cancel: Optional[threading.Event] = None, *,
                   grammar: Optional[GrammarState] = None, logprobs: Optional[LogprobQueue] = None,
                   tools: Any = None, kept: Optional[KeptCache] = None,
                   tokens: Optional[Callable[..., Iterator[int]]] = None,
                   run: Optional[LockstepStats] = None) -> Iterator[GenerationStep]:
    """Rank 0's side of one request in lockstep, as the engine's steps: text and token per step, the last with
    finish_reason and stats; EOS, stop strings and max_tokens decided by generation.assemble.StepAssembler (as in
    one process, so the text of the same tokens is the same). The other ranks run follow_request(shard,
    params.max_tokens) meanwhile; rank 0's decision to end travels with each token (lockstep_tokens' `stop`), so
    they need no EOS ids or stop strings.

    Args:
        shard: rank 0's Shard. prompt_ids: the prompt's token ids. params: the sampling parameters.
        detokenizer: a streaming detokenizer of the request's own (reset here).
        eos_ids: the tokens that end the request (not delivered).
        cancel: set (any thread) ends the request after the next token on every rank (finish_reason
            "cancelled").
        grammar, logprobs, tools: the request's GrammarState, LogprobQueue and ToolPlan (None: none; built as
            one process builds them: generation/structured_request.py); the grammar and logprobs run on rank 0
            (structured.LeadPick), each step carries its token's logprob, the final step the tool calls.
        kept: rank 0's KeptCache (lockstep_tokens; the other ranks pass theirs to follow_request).
        tokens: the token generator, lockstep_tokens' signature (None: lockstep_tokens; speculative.py's
            spec_lockstep_tokens decides several tokens a round, `stop` asked for each in order); one of its
            own takes no grammar, logprobs or kept cache.
        run: the stats it fills (None: a LockstepStats of its own).

    Yields:
        GenerationStep; the last has finish_reason ("stop", "length" or "cancelled") and GenerationStats.

    Raises:
        DistributedError: a peer lost (watchdog.guarded).
    """
    asm = StepAssembler(detokenizer, params.stop, eos_ids, params.max_tokens, tools)
    texts: Deque[Optional[str]] = deque()  # each picked token's text (None: the request ends with it)
    delivered: List[str] = []  # the text delivered (a ToolPlan parses it at the end)
    picker = LeadPick(params, grammar, logprobs) if grammar is not None or logprobs is not None else None

    def decide(token: int) -> bool:
        texts.append(asm.add(token))
        return texts[-1] is None or (cancel is not None and cancel.is_set())

    run = run if run is not None else LockstepStats()
    mx.reset_peak_memory()  # (this rank's: rank 0's shard, cache and activations)
    start, first = time.perf_counter(), None
    if tokens is None:
        tokens = partial(lockstep_tokens, picker=picker, kept=kept)
    elif picker is not None or kept is not None:
        raise ValueError("a token generator of its own takes no grammar, logprobs or kept KV cache")
    try:
        for token in tokens(shard, prompt_ids, params, (), run, stop=decide):
            first = first if first is not None else time.perf_counter()
            text = texts.popleft()  # (decided in order; a speculative round decides several before they are yielded)
            if text is not None:
                delivered.append(text)
                yield GenerationStep(text, token, logprob=logprobs.take() if logprobs is not None else None)
    finally:
        if picker is not None:
            picker.close()
    end = time.perf_counter()
    text, token, finish = asm.final()
    if asm.finish is None and cancel is not None and cancel.is_set():
        finish = "cancelled"
    first = first if first is not None else end
    prefilled = run.prompt_tokens - run.cached_tokens
    stats = GenerationStats(prompt_tokens=run.prompt_tokens, generated_tokens=asm.n, ttft_s=first - start,
                            prefill_tps=prefilled / run.prefill_s if run.prefill_s > 0 else 0.0,
                            decode_tps=(asm.n - 1) / (end - first) if asm.n > 1 and end > first else 0.0,
                            total_s=end - start, cached_prompt_tokens=run.cached_tokens,
                            peak_memory_bytes=int(mx.get_peak_memory()))
    logprob = logprobs.take() if logprobs is not None and token is not None else None
    final = GenerationStep(text, token, finish, stats, logprob=logprob)
    if tools is not None and finish != "cancelled":
        final = with_tool_calls(final, tools, "".join(delivered) + text)
    yield final


def follow_request(shard: Shard, max_tokens: int, kept: Optional[KeptCache] = None) -> int:
    """The other ranks' side of one request that rank 0 runs with lockstep_steps (or lockstep_tokens without EOS
    ids): every forward and broadcast to its end; the number of tokens stepped. kept: the rank's KeptCache
    (when rank 0 keeps one). Raises DistributedError."""
    return sum(1 for _ in lockstep_tokens(shard, None, SamplingParams(max_tokens=max_tokens), kept=kept))
