"""`mlx-infer serve` under `mlx.launch -n 2 --backend ring` on 127.0.0.1, answered by the `openai` client: what
the sharded server does beyond plain text. A disconnected stream stops at once (its request cancelled, the
next one served); response_format, logprobs and tools run on rank 0 (distributed/structured.py) and answer as
one process does: a JSON schema's output validates and equals the one-process greedy output; logprobs and
top_logprobs equal one process's lockstep path within 1e-5 under pipeline parallel (the
server keeps the KV cache of the request before, so the prompt's shared prefix is not prefilled again: the
first logits come from a forward over cached keys, another float order than a whole-prompt prefill; bit-identical
when nothing is reused) and within 1e-3 under tensor parallel (its all_sums add the slices in another float
order: 3e-5 measured on the default model's logits); a tool_choice "required" request returns a call whose
arguments parse."""

import json
import queue
import signal
import urllib.request

import jsonschema
import openai
import pytest

import mlx_infer
from launch_helpers import TIMEOUT_S, launch, mlx_launch
from mlx_infer.distributed import commands, init_group, load_sharded
from mlx_infer.distributed.front import LeadEngine
from mlx_infer.generation.sampling import SamplingParams
from gguf_factory import Q, tiny_gguf
from test_sharded_chat_serve import Launched, _errors, _free_port, _one_process

pytestmark = pytest.mark.skipif(mlx_launch() is None, reason="mlx.launch (the mlx package's launcher) is missing")

MESSAGES = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer"}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]
LOGPROB_TOKENS = 8
#: Tensor parallel's logprobs against one process's (absolute; see the module docstring).
TENSOR_TOLERANCE = 1e-3
#: Pipeline parallel's, when the prompt's prefix came from the kept KV cache (module docstring).
PIPELINE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """test_sharded_chat_serve's tiny llama (Q8_0, ChatML) with a context of 1024 tokens: room for a tool call
    after the tools' part of the prompt."""
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama-q8.gguf", "llama", Q.Q8_0, seed=3, layers=4,
                           context=1024)
    return str(path)


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def server(request, tiny_q8):
    """`mlx-infer serve` on 2 ranks (the module's parallel mode) on a free port: (base URL, job, mode), once
    /health answers; SIGINT at the end."""
    _one_process(["generate", "hi", "--model", tiny_q8, "--max-tokens", "1"])  # the conversion, cached
    port = _free_port()
    job = Launched(["serve", "--model", tiny_q8, "--port", str(port), "--parallel", request.param])
    url = f"http://127.0.0.1:{port}"
    job.wait_healthy(url)
    yield url, job, request.param
    job.stop(signal.SIGINT)
    try:
        job.proc.wait(60)
    finally:
        job.stop()


