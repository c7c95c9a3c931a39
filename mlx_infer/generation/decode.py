"""Plain decoding: one token per target forward, each step built while the previous one computes, as
mlx-lm's generate_step runs them (its one-token steps over mlx-lm's dense KVCache replayed as a compiled
graph where generation/compiled.py applies). Its own loop rather than generate_step's so that a token is
picked without a log-softmax over the vocabulary first (sampling.pick_token: greedy, and sampling without
top-p). A request with a grammar or logprobs runs `_structured_tokens` instead: each token is read back
before the next forward is built (the grammar consumes it first), and the grammar's forced tokens go into that
forward with it (jump-forward decoding)."""

import threading
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..defaults import CLEAR_CACHE_ROUNDS, PREFILL_STEP_SIZE
from ..structured.grammar import GrammarState
from ..structured.mask import apply_masks
from .compiled import CompiledDecode
from .logprobs import LogprobQueue
from .sampling import SamplingParams, build_logits_processors, build_sampler, pick_token


def decode_stream() -> mx.Stream:
    """The stream decoding runs on: mlx-lm's generation stream on the main thread, the calling thread's own
    default stream elsewhere (MLX streams belong to the thread that made them; a batch runner's thread cannot
    use the main thread's)."""
    if threading.current_thread() is threading.main_thread():
        return generation_stream
    return mx.default_stream(mx.default_device())


