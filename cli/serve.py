"""`mlx-infer serve`: the OpenAI-compatible HTTP server (mlx_infer/server) on uvicorn."""

import copy
import ipaddress
import logging
import socket
import time
from functools import partial
from typing import Annotated, List, Optional, Tuple

import typer
import uvicorn
import uvicorn.config

from mlx_infer.defaults import (
    IDLE_RELEASE_S, KV_BLOCK_SIZE as BLOCK_SIZE, MAX_BATCH, SERVE_HOST as HOST, SERVE_KEEP_ALIVE_S as KEEP_ALIVE_S,
    SERVE_MAX_QUEUE as MAX_QUEUE, SERVE_MAX_TOKENS_LIMIT as MAX_TOKENS_LIMIT, SERVE_PORT as PORT, SPEC_MODES as MODES,
)
from mlx_infer.errors import MlxInferError

from .errors import user_errors
from .options import (
    KV as KV_PANEL, MODEL as MODEL_PANEL, BlockSizeOpt, KVBitsOpt, KVBudgetOpt, LinearRmmOpt, RepackOpt, VerboseOpt,
    Weights, WeightsOpt, check_rmm, kv_kwargs, spec_kwargs,
)
from .progress import load_engine, prepare_speculation, stderr

#: Seconds Ctrl-C waits for open requests before they are cut (each then ends at once, its blocks freed).
SHUTDOWN_GRACE_S = 3

#: The environment variable read for --api-key (so that the key stays out of `ps` and shell history).
API_KEY_ENV = "MLX_INFER_API_KEY"

#: The --spec modes serve takes: every mode but "draft" (serve takes no draft model).
SERVE_MODES = tuple(m for m in MODES if m != "draft")

#: Bytes per GB of --max-model-memory.
GB = 1e9

ModelsOpt = Annotated[Optional[List[str]], typer.Option(
    "--model", "-m", metavar="MODEL", rich_help_panel=MODEL_PANEL,
    help="A .gguf file, an MLX / Hugging Face model directory or a Hugging Face repo id (org/name); repeat it to "
         "serve several (a request's `model` picks one by its file or directory name; the first is the default "
         "and is loaded at start, the others on their first request). Default: the embedded "
         "SmolLM2-135M-Instruct (Q4_1), served as 'default'.")]
ModelsDirOpt = Annotated[Optional[str], typer.Option(
    "--models-dir", metavar="DIR", rich_help_panel=MODEL_PANEL,
    help="Serve every .gguf file and MLX model directory in DIR too, named by file / directory name "
         "(see: mlx-infer models --models-dir DIR).")]
AliasOpt = Annotated[Optional[List[str]], typer.Option(
    "--alias", metavar="NAME=MODEL", rich_help_panel=MODEL_PANEL,
    help="Answer requests naming NAME with MODEL (a served model's name); NAME may be a pattern such as "
         "'claude-*' for clients that send a hard-coded model name. Repeatable; the first match wins.")]
KeepAliveOpt = Annotated[float, typer.Option(
    "--keep-alive", metavar="SECONDS", rich_help_panel=MODEL_PANEL,
    help="Seconds a model stays loaded after its last request (a request's keep_alive overrides it; 0: unload "
         "after each request; negative: keep loaded).")]
MaxLoadedOpt = Annotated[Optional[int], typer.Option(
    "--max-loaded-models", metavar="N", min=1, rich_help_panel=MODEL_PANEL,
    help="Most models in memory at once: loading another first unloads the least recently used idle one "
         "(a model with requests running is never unloaded: the request waits, then gets 503).")]
MaxMemoryOpt = Annotated[Optional[float], typer.Option(
    "--max-model-memory", metavar="GB", min=0, rich_help_panel=MODEL_PANEL,
    help="Most gigabytes of weights of the models in memory together; as --max-loaded-models, idle models "
         "are unloaded, least recently used first, to make room.")]


