"""Sampling parameters, validated in plain Python, and mlx-lm's samplers built from them.

Parameters are checked before any compiled MLX function runs: an exception inside a compiled
sampler can poison later calls in the same process.
"""

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p, categorical_sampling, make_logits_processors,
                                 make_sampler)

from ..defaults import MAX_TOKENS, TOP_P_CANDIDATES
from ..errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax). Must be >= 0.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        min_p: drop tokens below min_p * p(max) in [0, 1); 0 disables it.
        repetition_penalty: > 0; 1 disables it (as in mlx-lm, over the last
            `repetition_context_size` tokens).
        repetition_context_size: tokens the repetition, presence and frequency penalties look back over (>= 1).
        presence_penalty: subtracted from the logit of each token seen in that window (OpenAI's field,
            in [-2, 2]); 0 disables it.
        frequency_penalty: subtracted from a token's logit once per time it was seen in that window (OpenAI's
            field, in [-2, 2]); 0 disables it.
        seed: seed for MLX's random generator; None leaves it as it is.
        max_tokens: most tokens to generate (>= 1).
        stop: strings that end generation; the stop string itself is not returned.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = MAX_TOKENS
    stop: Tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        self.validate()

    def validate(self) -> None:
        """Raise RequestError (an MlxInferError) naming the first bad parameter, its `param` that field."""
        def finite(name, value):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {value!r}", name)

        def integer(value):
            return isinstance(value, int) and not isinstance(value, bool)

        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}", "temperature")
        finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", "top_k")
        finite("min_p", self.min_p)
        if not 0 <= self.min_p < 1:
            raise RequestError(f"min_p must be in [0, 1), got {self.min_p}", "min_p")
        finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}",
                               "repetition_penalty")
        if not integer(self.repetition_context_size) or self.repetition_context_size < 1:
            raise RequestError(f"repetition_context_size must be an integer >= 1, got {self.repetition_context_size!r}",
                               "repetition_context_size")
        for name in ("presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}", name)
        if not integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an integer in [0, 2**64), got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")

    def with_(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (validated again).

        Raises:
            RequestError: a name that is not a field (e.g. a typo passed to engine.generate), naming the
                fields; or a bad value.
        """
        names = [f.name for f in fields(self) if f.init]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise RequestError(f"unknown option {unknown[0]!r}; the sampling options are {', '.join(names)}",
                               unknown[0])
        return replace(self, **changes)

    def for_vocab(self, vocab: int) -> "SamplingParams":
        """These parameters checked against a model's vocabulary of `vocab` tokens (once per request,
        before any forward).

        Returns:
            self, or a copy with top_k=0 when top_k == vocab: keeping every token is the same
            distribution as no top-k, and mlx-lm's `apply_top_k` takes only 0 < k < vocab.

        Raises:
            RequestError: top_k > vocab (param "top_k").
        """
        if self.top_k > vocab:
            raise RequestError(f"top_k must be <= the vocabulary size ({vocab}); 0 keeps all, got {self.top_k}",
                               "top_k")
        return self.with_(top_k=0) if self.top_k == vocab else self

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax (temperature 0)."""
        return self.temperature == 0


