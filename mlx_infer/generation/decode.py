"""Plain decoding: one token per target forward, through mlx-lm's generate_step (its one-token steps over
mlx-lm's dense KVCache replayed as a compiled graph where generation/compiled.py applies)."""

import threading
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache

from ..defaults import PREFILL_STEP_SIZE
from .compiled import CompiledDecode
from .sampling import SamplingParams, build_logits_processors, build_sampler

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def decode_stream() -> mx.Stream:
    """The stream decoding runs on: mlx-lm's generation stream on the main thread, the calling thread's own
    default stream elsewhere (MLX streams belong to the thread that made them; a batch runner's thread cannot
    use the main thread's)."""
    if threading.current_thread() is threading.main_thread():
        return generation_stream
    return mx.default_stream(mx.default_device())


def with_prefix(processor: LogitsProcessor, prefix: mx.array) -> LogitsProcessor:
    """A logits processor that sees `prefix` ([P] token ids already in the cache) before the tokens
    generate_step gives it, so that a repetition penalty over a kept prefix looks back as far as it would
    over a fresh prompt."""
    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(mx.concatenate([prefix, tokens.astype(prefix.dtype)]), logits)

    return run


def plain_tokens(model: nn.Module, prompt_ids: List[int], params: SamplingParams, max_tokens: int,
                 cache: Optional[list] = None, start: int = 0,
                 progress: Optional[Callable[[int, int], None]] = None,
                 compiled: Optional[CompiledDecode] = None) -> Iterator[int]:
    """Token ids of plain autoregressive decoding, as `mlx_lm.stream_generate` produces them.

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
        cache holds the prompt and those k tokens (generate_step has already run the last one's forward).
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    processors = build_logits_processors(params)
    if start and processors:
        prefix = mx.array(prompt_ids[max(0, start - params.repetition_context_size):start], dtype=mx.uint32)
        processors = [with_prefix(p, prefix) for p in processors]
    total = len(prompt_ids)
    report = (lambda done, _: progress(start + done, total)) if progress is not None else (lambda *_: None)
    cache = make_prompt_cache(model) if cache is None else cache
    for token, _ in generate_step(
        mx.array(prompt_ids[start:]),
        (compiled or CompiledDecode(model)) if CompiledDecode.applies(model, cache) else model,
        max_tokens=max_tokens,
        sampler=build_sampler(params),
        logits_processors=processors,
        prompt_cache=cache,
        prefill_step_size=PREFILL_STEP_SIZE,
        prompt_progress_callback=report,
    ):
        yield int(token)
