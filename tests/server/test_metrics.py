"""GET /metrics read by prometheus_client's own text parser: the request counters move by exactly the requests
made (chat and completions, streamed and not, a 400 and a cut stream counted with their statuses), the token
counters by the answers' usage, one TTFT per request and one inter-token latency per further token, the
scheduler's gauges at scrape time, the API key, speculative tau, and the model load / unload counters."""

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import live_server

from mlx_infer.generation.results import GenerationStats, GenerationStep
from mlx_infer.server.metrics import Metrics

MODEL = "smollm2"
#: A generous bound for the server to notice a client gone (it depends on the machine's speed).
NOTICE_S = 120


def samples(text: str) -> dict:
    """{(sample name, frozenset of its labels): value} of a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, **kw) -> dict:
    r = httpx.get(url + "/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


def value(got: dict, name: str, **labels) -> float:
    return got.get((name, frozenset(labels.items())), 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_counters_move_by_the_requests_made(server):
    url, runner = server
    before = scrape(url)
    c = client(url)
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    usages = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6).usage]
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    usages.append(c.completions.create(model=MODEL, prompt="The rivers of Europe are", max_tokens=5).usage)
    stream = c.completions.create(model=MODEL, prompt="The rivers of Europe are", max_tokens=5, stream=True,
                                  stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=messages, temperature=5)
    after = scrape(url)

    assert len(usages) == 4
    requests = "mlx_infer_requests_total"
    assert delta(before, after, requests, api="chat", model=MODEL, status="200") == 2
    assert delta(before, after, requests, api="completions", model=MODEL, status="200") == 2
    assert delta(before, after, requests, api="chat", model="", status="400") == 1  # refused before a model served it
    assert sum(v for (name, _), v in after.items() if name == requests) - \
        sum(v for (name, _), v in before.items() if name == requests) == 5
    assert delta(before, after, "mlx_infer_prompt_tokens_total", model=MODEL) == sum(u.prompt_tokens for u in usages)
    assert delta(before, after, "mlx_infer_generated_tokens_total", model=MODEL) == \
        sum(u.completion_tokens for u in usages)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert delta(before, after, "mlx_infer_cached_prompt_tokens_total", model=MODEL) == sum(cached)
    assert sum(cached) > 0  # the repeated prompts start from the prefix cache
    assert delta(before, after, "mlx_infer_prefix_cache_hits_total", model=MODEL) == sum(1 for n in cached if n > 0)
    assert delta(before, after, "mlx_infer_time_to_first_token_seconds_count", api="chat", model=MODEL) == 2
    assert delta(before, after, "mlx_infer_time_to_first_token_seconds_count", api="completions", model=MODEL) == 2
    # every answer ran to max_tokens: one latency per token after its first
    assert [u.completion_tokens for u in usages] == [6, 6, 5, 5]
    assert delta(before, after, "mlx_infer_inter_token_latency_seconds_count", model=MODEL) == 22 - 4
    assert delta(before, after, "mlx_infer_inter_token_latency_seconds_sum", model=MODEL) > 0

    # idle now: the gauges read the scheduler and its block pool
    kv = runner.scheduler.kv
    assert value(after, "mlx_infer_requests_running", model=MODEL) == 0
    assert value(after, "mlx_infer_requests_waiting", model=MODEL) == 0
    assert value(after, "mlx_infer_requests_in_flight") == 0
    assert value(after, "mlx_infer_models_loaded") == 1
    assert value(after, "mlx_infer_kv_blocks_used", model=MODEL) == kv.pool.blocks_in_use == len(kv.prefix) > 0
    assert value(after, "mlx_infer_kv_blocks_cached", model=MODEL) == len(kv.prefix)
    assert value(after, "mlx_infer_kv_blocks_allocated", model=MODEL) == kv.pool.capacity
    assert ("mlx_infer_kv_blocks_free", frozenset({("model", MODEL)})) not in after  # no KV budget: unbounded


def test_running_request_and_a_cut_stream_counted_499(server):
    url, runner = server
    before = scrape(url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
            "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            during = scrape(url)
    assert value(during, "mlx_infer_requests_running", model=MODEL) == 1
    assert value(during, "mlx_infer_requests_in_flight") == 1
    assert value(during, "mlx_infer_kv_blocks_used", model=MODEL) > 0
    deadline = time.monotonic() + NOTICE_S
    while time.monotonic() < deadline:
        after = scrape(url)
        if delta(before, after, "mlx_infer_requests_total", api="chat", model=MODEL, status="499"):
            break
        time.sleep(0.1)
    assert delta(before, after, "mlx_infer_requests_total", api="chat", model=MODEL, status="499") == 1
    assert delta(before, after, "mlx_infer_requests_total", api="chat", model=MODEL, status="200") == 0


def test_metrics_behind_the_api_key(engine):
    with live_server(engine, api_key="s3cret") as (url, _):
        r = httpx.get(url + "/metrics")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        got = scrape(url, headers={"Authorization": "Bearer s3cret"})
        assert value(got, "mlx_infer_requests_in_flight") == 0


def test_speculative_tau_observed_per_speculative_request(engine):
    with live_server(engine, speculative="lookup", max_batch=4) as (url, _):
        before = scrape(url)
        prompt = "Repeat exactly: one two three four five six seven eight. one two three four five six seven eight."
        client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=24)
        after = scrape(url)
    assert delta(before, after, "mlx_infer_speculative_tau_count", model=MODEL) == 1
    assert delta(before, after, "mlx_infer_speculative_tau_sum", model=MODEL) >= 1


def test_tracked_steps_count_ttft_latencies_and_tokens():
    """Track (on the runner's thread): one TTFT at the first token, one latency per further token, the final
    stats counted; a failed request's labels marked."""
    metrics = Metrics()
    track = metrics.track("completions", "m")
    for token in (5, 6, 7):
        track.step(GenerationStep("x", token))
    track.step(GenerationStep("", None, finish_reason="stop",
                              stats=GenerationStats(prompt_tokens=9, generated_tokens=3, cached_prompt_tokens=4)))
    got = samples(metrics.exposition().decode())
    assert value(got, "mlx_infer_time_to_first_token_seconds_count", api="completions", model="m") == 1
    assert value(got, "mlx_infer_inter_token_latency_seconds_count", model="m") == 2
    assert value(got, "mlx_infer_prompt_tokens_total", model="m") == 9
    assert value(got, "mlx_infer_cached_prompt_tokens_total", model="m") == 4
    assert value(got, "mlx_infer_generated_tokens_total", model="m") == 3
    assert value(got, "mlx_infer_prefix_cache_hits_total", model="m") == 1
    assert value(got, "mlx_infer_speculative_tau_count", model="m") == 0  # not speculative


def test_model_loads_and_unloads():
    metrics = Metrics()
    metrics.model_loaded("a", 1.5)
    metrics.model_loaded("a", 0.7)
    metrics.model_loaded("b", 3.0)
    metrics.model_unloaded("a")
    got = samples(metrics.exposition().decode())
    assert value(got, "mlx_infer_model_loads_total", model="a") == 2
    assert value(got, "mlx_infer_model_loads_total", model="b") == 1
    assert value(got, "mlx_infer_model_unloads_total", model="a") == 1
    assert value(got, "mlx_infer_model_load_seconds_sum", model="a") == pytest.approx(2.2)
    assert value(got, "mlx_infer_model_load_seconds_bucket", model="a", le="1.0") == 1


def test_apps_count_apart():
    """Each app has its own registry: two Metrics in one process never share a counter."""
    one, two = Metrics(), Metrics()
    one.model_loaded("a", 1.0)
    assert value(samples(two.exposition().decode()), "mlx_infer_model_loads_total", model="a") == 0
