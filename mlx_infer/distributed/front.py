"""Rank 0's front of a sharded model: the parts of Engine and BatchRunner that `chat` and the server call, each
request run in lockstep on the lead thread (commands.py), one at a time in the order submitted.

    inbox = queue.Queue(); lead_in_thread(group, inbox)
    engine = LeadEngine(shard, inbox)
    for step in engine.stream_steps(messages, params): ...         # cli/chat.py's ChatSession
    Served("default", engine, engine.runner)                       # mlx_infer/server's app (submit, on_step)

What it takes of Engine: stream_steps (a prompt, SamplingParams, a system prompt), batch_request (a prompt, its
SamplingParams, chat_template, and response_format, tools, tool_choice, logprobs as one process checks them:
the grammar and logprobs run on rank 0, distributed/structured.py), encode / decode, reset (forgets the KV
cache kept between requests with keep_cache, a chat's; else each request prefills its whole prompt), tokenizer,
source, vocab_size, context_length, grammars. Speculative decoding: "lookup" (speculative.py: rank 0 drafts and
verifies, SPEC_REQUEST to the other ranks) or "off"; a lookup request that asks for response_format, tools or
logprobs decodes plainly (the sharded verify takes no grammar or logprobs yet; the output is the same), and a
lookup request neither reads nor changes the kept KV cache. What it refuses, with a RequestError naming the
field (the server's 400): the other speculative modes and eviction, which do not run sharded yet
(docs/distributed.md).
"""

import copy
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, List, Optional, Union

from ..batch.run import prompt_request
from ..defaults import DEFAULT_MAX_DRAFT
from ..errors import RequestError
from ..generation.detokenize import make_detokenizer
from ..generation.prompt import Prompt, PromptCodec
from ..generation.logprobs import LogprobQueue
from ..generation.request import sampling_params
from ..generation.results import GenerationStep
from ..generation.sampling import SamplingParams
from ..generation.structured_request import structured_options
from ..speculative.target import output_vocab
from ..structured.grammar import Grammars, GrammarState
from ..tools.plan import plan_tools
from .commands import finish, submit
from .generate import lockstep_steps
from .kept import KeptCache
from .load import Shard
from .speculative import SPEC_MODES, spec_lockstep_steps

__all__ = ["LeadEngine", "LeadHandle", "LeadRequest", "LeadRunner"]

#: What a request's steps are handed to, on the lead thread: each GenerationStep, or the exception that ended it.
OnStep = Callable[[Union[GenerationStep, BaseException]], None]


@dataclass
class LeadRequest:
    """A checked request: its prompt's token ids, its SamplingParams (max_tokens capped by the context window),
    its structured options (rank 0's: the grammar's state, the logprobs' queue, the ToolPlan, which the
    server's Choice reads as `tools`; None where not asked for), and max_draft: a speculative (lookup)
    request's draft tokens per round, None for plain decoding."""

    prompt_ids: List[int]
    params: SamplingParams
    tools: Any = None
    grammar: Optional[GrammarState] = None
    logprobs: Optional[LogprobQueue] = None
    max_draft: Optional[int] = None

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens


