"""Engine: owns a model and its tokenizer; generate, stream and chat.

    engine = mlx_infer.load()                       # the embedded default model
    result = engine.generate("What is the capital of France?", max_tokens=64)
    for chunk in engine.stream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")
"""

import copy
import numbers
import threading
from collections.abc import Iterable
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .backend import backend_name, blas_in_use, return_free_memory
from .aio import AsyncRunner
from .batch import BatchRequest, BatchRunner, BatchScheduler
from .batch.request import Emit
from .defaults import IDLE_RELEASE_S, MAX_BATCH
from .errors import EngineBusyError, MlxInferError, RequestError
from .generation.compiled import CompiledSteps
from .generation.decode import plain_tokens
from .generation.assemble import StepAssembler
from .generation.detokenize import make_detokenizer
from .generation.results import GenerationResult, GenerationStats, GenerationStep, collect
from .generation.sampling import SamplingParams
from .kernels import cpu as cpu_kernels
from .kv.attention_hook import install as install_attention_hook
from .kv.defaults import BLOCK_SIZE, KIVI_RESIDUAL, KV_GROUP_SIZE
from .kv.observe import QueryTap
from .kv.options import EvictSpec, check_block_size, check_kv_cache, parse_budget, parse_evict
from .kv.pool import BlockPool
from .kv.quant_cache import exact_prefix, kv_bytes_per_token, make_quant_cache
from .kv.quant_options import KVQuant, check_head_dims, check_paged_quant, fit_group_size, kv_quant
from .kv.session import KVRequest, PagedKV, probe_kv_layout, release
from .loading import ModelSource
from .paths import model_fingerprint
from .rmm.attention import reduced_products
from .rmm.options import Retention
from .speculative import DraftModel, SpecOptions, SpecState, SpecStats, Target
from .speculative.registry import target_names
from .speculative.target import output_vocab

Messages = Sequence[dict]
Prompt = Union[str, Messages, Sequence[int]]
#: What `draft_model` takes: a model path or repo id, an Engine, or an mlx-lm model (None: none, or the
#: registered drafter).
DraftModelArg = Union[None, str, "Engine", nn.Module]


@dataclass
class KeptCache:
    """The KV cache of the previous request, kept for the next one.

    Attributes:
        cache: the per-layer mlx-lm caches.
        tokens: the token ids whose KV they hold, in order (len == the caches' offset).
    """

    cache: list
    tokens: List[int]


def _check_unicode(text: str) -> None:
    """Raise MlxInferError for text the tokenizer cannot take: a lone surrogate, which is how Python keeps
    bytes that are not UTF-8 (a command-line argument or stdin in another encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MlxInferError(f"the prompt is not valid UTF-8 text (an undecodable byte at character {e.start}); "
                            "convert it to UTF-8 first (e.g. with iconv)") from None


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
    run on and the build of the CPU kernels (any of which a model's layers may run), the backend, BLAS and
    MLX version, and the RMM retention of a reduced model."""
    build = cpu_kernels.build_id() if backend_name() == "cpu" else None
    key = (f"{model_fingerprint(source.mlx_dir)}|{source.weights}|{source.kernels}|{backend_name()}|"
           f"{blas_in_use()}|{mx.__version__}|{build}")  # type: ignore[attr-defined]  # not in MLX's stubs
    return key if source.rmm is None else f"{key}|rmm:{source.rmm}"


