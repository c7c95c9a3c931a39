"""`mlx-infer serve` as users start it: refusals before loading, and a live server that answers and stops
cleanly on Ctrl-C (exit 0, no traceback, no abort from MLX's thread streams)."""

import signal
import socket
import subprocess
import time

import httpx
from cli_helpers import TIMEOUT_S, assert_user_error, cli_env, entry_point


def test_non_loopback_host_needs_an_api_key(run_cli):
    assert_user_error(run_cli("serve", "--host", "0.0.0.0"), "give --api-key")


def test_bad_kv_budget(run_cli):
    assert_user_error(run_cli("serve", "--kv-budget", "lots"), "--kv-budget")


def test_serves_and_stops_on_ctrl_c(default_gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([entry_point(), "serve", "--port", str(port)], env=cli_env(),
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
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "terminate called" not in err
    assert f"serving default on http://127.0.0.1:{port}/v1" in err


def test_spec_draft_is_refused(run_cli):
    assert_user_error(run_cli("serve", "--spec", "draft"), "serve does not take")
    assert_user_error(run_cli("serve", "--spec", "fast"), "--spec must be one of")
