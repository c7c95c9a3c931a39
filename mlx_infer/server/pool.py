"""ModelPool: several models behind one server, loaded when a request names them, unloaded when idle.

    pool = ModelPool([describe("a.gguf"), describe("b.gguf")], load=my_loader, aliases=["claude-*=a"],
                     keep_alive_s=300, max_loaded=2, max_bytes=8 << 30)
    app = build_pool_app(pool, ServerConfig(), capacity)          # app.py
    async with pool.lease("b", keep_alive=0) as served: ...      # what the routes do

The pool has models.OneModel's methods (`listing`, `find`, `lease`, `close`). A request names a model by its
name, the --model argument it was given as, or an alias (an exact name or a shell pattern such as `claude-*`,
for clients that send a hard-coded name); none: the first model (the default); anything else is a 404
model_not_found. A model not in memory is loaded on its first request (the request waits; `load` runs on a
thread of its own, one load at a time per model, and the requests for a model being loaded wait for that
load). After its last request a model stays loaded `keep_alive` seconds (the request's own keep_alive, else
the pool's; 0: unloaded at once; negative: kept), as Ollama does. Loading one more model when
`max_loaded` models are loaded, or when the loaded models' weight bytes plus the new one's would pass
`max_bytes`, first unloads the least recently used idle models; a model with requests in flight is never
unloaded: the request then waits for room up to `wait_s` seconds and gets a 503 with Retry-After after that.
Unloading closes the model's BatchRunner (its thread ends), drops the engine and gives the memory back
(backend.return_free_memory).

All the pool's state lives on the event loop's thread (no locks); only loading and closing runners run on
other threads.
"""

import asyncio
import fnmatch
import gc
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..backend import return_free_memory
from ..defaults import SERVE_KEEP_ALIVE_S, SERVE_MODEL_WAIT_S, SERVE_RETRY_AFTER_S
from ..errors import MlxInferError
from .models import ModelFile, Served, model_not_found, model_object
from .protocol import APIError

log = logging.getLogger("mlx_infer.server")

#: A loader: the ModelFile -> its Served (engine and started runner); runs on a thread of its own.
Loader = Callable[[ModelFile], Served]


def weight_bytes(engine) -> int:
    """Bytes of a loaded engine's weights (every parameter array of its model, as stored in memory)."""
    return sum(v.nbytes for _, v in tree_flatten(engine.model.parameters()))


def parse_aliases(aliases: Iterable[str], names: List[str]) -> List[Tuple[str, str]]:
    """[(name or pattern, model name)] of --alias NAME=MODEL arguments, in the order given (the first match
    wins); NAME may be a shell pattern (`claude-*`, `gpt-?`). Raises MlxInferError naming --alias for a
    malformed argument or a MODEL that is not served."""
    out = []
    for given in aliases:
        name, sep, target = given.partition("=")
        name, target = name.strip(), target.strip()
        if not sep or not name or not target:
            raise MlxInferError(f"--alias {given!r}: write NAME=MODEL (e.g. claude-*={names[0] if names else 'default'})")
        if target not in names:
            raise MlxInferError(f"--alias {given!r}: {target!r} is not a served model; served: {', '.join(names)}")
        out.append((name, target))
    return out


def in_thread(fn: Callable, *args) -> "asyncio.Future":
    """Run fn(*args) on a new thread; the future of its result on the running loop. The thread clears its MLX
    streams when done (MLX needs a thread's streams destroyed before it ends)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting request
            error = e
        finally:
            mx.synchronize()
            mx.clear_streams()
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="mlx-infer-load", daemon=True).start()
    return future


class _Slot:
    """One servable model's state (event loop thread only)."""

    def __init__(self, model: ModelFile):
        self.model = model
        self.served: Optional[Served] = None
        self.bytes: Optional[int] = None  # its weights' bytes, once loaded
        self.active = 0  # leases held (requests running)
        self.waiting = 0  # requests waiting to lease it
        self.last_used = 0.0  # loop time of its last lease or release
        self.keep_alive: Optional[float] = None  # the latest request's (None: the pool's)
        self.loading: Optional[asyncio.Future] = None
        self.unloading: Optional[asyncio.Future] = None
        self.timer: Optional[asyncio.TimerHandle] = None

    @property
    def resident(self) -> bool:
        """In memory or on its way in or out (counts against max_loaded and max_bytes)."""
        return self.served is not None or self.loading is not None or self.unloading is not None

    @property
    def idle(self) -> bool:
        """Loaded with no request running or waiting for it: may be unloaded."""
        return self.served is not None and self.active == 0 and self.waiting == 0 and self.loading is None

    def need(self) -> int:
        """Bytes its weights take (measured once loaded; before that its size on disk)."""
        return self.bytes if self.bytes is not None else (self.model.size or 0)


