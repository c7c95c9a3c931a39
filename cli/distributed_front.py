"""`mlx-infer chat` and `mlx-infer serve` under `mlx.launch`: one model over the launch's ranks, rank 0 facing
the user (docs/distributed.md).

    mlx.launch -n 2 --backend ring -- mlx-infer chat --parallel pipeline
    mlx.launch -n 2 --backend ring -- mlx-infer serve --port 8080

app.py registers these as `chat` and `serve` when a launcher started the process (MLX_RANK set). Every rank
loads its shard; rank 0 then runs the front end (chat's loop on stdin, or the HTTP server on uvicorn) on its
main thread and the requests on its lead thread (mlx_infer.distributed.commands: heartbeats while idle, one
request at a time, FIFO); the other ranks follow rank 0's commands until it shuts down. The front end is the
one-process one: cli/chat.py's ChatSession and mlx_infer/server's app, over distributed.front.LeadEngine.
"""

import os
import queue
import signal
import sys
from typing import Annotated, Callable, Optional

import typer

from mlx_infer.defaults import DEFAULT_MAX_DRAFT, SERVE_HOST, SERVE_MAX_QUEUE, SERVE_MAX_TOKENS_LIMIT, SERVE_PORT

from .distributed import BackendOpt, ParallelOpt, ShardMaxDraftOpt, ShardSpecOpt, check_spec
from .errors import fail, user_errors
from .options import (MaxTokensOpt, MinPOpt, ModelOpt, RepetitionPenaltyOpt, SeedOpt, StopOpt, SystemOpt,
                      TemperatureOpt, TopKOpt, TopPOpt, VerboseOpt, Weights, WeightsOpt, fit_to_model,
                      sampling_params)
from .serve import AccessLogOpt, ApiKeyOpt, HostOpt, MaxTokensLimitOpt, ModelsOpt, PortOpt


def run_sharded(model: Optional[str], weights: str, parallel: str, backend: str, verbose: bool,
                front: Callable, keep_cache: bool = False, spec: str = "off",
                max_draft: int = DEFAULT_MAX_DRAFT) -> None:
    """Load this rank's shard; rank 0 runs front(engine) (a LeadEngine, its lead thread started; spec: the mode
    of its chat's requests, checked) and then shuts the other ranks down, which follow its commands meanwhile
    (plain and speculative requests alike). keep_cache: every rank keeps its KV cache from one plain request to
    the next (a chat's turns; distributed/kept.py). A failure is one line on rank 0; the other ranks leave
    quietly with the same status."""
    from mlx_infer.distributed import init_group, load_sharded, watchdog
    from mlx_infer.distributed.commands import follow, lead_in_thread
    from mlx_infer.distributed.front import LeadEngine
    from mlx_infer.distributed.generate import follow_request
    from mlx_infer.distributed.kept import KeptCache
    from mlx_infer.distributed.speculative import check_rollback, follow_spec_request
    from mlx_lm.models.cache import make_prompt_cache

    group = init_group(backend) if backend in ("any", "ring", "jaccl", "mpi", "nccl") else None
    rank = group.rank if group is not None else 0
    watchdog.on_terminate(rank)
    with user_errors(verbose if rank == 0 else False):
        if group is None:
            raise fail(f"unknown --backend {backend!r}; use one of any, ring, jaccl, mpi, nccl")
        try:
            spec = check_spec(spec, max_draft)
            shard = load_sharded(model, group, parallel, weights)
            if spec != "off":
                check_rollback(make_prompt_cache(shard.model))  # every rank fails alike, before any request
            if not group.is_root:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every rank: rank 0's
                kept = KeptCache() if keep_cache else None
                follow(group, lambda max_tokens: follow_request(shard, max_tokens, kept),
                       lambda draft: follow_spec_request(shard, draft))
                return
            inbox: "queue.Queue" = queue.Queue()
            lead = lead_in_thread(group, inbox)
            engine = LeadEngine(shard, inbox, keep_cache=keep_cache, speculative=spec, max_draft=max_draft)
            try:
                front(engine)
            finally:
                engine.runner.close()  # SHUTDOWN after the requests queued
                lead.join()
        except BaseException:
            if rank != 0:  # rank 0 says what went wrong
                sys.stderr = open(os.devnull, "w")
            raise


