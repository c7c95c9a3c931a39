"""Engine: owns a model and its tokenizer; generate, stream and chat.

    engine = mlx_infer.load()                       # the embedded default model
    result = engine.generate("What is the capital of France?", max_tokens=64)
    for chunk in engine.stream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")
"""

import copy
from typing import Any, AsyncIterator, Callable, Iterator, List, Optional, Sequence, Union

import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit

from .backend import return_free_memory
from .aio import AsyncRunner
from .batch import BatchRequest, BatchRunner, BatchScheduler
from .batch.request import Emit
from .batch.run import batch_inputs, check_batchable, prompt_request, run_collected, solo_tokens
from .defaults import IDLE_RELEASE_S, MAX_BATCH
from .errors import RequestError
from .generation.compiled import CompiledSteps
from .generation.detokenize import make_detokenizer
from .generation.prompt import Prompt, PromptCodec
from .generation.request import Decoding, Request, check_evict, run_request, sampling_params
from .generation.results import GenerationResult, GenerationStats, GenerationStep, collect
from .generation.sampling import SamplingParams
from .generation.serial import Serializer
from .generation.structured_request import Structured, structured_options
from .kv.attention_hook import install as install_attention_hook
from .kv.defaults import BLOCK_SIZE, KIVI_RESIDUAL
from .kv.pool import BlockPool
from .kv.quant_options import KVQuant
from .kv.session import PagedKV
from .kv.store import KVStore, configure_store, make_store
from .loading import ModelSource
from .rmm.options import Retention
from .speculative import DraftModel, SpecOptions, SpecState, Target
from .speculative.registry import target_names
from .speculative.target import measurement_key, output_vocab
from .structured.grammar import Grammars
from .tools import plan_tools

#: What `draft_model` takes: a model path or repo id, an Engine, or an mlx-lm model (None: none, or the
#: registered drafter).
DraftModelArg = Union[None, str, "Engine", nn.Module]