class ModelPool:
    """Several models served on demand (see the module's docstring).

    Args:
        models: what can be served; the first is the default (a request naming no model). Names must differ.
        load: builds a model's Served on a thread of its own (engine loaded, KV configured, runner started).
        aliases: --alias NAME=MODEL arguments (NAME may be a shell pattern).
        keep_alive_s: seconds an idle model stays loaded (a request's keep_alive overrides it; 0: unload at
            once; negative: keep).
        max_loaded: most models in memory at once (None: no limit).
        max_bytes: most weight bytes of the models in memory together (None: no limit); a model larger than
            the whole budget loads only when no other is in memory.
        wait_s: most seconds a request waits for room before its 503.
        metrics: told of each load and unload (metrics.Metrics: `model_loaded(name, seconds)`,
            `model_unloaded(name)`); None: nobody.

    Raises:
        MlxInferError: no models, two with one name, a bad alias, max_loaded below 1.
    """

    def __init__(self, models: List[ModelFile], load: Loader, aliases: Iterable[str] = (),
                 keep_alive_s: float = SERVE_KEEP_ALIVE_S, max_loaded: Optional[int] = None,
                 max_bytes: Optional[int] = None, wait_s: float = SERVE_MODEL_WAIT_S, metrics=None):
        if not models:
            raise MlxInferError("no models to serve: give --model or a --models-dir that holds .gguf files or "
                                "model directories")
        names = [m.name for m in models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise MlxInferError(f"two models are named {twice[0]!r}: serve one of them (names come from the file or "
                                "directory names)")
        if max_loaded is not None and max_loaded < 1:
            raise MlxInferError(f"--max-loaded-models must be at least 1, got {max_loaded}")
        self.slots: Dict[str, _Slot] = {m.name: _Slot(m) for m in models}
        self.default = names[0]
        self.aliases = parse_aliases(aliases, names)
        self.load_fn, self.keep_alive_s = load, keep_alive_s
        self.max_loaded, self.max_bytes, self.wait_s = max_loaded, max_bytes, wait_s
        self.metrics = metrics
        self.loads: Dict[str, int] = {n: 0 for n in names}  # loads and unloads per model (metrics)
        self.unloads: Dict[str, int] = {n: 0 for n in names}
        self._room: List[asyncio.Future] = []  # requests waiting for room, woken on every release / unload
        self._tasks: set = set()  # unloads in flight (kept referenced)

    # ---- names

    def resolve(self, name: Optional[str]) -> _Slot:
        """The slot a request's model name picks: None the default, then a model's name, the --model argument
        it came from, an alias (exact, then patterns, in order). Raises APIError 404 model_not_found."""
        if name is None:
            return self.slots[self.default]
        if name in self.slots:
            return self.slots[name]
        for slot in self.slots.values():
            if slot.model.spec is not None and name == slot.model.spec:
                return slot
        for pattern, target in self.aliases:
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return self.slots[target]
        raise model_not_found(name, list(self.slots))

    def listing(self) -> List[dict]:
        """OpenAI's model objects of every servable model (`loaded`: in memory now), the default first."""
        return [model_object(n, s.served is not None) for n, s in self.slots.items()]

    def find(self, name: str) -> dict:
        """The model object `name` picks (an alias: its model's); raises APIError 404 model_not_found."""
        slot = self.resolve(name)
        return model_object(slot.model.name, slot.served is not None)

    def loaded(self) -> List[Served]:
        """The models in memory now (metrics reads their schedulers at scrape time)."""
        return [s.served for s in self.slots.values() if s.served is not None]

    # ---- adding a model loaded beforehand

    def adopt(self, served: Served, seconds: float = 0.0) -> None:
        """Put a model loaded outside the pool (serve loads the default before it starts listening) in its
        slot; it stays until its first request ends, then keep_alive applies. `seconds`: how long it took to
        load (metrics). Raises MlxInferError for a name not served."""
        if served.id not in self.slots:
            raise MlxInferError(f"{served.id!r} is not one of the pool's models")
        slot = self.slots[served.id]
        slot.served, slot.bytes = served, weight_bytes(served.engine)
        self._loaded(served.id, seconds)

    def _loaded(self, name: str, seconds: float) -> None:
        self.loads[name] += 1
        if self.metrics is not None:
            self.metrics.model_loaded(name, seconds)

    # ---- leases

    @asynccontextmanager
    async def lease(self, name: Optional[str], keep_alive: Optional[float] = None) -> AsyncIterator[Served]:
        """The model a request names, loaded if need be, held until the request ends.

        Raises:
            APIError: 404 model_not_found; 503 with Retry-After when no room could be made within wait_s;
                the load's error (api_error's status) when the model fails to load.
        """
        slot = self.resolve(name)
        served = await self._acquire(slot)
        slot.keep_alive = keep_alive  # the latest request's word, as Ollama
        try:
            yield served
        finally:
            self._release(slot)

    async def _acquire(self, slot: _Slot) -> Served:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        slot.waiting += 1
        try:
            while True:
                if slot.unloading is not None:
                    await asyncio.shield(slot.unloading)
                elif slot.served is not None:
                    slot.active += 1
                    slot.last_used = loop.time()
                    if slot.timer is not None:
                        slot.timer.cancel()
                        slot.timer = None
                    return slot.served
                elif slot.loading is not None:
                    try:
                        await asyncio.shield(slot.loading)
                    except Exception as e:  # the load failed: every request waiting for it is told
                        raise APIError(500, f"model {slot.model.name!r} could not be loaded: {e}", "model",
                                       kind="server_error") from None
                elif await self._make_room(slot, deadline):
                    slot.loading = asyncio.ensure_future(self._load(slot))
                    slot.loading.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by the waiters
        finally:
            slot.waiting -= 1

    def _release(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        slot.active -= 1
        slot.last_used = loop.time()
        if slot.idle:
            keep = self.keep_alive_s if slot.keep_alive is None else slot.keep_alive
            if keep == 0:
                self._unload_soon(slot, "keep_alive 0")
            elif keep > 0:
                slot.timer = loop.call_later(keep, self._expire, slot)
        self._wake()

    def _expire(self, slot: _Slot) -> None:
        slot.timer = None
        if slot.idle:
            self._unload_soon(slot, "idle past its keep_alive")

    # ---- room

    def _fits(self, slot: _Slot) -> bool:
        """Whether `slot` can load beside the models in memory (or on their way in or out)."""
        others = [s for s in self.slots.values() if s is not slot and s.resident]
        if not others:
            return True
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return False
        return self.max_bytes is None or sum(s.need() for s in others) + slot.need() <= self.max_bytes

    def _least_recent_idle(self, slot: _Slot) -> Optional[_Slot]:
        idle = [s for s in self.slots.values() if s is not slot and s.idle]
        return min(idle, key=lambda s: s.last_used) if idle else None

    async def _make_room(self, slot: _Slot, deadline: float) -> bool:
        """Unload idle models (least recently used first) until `slot` fits; wait for releases while none is
        idle. True when it fits now; False when the slot's state changed meanwhile (loaded or loading by
        another request: look again). Raises APIError 503 with Retry-After past the deadline."""
        loop = asyncio.get_running_loop()
        while not self._fits(slot):
            victim = self._least_recent_idle(slot)
            if victim is not None:
                await self._unload(victim, f"making room for {slot.model.name}")
            else:
                left = deadline - loop.time()
                if left <= 0:
                    busy = ", ".join(n for n, s in self.slots.items() if s is not slot and s.resident)
                    raise APIError(503, f"model {slot.model.name!r} cannot be loaded now: the models in memory "
                                        f"({busy}) are busy; retry shortly", "model", kind="server_error",
                                   code="model_busy", headers={"Retry-After": str(SERVE_RETRY_AFTER_S)})
                woken = loop.create_future()
                self._room.append(woken)
                try:
                    await asyncio.wait_for(woken, left)
                except asyncio.TimeoutError:
                    pass
                finally:
                    if woken in self._room:
                        self._room.remove(woken)
            if slot.resident:
                return False
        return True

    def _wake(self) -> None:
        """Wake the requests waiting for room (something was released or unloaded)."""
        for woken in self._room:
            if not woken.done():
                woken.set_result(None)
        self._room.clear()

    # ---- loading and unloading

    async def _load(self, slot: _Slot) -> None:
        name = slot.model.name
        try:
            log.info("loading model %s", name)
            started = time.monotonic()
            served = await in_thread(self.load_fn, slot.model)
            slot.served, slot.bytes = served, weight_bytes(served.engine)
            self._loaded(name, time.monotonic() - started)
            slot.last_used = asyncio.get_running_loop().time()
            log.info("loaded model %s (%.1f MB of weights)", name, slot.bytes / 1e6)
        finally:
            slot.loading = None
            self._wake()
        while self.max_bytes is not None and not self._fits_measured():  # its measured size was over the estimate
            victim = self._least_recent_idle(slot)
            if victim is None:
                break
            await self._unload(victim, f"making room for {name}")

    def _fits_measured(self) -> bool:
        return sum(s.need() for s in self.slots.values() if s.resident) <= self.max_bytes or len(self.loaded()) <= 1

    def _unload_soon(self, slot: _Slot, why: str) -> None:
        task = asyncio.ensure_future(self._unload(slot, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unload(self, slot: _Slot, why: str) -> None:
        """Take an idle model out of memory: no new lease gets it from now; its runner is closed on a thread,
        its engine dropped and the memory given back. A no-op for a model not idle any more."""
        if not slot.idle or slot.unloading is not None:
            return
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None
        served, slot.served = slot.served, None
        slot.unloading = asyncio.get_running_loop().create_future()
        try:
            await asyncio.to_thread(served.runner.close)  # its thread joins: no MLX work left on it
            del served
            gc.collect()
            return_free_memory()
            self.unloads[slot.model.name] += 1
            if self.metrics is not None:
                self.metrics.model_unloaded(slot.model.name)
            log.info("unloaded model %s (%s)", slot.model.name, why)
        finally:
            slot.unloading.set_result(None)
            slot.unloading = None
            self._wake()

    def close(self) -> None:
        """Close every loaded model's runner (the server stopped; any thread)."""
        for slot in self.slots.values():
            if slot.timer is not None:
                slot.timer.cancel()
                slot.timer = None
            if slot.served is not None:
                slot.served.runner.close()
                slot.served = None
