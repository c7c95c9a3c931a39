"""Plain decoding: one token per target forward, each step built while the previous one computes, as
mlx-lm's generate_step runs them (its one-token steps over mlx-lm's dense KVCache replayed as a compiled
graph where generation/compiled.py applies). Its own loop rather than generate_step's so that a token is
picked without a log-softmax over the vocabulary first (sampling.pick_token: greedy, and sampling without
top-p)."""

import threading
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..defaults import CLEAR_CACHE_ROUNDS, PREFILL_STEP_SIZE
from .compiled import CompiledDecode
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
                 compiled: Optional[CompiledDecode] = None) -> Iterator[int]:
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
        done = 0  # tokens of ids in the cache: all but the last are prefilled in chunks, as generate_step
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
