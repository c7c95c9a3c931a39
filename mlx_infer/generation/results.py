"""What a request gives back: GenerationStats (its measurements), GenerationStep (one streamed token) and
GenerationResult (a finished request)."""

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from .logprobs import TokenLogprob


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
        cached_prompt_tokens: prompt tokens whose KV came from the previous request (a common prefix, e.g.
            a chat's history), not prefilled again.
        spec_mode: the drafter speculative decoding used ("lookup", "draft", "lookup+dflash", ...; "off"
            when a speculative request decoded plainly), None when speculative decoding was not asked for.
        tau: committed tokens per target forward (speculative only; 0 for plain decoding).
        rounds: speculative rounds, one target forward each (0 for plain decoding).
        draft_s: seconds spent drafting (speculative only).
        verify_s: seconds spent in verify forwards and accept/reject (speculative only).
        acceptance: per-position acceptance rates of the draft tokens (speculative only, else None).
        kv: the paged KV cache's record (None with the dense cache): retained_blocks (the request's KV blocks,
            time average over its decode steps), retained_blocks_end (at the end), retained_blocks_max (the most
            over the decode steps, after eviction), live_tokens, waste (1 - mean
            live fraction of its blocks, at the end), repacks, repack_s (host seconds), peak_kv_bytes (its most
            blocks x bytes per block, all layers, K and V), block_size, evict, repack, evicted_tokens.
        kv_bits: the quantized KV cache's setting ("8", "4", "k8v4", "kivi-4"; "4@norot" / "8@rot" for a
            rotation other than the default; None: float KV).
        kv_bytes_per_token: KV bytes one token costs over all layers, K and V (scales included; the paged
            cache: one token slot of its blocks).
        rmm: the RMM retention the model runs with, in its canonical form (str(Retention): "mlp=0.9, attn=0.5"
            and "attn=0.5,mlp=0.9" both give "attn=0.5,mlp=0.9"); None: exact.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    total_s: float = 0.0
    peak_memory_bytes: int = 0
    cached_prompt_tokens: int = 0
    spec_mode: Optional[str] = None
    tau: float = 0.0
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    acceptance: Optional[List[float]] = None
    kv_bits: Optional[str] = None
    kv_bytes_per_token: float = 0.0
    kv: Optional[dict] = None
    rmm: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        """The stats as a JSON-ready dict, one key per attribute (what `--json` and the server print)."""
        return asdict(self)


@dataclass
class GenerationStep:
    """One streamed step: new text (possibly empty while a stop string or a UTF-8 sequence is
    incomplete), the token id it came from, and on the last step the finish reason and stats.

    `logprob`: the token's TokenLogprob when the request asked for logprobs (None otherwise, and on a final
    step without a token). `tool_calls`: on the final step of a request with tools, the calls parsed from its
    text (finish_reason is then "tool_calls")."""

    text: str
    token: Optional[int]
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None
    logprob: Optional[TokenLogprob] = None
    tool_calls: Optional[List["ToolCall"]] = None


@dataclass
class ToolCall:
    """A function call the model made (OpenAI's `tool_calls[i]`).

    Attributes:
        id: the call's id ("call_" + 24 hex digits), echoed back by the tool's result message.
        name: the function's name (one of the request's tools).
        arguments: the arguments as JSON text (a JSON object).
    """

    id: str
    name: str
    arguments: str


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        text: the generated text (stop string excluded).
        token_ids: generated token ids (EOS excluded).
        finish_reason: "stop" (EOS or a stop string) or "length" (max_tokens or the context window); a
            batched request cancelled through its RequestHandle ends with "cancelled"; "tool_calls" when the
            model called tools.
        stats: GenerationStats.
        logprobs: one TokenLogprob per generated token when logprobs were asked for, else None.
        tool_calls: the calls the model made (requests with tools), else [].
    """

    text: str
    token_ids: List[int]
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: Optional[List[TokenLogprob]] = None
    tool_calls: List[ToolCall] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """The result as a JSON-ready dict: text, token_ids, finish_reason, stats (GenerationStats.to_dict),
        and logprobs / tool_calls when present."""
        out: Dict[str, Any] = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [asdict(lp) for lp in self.logprobs]
        if self.tool_calls:
            out["tool_calls"] = [asdict(c) for c in self.tool_calls]
        return out


def collect(steps: Iterable[GenerationStep]) -> GenerationResult:
    """The GenerationResult of a request's steps (text joined, token ids, the last step's finish reason and
    stats). Raises ValueError when the steps end without a final one."""
    text: List[str] = []
    ids: List[int] = []
    logprobs: List[TokenLogprob] = []
    for step in steps:
        text.append(step.text)
        if step.token is not None:
            ids.append(step.token)
        if step.logprob is not None:
            logprobs.append(step.logprob)
        if step.finish_reason is not None:
            stats = step.stats if step.stats is not None else GenerationStats()
            return GenerationResult("".join(text), ids, step.finish_reason, stats, logprobs if logprobs else None,
                                    list(step.tool_calls or []))
    raise ValueError("the request's steps ended without a final step")