@pytest.fixture(scope="module")
def reference(tiny_q8):
    """One process's answers: the Engine's (`generate` with the same fields) and the lockstep path's on a group
    of one (LeadEngine: the same forwards as the ranks run, unsplit) for the logprobs."""
    engine = mlx_infer.load(tiny_q8)
    out = {"json": engine.generate(MESSAGES, SamplingParams(max_tokens=60), response_format=FORMAT),
           "logprobs": engine.generate(MESSAGES, SamplingParams(max_tokens=LOGPROB_TOKENS), logprobs=3)}
    inbox = queue.Queue()
    lead = commands.lead_in_thread(init_group("any"), inbox)
    front = LeadEngine(load_sharded(tiny_q8, init_group("any")), inbox)
    try:
        request = front.batch_request(MESSAGES, SamplingParams(max_tokens=LOGPROB_TOKENS), logprobs=3)
        out["lockstep"] = [s.logprob for s in front.runner.steps(request) if s.token is not None]
    finally:
        front.runner.close()
        lead.join()
    return out


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def _metric(url: str, name: str) -> float:
    """The sum of a /metrics counter's samples (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_response_format_json_schema_validates_and_equals_one_process(server, reference):
    url, job, _ = server
    got = _client(url).chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=60, temperature=0,
                                               response_format=FORMAT)
    text = got.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == reference["json"].text and got.choices[0].finish_reason == reference["json"].finish_reason
    assert got.usage.completion_tokens == len(reference["json"].token_ids)
    assert not _errors(job.err.decode(errors="replace"))


def test_logprobs_equal_one_process(server, reference):
    """Pipeline: every logprob and top_logprob bit-identical to the lockstep path's on one process when no
    prefix was reused, within PIPELINE_TOLERANCE when it was (and within 1e-5 of the Engine's compiled step);
    tensor: within TENSOR_TOLERANCE."""
    url, _, mode = server
    got = _client(url).chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=LOGPROB_TOKENS,
                                               temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    want = reference["lockstep"]
    assert len(content) == len(want) == LOGPROB_TOKENS
    assert [w.token for w in want] == reference["logprobs"].token_ids
    for g, w, e in zip(content, want, reference["logprobs"].logprobs):
        assert [t.logprob for t in g.top_logprobs][0] == g.logprob
        alts = [(a.token, a.logprob) for a in g.top_logprobs]
        assert len(alts) == len(w.top) == 3
        cached = got.usage.prompt_tokens_details.cached_tokens
        tolerance = TENSOR_TOLERANCE if mode == "tensor" else PIPELINE_TOLERANCE if cached else 0.0
        assert abs(g.logprob - w.logprob) <= tolerance
        assert max(abs(a - b) for (_, a), (_, b) in zip(alts, w.top)) <= tolerance
        assert abs(w.logprob - e.logprob) < 1e-5


def test_tool_choice_required_returns_a_call_whose_arguments_parse(server):
    url, _, _ = server
    got = _client(url).chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=120,
                                               temperature=0, tools=TOOLS, tool_choice="required")
    (call,) = got.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_serve_still_refuses_what_does_not_run_sharded(server):
    """Only n > 1 choices are left as they were (run one after the other); nothing in chat completions' fields
    is refused any more but what the one-process server refuses too (a bad schema: a 400 naming the field)."""
    url, _, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        _client(url).chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=4,
                                             response_format={"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": 3}})
    assert e.value.body["param"] == "response_format"


def test_disconnected_stream_stops_and_the_next_request_is_served(server):
    """A stream asking for the whole context (max_tokens far beyond what it is allowed to run), closed after its
    first chunks: its request is cancelled at once, so the tokens generated by the two requests (the /metrics
    counter, counted when each ends) are far fewer than the first one's max_tokens; the second one answers in
    full."""
    url, _, mode = server
    if mode != "pipeline":
        pytest.skip("the same front end for both modes: run once")
    client = _client(url)
    before = _metric(url, "mlx_infer_generated_tokens_total")
    stream = client.chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=900, temperature=0,
                                            stream=True)
    for _, _ in zip(range(4), stream):
        pass
    stream.close()
    second = client.chat.completions.create(model="llama-q8", messages=[{"role": "user", "content": "what is it"}],
                                            max_tokens=6, temperature=0)
    assert second.usage.completion_tokens == 6
    generated = _metric(url, "mlx_infer_generated_tokens_total") - before
    assert 6 + 3 <= generated < 6 + 100, generated  # (uncancelled, the tiny model runs on past 480)


def test_the_next_request_reuses_the_kv_cache_of_the_one_before(server):
    """A conversation resent with a turn more prefills only what follows the shared prefix (every rank keeps the
    KV cache of the request before): at least the first request's prompt comes from the cache; the same request
    after an unrelated one reuses less and answers the same."""
    url, job, _ = server
    c = _client(url)
    first = c.chat.completions.create(model="llama-q8", messages=MESSAGES, max_tokens=8, temperature=0)
    turn = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "and then?"}]
    reused = c.chat.completions.create(model="llama-q8", messages=turn, max_tokens=8, temperature=0)
    cached = reused.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < reused.usage.prompt_tokens
    c.chat.completions.create(model="llama-q8", messages=[{"role": "user", "content": "something else"}],
                              max_tokens=4, temperature=0)
    again = c.chat.completions.create(model="llama-q8", messages=turn, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens < cached
    assert again.choices[0].message.content == reused.choices[0].message.content
    assert not _errors(job.err.decode(errors="replace"))


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_cli_generate_json_schema_equals_one_process(tiny_q8, parallel):
    """`mlx-infer generate --json-schema ... --json` under mlx.launch: one answer (rank 0's) that validates, the
    one-process command's tokens and text."""
    args = ["generate", "hello there", "--model", tiny_q8, "--max-tokens", "60", "--json-schema", json.dumps(SCHEMA),
            "--json"]
    want = json.loads(_one_process(args))
    proc = launch(["-m", "mlx_infer", *args, "--parallel", parallel], script=None)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # rank 1 printed nothing
    got = json.loads(lines[0])
    jsonschema.validate(json.loads(got["text"]), SCHEMA)
    assert (got["text"], got["token_ids"], got["finish_reason"]) == (want["text"], want["token_ids"], "stop")
