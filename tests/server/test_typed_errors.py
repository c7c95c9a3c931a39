"""Errors as types at the server's edge (issue 47): the library raises errors that carry their HTTP status and
the request field at fault, and the server builds OpenAI's error object from those attributes, never from the
message's text; a served request is encoded once (the runner takes the request the server built)."""

import httpx
import pytest

from server_helpers import live_server

from mlx_infer import GenerationError, MlxInferError, RequestError, RunnerClosedError, SamplingParams
from mlx_infer.server.protocol import api_error


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 2.0), ("top_k", -3), ("min_p", 1.5),
                                          ("presence_penalty", 3.0), ("max_tokens", 0), ("seed", -1)])
def test_sampling_errors_name_their_field(field, value):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and err.value.status == 400 and isinstance(err.value, MlxInferError)
    with pytest.raises(RequestError) as err:
        SamplingParams(top_k=70).for_vocab(64)
    assert err.value.param == "top_k"


def test_error_objects_come_from_the_types_not_the_text():
    # a message that starts with a field name, or mentions "closed", says nothing about status or param
    plain = api_error(MlxInferError("top_k must be read closed")).body()["error"]
    assert plain == {"message": "top_k must be read closed", "type": "invalid_request_error", "param": None,
                     "code": None}
    assert api_error(MlxInferError("x")).status == 400
    closed = api_error(RunnerClosedError("the batch runner is closed"))
    assert closed.status == 503 and closed.body()["error"]["type"] == "server_error"
    failed = api_error(GenerationError("generation failed: a forward broke"))
    assert failed.status == 500 and failed.body()["error"]["type"] == "server_error"
    field = api_error(RequestError("anything at all", "frequency_penalty"))
    assert field.status == 400 and field.param == "frequency_penalty"
    assert api_error(RequestError("the prompt is empty", "prompt"), "messages").param == "messages"


def test_a_closed_runner_answers_503_as_a_server_error(engine):
    with live_server(engine) as (url, runner):
        runner.close()
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=600)
    assert r.status_code == 503
    assert r.json()["error"] == {"message": "the batch runner is closed", "type": "server_error", "param": None,
                                 "code": None}


def test_a_bad_value_names_its_field(server):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "top_p": 1.5}, timeout=600)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 10 ** 8]}, timeout=600)  # the engine's check
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "outside the model's vocabulary" in r.json()["error"]["message"]


def test_a_served_request_is_encoded_once(server, engine, monkeypatch):
    """The engine's prompt codec (what Engine.encode and encode_fitting run) and the tokenizer run once per
    request: the runner takes the request the server built instead of calling back into the engine to check
    (and encode) it again."""
    url, _ = server
    calls = {"engine": 0, "tokenizer": 0}
    hf = engine.tokenizer._tokenizer
    codec = engine._prompts
    encode, template, engine_encode = hf.encode, hf.apply_chat_template, codec.encode

    def counted(name, f):
        def call(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return call

    monkeypatch.setattr(hf, "encode", counted("tokenizer", encode))
    monkeypatch.setattr(hf, "apply_chat_template", counted("tokenizer", template))
    monkeypatch.setattr(codec, "encode", counted("engine", engine_encode))
    r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3}, timeout=600)
    assert r.status_code == 200 and calls == {"engine": 1, "tokenizer": 1}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3, "stream": True}, timeout=600)
    assert r.status_code == 200 and "[DONE]" in r.text and calls == {"engine": 2, "tokenizer": 2}
