"""`mlx-infer serve` as users start it: refusals before loading (API key, KV budget, bad --kv-bits, --spec modes,
--rmm on qk / pv), and a live server that answers, gives JSON errors to requests the HTTP parser rejects, and
stops cleanly on Ctrl-C (exit 0, no traceback, no abort from MLX's thread streams)."""

import json
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from cli_helpers import TIMEOUT_S, assert_user_error, cli_env, entry_point


def test_non_loopback_host_needs_an_api_key(run_cli):
    assert_user_error(run_cli("serve", "--host", "0.0.0.0"), "give --api-key")


def test_bad_kv_budget(run_cli):
    assert_user_error(run_cli("serve", "--kv-budget", "lots"), "--kv-budget")


@contextmanager
def serving(*args):
    """(port, process) of `mlx-infer serve --port PORT *args` once /health answers; Ctrl-C'd on exit (if still
    running) and waited for, its stderr then in process.stderr_text."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([entry_point(), "serve", "--port", str(port), *args], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, proc.stderr_text = proc.communicate(timeout=TIMEOUT_S)


def test_serves_and_stops_on_ctrl_c(default_gguf):
    with serving() as (port, proc):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "The sky is", "max_tokens": 4},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        body = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGINT)  # with a stream open: it ends with an error event and [DONE]
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    err = proc.stderr_text
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "terminate called" not in err
    assert f"serving default on http://127.0.0.1:{port}/v1" in err
    # an access line per request by default (issue 52), without uvicorn's other INFO lines
    assert '"POST /v1/completions HTTP/1.1" 200' in err and '"POST /v1/chat/completions HTTP/1.1" 200' in err
    assert "Uvicorn running" not in err


def test_serves_a_reduced_model_and_answers_bad_http_in_json(default_gguf):
    """--rmm with linear components only; the startup line names the retention in its canonical form; a
    request whose Content-Length is not a number gets an OpenAI error object, not uvicorn's plain text;
    --no-access-log logs no request."""
    with serving("--rmm", "mlp=0.9, attn=0.75", "--no-access-log") as (port, proc):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "The sky is", "max_tokens": 4},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: abc\r\n\r\n{}")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "Content-Length" in error["message"]
    assert proc.returncode == 0, proc.stderr_text
    assert f"serving default (rmm attn=0.75,mlp=0.9, lossy) on http://127.0.0.1:{port}/v1" in proc.stderr_text
    assert "HTTP/1.1\" " not in proc.stderr_text  # no access line


def alone_and_together(flags, prompts, max_tokens):
    """(each greedy completion alone, the same sent together) from a server started with `flags`; checks
    that it stopped cleanly."""
    def complete(port, prompt):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with serving(*flags) as (port, proc):
        alone = [complete(port, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: complete(port, p), prompts))
    assert proc.returncode == 0, proc.stderr_text
    return alone, together


def test_serves_on_quantized_kv_blocks(default_gguf):
    """--kv-bits 8: requests decode batched on 8-bit paged blocks; two greedy completions sent together give
    the texts each gives alone."""
    alone, together = alone_and_together(["--kv-bits", "8"], ["The capital of France is", "Once upon a time, a dragon"], 12)
    assert together == alone and all(alone)


def test_serves_with_eviction(default_gguf):
    """--evict h2o:0.5: every request evicts as it decodes; two greedy completions sent together give the
    texts each gives alone (the same eviction decisions)."""
    prompts = ["The history of the city of Paris begins with a small settlement on an island in the river",
               "Once upon a time, a dragon lived in a cave above a village, and every winter it"]
    alone, together = alone_and_together(["--evict", "h2o:0.5"], prompts, 24)
    assert together == alone and all(alone)


def test_evict_with_a_speculative_mode_is_refused(run_cli):
    line = assert_user_error(run_cli("serve", "--evict", "h2o:0.5", "--spec", "lookup"), "not supported yet")
    assert "--spec off or auto" in line


def test_a_port_in_use_is_one_line_before_serving(default_gguf):
    """A port another process listens on: one error line naming --port, exit 2, no "serving" line and no
    uvicorn log."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([entry_point(), "serve", "--port", str(port), "--spec", "off"], env=cli_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --port {port}: cannot listen on 127.0.0.1")
    assert "serving" not in proc.stderr and "Errno" not in proc.stderr


def test_spec_draft_is_refused(run_cli):
    assert_user_error(run_cli("serve", "--spec", "draft"), "serve does not take")
    line = assert_user_error(run_cli("serve", "--spec", "fast"), "--spec must be one of")
    assert line == "error: --spec must be one of off, auto, lookup, layerskip, rmm, dflash, dspark, got 'fast'"


def test_help_lists_the_spec_modes_serve_takes(run_cli):
    proc = run_cli("serve", "--help", env=cli_env(COLUMNS="300"))
    assert proc.returncode == 0 and "(off, auto, lookup, layerskip, rmm, dflash, dspark)" in proc.stdout
    assert ", draft," not in proc.stdout


@pytest.mark.parametrize("bits", ["8", "4", "k8v4", "16"])
def test_quantized_kv_is_accepted(run_cli, bits):
    """serve decodes batched on quantized paged blocks: --kv-bits passes (the run then fails on the missing
    model, not on --kv-bits)."""
    assert_user_error(run_cli("serve", "--kv-bits", bits, "-m", "/definitely/not/here.gguf"), "no GGUF file")


def test_kv_bits_is_checked_as_generate_checks_it(run_cli):
    assert_user_error(run_cli("serve", "--kv-bits", "3", "-m", "/definitely/not/here.gguf"), "--kv-bits must be")
