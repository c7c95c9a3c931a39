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
parallel, its own layers under pipeline parallel.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..generation.assemble import StepAssembler
from ..generation.results import GenerationStats, GenerationStep
from ..generation.sampling import SamplingParams, build_logits_processors, build_sampler, pick_token
from .group import broadcast_ints, broadcast_list
from .load import Shard
from .watchdog import guarded

__all__ = ["LockstepStats", "follow_request", "lockstep_steps", "lockstep_tokens"]

#: Prompt tokens per prefill forward (every rank runs the same chunks).
PREFILL_CHUNK = 512


@dataclass
class LockstepStats:
    """What a lockstep generation measured on this rank (seconds; wall clock of each phase).

    Attributes:
        prompt_tokens, generated_tokens: counts.
        prefill_s: the prompt's forwards. decode_s: the decode steps' forwards (eval of the logits).
        broadcast_s: the broadcasts of the sampled tokens (one int32 all_sum per step).
        step_s: each decode step's whole time (forward, pick, broadcast).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    broadcast_s: float = 0.0
    step_s: List[float] = field(default_factory=list)


def _forward(shard: Shard, ids: Sequence[int], cache, what: str) -> mx.array:
    """The model's logits of the last position for `ids` (appended to `cache`): [1, V] float32, evaluated."""
    logits = shard.model(mx.array([list(ids)], dtype=mx.uint32), cache=cache)[:, -1, :].astype(mx.float32)
    guarded(lambda: mx.eval(logits), what, shard.group.rank)
    return logits


def lockstep_tokens(shard: Shard, prompt_ids: Optional[Sequence[int]], params: SamplingParams,
                    eos_ids: Sequence[int] = (), stats: Optional[LockstepStats] = None,
                    stop: Optional[Callable[[int], bool]] = None,
                    prefill_chunk: int = PREFILL_CHUNK) -> Iterator[int]:
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
    cache = make_prompt_cache(shard.model)
    start = time.perf_counter()
    for lo in range(0, len(ids), prefill_chunk):
        logits = _forward(shard, ids[lo:lo + prefill_chunk], cache, f"the prompt's tokens from {lo}")
    stats.prefill_s = time.perf_counter() - start
    history = list(ids)
    eos = set(eos_ids)
    for step in range(params.max_tokens):
        t0 = time.perf_counter()
        decided = None
        if group.is_root:
            for p in processors:
                logits = p(mx.array(history), logits)
            token = int(pick_token(logits, params, sampler).item())
            decided = [token, int(token not in eos and stop is not None and stop(token))]
        t1 = time.perf_counter()
        token, stopping = broadcast_ints(group, decided, 2, f"token {step}")
        t2 = time.perf_counter()
        stats.broadcast_s += t2 - t1
        if token in eos:
            return
        stats.generated_tokens += 1
        history.append(token)
        yield token
        if stopping or step + 1 == params.max_tokens:
            return
        t3 = time.perf_counter()
        logits = _forward(shard, [token], cache, f"decode step {step + 1}")
        t4 = time.perf_counter()
        stats.decode_s += t4 - t3
        stats.step_s.append((t2 - t0) + (t4 - t3))  # (the caller's time between the two not counted)


def lockstep_steps(shard: Shard, prompt_ids: Sequence[int], params: SamplingParams, detokenizer: StreamingDetokenizer,
                   eos_ids: Sequence[int], cancel: Optional[threading.Event] = None,
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
        tokens: the token generator, lockstep_tokens' signature (None: lockstep_tokens; speculative.py's
            spec_lockstep_tokens decides several tokens a round, `stop` asked for each in order).
        run: the stats it fills (None: a LockstepStats of its own).

    Yields:
        GenerationStep; the last has finish_reason ("stop", "length" or "cancelled") and GenerationStats.

    Raises:
        DistributedError: a peer lost (watchdog.guarded).
    """
    asm = StepAssembler(detokenizer, params.stop, eos_ids, params.max_tokens)
    texts: List[Optional[str]] = []

    def decide(token: int) -> bool:
        texts.append(asm.add(token))
        return texts[-1] is None or (cancel is not None and cancel.is_set())

    run = run if run is not None else LockstepStats()
    start, first = time.perf_counter(), None
    for token in (tokens or lockstep_tokens)(shard, prompt_ids, params, (), run, stop=decide):
        first = first if first is not None else time.perf_counter()
        text = texts.pop(0)  # (decided in order; a speculative round decides several before they are yielded)
        if text is not None:
            yield GenerationStep(text, token)
    end = time.perf_counter()
    text, token, finish = asm.final()
    if asm.finish is None and cancel is not None and cancel.is_set():
        finish = "cancelled"
    first = first if first is not None else end
    stats = GenerationStats(prompt_tokens=run.prompt_tokens, generated_tokens=asm.n, ttft_s=first - start,
                            prefill_tps=run.prompt_tokens / run.prefill_s if run.prefill_s > 0 else 0.0,
                            decode_tps=(asm.n - 1) / (end - first) if asm.n > 1 and end > first else 0.0,
                            total_s=end - start)
    yield GenerationStep(text, token, finish, stats)


def follow_request(shard: Shard, max_tokens: int) -> int:
    """The other ranks' side of one request that rank 0 runs with lockstep_steps (or lockstep_tokens without EOS
    ids): every forward and broadcast to its end; the number of tokens stepped. Raises DistributedError."""
    return sum(1 for _ in lockstep_tokens(shard, None, SamplingParams(max_tokens=max_tokens)))
