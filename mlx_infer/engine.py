"""Engine: owns a model and its tokenizer; generate, stream and chat.

    engine = mlx_infer.load()                       # the embedded default model
    result = engine.generate("What is the capital of France?", max_tokens=64)
    for chunk in engine.stream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")
"""

import copy
import threading
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit

from .backend import backend_name, blas_in_use, return_free_memory
from .aio import AsyncRunner
from .batch import BatchRequest, BatchRunner, BatchScheduler
from .batch.request import Emit
from .batch.run import check_batchable, run_batch, solo_tokens
from .defaults import IDLE_RELEASE_S, MAX_BATCH
from .errors import EngineBusyError, MlxInferError, RequestError
from .generation.compiled import CompiledSteps
from .generation.detokenize import make_detokenizer
from .generation.prompt import Prompt, PromptCodec
from .generation.request import Decoding, Request, check_evict, run_request, sampling_params
from .generation.results import GenerationResult, GenerationStats, GenerationStep, collect
from .generation.sampling import SamplingParams
from .kernels import cpu as cpu_kernels
from .kv.attention_hook import install as install_attention_hook
from .kv.defaults import BLOCK_SIZE, KIVI_RESIDUAL, KV_GROUP_SIZE
from .kv.options import check_block_size, check_kv_cache, parse_budget
from .kv.pool import BlockPool
from .kv.quant_options import KVQuant, check_head_dims, check_paged_quant, fit_group_size, kv_quant
from .kv.session import PagedKV, probe_kv_layout
from .kv.store import KVStore, make_store
from .loading import ModelSource
from .paths import model_fingerprint
from .rmm.options import Retention
from .speculative import DraftModel, SpecOptions, SpecState, Target
from .speculative.registry import target_names
from .speculative.target import output_vocab

#: What `draft_model` takes: a model path or repo id, an Engine, or an mlx-lm model (None: none, or the
#: registered drafter).
DraftModelArg = Union[None, str, "Engine", nn.Module]


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
        self._prompts = PromptCodec(tokenizer, self.vocab_size)
        self._store: KVStore = make_store("dense", model, None, BLOCK_SIZE, None, None)  # (configure_kv sets it)
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
        store = make_store(kind, self.model, budget, size, quant, self._kv_layout)  # KVBudgetError: none set
        self.reset()
        self._store, self._quant = store, quant

    @property
    def kv_bits(self) -> Optional[str]:
        """The quantized KV setting of the next requests ("8", "k8v4", "kivi-4", ...), None for float KV."""
        return str(self._quant) if self._quant is not None else None

    @property
    def kv_cache(self) -> str:
        """The KV cache kind requests use: "dense" or "paged"."""
        return self._store.kind

    @property
    def kv_pool(self) -> Optional[BlockPool]:
        """The paged cache's BlockPool (None with the dense cache)."""
        return self._store.pool

    def reset(self) -> None:
        """Forget the kept KV cache and the prefix cache (their blocks go back to the pool, and a pool no
        request holds shrinks to its initial size, PagedKV.release_idle, its memory returned to the system,
        backend.return_free_memory): the next request prefills its whole prompt."""
        if self._store.reset():
            return_free_memory()

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
        return self._prompts.fitting(prompt, self.context_length, system, chat_template)

    def encode(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True) -> List[int]:
        """Prompt token ids: a string (through the chat template unless chat_template is False or the model
        has none), a list of chat messages ({"role", "content"}), or token ids; system: a system prompt, put
        first (chat template only). See generation.prompt.PromptCodec.encode.

        Raises:
            MlxInferError: empty prompt, bad messages, text that is not valid Unicode, token ids outside the
                vocabulary, or a system prompt without a chat template.
        """
        return self._prompts.encode(prompt, system, chat_template)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (as `generate`'s token_ids), special tokens included: the inverse of
        `encode` for a plain string prompt. Raises MlxInferError for an id that is not an int in the
        model's vocabulary."""
        return self._prompts.decode(token_ids)

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
            params = sampling_params(params, sampling, self.vocab_size)
            options = self._spec_options(speculative, draft_model, max_draft)
            eviction = check_evict(evict, repack, options, self.model, self._store.evicts)
            prompt_ids = self.encode_fitting(prompt, system, chat_template)
            max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
            request = Request(prompt_ids, params, max_tokens, options, progress, eviction, repack)
            # (mlx-lm's generation_stream is a thread-local stream, not the Stream its annotation names)
            with wired_limit(self.model, [generation_stream]):  # type: ignore[list-item]
                yield from run_request(self._decoding(), request)

    def _decoding(self) -> Decoding:
        """What a request borrows from the engine (generation.request.Decoding)."""
        products = self.rmm.products() if self.rmm is not None else {}
        return Decoding(self.model, self._store, self.spec, self._detokenizer, self.tokenizer.eos_token_ids,
                        self.compiled_steps, products, self.kv_bits, self.source.rmm)

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
        """The pool batched requests use (KVStore.batch_kv: the engine's paged cache, or a dense engine's own
        unbounded one). Raises MlxInferError for a quantization its blocks cannot hold or reduced attention
        products (RMM qk / pv)."""
        check_batchable(self.rmm)
        return self._store.batch_kv()

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
        eviction = check_evict(evict, repack, options, self.model)  # on the batch's paged pool, whatever the store
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

    def scheduler(self, max_batch: int = MAX_BATCH, prefix_cache: bool = True) -> BatchScheduler:
        """A BatchScheduler over this engine's block pool (drops the kept KV cache, whose blocks it may need).
        prefix_cache: requests start from the cached full blocks of earlier ones that share their prompt's
        beginning (GenerationStats.cached_prompt_tokens); `reset()` empties it.

        Raises:
            MlxInferError: max_batch < 1; UnsupportedModelError: a model whose layers are not all KV caches.
        """
        return BatchScheduler(self.model, self._batch_kv(), max_batch, prefix_cache, solo=solo_tokens(self.spec),
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
            run_batch(sched, requests)
        return [collect(s) for s in steps]
