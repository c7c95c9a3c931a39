"""Serving over real HTTP: `mlx_lm.server` and `mlx-infer serve` on the same weights, in one run.

Both servers run as subprocesses on loopback ports, on the same MLX model directory (the default model's
GGUF converted by mlx-infer: Q4_1 as MLX 4-bit; mlx_lm.server multiplies it with MLX's own quantized matmul,
mlx-infer serve with its kernel layer on the CPU). For each concurrency c (1 / 4 / 8 / 16), `--requests`
streaming chat requests drawn in turn from bench/prompts/*.jsonl are sent with at most c in flight, greedy,
the same max_tokens; the two servers alternate per level (mlx-lm first, then mlx-infer; the next level in
the other order). Measured per request on the client: TTFT (request sent -> first content chunk), inter-token
latency (gaps between content chunks), completion tokens (from `usage`, include_usage), failures. Total
tokens/s = all completion tokens / wall seconds of the level.

Multi-turn: a chat with a ~1k-token history (a system prompt and earlier turns), its next turn's TTFT
against the first turn's (both servers cache prompts across requests).

Soak (--soak-seconds S, mlx-infer only): 16 clients send requests for S seconds, a fifth of them dropping
the connection after a few chunks; failures other than those drops, and the server's RSS before the soak,
after its first quarter (the KV pool and the prefix cache, bounded by PREFIX_CACHE_BYTES, at their working
size), at the end, and after --kv-idle-release seconds idle (the server then gives its KV memory back).

Usage: python bench/serve.py [--concurrency 1,4,8,16] [--requests 16] [--max-tokens 32] [--soak-seconds 0]
                            [--kv-idle-release 10]
Prints tables and writes bench/results/serve-*.json.
"""

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402
from common import all_prompts, machine, machine_line, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name, cmd, port):
    """Start a server subprocess and wait until GET /health answers."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not start in 300 s")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


#: The "model" field of the requests: mlx_lm.server loads whatever model a request names, so it is given
#: the directory both servers serve (mlx-infer serve takes any name).
MODEL = {"id": "default"}


async def chat(client, url, messages, max_tokens, drop_after=None):
    """One streaming chat request: {"ttft_s", "gaps_s", "tokens", "ok", "dropped"}."""
    body = {"model": MODEL["id"], "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, last, gaps, tokens, chunks = None, None, [], 0, 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "dropped": False}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        return {"ok": True, "dropped": True}
    except httpx.HTTPError as e:
        return {"ok": False, "error": str(e), "dropped": False}
    return {"ok": first is not None, "ttft_s": (first or time.perf_counter()) - start, "gaps_s": gaps,
            "tokens": tokens, "dropped": False}


async def level(url, prompts, c, n, max_tokens):
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def one(i):
            async with sem:
                return await chat(client, url, [{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttft = sorted(r["ttft_s"] for r in ok)
    gaps = sorted(g for r in ok for g in r["gaps_s"])
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"concurrency": c, "requests": n, "failed": len(results) - len(ok), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in ok), "total_tps": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "itl_p50_s": pct(gaps, 0.5), "itl_p95_s": pct(gaps, 0.95)}


def history_messages(turns=12):
    """A system prompt and earlier turns: about 1k tokens of history before the next question."""
    msgs = [{"role": "system", "content": "You are a patient assistant who explains things step by step."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: tell me one fact about the number {i * 7 + 3} and why it matters in everyday life."})
        msgs.append({"role": "assistant", "content": f"The number {i * 7 + 3} shows up in many places. " * 6})
    return msgs


async def multi_turn(url, max_tokens):
    async with httpx.AsyncClient(timeout=600) as client:
        msgs = history_messages() + [{"role": "user", "content": "Summarize our chat in one sentence."}]
        first = await chat(client, url, msgs, max_tokens)
        msgs2 = msgs + [{"role": "assistant", "content": "We talked about numbers."},
                        {"role": "user", "content": "Thanks. Now give one more fact."}]
        second = await chat(client, url, msgs2, max_tokens)
    return {"first_ttft_s": first.get("ttft_s"), "next_ttft_s": second.get("ttft_s"),
            "ratio": second.get("ttft_s", float("nan")) / first.get("ttft_s", float("nan"))}


async def soak(url, prompts, seconds, max_tokens, pid, idle_release):
    """16 clients for `seconds`; RSS before any soak traffic, after the first quarter (the KV pool and the
    prefix cache at their working size), at the end (after 2 s idle) and once the server has been idle
    `idle_release` seconds (its --kv-idle-release: the KV memory given back)."""
    start_rss, start, results, marks = rss_bytes(pid), time.monotonic(), [], {}
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=20)) as client:
        async def worker(w):
            while time.monotonic() < start + seconds:
                drop = rng.randint(2, 6) if rng.random() < 0.2 else None
                results.append(await chat(client, url, [{"role": "user", "content": rng.choice(prompts)}], max_tokens, drop))
                if "quarter" not in marks and time.monotonic() > start + seconds / 4:
                    marks["quarter"] = rss_bytes(pid)
        await asyncio.gather(*(worker(w) for w in range(16)))
    await asyncio.sleep(2)
    end_rss = rss_bytes(pid)
    await asyncio.sleep(max(0.0, idle_release - 2) + 3)
    return {"seconds": seconds, "requests": len(results), "dropped": sum(r["dropped"] for r in results),
            "failed": sum(not r["ok"] for r in results), "rss_start_bytes": start_rss,
            "rss_quarter_bytes": marks.get("quarter", 0), "rss_end_bytes": end_rss,
            "idle_release_s": idle_release, "rss_released_bytes": rss_bytes(pid)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--soak-seconds", type=int, default=0)
    ap.add_argument("--systems", default="mlx-lm,mlx-infer")
    ap.add_argument("--kv-idle-release", type=float, default=10.0,
                    help="mlx-infer serve's --kv-idle-release (the soak waits for it before its last RSS)")
    args = ap.parse_args()

    engine = mlx_infer.load()  # converts the default GGUF once; both servers read its MLX directory
    mlx_dir = str(engine.source.mlx_dir)
    MODEL["id"] = mlx_dir
    kernels = engine.source.kernels
    del engine
    ports = {"mlx-lm": free_port(), "mlx-infer": free_port()}
    cmds = {"mlx-lm": [sys.executable, "-m", "mlx_lm", "server", "--model", mlx_dir, "--port", str(ports["mlx-lm"]),
                       "--log-level", "WARNING"],
            "mlx-infer": [sys.executable, "-m", "mlx_infer", "serve", "--model", mlx_dir, "--port", str(ports["mlx-infer"]),
                          "--kv-idle-release", str(args.kv_idle_release)]}
    systems = args.systems.split(",")
    procs = {s: start(s, cmds[s], ports[s]) for s in systems}
    prompts = all_prompts()
    rows, turns, soaked = [], {}, None
    try:
        for s in systems:  # warm-up
            asyncio.run(level(f"http://127.0.0.1:{ports[s]}", prompts, 1, 1, 8))
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            for s in (systems if i % 2 == 0 else systems[::-1]):
                row = asyncio.run(level(f"http://127.0.0.1:{ports[s]}", prompts, c, max(c, args.requests), args.max_tokens))
                rows.append({"system": s, **row})
                print(f"{s:<10} c={c:<3} {row['total_tps']:7.1f} tok/s  TTFT p50 {row['ttft_p50_s']:.2f} s "
                      f"p95 {row['ttft_p95_s']:.2f} s  ITL p50 {row['itl_p50_s'] * 1000:.0f} ms  failed {row['failed']}",
                      flush=True)
        for s in systems:
            turns[s] = asyncio.run(multi_turn(f"http://127.0.0.1:{ports[s]}", 16))
        if args.soak_seconds and "mlx-infer" in procs:
            soaked = asyncio.run(soak(f"http://127.0.0.1:{ports['mlx-infer']}", prompts, args.soak_seconds,
                                      args.max_tokens, procs["mlx-infer"].pid, args.kv_idle_release))
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=30)

    info = machine()
    print(f"\nmodel: {mlx_dir} (mlx-infer kernels: {kernels or 'MLX qmm'}); {args.max_tokens} tokens per request, greedy")
    print(machine_line(info))
    print(f"{'system':<10}{'c':>4}{'req':>5}{'fail':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'ITL p50':>9}{'ITL p95':>9}")
    for r in rows:
        print(f"{r['system']:<10}{r['concurrency']:>4}{r['requests']:>5}{r['failed']:>5}{r['total_tps']:>9.1f}"
              f"{r['ttft_p50_s']:>10.2f}{r['ttft_p95_s']:>10.2f}{r['itl_p50_s'] * 1000:>8.0f}m{r['itl_p95_s'] * 1000:>8.0f}m")
    for c in sorted({r["concurrency"] for r in rows}):
        by = {r["system"]: r for r in rows if r["concurrency"] == c}
        if len(by) == 2:
            print(f"c={c}: mlx-infer / mlx-lm total tokens/s {by['mlx-infer']['total_tps'] / by['mlx-lm']['total_tps']:.2f}x, "
                  f"p95 TTFT {by['mlx-infer']['ttft_p95_s']:.2f} s vs {by['mlx-lm']['ttft_p95_s']:.2f} s")
    for s, t in turns.items():
        print(f"{s}: next chat turn TTFT {t['next_ttft_s']:.2f} s vs first turn {t['first_ttft_s']:.2f} s ({t['ratio']:.2f}x)")
    if soaked:
        print(f"soak: {soaked['requests']} requests in {soaked['seconds']} s, {soaked['dropped']} dropped on purpose, "
              f"{soaked['failed']} failed; RSS {soaked['rss_start_bytes'] / 2**20:.0f} MiB before, "
              f"{soaked['rss_quarter_bytes'] / 2**20:.0f} MiB after a quarter, {soaked['rss_end_bytes'] / 2**20:.0f} MiB at the end, "
              f"{soaked['rss_released_bytes'] / 2**20:.0f} MiB after {soaked['idle_release_s']:g} s idle "
              f"({soaked['rss_released_bytes'] / soaked['rss_start_bytes'] - 1:+.1%} against before)")
    path = write_result("serve", {"machine": info, "model": mlx_dir, "kernels": kernels, "max_tokens": args.max_tokens,
                                  "rows": rows, "multi_turn": turns, "soak": soaked})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