def plain_tokens(model: nn.Module, prompt_ids: List[int], params: SamplingParams, max_tokens: int,
                 cache: Optional[list] = None, start: int = 0,
                 progress: Optional[Callable[[int, int], None]] = None,
                 compiled: Optional[CompiledDecode] = None, grammar: Optional[GrammarState] = None,
                 logprobs: Optional[LogprobQueue] = None) -> Iterator[int]:
    """Token ids of plain autoregressive decoding, as `mlx_lm.stream_generate` produces them (greedy: the
    argmax of the logits; sampling: mlx-lm's sampler, given the log-softmax only for top-p; see
    sampling.pick_token).

    Args:
        model: an mlx-lm model.
        prompt_ids: the prompt, token ids (non-empty).
        params: sampling parameters (already validated).
        max_tokens: how many tokens to produce at most.
        cache: the model's per-layer caches (None: fresh ones); they hold prompt_ids[:start].
        start: prompt tokens already in the cache (0 <= start < len(prompt_ids)); only the rest is prefilled.
        progress: callable(done, total) during prefill, prompt tokens (the kept prefix counted as done).
        compiled: the model's CompiledDecode (Engine.compiled_steps: its traces serve every request), run
            where CompiledDecode.applies; None: a new one for this call.
        grammar: the request's GrammarState (None: unconstrained): each pick is made under its mask, every
            token yielded is consumed by it, and its forced tokens (GrammarState.forced) are yielded without
            sampling, run through the model together with the token before them.
        logprobs: the request's LogprobQueue (None: none): each token's raw-logits row is added before the
            token is yielded.

    Yields:
        int token ids, the first after prefill. When the consumer stops after receiving k tokens, the
        cache holds the prompt and those k tokens (the last one's forward has already run, as in
        generate_step).
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    processors = build_logits_processors(params)
    sampler = build_sampler(params)
    total = len(prompt_ids)
    cache = make_prompt_cache(model) if cache is None else cache
    forward = (compiled or CompiledDecode(model)) if CompiledDecode.applies(model, cache) else model
    ids = prompt_ids[start:]
    if grammar is not None or logprobs is not None:
        yield from _structured_tokens(model, forward, prompt_ids, ids, params, max_tokens, cache, start, progress,
                                      grammar, logprobs)
        return
    # what the logits processors look back at (their window, a kept prefix included): the step's input last
    window = params.repetition_context_size
    history = mx.array(prompt_ids[-window:], dtype=mx.uint32) if processors else None

    def step(tokens: mx.array) -> mx.array:
        """The token after tokens [L] (the cache's next positions): lazy, [1]."""
        nonlocal history
        logits = forward(tokens[None], cache=cache)[:, -1, :].astype(mx.float32)  # [1, V]
        for proc in processors:
            logits = proc(history, logits)
        token = pick_token(logits, params, sampler)  # [1]
        if processors:
            history = mx.concatenate([history, token.astype(mx.uint32)])[-window:]
        return token

    with mx.stream(decode_stream()):
        done = _prefill(model, ids, cache, start, total, progress)
        token = step(mx.array(ids[done:]))
        mx.async_eval(token)
        for n in range(max_tokens + 1):
            if n < max_tokens:  # the next step is built while this one computes
                following = step(token)
                mx.async_eval(following)
            if n == 0:
                mx.eval(token)
                if progress is not None:
                    progress(total, total)
            if n == max_tokens:
                return
            yield int(token.item())
            if n % CLEAR_CACHE_ROUNDS == 0:
                mx.clear_cache()
            token = following


def _prefill(model: nn.Module, ids: List[int], cache: list, start: int, total: int,
             progress: Optional[Callable[[int, int], None]]) -> int:
    """Prefill all but the last of ids (the prompt's tokens not in the cache) in chunks, as generate_step;
    returns how many went in (len(ids) - 1)."""
    done = 0
    if progress is not None:
        progress(start, total)
    while len(ids) - done > 1:
        n = min(PREFILL_STEP_SIZE, len(ids) - done - 1)
        model(mx.array(ids[done:done + n])[None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if progress is not None:
            progress(start + done, total)
        mx.clear_cache()
    return done


def _structured_tokens(model: nn.Module, forward: Callable, prompt_ids: List[int], ids: List[int],
                       params: SamplingParams, max_tokens: int, cache: list, start: int,
                       progress: Optional[Callable[[int, int], None]], grammar: Optional[GrammarState],
                       logprobs: Optional[LogprobQueue]) -> Iterator[int]:
    """plain_tokens for a request with a grammar or logprobs (arguments as there; `forward` the one-token
    forward, the model itself runs the wider ones).

    Each round picks token t from the last logits row (processors applied, then the grammar's mask), the
    grammar consumes t and then F, the tokens it forces after t (at most what max_tokens leaves), the forward
    over [t] + F is launched and the grammar's next mask starts on the mask thread meanwhile
    (GrammarState.prefetch); t is yielded, then F's tokens once that forward ran (their logprobs from their
    rows, t's from the row it was picked from). When the consumer stops, the cache holds the prompt and the
    tokens yielded: a forced span's undelivered tail is trimmed.
    """
    processors = build_logits_processors(params)
    sampler = build_sampler(params)
    window = params.repetition_context_size
    history = list(prompt_ids[-window:])
    total = len(prompt_ids)
    with mx.stream(decode_stream()):
        done = _prefill(model, ids, cache, start, total, progress)
        raw = forward(mx.array(ids[done:])[None], cache=cache)[0, -1:].astype(mx.float32)  # [1, V]
        mx.async_eval(raw)
        if grammar is not None:
            grammar.prefetch()
        made = 0
        undelivered = 0  # tokens in the cache not yielded yet (a forced span's tail)
        try:
            while made < max_tokens:
                token = pick_structured(raw, history, processors, params, sampler, grammar)
                if made == 0 and progress is not None:
                    progress(total, total)
                if logprobs is not None:
                    logprobs.add(raw, [token])
                forced = commit_forced(grammar, token, max_tokens - made - 1)
                history = (history + [token] + forced)[-window:]
                if made + 1 < max_tokens:  # the next forward runs while the token is delivered
                    pending = [token] + forced
                    run = forward if len(pending) == 1 else model
                    rows = run(mx.array(pending)[None], cache=cache)[0].astype(mx.float32)  # [1 + F, V]
                    raw = rows[-1:]
                    mx.async_eval(rows)
                    if grammar is not None:
                        grammar.prefetch()
                    undelivered = len(forced)
                made += 1
                yield token
                if forced and logprobs is not None:
                    logprobs.add(rows[:len(forced)], forced)
                for token in forced:
                    undelivered -= 1
                    made += 1
                    yield token
                if made % CLEAR_CACHE_ROUNDS == 0:
                    mx.clear_cache()
        finally:
            if grammar is not None:
                grammar.close()  # the mask prefetched for a pick that will not come
            if undelivered and can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, undelivered)


def pick_structured(raw: mx.array, history: List[int], processors: list, params: SamplingParams, sampler: Callable,
          grammar: Optional[GrammarState]) -> int:
    """The next token from raw logits [1, V] float32: logits processors over `history`, the grammar's mask
    (GrammarState.mask: the one prefetched), then pick_token. Evaluates. (Also rank 0's pick of a sharded
    request: distributed/structured.py.)"""
    logits = raw
    for proc in processors:
        logits = proc(mx.array(history, dtype=mx.uint32), logits)
    if grammar is not None:
        logits = apply_masks(logits, [grammar.mask()])
    return int(pick_token(logits, params, sampler).item())


def commit_forced(grammar: Optional[GrammarState], token: int, room: int) -> List[int]:
    """The grammar consumes `token`, then the tokens it forces after it (at most `room`), which it returns
    (consumed); [] without a grammar. Raises ConstraintError for a token the grammar refuses (a bug)."""
    if grammar is None:
        return []
    grammar.consume([token])
    forced: List[int] = []
    while room > len(forced) and not grammar.stopped:
        more = grammar.forced()[:room - len(forced)]
        if not more:
            break
        grammar.consume(more)
        forced += more
    return forced
