"""The distributed package's pieces in one process: layer ranges, the tensor plan's splits and checks, the
model digest, the step timeout's parsing, a group of one; the command loop and rank 0's front."""

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import mlx_infer
from gguf_factory import Q, tiny_gguf
from mlx_infer.distributed import broadcast_list, commands, init_group, load_sharded
from mlx_infer.distributed.defaults import HEARTBEAT_S
from mlx_infer.distributed.front import LeadEngine
from mlx_infer.distributed.digest import model_digest
from mlx_infer.distributed.pipeline import layer_ranges
from mlx_infer.distributed.tensor import tensor_plan
from mlx_infer.distributed.watchdog import step_timeout
from mlx_infer.errors import DistributedError, MlxInferError, RequestError
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.loading import resolve


def test_layer_ranges_contiguous_first_ranks_take_the_extra():
    assert layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert layer_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(DistributedError, match="at least 4 layers"):
        layer_ranges(3, 4)


def test_tensor_plan_splits_by_kv_head():
    engine = mlx_infer.load()  # 9 query / 3 KV heads, head_dim 64, MLP 1536 rows, 4-bit group 32
    plan = tensor_plan(engine.model, 2)
    assert plan.kv == [0, 1, 3] and [plan.heads(0), plan.heads(1)] == [(0, 3), (3, 9)]
    assert plan.ffn == [0, 768, 1536]
    assert tensor_plan(engine.model, 3).kv == [0, 1, 2, 3]
    with pytest.raises(DistributedError, match="at least 4 KV heads"):
        tensor_plan(engine.model, 4)


def test_digest_tells_weights_apart_and_ignores_the_folder(tmp_path):
    a = resolve(str(tiny_gguf(tmp_path / "a.gguf", "llama", Q.F32, seed=1)[0])).mlx_dir
    b = resolve(str(tiny_gguf(tmp_path / "b.gguf", "llama", Q.F32, seed=2)[0])).mlx_dir
    copy = shutil.copytree(a, tmp_path / "elsewhere")
    assert model_digest(a) != model_digest(b)
    assert model_digest(a) == model_digest(copy)


def test_step_timeout_env(monkeypatch):
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "12.5")
    assert step_timeout() == 12.5
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "soon")
    with pytest.raises(MlxInferError, match="MLX_INFER_DIST_TIMEOUT must be a positive number"):
        step_timeout()


def test_group_of_one():
    group = init_group("any")
    assert (group.size, group.rank, group.is_root) == (1, 0, True)
    assert broadcast_list(group, [3, 1, 4], "ids") == [3, 1, 4]
    with pytest.raises(MlxInferError, match="unknown distributed backend"):
        init_group("carrier-pigeon")


# ---- the command loop (commands.py) and rank 0's front (front.py) on a group of one


def test_heartbeat_interval_stays_under_the_step_timeout(monkeypatch):
    monkeypatch.delenv("MLX_INFER_DIST_TIMEOUT", raising=False)
    assert commands.heartbeat_interval() == HEARTBEAT_S == 1.0
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "2")
    assert commands.heartbeat_interval() == 0.5


def test_lead_runs_jobs_in_order_skips_cancelled_ones_and_shuts_down(monkeypatch):
    sent = []
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: sent.append(list(values)) or values)
    inbox = queue.Queue()
    first = commands.submit(inbox, 5, lambda: "a")
    skipped = commands.submit(inbox, 6, lambda: "never")
    assert skipped.cancel()
    last = commands.submit(inbox, 7, lambda: "b")
    commands.finish(inbox)
    commands.lead(init_group("any"), inbox, interval=60)
    assert (first.result(), last.result()) == ("a", "b")
    assert sent == [[commands.REQUEST, 5], [commands.REQUEST, 7], [commands.SHUTDOWN, 0]]


