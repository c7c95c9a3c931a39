"""Engine: owns a model and its tokenizer; generate, stream and chat.

    engine = mlx_infer.load()                       # the embedded default model
    result = engine.generate("What is the capital of France?", max_tokens=64)
    for chunk in engine.stream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")
"""

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .errors import MlxInferError
from .generation.decode import plain_tokens
from .generation.sampling import SamplingParams
from .generation.stops import StopStringMatcher
from .loading import ModelSource

Messages = Sequence[dict]
Prompt = Union[str, Messages, Sequence[int]]


@dataclass
class GenerationStats:
    """Measurements of one request.

    Attributes:
        prompt_tokens: tokens in the prompt (after the chat template).
        generated_tokens: tokens generated (EOS not counted).
        ttft_s: time to first token, seconds (prefill + first sample).
        prefill_tps: prompt tokens per second of prefill.
        decode_tps: generated tokens per second after the first one.
        total_s: wall time of the request, seconds.
        peak_memory_bytes: MLX's peak memory during the request, bytes.
        spec_mode: the drafter used by speculative decoding ("lookup", "draft"), None for plain decoding.
        tau: committed tokens per target forward (speculative only; 0 for plain decoding).
        rounds: speculative rounds, one target forward each (0 for plain decoding).
        draft_s: seconds spent drafting (speculative only).
        verify_s: seconds spent in verify forwards and accept/reject (speculative only).
        acceptance: per-position acceptance rates of the draft tokens (speculative only, else None).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    spec_mode: Optional[str] = None
    tau: float = 0.0
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    acceptance: Optional[List[float]] = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationStep:
    """One streamed step: new text (possibly empty while a stop string or a UTF-8 sequence is
    incomplete), the token id it came from, and on the last step the finish reason and stats."""

    text: str
    token: Optional[int]
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        text: the generated text (stop string excluded).
        token_ids: generated token ids (EOS excluded).
        finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens or the context window).
        stats: GenerationStats.
    """

    text: str
    token_ids: List[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


class Engine:
    """A loaded model, ready to generate.

    Build it with `mlx_infer.load(...)`. Not thread-safe: one request at a time.
    """

    def __init__(self, model: nn.Module, tokenizer, config: dict, source: ModelSource):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.source = source

    @property
    def context_length(self) -> int:
        """The model's context window, tokens."""
        return int(self.config.get("max_position_embeddings") or self.config.get("text_config", {}).get("max_position_embeddings", 4096))

    def encode_fitting(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True) -> List[int]:
        """`encode`, and check that at least one token fits after the prompt in the context window.

        Raises:
            MlxInferError: as `encode`, or a prompt that fills the context window.
        """
        prompt_ids = self.encode(prompt, system, chat_template)
        if len(prompt_ids) >= self.context_length:
            raise MlxInferError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {self.context_length}; shorten it"
            )
        return prompt_ids

    def encode(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True) -> List[int]:
        """Prompt token ids.

        Args:
            prompt: a string, a list of chat messages ({"role", "content"}), or token ids.
            system: a system prompt, put first (chat template only).
            chat_template: apply the model's chat template to a string prompt (when it has one).

        Raises:
            MlxInferError: empty prompt, bad messages, or a system prompt without a chat template.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise MlxInferError("the prompt is empty; give some text")
            if not (chat_template and self.tokenizer.has_chat_template):
                if system:
                    raise MlxInferError("a system prompt needs a chat template, and this model has none (or --no-chat-template was given)")
                return list(self.tokenizer.encode(prompt))
            prompt = [{"role": "user", "content": prompt}]
        prompt = list(prompt)
        if not prompt:
            raise MlxInferError("the prompt is empty; give some text")
        if all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        for m in prompt:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise MlxInferError("each chat message must be a dict with 'role' and 'content' (a string)")
        if not self.tokenizer.has_chat_template:
            raise MlxInferError("this model has no chat template; pass a plain string prompt")
        if system:
            prompt = [{"role": "system", "content": system}] + [m for m in prompt if m["role"] != "system"]
        return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True))

    def stream_steps(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        system: Optional[str] = None,
        chat_template: bool = True,
        speculative: str = "off",
        draft_model=None,
        max_draft: Union[str, int] = "auto",
        **sampling,
    ) -> Iterator[GenerationStep]:
        """Generate, yielding a GenerationStep per token; the last one carries finish_reason and stats.

        Args:
            prompt: see `encode`.
            params: SamplingParams; keyword arguments (temperature=..., max_tokens=...) override fields.
            speculative: "off" (plain decoding), "lookup" (prompt lookup), "draft" (a draft model), "layerskip"
                (the target minus some layers, arXiv 2309.08168) or "auto"
                (the best drafter available: a draft model when given, else lookup). Lossless: greedy output
                is identical to plain decoding, sampled output has the same distribution.
            draft_model: for "draft": a model path / repo id, an Engine, or an mlx-lm model with the same
                tokenizer. For "dflash" (arXiv 2602.06036) / "dspark" (block drafters fed the target's hidden
                states): a drafter directory or repo id in the published format.
            max_draft: draft tokens per round, an int >= 0 or "auto".

        Raises:
            MlxInferError: bad parameters, empty prompt, a prompt that fills the context window, or a
                draft_model given to a mode that uses none ("off", "lookup", "layerskip").
        """
        params = (params or SamplingParams()).with_(**sampling) if sampling else (params or SamplingParams())
        from .speculative import check_draft_model, check_max_draft

        check_max_draft(max_draft)  # checked whatever the mode, as the CLI does
        check_draft_model(speculative, draft_model)
        prompt_ids = self.encode_fitting(prompt, system, chat_template)
        max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))

        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopStringMatcher(params.stop)
        eos = set(self.tokenizer.eos_token_ids)
        mx.reset_peak_memory()
        start = time.perf_counter()
        first_at = None
        finish, n = "length", 0
        held_text, held_token = "", None  # the last token's step, yielded with the final one
        spec = None
        if speculative != "off":
            from .speculative import SpecStats, token_source

            spec = SpecStats()
            tokens = token_source(self, prompt_ids, params, max_tokens, speculative, draft_model, max_draft, spec)
        else:
            tokens = plain_tokens(self.model, prompt_ids, params, max_tokens)
        try:
            for token in tokens:
                first_at = first_at or time.perf_counter()
                if token in eos:
                    finish = "stop"
                    break
                n += 1
                detok.add_token(token)
                text, hit = stops.feed(detok.text)
                if hit or n >= max_tokens:
                    finish = "stop" if hit else "length"
                    held_text, held_token = text, token
                    break
                yield GenerationStep(text, token)
        finally:  # also when the consumer closes this generator: the token source rolls its cache back
            tokens.close()
        end = time.perf_counter()
        if not (finish == "stop" and held_token is not None):  # no stop string hit yet
            detok.finalize()
            text, hit = stops.feed(detok.text)
            held_text += text if hit else text + stops.flush(detok.text)
            finish = "stop" if hit else finish
        first_at = first_at or end
        stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            generated_tokens=n,
            ttft_s=first_at - start,
            prefill_tps=len(prompt_ids) / (first_at - start) if first_at > start else 0.0,
            decode_tps=(n - 1) / (end - first_at) if n > 1 and end > first_at else 0.0,
            total_s=end - start,
            peak_memory_bytes=int(mx.get_peak_memory()),
        )
        if spec is not None:
            stats.spec_mode, stats.tau, stats.rounds = spec.mode, spec.tau, spec.rounds
            stats.draft_s, stats.verify_s, stats.acceptance = spec.draft_s, spec.verify_s, spec.acceptance
        yield GenerationStep(held_text, held_token, finish_reason=finish, stats=stats)

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> Iterator[str]:
        """Generate, yielding text chunks as they are ready (never a broken UTF-8 sequence).
        Arguments as `stream_steps`."""
        for step in self.stream_steps(prompt, params, **kwargs):
            if step.text:
                yield step.text

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs) -> GenerationResult:
        """Generate a whole answer. Arguments as `stream_steps`.

        Returns:
            GenerationResult with text, token ids, finish reason and stats.
        """
        text, ids = [], []
        for step in self.stream_steps(prompt, params, **kwargs):
            text.append(step.text)
            if step.token is not None:
                ids.append(step.token)
            if step.finish_reason is not None:
                return GenerationResult("".join(text), ids, step.finish_reason, step.stats)
        raise AssertionError("stream_steps ended without a final step")