def build_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for these parameters: logprobs [B, V] float (or logits: see sampler_input) -> token ids
    [B] uint32. With top-p, mlx-lm's filters in its order (top_p, min_p, top_k) and its categorical draw, the
    top-p one `top_p_filter` (the same kept tokens, without sorting the vocabulary)."""
    if params.greedy or not 0 < params.top_p < 1.0:
        return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    rest = make_sampler(temp=params.temperature, min_p=params.min_p, top_k=params.top_k)  # min_p, top_k, draw

    def sample(logprobs: mx.array) -> mx.array:
        return rest(top_p_filter(logprobs, params.top_p))

    return sample


@mx.compile
def _nucleus(logprobs: mx.array, candidates: mx.array, top_p: mx.array) -> tuple:
    """The top-p threshold among candidates (the K most likely tokens, logprobs [B, K] in any order) of
    logprobs [B, V]: (threshold [B, 1], exact [B] bool: whether it is apply_top_p's).

    apply_top_p compares the cumulative masses with top_p times the vocabulary's mass summed one token at a time
    in float32, most likely first. The candidates' part of that sum is added the same way here (`head`); each
    further (smaller) token then moves the running sum by its mass rounded to the float32 spacing of the sum's
    binade: u in head's, 2u once the sum crosses into the next. Without sorting them it is not known which
    tokens come after that crossing, so the total is bounded by taking for each token the smaller and the
    larger of its two roundings (plus 2u for the crossing token and the bounds' own rounding): exact where both
    bounds keep the same candidates. Not exact either (fall back to the sort): a token that ties the least likely
    candidate, candidates whose mass does not reach top_p, a total beyond the next binade."""
    ranked = mx.sort(candidates, axis=-1)[..., ::-1]  # [B, K], most likely first
    probs = mx.exp(ranked.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, inclusive=False)  # mass of the more likely candidates
    head = above[..., -1:] + probs[..., -1:]  # [B, 1], the candidates' float32 running sum
    exponent = mx.floor(mx.log2(head))
    exponent = mx.where(mx.power(2.0, exponent) > head, exponent - 1, exponent)
    exponent = mx.where(mx.power(2.0, exponent + 1) <= head, exponent + 1, exponent)
    unit = mx.power(2.0, exponent - 23)  # [B, 1], float32 spacing in head's binade
    tail = logprobs < ranked[..., -1:]  # [B, V], the tokens after the candidates
    scaled = mx.where(tail, mx.exp(logprobs.astype(mx.float32)) / unit, 0.0)  # masses in units u
    fine_lo, fine_hi = mx.ceil(scaled - 0.5), mx.floor(scaled + 0.5)  # rounded to u (ties either way)
    coarse_lo, coarse_hi = 2 * mx.ceil(scaled / 2 - 0.5), 2 * mx.floor(scaled / 2 + 0.5)  # rounded to 2u
    low = mx.minimum(fine_lo, coarse_lo).astype(mx.int32).sum(axis=-1, keepdims=True) - 2
    high = mx.maximum(fine_hi, coarse_hi).astype(mx.int32).sum(axis=-1, keepdims=True) + 2
    target_lo = top_p * (head + low.astype(mx.float32) * unit)
    target_hi = top_p * (head + high.astype(mx.float32) * unit)
    kept = (above < target_lo).sum(axis=-1, keepdims=True)  # >= 1
    threshold = mx.take_along_axis(ranked, kept - 1, axis=-1)
    whole = tail.sum(axis=-1) == logprobs.shape[-1] - candidates.shape[-1]  # no token ties the last candidate
    exact = ((above < target_hi).sum(axis=-1) == kept[..., 0]) & (head[..., 0] >= target_hi[..., 0]) & whole & \
        (head[..., 0] + high[..., 0].astype(mx.float32) * unit[..., 0] < mx.power(2.0, exponent[..., 0] + 2))
    return threshold, exact


def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's apply_top_p (logprobs [B, V] -> the same with the tokens outside the nucleus at -inf: the fewest
    most likely tokens whose mass reaches top_p, ties with the last one included), from a partial selection of
    the TOP_P_CANDIDATES most likely tokens (mx.argpartition) instead of a sort of the whole vocabulary; the
    full sort (apply_top_p) only where those do not reach top_p or the result would not be exactly
    apply_top_p's (see _nucleus). Evaluates (whether the partial selection suffices)."""
    vocab = logprobs.shape[-1]
    if TOP_P_CANDIDATES >= vocab:
        return apply_top_p(logprobs, top_p)
    part = mx.argpartition(-logprobs, kth=TOP_P_CANDIDATES - 1, axis=-1)[..., :TOP_P_CANDIDATES]
    candidates = mx.take_along_axis(logprobs, part, axis=-1)
    threshold, exact = _nucleus(logprobs, candidates, mx.array(top_p, dtype=mx.float32))
    if not bool(mx.all(exact).item()):
        return apply_top_p(logprobs, top_p)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def pick_token(logits: mx.array, params: SamplingParams, sampler: Callable[[mx.array], mx.array]) -> mx.array:
    """Plain decoding's next token from logits [B, V] float32 (logits processors applied): greedy, the argmax
    of the logits themselves; sampling, `sampler` (build_sampler) on them, normalized to log-probabilities
    first only for top-p (sampler_input). token ids [B], lazy.

    mlx-lm's generate_step takes a log-softmax before every token. Its argmax is the logits' own (but where
    float rounding of the subtraction would tie two logits), and mlx-lm's sampler does not depend on it (its
    categorical draw, min-p and top-k are the same for logits shifted by a constant) except for top-p, whose
    mask compares cumulative probabilities. Skipping it saves an exp over the vocabulary, which MLX's CPU
    backend computes one element at a time, a visible share of a small model's decode step over a large
    vocabulary (docs/benchmarks.md#plain-decoding-against-mlx-lm-and-llamacpp). The speculative loop (speculative/verify.process_logits) and batched decoding
    pick the same way.
    """
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return sampler(sampler_input(logits, params))


def sampler_input(logits: mx.array, params: SamplingParams) -> mx.array:
    """What mlx-lm's sampler is given (see pick_token): logits [B, V] float32 as they are, or their
    log-softmax for top-p."""
    if 0 < params.top_p < 1.0:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logits


def build_keyed_sampler(params: SamplingParams) -> Callable[[mx.array, mx.array], Tuple[mx.array, mx.array]]:
    """The sampler of `build_sampler` drawing from an explicit MLX random key instead of the global state:
    (logprobs [B, V] (or logits: see sampler_input), key) -> (token ids [B] uint32, the next key). The same
    filters in mlx-lm's order (top_p, min_p, top_k) and the same draw: from key(seed) it gives the tokens
    `build_sampler` gives after mx.random.seed(seed) (MLX splits its global key the same way), so one
    request's samples do not depend on what else draws in the process."""
    def sample(logprobs: mx.array, key: mx.array) -> Tuple[mx.array, mx.array]:
        if params.greedy:
            return mx.argmax(logprobs, axis=-1), key
        if 0 < params.top_p < 1.0:
            logprobs = top_p_filter(logprobs, params.top_p)
        if params.min_p != 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        key, draw = mx.random.split(key)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw), key

    return sample


def build_logits_processors(params: SamplingParams) -> List[Callable[[mx.array, mx.array], mx.array]]:
    """mlx-lm's logits processors (repetition, presence and frequency penalties) for these parameters:
    (tokens [T], logits [B, V]) -> logits."""
    if params.repetition_penalty == 1.0 and params.presence_penalty == 0 and params.frequency_penalty == 0:
        return []
    window = params.repetition_context_size
    return make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=params.presence_penalty or None, presence_context_size=window,
        frequency_penalty=params.frequency_penalty or None, frequency_context_size=window,
    )
