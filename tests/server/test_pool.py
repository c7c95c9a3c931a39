"""Several models behind one server (server/pool.py, issue 49): the default model and tiny GGUF models served
at once through the openai client, each answering as itself; a model loaded on demand evicting the least
recently used idle one (--max-loaded-models), its engine freed; keep_alive 0 and a short keep_alive
unloading; unknown names a 404 and aliases / patterns mapping names on purpose; a swap while another model
streams (the stream completes, the streaming model is not the one evicted); a 503 with Retry-After when no
room can be made."""

import asyncio
import gc
import threading
import time
import weakref
from contextlib import contextmanager
from functools import lru_cache

import httpx
import openai
import pytest

import mlx_infer
from gguf_factory import TinySpec, random_weights, write_gguf
from mlx_infer.errors import MlxInferError
from mlx_infer.server import ServerConfig
from mlx_infer.server.app import build_pool_app
from mlx_infer.server.metrics import Metrics
from prometheus_client.parser import text_string_to_metric_families
from mlx_infer.server.models import Served, describe
from mlx_infer.server.pool import ModelPool, in_thread, parse_aliases
from server_helpers import serving

#: Only to fail a hang (loading and decoding take as long as the machine needs).
HANG_S = 300
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Three tiny llama GGUFs a, b, c (different random weights: different answers)."""
    folder = tmp_path_factory.mktemp("models")
    spec = TinySpec("llama")
    return {name: write_gguf(folder / f"{name}.gguf", spec, random_weights(spec, seed=seed))
            for seed, name in enumerate("abc")}


@lru_cache(maxsize=None)
def alone(path, n: int = 8) -> str:
    """A tiny model's greedy completion of PROMPT, from an engine of its own."""
    return mlx_infer.load(str(path)).generate(PROMPT, chat_template=False, max_tokens=n, temperature=0).text


class GatedRunner:
    """A BatchRunner whose steps after a request's first wait for `gate` (on the runner's thread): a stream
    stays open, and its model busy, for as long as a test needs."""

    def __init__(self, runner, gate: threading.Event):
        self.runner, self.gate, self.scheduler = runner, gate, runner.scheduler

    def submit(self, request, on_step=None):
        seen = []

        def gated(step):
            if seen:
                self.gate.wait(HANG_S)
            seen.append(step)
            on_step(step)
        return self.runner.submit(request, on_step=gated)

    def close(self):
        self.gate.set()
        self.runner.close()


def loader(gates=None):
    """The pool's loader: the model as serve loads it (paged KV, its runner); a model named in `gates` gets a
    GatedRunner."""
    def load(model):
        engine = mlx_infer.load(model.spec, kv_cache="paged")
        runner = engine.batch_runner(4)
        if gates and model.name in gates:
            runner = GatedRunner(runner, gates[model.name])
        return Served(model.name, engine, runner)
    return load


@contextmanager
def live_pool(models, **options):
    """(base_url, pool) of a server over ModelPool(models, ...) on a free loopback port; closed on exit."""
    gates = options.pop("gates", None)
    metrics = Metrics()
    pool = ModelPool([describe(m) for m in models], loader(gates), metrics=metrics, **options)
    app = build_pool_app(pool, ServerConfig(), 32, metrics)
    try:
        with serving(app, HANG_S) as url:
            yield url, pool
    finally:
        pool.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def loaded(url: str) -> dict:
    return {m["id"]: m["loaded"] for m in httpx.get(url + "/v1/models", timeout=HANG_S).json()["data"]}


def complete(c: openai.OpenAI, model: str, **extra):
    return c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, **extra)


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_two_models_at_once_each_answers_as_itself(default_gguf, tiny):
    """The default model (first: a request naming none gets it) and a tiny one, both loaded on demand and
    then both in memory; each answer equals its model's own."""
    reference = mlx_infer.load()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.generate(question, max_tokens=12, temperature=0).text
    with live_pool([None, str(tiny["a"])]) as (url, pool):
        c = client(url)
        assert loaded(url) == {"default": False, "a": False}
        chat = c.chat.completions.create(model="default", messages=question, max_tokens=12, temperature=0)
        small = complete(c, "a")
        assert (chat.model, chat.choices[0].message.content) == ("default", expected)
        assert (small.model, small.choices[0].text) == ("a", alone(tiny["a"]))
        assert loaded(url) == {"default": True, "a": True}
        # no model: the default; the --model argument itself names its model too
        plain = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, timeout=HANG_S).json()
        assert plain["model"] == "default"
        assert complete(c, str(tiny["a"])).model == "a"
        assert c.models.retrieve("a").id == "a" and pool.loads == {"default": 1, "a": 1}


def test_a_third_model_evicts_the_least_recently_used_idle_one(tiny):
    with live_pool([str(tiny[n]) for n in "abc"], max_loaded=2) as (url, pool):
        c = client(url)
        assert complete(c, "a").choices[0].text == alone(tiny["a"])
        assert complete(c, "b").choices[0].text == alone(tiny["b"])
        complete(c, "a")  # a used last: b is the least recently used
        engine_b = weakref.ref(pool.slots["b"].served.engine)
        assert complete(c, "c").choices[0].text == alone(tiny["c"])
        assert loaded(url) == {"a": True, "b": False, "c": True}
        assert pool.unloads == {"a": 0, "b": 1, "c": 0}
        gc.collect()
        assert engine_b() is None  # b's engine (its weights, its KV pool) is gone
        assert complete(c, "b").choices[0].text == alone(tiny["b"])  # b again: a (now least recent) goes
        assert loaded(url) == {"a": False, "b": True, "c": True}
        scraped = {(s.name, s.labels.get("model")): s.value for f in text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=HANG_S).text) for s in f.samples}
        assert [scraped[("mlx_infer_model_loads_total", n)] for n in "abc"] == [1, 2, 1]
        assert [scraped[("mlx_infer_model_unloads_total", n)] for n in "ab"] == [1, 1]
        assert scraped[("mlx_infer_models_loaded", None)] == 2