def chat(
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    stop: StopOpt = None,
    system: SystemOpt = None,
    weights: WeightsOpt = Weights.auto,
    parallel: ParallelOpt = "auto",
    backend: BackendOpt = "any",
    spec: ShardSpecOpt = "off",
    max_draft: ShardMaxDraftOpt = DEFAULT_MAX_DRAFT,
    stats: Annotated[bool, typer.Option("--stats", help="Print stats of each answer to stderr.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model split over the ranks of mlx.launch: multi-turn, with history.

    Rank 0 reads the turns from stdin and prints the answers; every rank runs each step in lockstep. /reset
    clears the history, /exit quits (mlx.launch does not pass on the end of its input: end a piped chat with
    /exit). Every rank keeps its KV cache between turns: each turn prefills only what follows the tokens it
    holds.
    """
    from .chat import ChatSession, require_chat_template
    from .progress import isatty

    params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty, stop)

    def front(engine) -> None:
        require_chat_template(engine)
        ChatSession(engine, fit_to_model(params, engine), system, stats, verbose, interactive=isatty()).run()

    run_sharded(model, weights.value, parallel, backend, verbose, front, keep_cache=True, spec=spec,
                max_draft=max_draft)


def serve(
    model: ModelsOpt = None,
    host: HostOpt = SERVE_HOST,
    port: PortOpt = SERVE_PORT,
    api_key: ApiKeyOpt = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0,
                                           help="Requests that may wait beyond the one running; more get HTTP 429.")]
    = SERVE_MAX_QUEUE,
    max_tokens_limit: MaxTokensLimitOpt = SERVE_MAX_TOKENS_LIMIT,
    weights: WeightsOpt = Weights.auto,
    parallel: ParallelOpt = "auto",
    backend: BackendOpt = "any",
    spec: ShardSpecOpt = "off",
    max_draft: ShardMaxDraftOpt = DEFAULT_MAX_DRAFT,
    access_log: AccessLogOpt = True,
    verbose: VerboseOpt = False,
) -> None:
    """Serve a model split over the ranks of mlx.launch over the OpenAI-compatible HTTP API (rank 0 listens):
    POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models, GET /health.

    Requests run one at a time in the order they came (no continuous batching when sharded), each in lockstep
    over the ranks, prefilling only what follows the tokens it shares with the request before it (every rank
    keeps that request's KV cache: an agent's next turn resends its history); response_format, tools and
    logprobs run as in one process (rank 0 picks each token). Ctrl-C stops it.
    """
    from mlx_infer.server import ServerConfig
    from mlx_infer.server.app import build_pool_app
    from mlx_infer.server.models import OneModel, Served, describe

    from .progress import stderr
    from .serve import check_host, check_port, run_http

    rank0 = os.environ.get("MLX_RANK", "0") == "0"
    with user_errors(verbose if rank0 else False):
        if len(model or []) > 1:  # every rank decides alike from the same flags; rank 0 says it
            if not rank0:
                sys.stderr = open(os.devnull, "w")
            raise fail(f"--model is given {len(model)} times: one model is split over mlx.launch ranks; serve "
                       "several models from one process (docs/distributed.md)")
        if rank0:
            check_host(host, api_key)
            check_port(host, port)  # before loading
    model = model[0] if model else None

    def front(engine) -> None:
        name = describe(model).name
        config = ServerConfig(model_id=name, api_key=api_key, max_tokens_limit=max_tokens_limit, max_queue=max_queue,
                              speculative=engine.speculative)
        app = build_pool_app(OneModel(Served(name, engine, engine.runner)), config, 1 + max_queue)
        shown = f"[{host}]" if ":" in host else host
        stderr.print(f"serving {name} over {engine.shard.group.size} ranks ({engine.shard.parallel} parallel) on "
                     f"http://{shown}:{port}/v1 (Ctrl-C stops)" + ("; API key required" if api_key else ""),
                     markup=False)
        run_http(app, host, port, verbose, access_log)

    run_sharded(model, weights.value, parallel, backend, verbose, front, keep_cache=True, spec=spec,
                max_draft=max_draft)