class StoppingServer(uvicorn.Server):
    """uvicorn's server that, on Ctrl-C, first ends the open requests (their streams get an error event and
    [DONE]) so that their connections close within the grace period instead of being cancelled."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def log_config() -> dict:
    """uvicorn's logging configuration with its access lines on stderr (uvicorn's default is stdout), where
    every command's chatter goes."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def is_loopback(host: str) -> bool:
    """Whether `host` binds only this machine ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


HostOpt = Annotated[str, typer.Option("--host", help="Address to bind. Anything but loopback needs --api-key.")]
PortOpt = Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="TCP port.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar=API_KEY_ENV, show_envvar=True, help="Require 'Authorization: Bearer KEY' on every /v1 route.")]
MaxTokensLimitOpt = Annotated[int, typer.Option("--max-tokens-limit", min=1, help="Most tokens one request may ask for.")]
AccessLogOpt = Annotated[bool, typer.Option(
    "--access-log/--no-access-log",
    help="One line per request on stderr (uvicorn's access log: client, method, path, status).")]


def check_host(host: str, api_key: Optional[str]) -> None:
    """Refuse to bind an address other machines reach without an API key. Raises MlxInferError (exit 2)."""
    if not is_loopback(host) and not api_key:
        raise MlxInferError(f"--host {host} is reachable from other machines: give --api-key (or ${API_KEY_ENV}), "
                            "or bind 127.0.0.1")


def run_http(app, host: str, port: int, verbose: bool, access_log: bool) -> None:
    """Serve `app` with uvicorn on (host, port) until Ctrl-C / SIGTERM (StoppingServer calls the app's server
    shutdown on exit): mlx-infer's JSON errors for bad HTTP, its log format, an access line per request when
    asked."""
    from mlx_infer.server import JSONErrorProtocol

    http_config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                                 access_log=access_log, log_config=log_config(), lifespan="off",
                                 http=JSONErrorProtocol, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    if access_log:  # its lines are INFO records: shown without the rest of uvicorn's INFO chatter
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = StoppingServer(http_config, on_exit=app.state.server.shutdown)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it handled again once it has shut down
        pass


def serve_spec(spec: str) -> dict:
    """spec_kwargs of serve's --spec (no draft model, max_draft auto); raises MlxInferError listing
    SERVE_MODES for a mode serve does not take."""
    mode = spec.strip().lower()
    if mode == "draft":
        raise MlxInferError("--spec draft needs a draft model, which serve does not take: use lookup or auto")
    if mode not in SERVE_MODES:
        raise MlxInferError(f"--spec must be one of {', '.join(SERVE_MODES)}, got {spec!r}")
    return spec_kwargs(mode, None, "auto")


def check_port(host: str, port: int) -> None:
    """Fail with one line when (host, port) cannot be listened on (in use, not an address of this machine, a
    privileged port), rather than after announcing the server. Raises MlxInferError naming --port / --host."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise MlxInferError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise MlxInferError(f"--port {port}: cannot listen on {host} ({e.strerror.lower()}); "
                                "pick another --port") from None


def serve_models(models: Optional[List[str]], models_dir: Optional[str]) -> list:
    """The ModelFiles serve serves, the default first: the --model arguments in order, then the models of
    --models-dir by name; the embedded default when neither is given. Raises MlxInferError (a path not
    there, an empty --models-dir)."""
    from mlx_infer.server.models import describe, scan_dir

    found = [describe(m) for m in models or []]
    if models_dir is not None:
        listed = scan_dir(models_dir)
        if not listed:
            raise MlxInferError(f"--models-dir {models_dir}: no .gguf files or model directories in it")
        found += [m for m in listed if m.path not in {f.path for f in found}]
    return found or [describe(None)]


def load_served(model, weights: str, verbose: bool, rmm: Optional[str], load_kw: dict, speculative: dict,
                max_batch: int, idle_release_s: Optional[float]):
    """One model as serve runs it (models.Served under its name): the engine loaded, its paged KV configured,
    the one-time speculative measurements made, its BatchRunner started. The pool calls it per model."""
    from mlx_infer.server.models import Served

    engine = load_engine(model.spec, weights, verbose, rmm)
    engine.configure_kv(**load_kw)
    prepare_speculation(engine, speculative)  # the one-time measurements before the first request
    return Served(model.name, engine, engine.batch_runner(max_batch, idle_release_s=idle_release_s))


def adopt_default(pool, loader, model) -> Tuple[str, Optional[str]]:
    """Load the default model now (its errors are the command's) into `pool`; its id and RMM setting. Only
    the pool keeps the loaded model: a reference in serve's frame, which runs as long as the server, would
    keep its weights in memory after the pool unloads it (seen: an unloaded default's engine alive at idle)."""
    started = time.monotonic()
    served = loader(model)
    pool.adopt(served, time.monotonic() - started)
    return served.id, served.engine.source.rmm