def test_keep_alive_zero_unloads_after_the_request(tiny):
    with live_pool([str(tiny["a"]), str(tiny["b"])]) as (url, pool):
        c = client(url)
        assert complete(c, "b", extra_body={"keep_alive": 0}).choices[0].text == alone(tiny["b"])
        wait_until(lambda: not loaded(url)["b"], "keep_alive 0 did not unload b")
        assert pool.unloads["b"] == 1
        complete(c, "b")  # the server's keep-alive (300 s): b stays
        complete(c, "b", extra_body={"keep_alive": "0.2s"})  # a duration: unloaded once idle that long
        wait_until(lambda: not loaded(url)["b"], "keep_alive 0.2s did not unload b")
        assert pool.loads["b"] == 2 and pool.unloads["b"] == 2
        r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": PROMPT, "keep_alive": "soon"},
                       timeout=HANG_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_unknown_model_404_and_aliases(tiny):
    with live_pool([str(tiny["a"]), str(tiny["b"])], aliases=["gpt-4o=b", "claude-*=a"]) as (url, pool):
        c = client(url)
        with pytest.raises(openai.NotFoundError) as caught:
            complete(c, "llama-70b")
        assert caught.value.code == "model_not_found" and "'a', 'b'" in caught.value.message
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("llama-70b")
        assert loaded(url) == {"a": False, "b": False}  # nothing loaded for it
        assert complete(c, "claude-3-5-sonnet-latest").model == "a"
        assert complete(c, "gpt-4o").choices[0].text == alone(tiny["b"])
        assert c.models.retrieve("claude-opus").id == "a"


def test_bad_pool_options(tiny):
    models = [describe(str(tiny["a"]))]
    with pytest.raises(MlxInferError, match="not a served model"):
        ModelPool(models, loader(), aliases=["x=zzz"])
    with pytest.raises(MlxInferError, match="NAME=MODEL"):
        parse_aliases(["claude-*"], ["a"])
    with pytest.raises(MlxInferError, match="two models are named 'a'"):
        ModelPool(models * 2, loader())


def test_a_swap_while_another_model_streams(tiny):
    """a streams (held open by its gate) while b loads and c evicts b, never a; a's stream then completes
    with a's own answer. With one model allowed, a request for another model gets 503 and Retry-After."""
    gate = threading.Event()
    with live_pool([str(tiny[n]) for n in "abc"], max_loaded=2, gates={"a": gate}) as (url, pool):
        c = client(url)
        stream = c.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        first = next(stream)
        assert pool.slots["a"].active == 1
        complete(c, "b")
        assert complete(c, "c").choices[0].text == alone(tiny["c"])
        assert loaded(url) == {"a": True, "b": False, "c": True} and pool.unloads["a"] == 0
        gate.set()
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream)
        assert text == alone(tiny["a"])
    gate = threading.Event()
    with live_pool([str(tiny[n]) for n in "ab"], max_loaded=1, wait_s=0, gates={"a": gate}) as (url, pool):
        c = client(url)
        stream = c.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        next(stream)
        r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 4}, timeout=HANG_S)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "model_busy" and loaded(url) == {"a": True, "b": False}
        gate.set()
        assert list(stream)[-1].choices[0].finish_reason in ("stop", "length")
        assert complete(c, "b").choices[0].text == alone(tiny["b"])  # a idle now: evicted for b
        assert loaded(url) == {"a": False, "b": True}


def test_a_request_waits_for_a_busy_model_to_finish(tiny):
    """With one model allowed and a streaming, a request for b waits (no 503 within wait_s) and is answered
    once a's stream ends."""
    gate = threading.Event()
    with live_pool([str(tiny[n]) for n in "ab"], max_loaded=1, gates={"a": gate}) as (url, pool):
        c = client(url)
        stream = c.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
        next(stream)
        answer = {}
        waiting = threading.Thread(target=lambda: answer.update(r=complete(c, "b")))
        waiting.start()
        wait_until(lambda: pool._room, "the request for b did not wait for room")
        assert loaded(url) == {"a": True, "b": False}
        gate.set()
        list(stream)
        waiting.join(HANG_S)
        assert answer["r"].choices[0].text == alone(tiny["b"]) and loaded(url) == {"a": False, "b": True}


def test_load_failure_is_an_error_for_every_waiting_request(tiny, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with live_pool([str(tiny["a"]), str(broken)]) as (url, pool):
        r = httpx.post(url + "/v1/completions", json={"model": "broken", "prompt": PROMPT}, timeout=HANG_S)
        assert r.status_code == 500 and "could not be loaded" in r.json()["error"]["message"]
        assert loaded(url) == {"a": False, "broken": False}
        assert complete(client(url), "a").choices[0].text == alone(tiny["a"])


def test_in_thread_clears_its_streams():
    """The pool's loads run on a thread of their own; an error there reaches the awaiting coroutine."""
    async def main():
        assert await in_thread(lambda x: x + 1, 1) == 2
        with pytest.raises(ZeroDivisionError):
            await in_thread(lambda: 1 / 0)
    asyncio.run(main())
