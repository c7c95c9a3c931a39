"""`mlx-infer chat` and `mlx-infer serve` under `mlx.launch -n 2 --backend ring` on 127.0.0.1, against one
process: rank 0's answers equal the one-process command's (greedy; pipeline parallel is bit-identical, tensor
parallel's logits differ in the last bits and its greedy tokens are held to equality on these prompts, as in
test_distributed.py), rank 1 prints nothing, and a job idle for longer than the step timeout lives on (rank 0's
heartbeats: mlx_infer/distributed/commands.py)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest

from gguf_factory import Q, tiny_gguf
from launch_helpers import TIMEOUT_S, free_port_block, mlx_launch

pytestmark = pytest.mark.skipif(mlx_launch() is None, reason="mlx.launch (the mlx package's launcher) is missing")

TURNS = ["hello there", "what is it"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """A tiny llama GGUF (4 query / 2 KV heads, 4 layers, Q8_0) with a ChatML template."""
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama-q8.gguf", "llama", Q.Q8_0, seed=3, layers=4)
    return str(path)


def _env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        env.pop(name, None)
    return env


def _one_process(args, stdin: str = "") -> str:
    """stdout of `mlx-infer ARGS` as one plain process (its model conversion cached for the launches)."""
    proc = subprocess.run([sys.executable, "-m", "mlx_infer", *args], input=stdin.encode(), capture_output=True,
                          timeout=TIMEOUT_S, env=_env())
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode(errors="replace")  # (bytes decoded as Launched does: "\r\n" kept)


class Launched:
    """`mlx.launch -n 2 --backend ring -- python -m mlx_infer ARGS` in a session of its own, its stdout and
    stderr read on threads. Its stdin stays open until it ends: mlx.launch passes no end of input on, and
    polls a closed stdin without pause."""

    def __init__(self, args, **env):
        cmd = [mlx_launch(), "-n", "2", "--backend", "ring", "--starting-port", str(free_port_block(4)),
               "--python", sys.executable, "--", "-m", "mlx_infer", *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=_env(**env), start_new_session=True)
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                        for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, into: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            into += chunk

    def write(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def wait_for_output(self, stderr_holds: bytes = b"") -> None:
        """Until rank 0 has written something to stdout, and `stderr_holds` to stderr (the limit is only there to
        fail a hang)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not (self.out and stderr_holds in self.err) and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.out and stderr_holds in self.err, self.err.decode(errors="replace")

    def wait_healthy(self, url: str) -> None:
        """Until the job's server answers GET url/health with 200 (the limit is only there to fail a hang)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.err.decode(errors="replace")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)

    def wait(self) -> tuple:
        """(stdout, stderr) as text once the job has ended."""
        try:
            self.proc.wait(TIMEOUT_S)
        finally:
            self.stop()
        for t in self.readers:
            t.join()
        return self.out.decode(errors="replace"), self.err.decode(errors="replace")

    def stop(self, sig=signal.SIGKILL) -> None:
        """Signal every process of the job (its session's group) that is still there."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.proc.stdin.close()


def _errors(stderr: str) -> list:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ") or "Traceback" in ln]


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_chat_two_turns_equal_one_process(tiny_q8, parallel):
    """Two turns piped to rank 0 (then /exit): the answers, the second one to the whole history, equal the
    one-process chat's (the dense KV cache, no speculation: plain greedy decoding), printed once. The second
    turn prefills only what follows the first turn's tokens in the KV cache every rank kept (--stats: its
    "prompt N tok (K cached)", 0 < K < N; the first turn has none cached)."""
    args = ["chat", "--model", tiny_q8, "--max-tokens", str(MAX_TOKENS)]
    expected = _one_process([*args, "--kv-cache", "dense", "--spec", "off"], "\n".join(TURNS) + "\n")
    assert len(expected.splitlines()) == 2 and expected.strip()
    job = Launched([*args, "--parallel", parallel, "--stats"])
    job.write("\n".join(TURNS) + "\n/exit\n")
    out, err = job.wait()
    assert out == expected, err
    assert not _errors(err), err
    prompts = re.findall(r"prompt (\d+) tok(?: \((\d+) cached\))?", err)
    assert len(prompts) == 2 and prompts[0][1] == "", err
    total, cached = int(prompts[1][0]), int(prompts[1][1] or 0)
    assert int(prompts[0][0]) <= cached < total, err  # the first turn's prompt at least (and its answer's tokens
    #                                                    as far as the history's text tokenizes to them again)


def test_chat_idle_longer_than_the_step_timeout_lives_on(tiny_q8):
    """With MLX_INFER_DIST_TIMEOUT=3, the second turn comes 6 s after the first answer: rank 1, waiting for rank
    0's next command all that time, gets heartbeats and never times out; both answers as one process's. (Without
    heartbeats rank 1 ends the job: 'error: rank 1: broadcasting rank 0's next command ... did not finish
    within 3 s'.)"""
    args = ["chat", "--model", tiny_q8, "--max-tokens", str(MAX_TOKENS)]
    expected = _one_process([*args, "--kv-cache", "dense", "--spec", "off"], "\n".join(TURNS) + "\n")
    job = Launched([*args, "--parallel", "pipeline"], MLX_INFER_DIST_TIMEOUT="3")
    job.write(TURNS[0] + "\n")
    job.wait_for_output()  # the first answer: loading is over, the job idles from here
    time.sleep(6)
    assert job.proc.poll() is None, job.err.decode(errors="replace")
    job.write(TURNS[1] + "\n/exit\n")
    out, err = job.wait()
    assert not _errors(err), err
    assert out == expected


def _rank_pid(job: Launched, rank: int) -> int:
    """The process id of a rank of `job` (its session's process whose environment has MLX_RANK=rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != job.proc.pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"MLX_RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(entry)
        except OSError:
            continue
    raise AssertionError(f"no rank {rank} in the job")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process through /proc")
def test_chat_rank_lost_while_idle_ends_the_job_with_one_error(tiny_q8):
    """Rank 1 killed while the chat waits for its next line: rank 0's next heartbeat fails (or mlx.launch stops
    it), one error line from rank 0, and the job ends with no more input."""
    _one_process(["generate", "hi", "--model", tiny_q8, "--max-tokens", "1"])  # the conversion, cached
    job = Launched(["chat", "--model", tiny_q8, "--max-tokens", str(MAX_TOKENS), "--parallel", "pipeline", "--stats"])
    job.write(TURNS[0] + "\n")
    job.wait_for_output(b"generated ")  # the answer's stats line: it has ended, the chat waits for a line
    os.kill(_rank_pid(job, 1), signal.SIGKILL)
    out, err = job.wait()
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: ") and "Traceback" not in err, err
    assert "the command IDLE failed: a rank of the group was lost" in lines[0] or "stopped by mlx.launch" in lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_q8):
    """`mlx-infer serve` on 2 ranks (pipeline parallel: bit-identical to one process) on a free port: its base
    URL, once /health answers; SIGINT to the job at the end (rank 0 stops uvicorn and shuts rank 1 down)."""
    _one_process(["generate", "hi", "--model", tiny_q8, "--max-tokens", "1"])  # the conversion, cached
    port = _free_port()
    job = Launched(["serve", "--model", tiny_q8, "--port", str(port), "--parallel", "pipeline"])
    url = f"http://127.0.0.1:{port}"
    job.wait_healthy(url)
    yield url, job
    job.stop(signal.SIGINT)
    try:
        job.proc.wait(60)
    finally:
        job.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def _generate(tiny_q8, prompt: str, chat_template: bool = True) -> dict:
    """One process's greedy answer (`generate --json`): text, token_ids, finish_reason."""
    args = ["generate", prompt, "--model", tiny_q8, "--max-tokens", str(MAX_TOKENS), "--json"]
    return json.loads(_one_process(args + ([] if chat_template else ["--no-chat-template"])))


