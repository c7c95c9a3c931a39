"""`mlx-infer serve` through the official openai client and raw HTTP: chat and completions, streaming and
not, stop strings, usage, concurrent streams equal to each request alone, disconnects, auth, malformed
requests (bodies, and raw HTTP the parser rejects), an internal error logged once, 429, and the prefix cache
across chat turns."""

import asyncio
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from server_helpers import live_server

import mlx_infer
from mlx_infer.errors import GenerationError
from mlx_infer.server import ServerConfig, build_app
from mlx_infer.server.protocol import generation_failed

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
             "Explain what a CPU does in one sentence.", "Say hi.", "Count from one to ten.",
             "Name two planets.", "What is 2 + 2?"]


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def alone(engine, question, n):
    engine.reset()
    return engine.generate([{"role": "user", "content": question}], max_tokens=n).text


def test_chat_and_completions(server, reference):
    url, _ = server
    c = client(url)
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12)
    assert r.choices[0].message.content == alone(reference, QUESTIONS[0], 12)
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == "smollm2"
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=12, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    full = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=20, temperature=0)
    cut = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=20, stop=[" Paris", "\n"])
    stops = [i for i in (full.choices[0].text.find(" Paris"), full.choices[0].text.find("\n")) if i >= 0]
    assert stops, "the reference text should contain a stop string"
    assert cut.choices[0].text == full.choices[0].text[:min(stops)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=20, stream=True))
    assert streamed == full.choices[0].text
    assert client(url).models.list().data[0].id == "smollm2"


def test_retrieve_the_served_model_and_404_for_another(server):
    """GET /v1/models/{id} (issue 52, defect 7): the served model's object through the openai client; an id
    this server does not serve is a 404 in OpenAI's error shape."""
    url, _ = server
    model = client(url).models.retrieve("smollm2")
    assert (model.id, model.object, model.owned_by) == ("smollm2", "model", "mlx-infer")
    assert model.model_dump() == client(url).models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client(url).models.retrieve("gpt-4o")
    error = caught.value.response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "'gpt-4o'" in error["message"] and "'smollm2'" in error["message"]


def test_retrieve_a_model_id_with_a_slash_and_under_auth(engine):
    """Hugging Face ids hold a '/'; the route is behind the API key like /v1/models."""
    with live_server(engine, model_id="HuggingFaceTB/SmolLM2-135M-Instruct", api_key="k") as (url, _):
        assert client(url, "k").models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct").id == \
            "HuggingFaceTB/SmolLM2-135M-Instruct"
        with pytest.raises(openai.NotFoundError):
            client(url, "k").models.retrieve("HuggingFaceTB/other")
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_eight_concurrent_streams_equal_each_alone(server, reference):
    url, _ = server
    want = [alone(reference, q, 24) for q in QUESTIONS]
    got = [None] * len(QUESTIONS)

    def one(i):
        stream = client(url).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i]}],
                                                      max_tokens=24, stream=True)
        got[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_disconnect_mid_stream_frees_its_blocks(server):
    url, runner = server
    pool, prefix = runner.scheduler.kv.pool, runner.scheduler.kv.prefix
    body = {"messages": [{"role": "user", "content": "Tell me a very long story about dragons."}], "max_tokens": 2000,
            "stream": True}
    other = threading.Thread(target=lambda: client(url).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=40))
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert runner.scheduler.running
            other.start()
    other.join()
    for _ in range(200):
        if not runner.scheduler.busy:
            break
        time.sleep(0.05)
    assert not runner.scheduler.running
    assert pool.blocks_in_use == len(prefix)  # only the prefix cache's blocks are left


def test_auth(engine):
    with live_server(engine, api_key="s3cret") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
        assert client(url, "s3cret").chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices[0].message.content
        assert httpx.get(url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "bogus": 1}).encode(), 400, "unsupported field 'bogus'"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "n": 9}).encode(), 400, "'n' must be an integer from 1 to 8"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}).encode(), 400, "'temperature' must be a number"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}).encode(), 400, "temperature must be >= 0"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10 ** 9}).encode(), 400, "'max_tokens' must be between"),
    (json.dumps({"messages": []}).encode(), 400, "non-empty list"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400, "only text parts"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "'messages' is required"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "temperature": 5}).encode(), 400, "between 0 and 2"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "seed": 2 ** 64}).encode(), 400, "seed must be"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "not valid Unicode"),
    (b"[" * 100000 + b"]" * 100000, 400, "nested too deeply"),
    (b"{" + b" " * (2 << 20) + b"}", 413, "over"),
])
def test_malformed_requests(server, body, status, needle):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