class Engine:
    """A loaded model, ready to generate.

    Build it with `mlx_infer.load(...)`. Safe to call from several threads: calls are serialized (a request,
    a stream's whole iteration included, holds the engine until it finishes or the stream is closed or
    garbage-collected; the others wait, as they wait for a BatchRunner of the engine while it has requests).
    For concurrent decoding use the asyncio API (`agenerate`, `astream`: one runner per engine, shared by
    every coroutine), `batch_runner` (submit from any thread) or `generate_batch`. Starting a second request
    on a thread whose stream is still open raises EngineBusyError (the two would otherwise wait for each
    other forever).

    The engine keeps the KV of its requests for the next ones: a request whose prompt starts with tokens an
    earlier one held (a chat's next turn: the history, then the new message) prefills only what follows
    (`GenerationStats.cached_prompt_tokens`). With the paged cache that is the prefix cache batched requests
    and the server share (kv/prefix.py: full blocks keyed by a hash chain of their tokens, reference-counted,
    idle ones in an LRU freed when the pool needs room), so any earlier request's prefix serves, in whole
    blocks; with the dense cache it is the last request's cache, trimmed to the common prefix. `reset()`
    drops both. A request that evicts tokens shares nothing (its cache stops equalling a prefill of its
    tokens).

    KV cache (`configure_kv`, or the same keyword arguments of the constructor and `mlx_infer.load`):
    kv_cache="dense" (default: mlx-lm's own contiguous cache; without eviction the paged one only adds a
    little per decode step: docs/kv.md#dense-or-paged) or "paged" (a block
    pool per engine with a token table per request, vToken arXiv 2608.13263: needed for eviction with
    reclaimed blocks, and the prefix cache); kv_budget (bytes, "512MB" / "2GiB", or a fraction of free memory "0.5"; None: no limit);
    block_size (tokens per block, 16). Quantized KV (dense cache; paged cache and batched decoding: quantized
    blocks, affine scheme from the first token only): kv_bits (8, 4 or
    "k8v4": K and V apart; None: float), kv_scheme ("affine": per token, groups along head_dim; "kivi":
    keys per channel, values per token, the last tokens in float, arXiv 2402.02750), kv_quant_start (tokens
    kept in float first), kv_group_size (None: 64, or 32 when 64 does not divide the model's head
    dims), kv_residual (KIVI's float window, 64), kv_rotate (affine: each group of K/V values
    Hadamard-rotated before quantizing; None: the 4-bit stores, kv/rotation.py). Attention then reads the
    packed K/V through the kernel layer's fused quant_attention.

    RMM (`mlx_infer.load(rmm=...)`, arXiv 2608.13426; lossy): the model's linear layers were reduced when it
    was loaded; the attention products (qk, pv) are reduced inside each single request (batched decoding
    refuses them).

    Attributes:
        model, tokenizer, config, source: the loaded model (mlx-lm classes), its tokenizer, config.json
            and where it came from.
        rmm: the model's RMM Retention, None when exact.
        vocab_size: the model's output vocabulary (rows of its logits, padding included).
        spec: SpecState, what speculative decoding keeps for this model (loaded drafters, schedulers,
            measured costs).
    """

    def __init__(self, model: nn.Module, tokenizer, config: dict, source: ModelSource, *, kv_cache: str = "dense",
                 kv_budget: Union[None, int, float, str] = None, block_size: int = BLOCK_SIZE,
                 rmm: Optional[Retention] = None, **kv_quant_options):
        self.model = model
        self.rmm = rmm
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
        self._batch_pool: Optional[PagedKV] = None  # batched decoding's pool when the engine's cache is dense
        self._quant: Optional[KVQuant] = None
        self._kv_layout: Optional[tuple] = None  # (n_kv, k_dim, v_dim, dtype) of the model's K/V, probed once
        self._compiled: Optional[CompiledSteps] = None  # the model's compiled one-token steps (made on first use)
        self._busy = threading.Lock()  # held by the request running (a stream: until it ends or is closed)
        self._owner: Optional[int] = None  # the thread that holds _busy (threading.get_ident), None when free
        self._aio = AsyncRunner(self.batch_runner)  # agenerate / astream's runner, started on first use
        install_attention_hook(self.model)  # the kernels' attention: prefill tiles, quantized KV, RMM products
        self.configure_kv(kv_cache, kv_budget, block_size, **kv_quant_options)

    def compiled_steps(self) -> CompiledSteps:
        """The model's compiled one-token steps (generation/compiled.py), kept across requests while its
        modules stay the same, so that their traces serve every request."""
        self._compiled = CompiledSteps(self.model) if self._compiled is None else self._compiled.current()
        return self._compiled

    def configure_kv(self, kv_cache: str = "dense", kv_budget: Union[None, int, float, str] = None,
                     block_size: int = BLOCK_SIZE, kv_bits: Union[None, int, str] = None, kv_scheme: str = "affine",
                     kv_quant_start: int = 0, kv_group_size: Optional[int] = None,
                     kv_residual: int = KIVI_RESIDUAL, kv_rotate: Optional[bool] = None) -> None:
        """Choose the KV cache of the next requests (see the class docstring); drops the kept cache. Every
        call sets all of these options: one not given goes back to its default (float, dense KV).

        Raises:
            MlxInferError: an unknown kv_cache, a kv_budget that does not parse, a block_size < 1, or a
                kv_budget / block_size other than the default given with the dense cache; a bad quantized-KV
                option (see kv.quant_options.kv_quant), or with the paged cache a quantization its blocks
                cannot hold (kv_scheme='kivi', kv_quant_start > 0: kv.quant_options.check_paged_quant), or head
                dims that kv_group_size does not divide (None: KV_GROUP_SIZE, or the largest group size that
                divides them: kv.quant_options.fit_group_size); KVBudgetError: a kv_budget that cannot hold one
                block. On an error the previous setting stays.
        """
        kind, budget, size = check_kv_cache(kv_cache), parse_budget(kv_budget), check_block_size(block_size)
        quant = kv_quant(kv_bits, kv_scheme, kv_quant_start, KV_GROUP_SIZE if kv_group_size is None else kv_group_size,
                         kv_residual, kv_rotate)
        if quant is not None:  # the model's head dims, known now: a group size that fits, or the error here
            if self._kv_layout is None:
                self._kv_layout = probe_kv_layout(self.model)
            dims = self._kv_layout[1:3]
            quant = fit_group_size(quant, *dims) if kv_group_size is None else quant
            check_head_dims(quant, *dims)
        if kind == "dense" and (budget is not None or size != BLOCK_SIZE):
            raise MlxInferError("kv_budget and block_size apply to the paged KV cache: add kv_cache='paged'")
        if kind == "paged" and quant is not None:
            check_paged_quant(quant)  # KIVI or a float prefix: a one-line error
        kv = PagedKV(self.model, budget, size, quant, self._kv_layout) if kind == "paged" else None
        if kv is not None and budget is not None:
            kv.check_budget()  # a budget under one block fails here, the previous setting kept
        self.reset()
        self._kv = kv
        self._batch_pool = None  # a dense engine's batched pool follows its quantization (made on first use)
        self._quant = quant

    @property
    def kv_bits(self) -> Optional[str]:
        """The quantized KV setting of the next requests ("8", "k8v4", "kivi-4", ...), None for float KV."""
        return str(self._quant) if self._quant is not None else None

    @property
    def kv_cache(self) -> str:
        """The KV cache kind requests use: "dense" or "paged"."""
        return "dense" if self._kv is None else "paged"

    @property
    def kv_pool(self) -> Optional[BlockPool]:
        """The paged cache's BlockPool (None with the dense cache)."""
        return self._kv.pool if self._kv is not None else None

    def reset(self) -> None:
        """Forget the kept KV cache and the prefix cache (their blocks go back to the pool, and a pool no
        request holds shrinks to its initial size, PagedKV.release_idle, its memory returned to the system,
        backend.return_free_memory): the next request prefills its whole prompt."""
        self._drop_kept()
        released = 0
        for kv in (self._kv, self._batch_pool):
            if kv is not None:
                kv.prefix.clear()
                released += kv.release_idle()
        if released:
            return_free_memory()

    def _drop_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            release(kept.cache)

    def _fresh_cache(self) -> list:
        if self._kv is not None:
            return self._kv.new_cache()
        return make_prompt_cache(self.model) if self._quant is None else make_quant_cache(self.model, self._quant)

    def _cache_for(self, prompt_ids: List[int], share: bool = True):
        """(caches, start): with the paged cache, a cache holding the longest prefix of the prompt in the
        prefix cache (whole blocks, when `share`: PagedKV.start); with the dense cache, the kept cache trimmed
        to its common prefix with the prompt (at most all but the prompt's last token, and where a fresh
        prefill would hold the same: kv.quant_cache.exact_prefix), or a fresh cache and 0 when nothing is
        shared or the kept one cannot trim."""
        if self._kv is not None:
            return self._kv.start(prompt_ids, share)
        kept, self._kept = self._kept, None
        if kept is not None:
            start = min(common_prefix(kept.tokens, prompt_ids), len(prompt_ids) - 1)
            start = exact_prefix(kept.cache, start, len(prompt_ids) - 1)
            extra = len(kept.tokens) - start
            if start > 0 and (extra == 0 or can_trim_prompt_cache(kept.cache)):
                trim_prompt_cache(kept.cache, extra)
                return kept.cache, start
            release(kept.cache)
        return self._fresh_cache(), 0

    def _keep(self, cache: list, tokens: List[int]) -> None:
        """Keep a finished request's KV for the next ones: a paged cache's full blocks go to the prefix cache
        (PagedKV.keep); a dense cache is kept whole when it can be trimmed (else the next starts fresh).
        `tokens`: the prompt and every token the request's source delivered."""
        if self._kv is not None:
            return self._kv.keep(cache, tokens)
        offset = cache[0].offset if can_trim_prompt_cache(cache) else -1
        if 0 < offset <= len(tokens):
            self._kept = KeptCache(cache, tokens[:offset])
        else:
            release(cache)

    def prepare(self, speculative: str = "off", draft_model: DraftModelArg = None, max_draft: Union[str, int] = "auto",
                say: Optional[Callable[[str], None]] = None) -> None:
        """Measure now, once per model and machine, what a speculative request with these options would
        otherwise measure during its first run (SpecState.prepare), so that its TTFT does not include them.
        say: gets a line before each measurement. Raises MlxInferError for bad options, EngineBusyError as
        `stream_steps`."""
        with self._serialized():
            self.spec.prepare(self._spec_options(speculative, draft_model, max_draft), say=say)

    @contextmanager
    def _serialized(self):
        """Hold the engine for one request: another thread's request waits until it is released; one on the
        thread that holds it raises EngineBusyError (a stream of that thread is still open: waiting would
        never end). Released on exit, also when a stream's generator is closed or garbage-collected (from
        any thread)."""
        me = threading.get_ident()
        if self._owner == me:  # (only this thread sets or clears _owner while it holds _busy)
            raise EngineBusyError("this thread is still streaming an earlier request of this engine: iterate that "
                                  "stream to its end or close() it first, or use engine.batch_runner() for "
                                  "concurrent requests")
        with self._busy:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None

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
            MlxInferError: empty prompt, bad messages, text that is not valid Unicode (bytes that were not
                UTF-8, kept by Python as lone surrogates), token ids outside the vocabulary, or a system
                prompt without a chat template.
        """
        if isinstance(prompt, str):
            _check_unicode(prompt)
            if not prompt.strip():
                raise MlxInferError("the prompt is empty; give some text")
            if not (chat_template and self.tokenizer.has_chat_template):
                if system:
                    raise MlxInferError("a system prompt needs a chat template, and this model has none (or --no-chat-template was given)")
                return list(self.tokenizer.encode(prompt))
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, dict):
            raise MlxInferError("a chat prompt is a list of messages: wrap the message in a list ([{...}])")
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            raise MlxInferError(f"the prompt must be a string, a list of chat messages or a list of token ids "
                                f"(ints), got {type(prompt).__name__}")
        items: List[Any] = list(prompt)
        if not items:
            raise MlxInferError("the prompt is empty; give some text")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return self._checked_ids(items)
        if not all(isinstance(m, dict) for m in items):
            raise MlxInferError("a list prompt must hold token ids (ints) or chat messages (dicts with 'role' and "
                                "'content'), not a mix or other values")
        for m in items:
            if "role" not in m or not isinstance(m.get("content"), str):
                raise MlxInferError("each chat message must be a dict with 'role' and 'content' (a string)")
            _check_unicode(m["content"])
        if system:
            _check_unicode(system)
        if not self.tokenizer.has_chat_template:
            raise MlxInferError("this model has no chat template; pass a plain string prompt")
        if system:
            items = [{"role": "system", "content": system}] + [m for m in items if m["role"] != "system"]
        return list(self.tokenizer.apply_chat_template(items, add_generation_prompt=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (as `generate`'s token_ids), special tokens included: the inverse of
        `encode` for a plain string prompt.

        Raises:
            MlxInferError: an id that is not an int in the model's vocabulary.
        """
        try:
            ids = None if isinstance(token_ids, (str, bytes)) else list(token_ids)
        except TypeError:
            ids = None
        if ids is None:
            raise MlxInferError(f"decode takes a list of token ids (ints), got {type(token_ids).__name__}")
        return self.tokenizer.decode(self._checked_ids(ids))

    def _checked_ids(self, ids: List) -> List[int]:
        """ids as ints, or MlxInferError naming the first that is not an int or not in 0..vocab_size - 1."""
        odd = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if odd is not None:
            raise MlxInferError(f"token ids must be ints, got {odd!r} ({type(odd).__name__})")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise MlxInferError(f"token id {bad!r} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        return [int(t) for t in ids]

    def stream_steps(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        system: Optional[str] = None,
        chat_template: bool = True,
        speculative: str = "off",
        draft_model: DraftModelArg = None,
        max_draft: Union[str, int] = "auto",
        progress: Optional[Callable[[int, int], None]] = None,
        evict: Optional[str] = None,
        repack: bool = True,
        **sampling: Any,
    ) -> Iterator[GenerationStep]:
        """Generate, yielding a GenerationStep per token; the last one carries finish_reason and stats.

        Args:
            prompt: see `encode`.
            params: SamplingParams; keyword arguments (temperature=..., max_tokens=...) override fields.
            speculative: "off" (plain decoding), "lookup" (prompt lookup, arXiv 2311.03511), "draft" (a draft
                model), "layerskip" (the target minus some layers, arXiv 2309.08168), "rmm" (the target with
                its linear layers reduced, arXiv 2608.13426), "dflash" (arXiv
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

        Calls from several threads are serialized: the request waits (from its first step) until the engine
        is free, and holds it until its last step was taken or the iterator is closed (see the class docstring).

        Raises:
            MlxInferError: bad parameters, empty prompt, a prompt that fills the context window, a draft_model
                given to a mode that uses none ("off", "lookup", "layerskip", "rmm"), a bad evict, evict with the dense
                cache or with a speculative mode other than "auto"; KVBudgetError (an MlxInferError): a request
                that cannot fit the KV budget (before prefill); EngineBusyError (an MlxInferError): a stream of
                this engine started on the same thread is still open.
        """
        with self._serialized():
            params = (params or SamplingParams()).with_(**sampling) if sampling else (params or SamplingParams())
            params = params.for_vocab(self.vocab_size)
            options = self._spec_options(speculative, draft_model, max_draft)
            eviction = self._check_evict(evict, repack, options)
            prompt_ids = self.encode_fitting(prompt, system, chat_template)
            max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
            # (mlx-lm's generation_stream is a thread-local stream, not the Stream its annotation names)
            with wired_limit(self.model, [generation_stream]):  # type: ignore[list-item]
                yield from self._steps(prompt_ids, params, max_tokens, options, progress, eviction, repack)

    def _check_evict(self, evict: Optional[str], repack: bool, options: SpecOptions,
                     batched: bool = False) -> Optional[EvictSpec]:
        """The request's EvictSpec (None: no eviction); raises MlxInferError for a bad one or a bad pairing
        (batched: the request runs on the batch's paged pool, whichever cache the engine keeps), and
        UnsupportedModelError for a model whose attention the query tap cannot reach."""
        spec = parse_evict(evict)
        if not isinstance(repack, bool):
            raise MlxInferError(f"repack must be True or False, got {repack!r}")
        if spec is None:
            return None
        QueryTap(self.model)  # raises for a model whose attention statistics cannot be collected
        if self._kv is None and not batched:
            raise MlxInferError("evict needs the paged KV cache: load with kv_cache='paged' (CLI: --kv-cache paged)")
        if options.on and options.mode != "auto":
            raise MlxInferError(f"eviction with speculative decoding is not supported yet: use speculative='off' "
                                f"or 'auto' (which then decodes plainly), not {options.mode!r}")
        return spec

    def _steps(self, prompt_ids: List[int], params: SamplingParams, max_tokens: int, options: SpecOptions,
               progress: Optional[Callable[[int, int], None]], evict: Optional[EvictSpec] = None,
               repack: bool = True) -> Iterator[GenerationStep]:
        """The steps of one validated request (see stream_steps)."""
        asm = StepAssembler(self._detokenizer, params.stop, self.tokenizer.eos_token_ids, max_tokens)
        mx.reset_peak_memory()
        start = time.perf_counter()
        # an evicting request shares no prefix: its blocks are repacked, and its cache stops matching a prefill
        cache, cached = self._cache_for(prompt_ids, share=evict is None)
        kv = None
        if self._kv is not None:
            try:
                self._kv.reserve(cache, len(prompt_ids), max_tokens, evict, repack)
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
            tokens = plain_tokens(self.model, prompt_ids, params, max_tokens, cache, cached, progress,
                                  compiled=self.compiled_steps().decode)
        first_at = None
        delivered: List[int] = []  # every token the source gave, EOS included (what the cache may hold)
        clean = False
        kv_stats = None
        try:
            if kv is not None:
                kv.__enter__()
            with reduced_products(**(self.rmm.products() if self.rmm is not None else {})):
                for token in tokens:
                    first_at = first_at or time.perf_counter()
                    delivered.append(token)
                    if kv is not None:
                        kv.step()
                    text = asm.add(token)
                    if text is None:
                        break
                    yield GenerationStep(text, token)
            clean = True
        except GeneratorExit:  # the consumer stopped: the token source rolls its cache back to `delivered`
            clean = True
            raise
        finally:
            tokens.close()  # type: ignore[attr-defined]  # both token sources are generators
            token_bytes = kv_bytes_per_token(cache)
            if kv is not None:
                kv.__exit__(None, None, None)
                kv_stats = kv.stats()
            # an exception inside a forward leaves the cache in an unknown state, and an evicted one no longer
            # equals a fresh prefill of its tokens: neither is kept
            if clean and evict is None:
                self._keep(cache, list(prompt_ids) + delivered)
            else:
                release(cache)
        end = time.perf_counter()
        held_text, held_token, finish = asm.final()
        n = asm.n
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
            kv_bits=self.kv_bits,
            kv_bytes_per_token=round(token_bytes, 3),
            rmm=self.source.rmm,
        )
        if spec is not None:
            stats.spec_mode, stats.tau, stats.rounds = spec.mode, spec.tau, spec.rounds
            stats.draft_s, stats.verify_s, stats.acceptance = spec.draft_s, spec.verify_s, spec.acceptance
        yield GenerationStep(held_text, held_token, finish_reason=finish, stats=stats)

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs: Any) -> Iterator[str]:
        """Generate, yielding text chunks as they are ready (never a broken UTF-8 sequence).
        Arguments as `stream_steps`."""
        for step in self.stream_steps(prompt, params, **kwargs):
            if step.text:
                yield step.text

    def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs: Any) -> GenerationResult:
        """Generate a whole answer. Arguments as `stream_steps`.

        Returns:
            GenerationResult with text, token ids, finish reason and stats.
        """
        return collect(self.stream_steps(prompt, params, **kwargs))

    # ---- batched decoding (continuous batching over the block pool)

    def _batch_kv(self) -> PagedKV:
        """The pool batched requests use: the engine's paged cache, or (dense engine) a private unbounded one,
        with quantized blocks when the engine quantizes its KV (kv_bits). Raises MlxInferError for a
        quantization the blocks cannot hold (a dense engine's KIVI or float prefix) or reduced attention
        products (RMM qk / pv)."""
        if self._quant is not None and self._kv is None:
            try:
                check_paged_quant(self._quant)
            except MlxInferError as exc:
                raise MlxInferError(f"batched decoding runs on the paged KV pool: {exc}") from None
        if self.rmm is not None and self.rmm.products() != {"qk": 1.0, "pv": 1.0}:
            raise MlxInferError("batched decoding does not reduce the attention products: load the model with "
                                "rmm= without qk / pv for batched requests")
        if self._kv is not None:
            return self._kv
        if self._batch_pool is None:
            self._batch_pool = PagedKV(self.model, None, BLOCK_SIZE, self._quant, self._kv_layout)
        return self._batch_pool

    def batch_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, system: Optional[str] = None,
                      chat_template: bool = True, speculative: str = "off", evict: Optional[str] = None,
                      repack: bool = True, emit: Optional[Emit] = None, **sampling: Any) -> BatchRequest:
        """A request for `BatchRunner.submit`, built and checked on the caller's thread (any thread: no MLX
        work but its random key): the prompt encoded once (as `encode_fitting`), the parameters checked as
        `stream_steps`'. speculative: a mode used while the request runs alone; evict (with speculative "off"
        or "auto", which then decodes plainly) and repack as `generate_batch`. emit: where its steps go when
        a BatchScheduler is driven by hand (a runner points them at the request's handle).

        Raises:
            RequestError: a bad prompt (param "prompt"; as `encode_fitting`) or sampling parameter (param: the
                field); MlxInferError: a bad speculative mode or evict.
        """
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}", "params")
        params = (params or SamplingParams()).with_(**sampling).for_vocab(self.vocab_size)
        options = self._spec_options(speculative, None, "auto")
        eviction = self._check_evict(evict, repack, options, batched=True)
        if eviction is not None:
            options = self._spec_options("off", None, "auto")
        try:
            prompt_ids = self.encode_fitting(prompt, system, chat_template)
        except RequestError:
            raise
        except MlxInferError as e:
            raise RequestError(str(e), "prompt") from None
        max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
        return BatchRequest(prompt_ids, params, max_tokens, copy.copy(self._detokenizer),
                            self.tokenizer.eos_token_ids, emit, options, self.source.rmm, eviction, repack)

    def _solo_tokens(self, req: BatchRequest) -> Optional[Iterator[int]]:
        """The speculative iterator of a batched request running alone (BatchScheduler `solo`): its cache
        holds its prompt and its tokens but the last; None where speculation cannot pay."""
        if req.speculative is None or req.spec is None or req.cache is None:
            return None
        history = req.prompt_ids + req.generated
        return self.spec.tokens(history, req.params, req.max_tokens - req.assembler.n, req.speculative, req.spec,
                                req.cache, start=len(history) - 1)

    def scheduler(self, max_batch: int = MAX_BATCH, prefix_cache: bool = True) -> BatchScheduler:
        """A BatchScheduler over this engine's block pool (drops the kept KV cache, whose blocks it may need).
        prefix_cache: requests start from the cached full blocks of earlier ones that share their prompt's
        beginning (GenerationStats.cached_prompt_tokens); `reset()` empties it.

        Raises:
            MlxInferError: max_batch < 1; UnsupportedModelError: a model whose layers are not all KV caches.
        """
        self._drop_kept()
        return BatchScheduler(self.model, self._batch_kv(), max_batch, prefix_cache, solo=self._solo_tokens,
                              compiled=self.compiled_steps().batch)

    def batch_runner(self, max_batch: int = MAX_BATCH, prefix_cache: bool = True,
                     idle_release_s: Optional[float] = IDLE_RELEASE_S) -> BatchRunner:
        """A continuous-batching decode loop on its own thread: `submit(engine.batch_request(prompt, params))`
        from any thread returns a RequestHandle to stream from or cancel (what the server uses). After
        idle_release_s seconds without a request (None: never) it gives its KV memory back: the prefix cache
        is forgotten and the block pool shrinks, so the next request prefills in full. While it has requests
        its thread holds the engine: the engine's own calls from other threads wait. Close it (or use it as a
        context manager) when done."""
        return BatchRunner(self.scheduler(max_batch, prefix_cache), idle_release_s, hold=self._busy)

    async def agenerate(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                        **kwargs: Any) -> GenerationResult:
        """`generate` for asyncio: the request joins the engine's own BatchRunner (started on first use), so
        that concurrent coroutines decode together; cancelling the task cancels the request (its KV blocks
        freed at the runner's next step). Arguments as `batch_request`. Raises as `batch_request`, and
        GenerationError / RunnerClosedError as `RequestHandle.result`."""
        return await self._aio.generate(self.batch_request(prompt, params, **kwargs))

    def astream(self, prompt: Prompt, params: Optional[SamplingParams] = None, **kwargs: Any) -> AsyncIterator[str]:
        """`stream` for asyncio (`async for chunk in engine.astream(...)`), on the engine's BatchRunner as
        `agenerate`; leaving the loop (break, aclose, a cancelled task) cancels the request at once. The
        request is checked now (raises as `batch_request`) and submitted on the first iteration."""
        return self._aio.stream(self.batch_request(prompt, params, **kwargs))

    def generate_batch(self, prompts: Sequence[Prompt], params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                       *, system: Optional[str] = None, chat_template: bool = True, max_batch: int = MAX_BATCH,
                       prefix_cache: bool = True, speculative: str = "off", evict: Optional[str] = None,
                       repack: bool = True, **sampling: Any) -> List[GenerationResult]:
        """Generate answers to several prompts decoding together (continuous batching: at most max_batch at
        once, newcomers admitted as others finish or as the KV budget allows). Batched rows decode plainly,
        evicting tokens when asked; greedy answers equal `generate`'s up to float rounding of the
        batched matmul, seeded ones draw from their own random key (as `generate` with that seed; with
        speculative decoding off: a speculating request draws differently, from the same distribution).

        Args:
            prompts: each as `encode` takes it.
            params: one SamplingParams for all, one per prompt, or None; keyword arguments override fields of each.
            max_batch: most requests decoding at once.
            prefix_cache: reuse the full KV blocks of earlier batched requests with the same beginning (see
                `scheduler`).
            speculative: a mode of `stream_steps` ("off", "lookup", "auto", ...), used by a request while it
                runs alone (the last one of a batch, a lone prompt); batched requests decode plainly.
            evict: "POLICY:RATIO" for every request, as `stream_steps` (its tokens equal the same request's
                alone, up to float rounding; stats.kv per request); with repack (vToken) a request reserves
                only the KV blocks of the tokens it keeps, so more requests fit one budget. Not with a
                speculative mode but "off" / "auto". No prefix cache for evicting requests.
            repack: with evict: vToken repacking (True) or Naive-Evict (False, which reserves every token).

        Returns:
            one GenerationResult per prompt, in order (stats.ttft_s counts from the call); no prompts, [].

        Raises:
            MlxInferError: a bad prompt (its message starts with "prompt i: ") or parameter (evict as
                `stream_steps`), params of another length than prompts; KVBudgetError: a request that can
                never fit the KV budget (before anything runs); EngineBusyError: a stream of this engine
                started on the same thread is still open (other threads' calls wait, as `stream_steps`).
        """
        if isinstance(prompts, str):
            raise MlxInferError("generate_batch takes a list of prompts; for one prompt use generate, or pass [prompt]")
        prompts = list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise MlxInferError(f"{len(prompts)} prompts but {len(params)} params: give one, or one per prompt")
        params = [p.with_(**sampling) if sampling else p for p in params]
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.encode_fitting(p, system, chat_template))
            except MlxInferError as e:
                raise MlxInferError(f"prompt {i}: {e}") from e
        with self._serialized():
            sched = self.scheduler(max_batch, prefix_cache)
            steps: List[list] = [[] for _ in prompts]
            requests = [self.batch_request(i, p, speculative=speculative, evict=evict, repack=repack, emit=s.append)
                        for i, p, s in zip(ids, params, steps)]
            for r in requests:
                sched.check_fits(r)
            for r in requests:
                sched.add(r)
            try:
                while sched.busy:
                    sched.step()
            except BaseException:
                sched.fail_all()
                raise
        return [collect(s) for s in steps]