def _stream_text(client, prompt: str) -> tuple:
    """(text, finish_reason) of a streamed chat completion."""
    text, finish = [], None
    for chunk in client.chat.completions.create(model="llama-q8", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


def test_serve_chat_and_completions_equal_one_process(server, tiny_q8):
    url, _ = server
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["llama-q8"]
    want = _generate(tiny_q8, TURNS[0])
    got = client.chat.completions.create(model="llama-q8", messages=[{"role": "user", "content": TURNS[0]}],
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].message.content == want["text"] and got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.completion_tokens == len(want["token_ids"])
    assert _stream_text(client, TURNS[0]) == (want["text"], want["finish_reason"])
    raw = _generate(tiny_q8, TURNS[1], chat_template=False)
    done = client.completions.create(model="llama-q8", prompt=TURNS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == raw["text"] and done.usage.completion_tokens == len(raw["token_ids"])


def test_serve_two_concurrent_streams_both_complete(server, tiny_q8):
    """Two streams at once: served one after the other (FIFO), each whole and each its one-process answer."""
    url, _ = server
    wants = [_generate(tiny_q8, p) for p in TURNS]
    results = [None, None]

    def one(i: int) -> None:
        results[i] = _stream_text(_client(url), TURNS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == [(w["text"], w["finish_reason"]) for w in wants]


def test_serve_unknown_model_is_a_404(server):
    """(tools, logprobs and response_format run sharded: test_sharded_serve_structured.py.)"""
    url, job = server
    client = _client(url)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert job.proc.poll() is None and not _errors(job.err.decode(errors="replace"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's process through /proc")
def test_serve_ctrl_c_shuts_every_rank_down(server):
    """SIGINT to rank 0 (Ctrl-C): it stops uvicorn and sends SHUTDOWN, rank 1 leaves its loop, and the job ends
    with no error line (the last test on this server). (Ctrl-C in a terminal reaches every rank, which ignore
    it but rank 0, and mlx.launch, which ends with a KeyboardInterrupt traceback of its own.)"""
    url, job = server
    os.kill(_rank_pid(job, 0), signal.SIGINT)
    job.proc.wait(TIMEOUT_S)
    for t in job.readers:
        t.join()
    err = job.err.decode(errors="replace")
    assert not _errors(err), err
    assert "exited with code" not in err and "was killed" not in err, err  # (mlx.launch's notes on its ranks)


def test_serve_of_several_models_is_refused_with_one_line(tiny_q8):
    """Several --model under mlx.launch (one model is split over the ranks): one error line from rank 0 before
    anything is loaded, every rank gone (was: the last --model served, the others dropped without a word)."""
    job = Launched(["serve", "--model", tiny_q8, "--model", tiny_q8, "--port", str(_free_port())])
    _, err = job.wait()
    assert _errors(err) == ["error: --model is given 2 times: one model is split over mlx.launch ranks; serve "
                            "several models from one process (docs/distributed.md)"], err
    assert "serving" not in err


def test_a_flag_the_sharded_command_lacks_is_one_line_from_rank_0(tiny_q8):
    """serve's --max-loaded-models (one-process only) under mlx.launch: one error line (rank 0's, not one per
    rank) that says it is the launcher's command that lacks it and where its own help is."""
    job = Launched(["serve", "--model", tiny_q8, "--max-loaded-models", "1"])
    _, err = job.wait()
    assert _errors(err) == ["error: No such option: --max-loaded-models under mlx.launch (see: mlx.launch -n 1 -- "
                            "mlx-infer serve --help)"], err