def raw_request(url: str, request: bytes) -> tuple:
    """(status, headers (lower-case names), body) of one raw HTTP/1.1 exchange with the server at `url`."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines))
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("length", [b"abc", b"-1", b"12abc", b"\xef\xbc\x91\xef\xbc\x92"])  # the last: full-width 12
def test_unparsable_content_length_is_a_json_error(server, length):
    url, _ = server
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + length + b"\r\n\r\n{}")
    status, headers, body = raw_request(url, request)
    assert status == 400 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "Content-Length" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").status_code == 200  # still serving


def test_an_unknown_model_is_a_404_model_not_found(server):
    """A request naming a model the server does not serve is never answered by another one."""
    url, _ = server
    with pytest.raises(openai.NotFoundError) as e:
        client(url).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    ok = client(url).completions.create(model="smollm2", prompt="hi", max_tokens=2)
    assert ok.model == "smollm2"


def test_bad_content_length_reaching_the_app_is_a_400(engine):
    """Behind an ASGI server that passes the header on unparsed, the app itself answers it with a 400."""
    app = build_app(engine, SimpleNamespace(scheduler=SimpleNamespace(max_batch=1)), ServerConfig())
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-length", "\uff11".encode()), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert "Content-Length header must be a number" in error["message"] and error["type"] == "invalid_request_error"


def test_a_failed_generation_says_so_once():
    """The runner's own error already reads 'generation failed: ...' (it said it twice)."""
    ran = generation_failed(GenerationError("generation failed: a forward broke")).body()["error"]
    other = generation_failed(RuntimeError("a forward broke")).body()["error"]
    assert ran["message"] == other["message"] == "generation failed: a forward broke"
    assert ran["type"] == other["type"] == "server_error"


def test_internal_error_is_logged_once(server, engine, monkeypatch, caplog):
    """A 500 is one log record with its traceback (the server's), not a second one from uvicorn."""
    url, _ = server

    def boom(*args, **kwargs):
        raise RuntimeError("boom from the test")

    monkeypatch.setattr(engine, "encode_fitting", boom)
    uvicorn_log = logging.getLogger("uvicorn")  # uvicorn's loggers do not propagate to the root one
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
            time.sleep(0.2)  # uvicorn logs after the response is sent
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "boom" not in r.text and "Traceback" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info and "boom from the test" in str(rec.exc_info[1])]
    assert len(logged) == 1 and logged[0].name == "mlx_infer.server"
    assert "/v1/completions" in logged[0].getMessage()
    assert not [rec for rec in caplog.records if "Exception in ASGI application" in rec.getMessage()]


@pytest.mark.parametrize("prompt, needle", [([99999999], "outside the model's vocabulary"), ([-1], "must be"),
                                              ([2 ** 40], "outside the model's vocabulary")])
def test_bad_token_ids(server, prompt, needle):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    assert httpx.get(url + "/health").status_code == 200  # still serving


def test_top_k_past_the_vocabulary_names_its_field(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": 10_000_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert "vocabulary size" in r.json()["error"]["message"]


def test_completions_logprobs_past_the_legacy_limit_is_refused(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "logprobs": 6}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "'logprobs' must be an integer from 0 to 5" in r.json()["error"]["message"]


def test_non_streaming_disconnect_cancels(server):
    """A non-streaming client that goes away while tokens keep coming is cancelled within a poll interval."""
    url, runner = server
    body = {"messages": [{"role": "user", "content": "Tell me a very long story about dragons."}], "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=body, timeout=1.5)
    for _ in range(100):
        if not runner.scheduler.busy:
            break
        time.sleep(0.1)
    assert not runner.scheduler.busy


def test_unknown_route_and_method(server):
    url, _ = server
    assert httpx.get(url + "/v1/nothing").status_code == 404
    assert "no route" in httpx.get(url + "/v1/nothing").json()["error"]["message"]
    assert httpx.get(url + "/v1/chat/completions").status_code == 405


def test_full_server_answers_429(engine):
    with live_server(engine, max_batch=1, max_queue=0) as (url, runner):
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()  # kept: a dropped iterator closes the connection (a disconnect)
                next(lines)
                busy = http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
                assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"


def test_next_chat_turn_reuses_the_first_turns_blocks(server):
    url, _ = server
    c = client(url)
    history = [{"role": "system", "content": "You are a patient teacher. " * 20},
               {"role": "user", "content": "Explain photosynthesis briefly."}]
    first = c.chat.completions.create(model="smollm2", messages=history, max_tokens=40)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And respiration?"}]
    second = c.chat.completions.create(model="smollm2", messages=history, max_tokens=8)
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit >= (first.usage.prompt_tokens // 16) * 16  # at least the first turn's whole prompt blocks
    assert hit < second.usage.prompt_tokens


def test_lone_request_speculates_losslessly(engine, reference):
    """With speculative decoding on (lookup), a request running alone speculates and answers exactly as
    plain decoding does."""
    question = ("Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries, figs, grapes, "
                "apples, bananas, cherries, dates, elderberries, figs, grapes.")
    with live_server(engine, speculative="lookup") as (url, runner):
        r = client(url).chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=48)
        assert runner.scheduler.steps == 0  # no batched decode forward: every token came from speculative rounds
    assert r.choices[0].message.content == alone(reference, question, 48) and r.usage.completion_tokens > 1


def test_a_request_past_the_kv_budget_is_a_400_naming_max_tokens(default_gguf):
    """10 MB of KV blocks hold 13 blocks of 16 tokens: a request for 1000 new tokens can never fit. The 400
    names the client's field (max_tokens), not the server's flag as a keyword."""
    small = mlx_infer.load(kv_cache="paged", kv_budget="10MB")
    with live_server(small) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens"
    assert "but the KV budget of 9.5 MiB holds 13: lower max_tokens or shorten the prompt" in error["message"]
    assert "kv_budget" not in error["message"]