def test_lead_sends_heartbeats_while_idle_and_a_failed_job_ends_it(monkeypatch):
    sent = []
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: sent.append(list(values)) or values)
    inbox = queue.Queue()
    thread = threading.Thread(target=lambda: pytest.raises(DistributedError, commands.lead, init_group("any"),
                                                             inbox, 0.01))
    thread.start()
    while len(sent) < 3:  # idle: heartbeats only
        time.sleep(0.01)
    assert all(s == [commands.IDLE, 0] for s in sent)

    def lost():
        raise DistributedError("rank 1 lost")
    failed = commands.submit(inbox, 4, lost)
    thread.join()
    assert isinstance(failed.exception(), DistributedError)
    assert [commands.REQUEST, 4] in sent and [commands.SHUTDOWN, 0] not in sent


def test_follow_runs_requests_until_shutdown_and_refuses_garbage(monkeypatch):
    script = iter([[commands.IDLE, 0], [commands.REQUEST, 9], [commands.IDLE, 0], [commands.REQUEST, 3],
                   [commands.SHUTDOWN, 0]])
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: next(script))
    ran = []
    assert commands.follow(init_group("any"), ran.append) == 2 and ran == [9, 3]
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: [7, 0])
    with pytest.raises(DistributedError, match="out of step"):
        commands.receive(init_group("any"))


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny llama GGUF with a ChatML template (gguf_factory's byte-level tokenizer)."""
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("front") / "llama.gguf", "llama", Q.F32, seed=4)
    return str(path)


def test_lead_engine_steps_equal_one_engine(tiny_chat):
    """LeadEngine over a group of one (the lead thread running lockstep_steps) gives the Engine's text, tokens
    and finish reason, also with a stop string cut from that text, and refuses what does not run sharded
    (speculative decoding)."""
    engine = mlx_infer.load(tiny_chat)
    messages = [{"role": "user", "content": "hello there"}]
    plain = engine.generate(messages, SamplingParams(max_tokens=12))
    inbox = queue.Queue()
    lead = commands.lead_in_thread(init_group("any"), inbox)
    front = LeadEngine(load_sharded(tiny_chat, init_group("any")), inbox)
    try:
        steps = list(front.stream_steps(messages, SamplingParams(max_tokens=12)))
        assert "".join(s.text for s in steps) == plain.text and len(plain.token_ids) == 12
        assert [s.token for s in steps] == plain.token_ids
        assert steps[-1].finish_reason == plain.finish_reason == "length"
        assert steps[-1].stats.generated_tokens == 12 and steps[-1].stats.prompt_tokens == plain.stats.prompt_tokens
        assert steps[-1].stats.peak_memory_bytes > 0  # this rank's peak (a chat's --stats printed 0.0 MiB)
        stop = plain.text[3:5]
        cut = engine.generate(messages, SamplingParams(max_tokens=12, stop=(stop,)))
        steps = list(front.stream_steps(messages, SamplingParams(max_tokens=12, stop=(stop,))))
        assert "".join(s.text for s in steps) == cut.text == plain.text[:plain.text.index(stop)]
        assert steps[-1].finish_reason == "stop"
        got = []

        def gone(step):  # a receiver that fails (a server's closed event loop) after the first step
            got.append(step)
            raise RuntimeError("Event loop is closed")
        handle = front.runner.submit(front.batch_request(messages, SamplingParams(max_tokens=12)), gone)
        assert handle.future.result() is None and len(got) == 1 and handle.cancelled.is_set()
        assert "".join(s.text for s in front.stream_steps(messages, SamplingParams(max_tokens=12))) == plain.text
        with pytest.raises(RequestError, match="'speculative' is not supported while the model is split") as e:
            front.batch_request(messages, speculative="dflash")
        assert e.value.param == "speculative"
    finally:
        front.runner.close()
        lead.join()


def test_sigterm_gives_one_line_when_the_main_thread_is_free():
    """SIGTERM while rank 0's main thread sleeps in Python: both the Python handler and the pipe's reader
    thread see it; exactly one error line, exit 2 (a chat waiting for input had printed it twice). The exit is
    slowed down in the child, so that the second path always arrives before the process ends."""
    code = ("import os, sys, time; from mlx_infer.distributed.watchdog import on_terminate; real = os._exit; "
            "os._exit = lambda c: (time.sleep(1.0), real(c)); on_terminate(0); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert [ln for ln in err.splitlines() if ln.startswith("error: ")] == [
        "error: rank 0: stopped by mlx.launch: another rank of the group failed or was killed (its error, if it "
        "wrote one, is above)"], err


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer"}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]


