"""Plain decoding: one token per target forward, through mlx-lm's generate_step."""

from typing import Iterator, List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

from ..defaults import PREFILL_STEP_SIZE
from .sampling import SamplingParams, build_logits_processors, build_sampler


def plain_tokens(model: nn.Module, prompt_ids: List[int], params: SamplingParams, max_tokens: int) -> Iterator[int]:
    """Token ids of plain autoregressive decoding, as `mlx_lm.stream_generate` produces them.

    Args:
        model: an mlx-lm model.
        prompt_ids: the prompt, token ids (non-empty).
        params: sampling parameters (already validated).
        max_tokens: how many tokens to produce at most.

    Yields:
        int token ids, the first after prefill.
    """
    if params.seed is not None:
        mx.random.seed(params.seed)
    for token, _ in generate_step(
        mx.array(prompt_ids),
        model,
        max_tokens=max_tokens,
        sampler=build_sampler(params),
        logits_processors=build_logits_processors(params),
        prefill_step_size=PREFILL_STEP_SIZE,
    ):
        yield int(token)