class LeadHandle:
    """A submitted request: cancel() ends it after its next token on every rank, or skips it if it has not
    started (no broadcast is made for it)."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.future = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.future is not None:
            self.future.cancel()  # (a no-op once the lead thread runs it)


class LeadRunner:
    """The BatchRunner-shaped side the server submits to: requests run one at a time, FIFO, on the lead thread.

    Attributes:
        scheduler: None (no batch scheduler: the server's KV gauges skip this model).
    """

    scheduler = None

    def __init__(self, engine: "LeadEngine"):
        self.engine = engine

    def submit(self, request: LeadRequest, on_step: OnStep) -> LeadHandle:
        """Queue `request`; on_step gets its steps on the lead thread (the last with finish_reason), or the
        exception that failed it."""
        handle = LeadHandle()
        handle.future = submit(self.engine.inbox, request.max_tokens,
                               lambda: self._run(request, on_step, handle.cancelled), request.max_draft)
        return handle

    def _run(self, request: LeadRequest, on_step: OnStep, cancel: threading.Event) -> None:
        """The request on the lead thread, to its end whatever happens to its receiver: an on_step that fails
        (a server's event loop closed at shutdown) cancels the request, which still runs its next token on
        every rank (the other ranks are in the middle of it)."""
        engine = self.engine
        receiver: Optional[OnStep] = on_step

        def deliver(step) -> None:
            nonlocal receiver
            if receiver is None:
                return
            try:
                receiver(step)
            except Exception:
                receiver = None
                cancel.set()

        try:
            args = (engine.shard, request.prompt_ids, request.params, copy.copy(engine.detokenizer),
                    engine.tokenizer.eos_token_ids, cancel)
            steps = (lockstep_steps(*args, grammar=request.grammar, logprobs=request.logprobs, tools=request.tools,
                                    kept=engine.kept) if request.max_draft is None
                     else spec_lockstep_steps(*args, max_draft=request.max_draft))
            for step in steps:
                deliver(step)
        except BaseException as e:
            deliver(e)
            raise

    def steps(self, request: LeadRequest) -> Iterator[GenerationStep]:
        """The request's steps on the calling thread (submitted now). Closing the iterator early (Ctrl-C in a
        chat) cancels the request: it ends after its next token on every rank.

        Raises:
            DistributedError: the request failed (a peer lost).
        """
        inbox: "queue.Queue" = queue.Queue()
        handle = self.submit(request, inbox.put)
        try:
            while True:
                step = inbox.get()
                if isinstance(step, BaseException):
                    raise step
                yield step
                if step.finish_reason is not None:
                    return
        finally:
            handle.cancel()

    def close(self) -> None:
        """End the command loop after the queued requests (SHUTDOWN on every rank)."""
        finish(self.engine.inbox)


class LeadEngine:
    """Rank 0's Engine-shaped front of `shard` (see the module docstring).

    Args:
        shard: rank 0's Shard.
        inbox: the lead thread's queue (commands.lead_in_thread).
        keep_cache: keep the KV cache from one request to the next (a chat: each turn prefills only what
            follows the tokens it holds; kept.py): every rank then follows with a KeptCache of its own.
        speculative: the mode of stream_steps' requests (a chat's --spec): "off" or "lookup".
        max_draft: draft tokens per round of a lookup request.
    """

    def __init__(self, shard: Shard, inbox: "queue.Queue", keep_cache: bool = False, speculative: str = "off",
                 max_draft: int = DEFAULT_MAX_DRAFT):
        self.shard, self.inbox = shard, inbox
        self.kept: Optional[KeptCache] = KeptCache() if keep_cache else None
        self.speculative, self.max_draft = speculative, max_draft
        self.tokenizer, self.source, self.config = shard.tokenizer, shard.source, shard.config
        self.vocab_size = output_vocab(shard.model)
        self.codec = PromptCodec(shard.tokenizer, self.vocab_size)
        self.detokenizer = make_detokenizer(shard.tokenizer)  # copied per request
        self._grammars: Optional[Grammars] = None  # (built on first use: `grammars`)
        self.runner = LeadRunner(self)

    @property
    def grammars(self) -> Grammars:
        """The model's Grammars (structured generation's constraint compiler, as Engine.grammars), built on
        first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.tokenizer.eos_token_ids)
        return self._grammars

    @property
    def context_length(self) -> int:
        """The model's context window, tokens (as Engine.context_length)."""
        return int(self.config.get("max_position_embeddings")
                   or self.config.get("text_config", {}).get("max_position_embeddings", 4096))

    def encode(self, prompt: Prompt, system: Optional[str] = None, chat_template: bool = True) -> List[int]:
        """The prompt's token ids (PromptCodec.encode). Raises MlxInferError."""
        return self.codec.encode(prompt, system, chat_template)

    def decode(self, token_ids: List[int]) -> str:
        """The text of token ids (PromptCodec.decode). Raises MlxInferError."""
        return self.codec.decode(token_ids)

    def reset(self) -> None:
        """Forget the kept KV cache (the next request prefills its whole prompt on every rank: rank 0 decides
        what is reused). Call it between requests."""
        if self.kept is not None:
            self.kept.clear()

    def batch_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, system: Optional[str] = None,
                      chat_template: bool = True, speculative: str = "off", evict: Optional[str] = None,
                      repack: bool = True, response_format: Any = None, tools: Any = None, tool_choice: Any = None,
                      parallel_tool_calls: bool = True, logprobs: Optional[int] = None, forced_spans: bool = True,
                      **sampling: Any) -> LeadRequest:
        """A checked request for runner.submit (as Engine.batch_request; any thread): response_format, tools,
        tool_choice, parallel_tool_calls, logprobs and forced_spans checked and built as one process does
        (generation/structured_request.py, tools/plan.py).

        Raises:
            RequestError: a bad prompt (param "prompt": empty, over the context window, ...), sampling field or
                structured option (ConstraintError, naming it); a field that does not run sharded (a speculative
                mode other than off / lookup, evict), naming it.
        """
        unsupported = {"speculative": None if speculative in SPEC_MODES else speculative, "evict": evict}
        for name, value in unsupported.items():
            if value is not None:
                raise RequestError(f"'{name}' is not supported while the model is split over mlx.launch ranks "
                                   "(see docs/distributed.md): drop it, or serve the model from one process", name)
        params = sampling_params(params, sampling, self.vocab_size)
        plan = plan_tools(self.tokenizer, tools, tool_choice, parallel_tool_calls, self.grammars)
        structured = structured_options(lambda: self.grammars, response_format, logprobs, forced_spans, plan)
        ids = prompt_request(lambda: self.codec.fitting(prompt, self.context_length, system, chat_template,
                                                        structured.tools))
        grammar, queue_ = structured.grammar(self.grammars), structured.queue()
        plain = grammar is not None or queue_ is not None or structured.tools is not None
        return LeadRequest(ids, replace(params, max_tokens=min(params.max_tokens, self.context_length - len(ids))),
                           structured.tools, grammar, queue_,
                           max_draft=self.max_draft if speculative == "lookup" and not plain else None)

    def stream_steps(self, prompt: Prompt, params: Optional[SamplingParams] = None, *, system: Optional[str] = None,
                     progress: Any = None) -> Iterator[GenerationStep]:
        """The steps of one request (as Engine.stream_steps, without its speculative, KV and structured options;
        `progress` is not called: the prefill runs on the lead thread; speculative: the engine's mode). Raises
        RequestError as batch_request, DistributedError while it runs (a generator, as Engine's: the errors come
        with its first step)."""
        yield from self.runner.steps(self.batch_request(prompt, params, system=system, speculative=self.speculative))