def test_lead_engine_structured_equals_one_engine(tiny_chat):
    """Over a group of one, a LeadEngine request with response_format (a JSON schema: jump-forward over the
    forced tokens), logprobs with top_logprobs, or tools with tool_choice "required" gives the Engine's tokens,
    text, finish reason and tool call (the tiny model's context ends just after it); logprobs within 1e-5 of
    the Engine's (its compiled decode step sums in another order), the same top tokens."""
    engine = mlx_infer.load(tiny_chat)
    messages = [{"role": "user", "content": "hello there"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    inbox = queue.Queue()
    lead = commands.lead_in_thread(init_group("any"), inbox)
    front = LeadEngine(load_sharded(tiny_chat, init_group("any")), inbox)

    def run(**kw):
        steps = list(front.runner.steps(front.batch_request(messages, SamplingParams(max_tokens=kw.pop("n")), **kw)))
        return steps, "".join(s.text for s in steps), [s.token for s in steps if s.token is not None]

    try:
        want = engine.generate(messages, SamplingParams(max_tokens=60), response_format=fmt)
        steps, text, tokens = run(n=60, response_format=fmt)
        assert text == want.text and tokens == want.token_ids and steps[-1].finish_reason == want.finish_reason
        assert set(json.loads(text)) == {"ok", "color", "n"}
        want = engine.generate(messages, SamplingParams(max_tokens=8), logprobs=3)
        steps, text, tokens = run(n=8, logprobs=3)
        got = [s.logprob for s in steps if s.token is not None]
        assert tokens == want.token_ids and [g.token for g in got] == tokens
        for g, w in zip(got, want.logprobs):
            assert abs(g.logprob - w.logprob) < 1e-5 and [t for t, _ in g.top] == [t for t, _ in w.top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(g.top, w.top)) < 1e-5
        want = engine.generate(messages, SamplingParams(max_tokens=120), tools=TOOLS, tool_choice="required")
        steps, text, tokens = run(n=120, tools=TOOLS, tool_choice="required")
        assert tokens == want.token_ids and steps[-1].finish_reason == want.finish_reason  # (the context's end)
        (call,) = steps[-1].tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
        assert [(c.name, c.arguments) for c in want.tool_calls] == [(call.name, call.arguments)]
    finally:
        front.runner.close()
        lead.join()


def test_lead_engine_keeps_its_cache_between_turns(tiny_chat):
    """keep_cache over a group of one: a second turn (the first's prompt and answer, then a new line) gives the
    Engine's answer to the whole history, its prompt's leading tokens from the kept cache (at least the first
    turn's prompt, fewer than its own); a diverging prompt trims the cache to the common prefix; after reset
    nothing is reused."""
    engine = mlx_infer.load(tiny_chat)
    inbox = queue.Queue()
    lead = commands.lead_in_thread(init_group("any"), inbox)
    front = LeadEngine(load_sharded(tiny_chat, init_group("any")), inbox, keep_cache=True)
    params = SamplingParams(max_tokens=10)
    first = [{"role": "user", "content": "hello there"}]
    try:
        one = list(front.stream_steps(first, params))
        assert one[-1].stats.cached_prompt_tokens == 0
        second = first + [{"role": "assistant", "content": "".join(s.text for s in one)},
                          {"role": "user", "content": "what is it"}]
        two = list(front.stream_steps(second, params))
        want = engine.generate(second, params)
        assert "".join(s.text for s in two) == want.text
        assert one[-1].stats.prompt_tokens <= two[-1].stats.cached_prompt_tokens < two[-1].stats.prompt_tokens
        other = [{"role": "user", "content": "hello world"}]
        three = list(front.stream_steps(other, params))
        assert "".join(s.text for s in three) == engine.generate(other, params).text
        assert 0 < three[-1].stats.cached_prompt_tokens < three[-1].stats.prompt_tokens  # "<|im_start|>user\nhello "
        front.reset()
        assert list(front.stream_steps(other, params))[-1].stats.cached_prompt_tokens == 0
    finally:
        front.runner.close()
        lead.join()