def serve(
    model: ModelsOpt = None,
    models_dir: ModelsDirOpt = None,
    alias: AliasOpt = None,
    keep_alive: KeepAliveOpt = KEEP_ALIVE_S,
    max_loaded_models: MaxLoadedOpt = None,
    max_model_memory: MaxMemoryOpt = None,
    host: HostOpt = HOST,
    port: PortOpt = PORT,
    api_key: ApiKeyOpt = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Most requests decoding together.")] = MAX_BATCH,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0,
                                           help="Requests that may wait beyond the batch; more get HTTP 429.")] = MAX_QUEUE,
    max_tokens_limit: MaxTokensLimitOpt = MAX_TOKENS_LIMIT,
    spec: Annotated[str, typer.Option(
        "--spec", metavar="MODE",
        help=f"Lossless speculative decoding ({', '.join(SERVE_MODES)}) for a request while it is the only one "
             "running (batched requests decode plainly); auto drafts where drafts pay and decodes plainly "
             "elsewhere; off is plain decoding.")] = "auto",
    kv_budget: KVBudgetOpt = None,
    evict: Annotated[Optional[str], typer.Option(
        "--evict", metavar="POLICY:RATIO", rich_help_panel=KV_PANEL,
        help="Every request evicts this fraction of its KV tokens with a policy: h2o, scissorhands, streaming, "
             "snapkv, random (e.g. h2o:0.5; lossy); an evicting request does not speculate.")] = None,
    repack: RepackOpt = "on",
    block_size: BlockSizeOpt = str(BLOCK_SIZE),
    kv_bits: KVBitsOpt = None,
    kv_idle_release: Annotated[float, typer.Option(
        "--kv-idle-release", metavar="SECONDS", min=0, rich_help_panel=KV_PANEL,
        help="After this many seconds without a request, give the KV memory back: the prefix cache is "
             "forgotten and the block pool shrinks (the next request prefills in full). 0: never.")] = IDLE_RELEASE_S,
    rmm: LinearRmmOpt = None,
    weights: WeightsOpt = Weights.auto,
    access_log: AccessLogOpt = True,
    verbose: VerboseOpt = False,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions
    (streaming as server-sent events, or not), GET /v1/models, GET /health.

    Several models (--model repeated, --models-dir) are served by name: each is loaded on its first request,
    unloaded after --keep-alive seconds idle, and unloaded least recently used first when --max-loaded-models
    or --max-model-memory would be passed.

    Requests decode together (continuous batching over a paged KV cache; --kv-budget bounds its memory: a
    request waits while the budget is full, and one that could never fit gets a 400). Batched decoding runs
    on the paged KV blocks, quantized with --kv-bits (8, 4, kXvY: the affine scheme; the KV budget then holds
    about two / four times the tokens of float16), and reduces only linear layers (--rmm without qk / pv). With
    --evict every request evicts as it decodes; with repacking on (vToken) it reserves only the KV blocks
    of the tokens it keeps, so more requests fit the budget. Binds
    127.0.0.1 unless told otherwise; logs one line per request (--no-access-log: none). Ctrl-C stops it, cutting
    open requests after a few seconds.
    """
    from mlx_infer.backend import limit_malloc_arenas
    from mlx_infer.server import ServerConfig
    from mlx_infer.server.app import build_pool_app
    from mlx_infer.server.defaults import MALLOC_ARENAS
    from mlx_infer.server.metrics import Metrics
    from mlx_infer.server.pool import ModelPool

    with user_errors(verbose):
        check_host(host, api_key)
        speculative = serve_spec(spec)
        load_kw, kv_request = kv_kwargs("paged", kv_budget, evict, repack, block_size, speculative, kv_bits)
        rmm = check_rmm(rmm, "serve")  # every flag checked before the model files are looked at
        models = serve_models(model, models_dir)
        loader = partial(load_served, weights=weights.value, verbose=verbose, rmm=rmm,
                         load_kw=load_kw, speculative=speculative, max_batch=max_batch,
                         idle_release_s=kv_idle_release or None)
        limit_malloc_arenas(MALLOC_ARENAS)  # before the models' and the server's threads allocate
        metrics = Metrics()
        pool = ModelPool(models, loader, alias or (), keep_alive_s=keep_alive, max_loaded=max_loaded_models,
                         max_bytes=None if max_model_memory is None else int(max_model_memory * GB), metrics=metrics)
        check_port(host, port)  # before loading and the "serving" line
        first_id, first_rmm = adopt_default(pool, loader, models[0])
        config = ServerConfig(model_id=first_id, api_key=api_key, max_tokens_limit=max_tokens_limit,
                              max_queue=max_queue, speculative=speculative.get("speculative", "off"), **kv_request)
        try:
            shown = f"[{host}]" if ":" in host else host
            reduced = f" (rmm {first_rmm}, lossy)" if first_rmm is not None else ""
            others = f"; on demand: {', '.join(m.name for m in models[1:])}" if len(models) > 1 else ""
            stderr.print(f"serving {first_id}{reduced} on http://{shown}:{port}/v1 (Ctrl-C stops)"
                         + ("; API key required" if api_key else "") + others, markup=False)
            running = max_batch * min(len(models), max_loaded_models or len(models))
            run_http(build_pool_app(pool, config, running + max_queue, metrics), host, port, verbose, access_log)
        finally:
            pool.close()
