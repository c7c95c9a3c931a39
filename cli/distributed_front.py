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

from mlx_infer.defaults import SERVE_HOST, SERVE_MAX_QUEUE, SERVE_MAX_TOKENS_LIMIT, SERVE_PORT

from .distributed import BackendOpt, ParallelOpt
from .errors import fail, user_errors
from .options import (MaxTokensOpt, MinPOpt, ModelOpt, RepetitionPenaltyOpt, SeedOpt, StopOpt, SystemOpt,
                      TemperatureOpt, TopKOpt, TopPOpt, VerboseOpt, Weights, WeightsOpt, fit_to_model,
                      sampling_params)
from .serve import API_KEY_ENV


def run_sharded(model: Optional[str], weights: str, parallel: str, backend: str, verbose: bool,
                front: Callable) -> None:
    """Load this rank's shard; rank 0 runs front(engine) (a LeadEngine, its lead thread started) and then shuts
    the other ranks down, which follow its commands meanwhile. A failure is one line on rank 0; the other ranks
    leave quietly with the same status."""
    from mlx_infer.distributed import init_group, load_sharded, watchdog
    from mlx_infer.distributed.commands import follow, lead_in_thread
    from mlx_infer.distributed.front import LeadEngine
    from mlx_infer.distributed.generate import follow_request

    group = init_group(backend) if backend in ("any", "ring", "jaccl", "mpi", "nccl") else None
    rank = group.rank if group is not None else 0
    watchdog.on_terminate(rank)
    with user_errors(verbose if rank == 0 else False):
        if group is None:
            raise fail(f"unknown --backend {backend!r}; use one of any, ring, jaccl, mpi, nccl")
        try:
            shard = load_sharded(model, group, parallel, weights)
            if not group.is_root:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches every rank: rank 0's
                follow(group, lambda max_tokens: follow_request(shard, max_tokens))
                return
            inbox: "queue.Queue" = queue.Queue()
            lead = lead_in_thread(group, inbox)
            engine = LeadEngine(shard, inbox)
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
    stats: Annotated[bool, typer.Option("--stats", help="Print stats of each answer to stderr.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model split over the ranks of mlx.launch: multi-turn, with history.

    Rank 0 reads the turns from stdin and prints the answers; every rank runs each step in lockstep. /reset
    clears the history, /exit quits (mlx.launch does not pass on the end of its input: end a piped chat with
    /exit). Each turn prefills the whole history (no KV cache is kept between turns when sharded).
    """
    from .chat import ChatSession
    from .progress import isatty

    params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty, stop)

    def front(engine) -> None:
        if not engine.tokenizer.has_chat_template:
            raise fail(f"{engine.source.name} has no chat template, so it cannot chat; "
                       "use `mlx-infer generate --no-chat-template` with it")
        ChatSession(engine, fit_to_model(params, engine), system, stats, verbose, interactive=isatty()).run()

    run_sharded(model, weights.value, parallel, backend, verbose, front)


def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind. Anything but loopback needs --api-key.")] = SERVE_HOST,
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="TCP port.")] = SERVE_PORT,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar=API_KEY_ENV, show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every /v1 route.")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0,
                                           help="Requests that may wait beyond the one running; more get HTTP 429.")]
    = SERVE_MAX_QUEUE,
    max_tokens_limit: Annotated[int, typer.Option("--max-tokens-limit", min=1,
                                                  help="Most tokens one request may ask for.")] = SERVE_MAX_TOKENS_LIMIT,
    weights: WeightsOpt = Weights.auto,
    parallel: ParallelOpt = "auto",
    backend: BackendOpt = "any",
    access_log: Annotated[bool, typer.Option(
        "--access-log/--no-access-log",
        help="One line per request on stderr (uvicorn's access log: client, method, path, status).")] = True,
    verbose: VerboseOpt = False,
) -> None:
    """Serve a model split over the ranks of mlx.launch over the OpenAI-compatible HTTP API (rank 0 listens):
    POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models, GET /health.

    Requests run one at a time in the order they came (no continuous batching when sharded), each in lockstep
    over the ranks; response_format, tools and logprobs are refused with a 400. Ctrl-C stops it.
    """
    import logging

    import uvicorn

    from mlx_infer.errors import MlxInferError
    from mlx_infer.server import JSONErrorProtocol, ServerConfig
    from mlx_infer.server.app import build_pool_app
    from mlx_infer.server.models import OneModel, Served, describe

    from .progress import stderr
    from .serve import SHUTDOWN_GRACE_S, StoppingServer, check_port, is_loopback, log_config

    rank0 = os.environ.get("MLX_RANK", "0") == "0"
    with user_errors(verbose if rank0 else False):
        if rank0 and not is_loopback(host) and not api_key:
            raise MlxInferError(f"--host {host} is reachable from other machines: give --api-key (or ${API_KEY_ENV}), "
                                "or bind 127.0.0.1")
        if rank0:
            check_port(host, port)  # before loading

    def front(engine) -> None:
        name = describe(model).name
        config = ServerConfig(model_id=name, api_key=api_key, max_tokens_limit=max_tokens_limit, max_queue=max_queue)
        app = build_pool_app(OneModel(Served(name, engine, engine.runner)), config, 1 + max_queue)
        shown = f"[{host}]" if ":" in host else host
        stderr.print(f"serving {name} over {engine.shard.group.size} ranks ({engine.shard.parallel} parallel) on "
                     f"http://{shown}:{port}/v1 (Ctrl-C stops)" + ("; API key required" if api_key else ""),
                     markup=False)
        http_config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                                     access_log=access_log, log_config=log_config(), lifespan="off",
                                     http=JSONErrorProtocol, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        if access_log:
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        server = StoppingServer(http_config, on_exit=app.state.server.shutdown)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has shut down
            pass

    run_sharded(model, weights.value, parallel, backend, verbose, front)