class Engine:
    """A loaded model, ready to generate.

    Build it with `mlx_infer.load(...)`. Safe to call from several threads: calls are serialized (a request,
    a stream's whole iteration included, holds the engine); a second request on a thread whose stream is
    still open raises EngineBusyError. Concurrent decoding: `agenerate` / `astream`, `batch_runner`,
    `generate_batch`. It keeps the KV of its requests for the next ones (a chat's next turn prefills only
    what follows). Details: docs/api.md#engine.

    Attributes:
        model, tokenizer, config, source: the loaded model, its tokenizer, config.json and its origin.
        rmm: the model's RMM Retention, None when exact. vocab_size: rows of the logits, padding included.
        spec: SpecState, what speculative decoding keeps for this model.
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
        self._serial = Serializer()  # one request at a time (a stream: until it ends or is closed)
        self._aio = AsyncRunner(self.batch_runner)  # agenerate / astream's runner, started on first use
        self._grammars: Optional[Grammars] = None  # (built on first use: `grammars`)
        install_attention_hook(self.model)  # the kernels' attention: prefill tiles, quantized KV, RMM products
        self.configure_kv(kv_cache, kv_budget, block_size, **kv_quant_options)

    @property
    def grammars(self) -> Grammars:
        """The model's Grammars (structured generation's constraint compiler), built on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids)
        return self._grammars

    def _structured(self, response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                    parallel_tool_calls: bool = True, logprobs: Optional[int] = None,
                    forced_spans: bool = True) -> Structured:
        """A request's structured-generation options checked (generation/structured_request.py). Raises
        ConstraintError / RequestError naming the bad field."""
        plan = plan_tools(self.tokenizer, tools, tool_choice, parallel_tool_calls, self.grammars)
        return structured_options(lambda: self.grammars, response_format, logprobs, forced_spans, plan)

    def compiled_steps(self) -> CompiledSteps:
        """The model's compiled one-token steps (generation/compiled.py), kept across requests while its
        modules stay the same, so that their traces serve every request."""
        self._compiled = CompiledSteps(self.model) if self._compiled is None else self._compiled.current()
        return self._compiled

    def configure_kv(self, kv_cache: str = "dense", kv_budget: Union[None, int, float, str] = None,
                     block_size: int = BLOCK_SIZE, kv_bits: Union[None, int, str] = None, kv_scheme: str = "affine",
                     kv_quant_start: int = 0, kv_group_size: Optional[int] = None,
                     kv_residual: int = KIVI_RESIDUAL, kv_rotate: Optional[bool] = None) -> None:
        """Choose the KV cache of the next requests (the options: docs/api.md, "The KV cache"); drops the kept
        cache. Every call sets all of these options: one not given goes back to its default (float, dense KV).
        Raises MlxInferError for a bad option, KVBudgetError for a kv_budget that cannot hold one block
        (kv.store.configure_store lists the checks); on an error the previous setting stays."""
        store, quant, self._kv_layout = configure_store(self.model, self._kv_layout, kv_cache, kv_budget, block_size,
                                                        kv_bits, kv_scheme, kv_quant_start, kv_group_size,
                                                        kv_residual, kv_rotate)  # KVBudgetError: none set
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
        """Forget the kept KV cache and the prefix cache (an idle pool shrinks, its memory returned to the
        system): the next request prefills its whole prompt."""
        if self._store.reset():
            return_free_memory()

    def prepare(self, speculative: str = "off", draft_model: DraftModelArg = None, max_draft: Union[str, int] = "auto",
                say: Optional[Callable[[str], None]] = None) -> None:
        """Measure now, once per model and machine, what a speculative request with these options would
        otherwise measure during its first run (SpecState.prepare), so that its TTFT does not include them.
        say: gets a line before each measurement. Raises MlxInferError for bad options, EngineBusyError as
        `stream_steps`."""
        with self._serial.held():
            self.spec.prepare(self._spec_options(speculative, draft_model, max_draft), say=say)

    @property
    def defer_measurements(self) -> bool:
        """False (the default): a speculative="auto" request measures what this model and machine have not
        measured yet (the verify cost curve, the registered drafter's agreement; cached on disk) before it
        decodes. True: such a request decodes plainly (its stats' spec_mode "off") and `prepare` measures
        later, e.g. once the answer is out (what `mlx-infer generate` and `chat` do). Other modes always
        measure first."""
        return self.spec.defer_measurements

    @defer_measurements.setter
    def defer_measurements(self, on: bool) -> None:
        self.spec.defer_measurements = bool(on)

    def _spec_options(self, speculative: str, draft_model, max_draft) -> SpecOptions:
        if isinstance(draft_model, Engine):
            draft_model = DraftModel(draft_model.model, draft_model.tokenizer)
        return SpecOptions(speculative, draft_model, max_draft)

    @property
    def context_length(self) -> int:
        """The model's context window, tokens."""
        return int(self.config.get("max_position_embeddings") or self.config.get("text_config", {}).get("max_position_embeddings", 4096))

    def encode_fitting(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True,
                       tools: Any = None) -> List[int]:
        """`encode`, and check that at least one token fits after the prompt in the context window (tools: the
        request's ToolPlan, rendered with the prompt).

        Raises:
            MlxInferError: as `encode`, or a prompt that fills the context window.
        """
        return self._prompts.fitting(prompt, self.context_length, system, chat_template, tools)

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

    def stream_steps(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, system: Optional[str] = None,
                     chat_template: bool = True, speculative: str = "off", draft_model: DraftModelArg = None,
                     max_draft: Union[str, int] = "auto", progress: Optional[Callable[[int, int], None]] = None,
                     evict: Optional[str] = None, repack: bool = True, response_format: Any = None,
                     tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
                     logprobs: Optional[int] = None, forced_spans: bool = True,
                     **sampling: Any) -> Iterator[GenerationStep]:
        """Generate, yielding a GenerationStep per token; the last one carries finish_reason and stats.
        Details: docs/api.md#generating.

        Args:
            prompt: see `encode`. params: SamplingParams; keyword arguments (temperature=...) override fields.
            speculative: "off", "lookup", "draft", "layerskip", "rmm", "dflash", "dspark" or "auto" (lossless).
            draft_model: for "draft" / "auto" a model, Engine or path; for "dflash" / "dspark" a drafter.
            max_draft: draft tokens per round, an int >= 0 or "auto".
            progress: callable(done, total) during prefill, prompt tokens.
            evict: "POLICY:RATIO" (paged cache only); repack: vToken (True) or Naive-Evict (False).
            response_format: OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema",
                "json_schema": {"schema": ...}}) or a structured.Constraint: the output matches it.
            tools, tool_choice, parallel_tool_calls: OpenAI function tools; the final step's tool_calls.
            logprobs: None, or 0..20 alternatives per token: each step's `logprob`.
            forced_spans: commit the grammar's forced tokens without sampling (jump-forward decoding).

        Calls from several threads are serialized (the request holds the engine until its last step).

        Raises:
            MlxInferError: bad parameters or prompt, a prompt that fills the context window, a draft_model
                for a mode that uses none, a bad evict; ConstraintError: a bad response_format or tools (an
                unsupported schema keyword named); KVBudgetError: the request cannot fit the KV budget;
                EngineBusyError: a stream of this engine started on the same thread is still open.
        """
        with self._serial.held():
            params = sampling_params(params, sampling, self.vocab_size)
            options = self._spec_options(speculative, draft_model, max_draft)
            eviction = check_evict(evict, repack, options, self.model, self._store.evicts)
            structured = self._structured(response_format, tools, tool_choice, parallel_tool_calls, logprobs,
                                          forced_spans)
            prompt_ids = self.encode_fitting(prompt, system, chat_template, structured.tools)
            max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
            request = Request(prompt_ids, params, max_tokens, options, progress, eviction, repack,
                              structured.grammar(self.grammars), structured.queue(), structured.tools)
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
                      repack: bool = True, emit: Optional[Emit] = None, response_format: Any = None,
                      tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
                      logprobs: Optional[int] = None, forced_spans: bool = True, **sampling: Any) -> BatchRequest:
        """A request for `BatchRunner.submit`, built and checked on the caller's thread (any thread): the
        prompt encoded once, the parameters checked as `stream_steps`'. Details:
        docs/api.md#preparing-and-lower-level-pieces.

        Raises:
            RequestError: a bad prompt (param "prompt") or sampling parameter (param: the field), or structured
                option (ConstraintError; as `stream_steps`); MlxInferError: a bad speculative mode or evict.
        """
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}", "params")
        params = sampling_params(params, sampling, self.vocab_size)
        options = self._spec_options(speculative, None, "auto")
        eviction = check_evict(evict, repack, options, self.model)  # on the batch's paged pool, whatever the store
        options = options if eviction is None else self._spec_options("off", None, "auto")
        structured = self._structured(response_format, tools, tool_choice, parallel_tool_calls, logprobs,
                                      forced_spans)
        prompt_ids = prompt_request(lambda: self.encode_fitting(prompt, system, chat_template, structured.tools))
        max_tokens = min(params.max_tokens, self.context_length - len(prompt_ids))
        return BatchRequest(prompt_ids, params, max_tokens, copy.copy(self._detokenizer),
                            self.tokenizer.eos_token_ids, emit, options, self.source.rmm, eviction, repack,
                            grammar=structured.grammar(self.grammars), logprobs=structured.queue(),
                            tools=structured.tools)

    def scheduler(self, max_batch: int = MAX_BATCH, prefix_cache: bool = True) -> BatchScheduler:
        """A BatchScheduler over this engine's block pool (drops the kept KV cache).
        Details: docs/api.md#preparing-and-lower-level-pieces.

        Raises:
            MlxInferError: max_batch < 1; UnsupportedModelError: a model whose layers are not all KV caches.
        """
        return BatchScheduler(self.model, self._batch_kv(), max_batch, prefix_cache, solo=solo_tokens(self.spec),
                              compiled=self.compiled_steps().batch)

    def batch_runner(self, max_batch: int = MAX_BATCH, prefix_cache: bool = True,
                     idle_release_s: Optional[float] = IDLE_RELEASE_S) -> BatchRunner:
        """A continuous-batching decode loop on its own thread: `submit(engine.batch_request(...))` from any
        thread returns a RequestHandle. After idle_release_s seconds idle (None: never) it gives its KV memory
        back. Close it (or use it as a context manager) when done. Details:
        docs/api.md#preparing-and-lower-level-pieces.

        Raises:
            EngineBusyError: this thread's stream of the engine is still open (it waits for other threads')."""
        with self._serial.held():  # the scheduler takes the engine's pool: not while another request uses it
            scheduler = self.scheduler(max_batch, prefix_cache)
        return BatchRunner(scheduler, idle_release_s, hold=self._serial.lock)

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
                       repack: bool = True, response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                       parallel_tool_calls: bool = True, logprobs: Optional[int] = None, forced_spans: bool = True,
                       **sampling: Any) -> List[GenerationResult]:
        """Generate answers to several prompts decoding together (continuous batching).
        Details: docs/api.md#generating.

        Args:
            prompts: each as `encode` takes it. params: one SamplingParams, one per prompt, or None.
            max_batch: most requests decoding at once. prefix_cache: reuse earlier requests' full KV blocks.
            speculative: a mode of `stream_steps`, used by a request while it runs alone.
            evict, repack, response_format, tools, tool_choice, parallel_tool_calls, logprobs, forced_spans:
                as `stream_steps`, for every request.

        Returns:
            one GenerationResult per prompt, in order; no prompts, [].

        Raises:
            MlxInferError: a bad prompt ("prompt i: ...") or parameter, params of another length than
                prompts; KVBudgetError: a request that can never fit the KV budget; EngineBusyError: as
                `stream_steps`.
        """
        structured = dict(response_format=response_format, tools=tools, tool_choice=tool_choice,
                          parallel_tool_calls=parallel_tool_calls, logprobs=logprobs, forced_spans=forced_spans)
        plan = self._structured(**structured).tools  # checked before any decoding
        ids, each = batch_inputs(prompts, params, sampling,
                                 lambda p: self.encode_fitting(p, system, chat_template, plan))
        with self._serial.held():
            return run_collected(self.scheduler(max_batch, prefix_cache),
                                 lambda i, p, emit: self.batch_request(i, p, speculative=speculative, evict=evict,
                                                                       repack=repack, emit=emit, **structured),
                                 ids, each)
