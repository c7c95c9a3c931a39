"""Engine: owns a model and its tokenizer; generate, stream and chat.

    engine = mlx_infer.load()                       # the embedded default model
    result = engine.generate("What is the capital of France?", max_tokens=64)
    for chunk in engine.stream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")
"""

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .backend import backend_name, blas_in_use
from .errors import MlxInferError
from .generation.decode import plain_tokens
from .generation.detokenize import make_detokenizer
from .generation.sampling import SamplingParams
from .generation.stops import StopStringMatcher
from .kv.defaults import BLOCK_SIZE
from .kv.options import EvictSpec, check_block_size, check_kv_cache, parse_budget, parse_evict
from .kv.session import KVRequest, PagedKV, release
from .loading import ModelSource
from .paths import model_fingerprint
from .speculative import DraftModel, SpecOptions, SpecState, SpecStats, Target
from .speculative.registry import target_names
from .speculative.target import output_vocab

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
    kv: Optional[dict] = None

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


@dataclass
class KeptCache:
    """The KV cache of the previous request, kept for the next one.

    Attributes:
        cache: the per-layer mlx-lm caches.
        tokens: the token ids whose KV they hold, in order (len == the caches' offset).
    """

    cache: list
    tokens: List[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measurement_key(source: ModelSource) -> str:
    """What a timing of this model on this machine depends on (the disk-cache key of cost curves and
    priors): the model's content, not where it lies, its weights mode, the quantized-matmul kernel its layers
    run on, the backend, BLAS and MLX version."""
    return (f"{model_fingerprint(source.mlx_dir)}|{source.weights}|{source.kernels}|{backend_name()}|"
            f"{blas_in_use()}|{mx.__version__}")


class Engine:
    """A loaded model, ready to generate.

    Build it with `mlx_infer.load(...)`. Not thread-safe: one request at a time.

    The engine keeps the KV cache of its last request: a request whose prompt starts with the tokens of
    the previous one (a chat's next turn: the history, then the new message) prefills only what follows the
    common prefix (`GenerationStats.cached_prompt_tokens`). `reset()` drops it. A request that evicted tokens
    is not kept (its cache no longer equals a fresh prefill of its tokens).

    KV cache (`configure_kv`, or the same keyword arguments of the constructor and `mlx_infer.load`):
    kv_cache="dense" (default: mlx-lm's own contiguous cache; the paged one costs +0.5-1% decode time
    without holes, +1-4% with them, measured in bench/kv_core.py --overhead) or "paged" (a block pool per
    engine with a token table per request, vToken arXiv 2608.13263: needed for eviction with reclaimed
    blocks); kv_budget (bytes, "512MB" / "2GiB", or a fraction of free memory "0.5"; None: no limit);
    block_size (tokens per block, 16).

    Attributes:
        model, tokenizer, config, source: the loaded model (mlx-lm classes), its tokenizer, config.json
            and where it came from.
        vocab_size: the model's output vocabulary (rows of its logits, padding included).
        spec: SpecState, what speculative decoding keeps for this model (loaded drafters, schedulers,
            measured costs).
    """

    def __init__(self, model: nn.Module, tokenizer, config: dict, source: ModelSource, *, kv_cache: str = "dense",
                 kv_budget: Union[None, int, float, str] = None, block_size: int = BLOCK_SIZE):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.source = source
        names = target_names(source.name, str(source.path), str(source.mlx_dir))
        target = Target(model, tokenizer, measurement_key(source), names, source.weights)
        self.spec = SpecState(target)
        self.vocab_size = output_vocab(model)  # rows of the logits (padding included): what top_k counts
        self._detokenizer = make_detokenizer(tokenizer)  # built once (it reads the vocabulary), reset per request
        self._kept: Optional[KeptCache] = None
        self._kv: Optional[PagedKV] = None
        self.configure_kv(kv_cache, kv_budget, block_size)

    def configure_kv(self, kv_cache: str = "dense", kv_budget: Union[None, int, float, str] = None,
                     block_size: int = BLOCK_SIZE) -> None:
        """Choose the KV cache of the next requests (see the class docstring); drops the kept cache.

        Raises:
            MlxInferError: an unknown kv_cache, a kv_budget that does not parse, a block_size < 1, or a
                kv_budget / block_size other than the default given with the dense cache.
        """
        kind, budget, size = check_kv_cache(kv_cache), parse_budget(kv_budget), check_block_size(block_size)
        if kind == "dense" and (budget is not None or size != BLOCK_SIZE):
            raise MlxInferError("kv_budget and block_size apply to the paged KV cache: add kv_cache='paged'")
        self.reset()
        self._kv = PagedKV(self.model, budget, size) if kind == "paged" else None

    @property
    def kv_cache(self) -> str:
        """The KV cache kind requests use: "dense" or "paged"."""
        return "dense" if self._kv is None else "paged"

    @property
    def kv_pool(self):
        """The paged cache's BlockPool (None with the dense cache)."""
        return self._kv.pool if self._kv is not None else None

    def reset(self) -> None:
        """Forget the kept KV cache (its blocks go back to the pool): the next request prefills its whole prompt."""
        kept, self._kept = self._kept, None
        if kept is not None:
            release(kept.cache)

    def _fresh_cache(self) -> list:
        return make_prompt_cache(self.model) if self._kv is None else self._kv.new_cache()

    def _cache_for(self, prompt_ids: List[int]):
        """(caches, start): the kept cache trimmed to its common prefix with the prompt (at most all but the
        prompt's last token), or a fresh cache and 0 when nothing is shared or the kept one cannot trim."""
        kept, self._kept = self._kept, None
        if kept is not None:
            start = min(common_prefix(kept.tokens, prompt_ids), len(prompt_ids) - 1)
            extra = len(kept.tokens) - start
            if start > 0 and (extra == 0 or can_trim_prompt_cache(kept.cache)):
                trim_prompt_cache(kept.cache, extra)
                return kept.cache, start
            release(kept.cache)
        return self._fresh_cache(), 0

    def _keep(self, cache: list, tokens: List[int]) -> None:
        """Keep a finished request's cache for the next one when it can be trimmed (else the next starts
        fresh, and a paged cache's blocks go back to the pool); `tokens`: the prompt and every token the
        request's source delivered."""
        offset = cache[0].offset if can_trim_prompt_cache(cache) else -1
        if 0 < offset <= len(tokens):
            self._kept = KeptCache(cache, tokens[:offset])
        else:
            release(cache)

    def prepare(self, speculative: str = "off", draft_model=None, max_draft: Union[str, int] = "auto",
                say: Optional[Callable[[str], None]] = None) -> None:
        """Measure now, once per model and machine, what a speculative request with these options would
        otherwise measure during its first run (SpecState.prepare), so that its TTFT does not include them.
        say: gets a line before each measurement. Raises MlxInferError for bad options."""
        self.spec.prepare(self._spec_options(speculative, draft_model, max_draft), say=say)

    def _spec_options(self, speculative: str, draft_model, max_draft) -> SpecOptions:
        if isinstance(draft_model, Engine):
            draft_model = DraftModel(draft_model.model, draft_model.tokenizer)
        return SpecOptions(speculative, draft_model, max_draft)



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
        progress: Optional[Callable[[int, int], None]] = None,
        evict: Optional[str] = None,
        repack: bool = True,
        **sampling,
    ) -> Iterator[GenerationStep]:
        """Generate, yielding a GenerationStep per token; the last one carries finish_reason and stats.

        Args:
            prompt: see `encode`.
            params: SamplingParams; keyword arguments (temperature=..., max_tokens=...) override fields.
            speculative: "off" (plain decoding), "lookup" (prompt lookup, arXiv 2311.03511), "draft" (a draft
                model), "layerskip" (the target minus some layers, arXiv 2309.08168), "dflash" (arXiv
                2602.06036) / "dspark" (block drafters fed the target's hidden states), or "auto" (a draft
                model when given; else lookup, backed by the target's registered block drafter where its
                calibration says it pays on this machine; plain decoding where speculation cannot pay).
                Lossless: greedy output is identical to plain decoding, sampled output has the same
                distribution.
            draft_model: for "draft" / "auto": a model path / repo id, an Engine, or an mlx-lm model with the
                same tokenizer. For "dflash" / "dspark": a drafter directory or repo id in the published
                format (None: the one registered for this model).
            max_draft: draft tokens per round, an int >= 0 or "auto" (chosen each round from measured costs).
            progress: callable(done, total) during prefill, prompt tokens (a kept prefix counts as done).
            evict: "POLICY:RATIO" (paged cache only): evict that fraction of the tokens with the policy (h2o,
                scissorhands, streaming, snapkv, random); None: no eviction. Not with speculative decoding yet:
                speculative="auto" then decodes plainly.
            repack: with evict, repack live tokens into fewer blocks (vToken); False: the Naive-Evict baseline
                (the same eviction decisions, blocks freed only when empty).

        Raises:
            MlxInferError: bad parameters, empty prompt, a prompt that fills the context window, a draft_model
                given to a mode that uses none ("off", "lookup", "layerskip"), a bad evict, evict with the dense
                cache or with a speculative mode other than "auto"; KVBudgetError (an MlxInferError): a request
                that cannot fit the KV budget (before prefill).
        """
        params = (params or SamplingParams()).with_(**sampling) if sampling else (params or SamplingParams())
        params = params.for_vocab(self.vocab_size)
        options = self._spec_options(speculative, draft_model, max_draft)
        eviction = self._check_evict(evict, repack, options)
        prompt_ids = self.encode_fitting(prompt, system, chat_template)
        max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
        with wired_limit(self.model, [generation_stream]):
            yield from self._steps(prompt_ids, params, max_tokens, options, progress, eviction, repack)

    def _check_evict(self, evict: Optional[str], repack: bool, options: SpecOptions) -> Optional[EvictSpec]:
        """The request's EvictSpec (None: no eviction); raises MlxInferError for a bad one or a bad pairing."""
        spec = parse_evict(evict)
        if not isinstance(repack, bool):
            raise MlxInferError(f"repack must be True or False, got {repack!r}")
        if spec is None:
            return None
        if self._kv is None:
            raise MlxInferError("evict needs the paged KV cache: load with kv_cache='paged' (CLI: --kv-cache paged)")
        if options.on and options.mode != "auto":
            raise MlxInferError(f"eviction with speculative decoding is not supported yet: use speculative='off' "
                                f"or 'auto' (which then decodes plainly), not {options.mode!r}")
        return spec

    def _steps(self, prompt_ids: List[int], params: SamplingParams, max_tokens: int, options: SpecOptions,
               progress: Optional[Callable[[int, int], None]], evict: Optional[EvictSpec] = None,
               repack: bool = True) -> Iterator[GenerationStep]:
        """The steps of one validated request (see stream_steps)."""
        detok = self._detokenizer
        detok.reset()
        stops = StopStringMatcher(params.stop)
        eos = set(self.tokenizer.eos_token_ids)
        mx.reset_peak_memory()
        start = time.perf_counter()
        cache, cached = self._cache_for(prompt_ids)
        kv = None
        if self._kv is not None:
            try:
                self._kv.check_fits(cache, len(prompt_ids), max_tokens, evict is not None)
                kv = KVRequest(self._kv, cache, evict, repack)
            except MlxInferError:
                release(cache)
                raise
        spec = SpecStats() if options.on else None
        tokens = None
        if spec is not None and evict is not None:
            spec.mode = "off"  # speculative="auto" with eviction: plain decoding (not supported together yet)
        elif spec is not None:
            try:
                tokens = self.spec.tokens(prompt_ids, params, max_tokens, options, spec, cache, cached, progress)
            except Exception:  # e.g. a drafter that fails to load: a paged cache's blocks go back to the pool
                release(cache)
                raise
        if tokens is None:  # plain decoding (asked for, or where speculation cannot pay)
            tokens = plain_tokens(self.model, prompt_ids, params, max_tokens, cache, cached, progress)
        first_at = None
        finish, n = "length", 0
        held_text, held_token = "", None  # the last token's step, yielded with the final one
        delivered: List[int] = []  # every token the source gave, EOS included (what the cache may hold)
        clean = False
        kv_stats = None
        try:
            if kv is not None:
                kv.__enter__()
            for token in tokens:
                first_at = first_at or time.perf_counter()
                delivered.append(token)
                if kv is not None:
                    kv.step()
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
            clean = True
        except GeneratorExit:  # the consumer stopped: the token source rolls its cache back to `delivered`
            clean = True
            raise
        finally:
            tokens.close()
            if kv is not None:
                kv.__exit__(None, None, None)
                kv_stats = kv.stats()
            # an exception inside a forward leaves the cache in an unknown state, and an evicted one no longer
            # equals a fresh prefill of its tokens: neither is kept
            if clean and (kv is None or kv.evicted == 0):
                self._keep(cache, list(prompt_ids) + delivered)
            else:
                release(cache)
        end = time.perf_counter()
        if not (finish == "stop" and held_token is not None):  # no stop string hit yet
            detok.finalize()
            text, hit = stops.feed(detok.text)
            held_text += text if hit else text + stops.flush(detok.text)
            finish = "stop" if hit else finish
        first_at = first_at or end
        prefilled = len(prompt_ids) - cached
        stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            generated_tokens=n,
            ttft_s=first_at - start,
            prefill_tps=prefilled / (first_at - start) if first_at > start else 0.0,
            decode_tps=(n - 1) / (end - first_at) if n > 1 and end > first_at else 0.0,
            total_s=end - start,
            peak_memory_bytes=int(mx.get_peak_memory()),
            cached_prompt_tokens=cached,
            kv=kv_stats,
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
