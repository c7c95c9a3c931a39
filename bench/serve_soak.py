"""Serving soak: N clients (default 16) against one `mlx-infer serve` subprocess for T minutes (default 10),
spread over the generating APIs the server has (chat and completions; /v1/responses and /v1/messages when
their routes answer) and the models GET /v1/models lists, half of the requests streamed; a fifth of the
streamed ones drop the connection after a few text events (deliberate disconnects).

Measured: requests made, dropped on purpose, failed (any other request that did not end well: a status other
than 200, an error event in a stream, a stream that stops before its last event ([DONE], message_stop,
response.completed), a transport error), p50 / p95 TTFT of the
streamed requests (request sent -> first text event, on the client), the server process' RSS (VmRSS) at the
start (a fresh server after one warm-up request per API and its --kv-idle-release), while busy (the most of
samples every 5 s), and after idle (the soak over, the server idle past --kv-idle-release); and the round trip
of GET /metrics while the server reports at least N running requests, beside GET /health's at the same
moments (the HTTP and event-loop share of the scrape's time on a busy machine); and one exposition's time in
the bench's own process over a pool of N running requests (the scrape's own cost, without HTTP or a decode
thread competing for the interpreter).

With --swap-every S, every client asks for one model at a time, the next of /v1/models' list every S seconds
(with --serve-arg=--max-loaded-models --serve-arg=1 the server unloads one model and loads the next at each
swap); the models' loads and unloads are read from /metrics at the end.

Usage: python bench/serve_soak.py [--clients 16] [--minutes 10] [--max-tokens 48] [--kv-idle-release 10]
                                  [--swap-every SECONDS] [--serve-arg=--model --serve-arg=PATH ...]
Prints a summary and writes bench/results/serve-soak-*.json.
"""

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mlx_infer.generation.results import GenerationStats, GenerationStep
from mlx_infer.server.metrics import Metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import all_prompts, machine, machine_line, write_result  # noqa: E402
from serve import free_port, rss_bytes, start  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: Route of each API and the chance a request is streamed.
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "messages": "/v1/messages"}
#: Share of streamed requests that drop the connection after a few text events.
DROP_SHARE = 0.2
#: Seconds between two RSS samples while busy, and between two scrapes of /metrics.
SAMPLE_S = 5.0
SCRAPE_S = 0.5


def body(api: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """A request of `api` asking `prompt` (greedy, max_tokens)."""
    if api == "chat":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}
    if api == "completions":
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "responses":
        return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "temperature": 0, "stream": stream}
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def event_text(api: str, data: dict) -> str:
    """The text a streamed event of `api` carries ("" for none)."""
    if api == "chat":
        return "".join((c.get("delta") or {}).get("content") or "" for c in data.get("choices") or [])
    if api == "completions":
        return "".join(c.get("text") or "" for c in data.get("choices") or [])
    if api == "responses":
        return data.get("delta", "") if data.get("type") == "response.output_text.delta" else ""
    delta = data.get("delta") or {}
    return delta.get("text", "") if data.get("type") == "content_block_delta" else ""


def event_failed(data: dict) -> bool:
    """Whether a streamed event reports an error (OpenAI's error object, Anthropic's and Responses' events)."""
    return data.get("type") in ("error", "response.failed") or ("error" in data and "type" not in data)


async def one(client, url: str, api: str, model: str, prompt: str, max_tokens: int, stream: bool,
              drop_after) -> dict:
    """One request: {"api", "ok", "dropped", "ttft_s" (streamed and ok), "status", "error"}."""
    headers = {"anthropic-version": "2023-06-01"} if api == "messages" else {}
    payload = body(api, model, prompt, max_tokens, stream)
    began = time.perf_counter()
    row = {"api": api, "model": model, "stream": stream, "ok": False, "dropped": False}
    try:
        if not stream:
            r = await client.post(url + ROUTES[api], json=payload, headers=headers)
            row.update(ok=r.status_code == 200, status=r.status_code)
            if r.status_code != 200:
                row["error"] = r.text[:300]
            return row
        async with client.stream("POST", url + ROUTES[api], json=payload, headers=headers) as r:
            row["status"] = r.status_code
            if r.status_code != 200:
                row["error"] = (await r.aread()).decode()[:300]
                return row
            events, ended = 0, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    ended = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if event_failed(data):
                    row["error"] = line[:300]
                    return row
                ended = ended or data.get("type") in ("message_stop", "response.completed", "response.incomplete")
                if event_text(api, data):
                    events += 1
                    if events == 1:
                        row["ttft_s"] = time.perf_counter() - began
                    if drop_after is not None and events >= drop_after:
                        row.update(ok=True, dropped=True)
                        return row
            row["ok"] = ended
            if not ended:
                row["error"] = "a stream that ended without its last event"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        row["error"] = f"{type(e).__name__}: {e}"
    return row


async def apis_present(client, url: str) -> list:
    """The generating APIs whose routes answer (an empty body gets a 400, a missing route a 404)."""
    found = []
    for api, route in ROUTES.items():
        r = await client.post(url + route, json={})
        if r.status_code != 404 or "no route" not in r.text:
            found.append(api)
    return found


def running_requests(text: str) -> float:
    """mlx_infer_requests_running summed over the models, from a /metrics text."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "mlx_infer_requests_running")


async def scraper(client, url: str, busy_from: int, until: float, out: dict) -> None:
    """Scrape /metrics (and GET /health at once after) every SCRAPE_S until `until`; keep the round trips of
    the scrapes that saw at least `busy_from` running requests."""
    while time.monotonic() < until:
        t0 = time.perf_counter()
        r = await client.get(url + "/metrics")
        t1 = time.perf_counter()
        await client.get(url + "/health")
        t2 = time.perf_counter()
        out["scrapes"] += 1
        if r.status_code == 200 and running_requests(r.text) >= busy_from:
            out["metrics_s"].append(t1 - t0)
            out["health_s"].append(t2 - t1)
        await asyncio.sleep(SCRAPE_S)


def exposition_cost(running: int, apis: list, models: list, trials: int = 200) -> dict:
    """Seconds one /metrics exposition takes in this process (no HTTP, no decode thread beside it): a Metrics
    whose series the soak's APIs and models filled, over a pool whose scheduler has `running` requests."""
    metrics = Metrics()
    for api in apis:
        for model in models:
            for status in ("200", "400", "499"):
                metrics.requests.labels(api, model, status).inc()
            track = metrics.track(api, model)
            for token in range(8):
                track.step(GenerationStep("x", token))
            track.step(GenerationStep("", None, "length", GenerationStats(prompt_tokens=30, generated_tokens=8)))
    kv = SimpleNamespace(pool=SimpleNamespace(blocks_in_use=400, free_blocks=None, capacity=512), prefix=[0] * 64)
    scheduler = SimpleNamespace(waiting=[], running=[object()] * running, kv=kv)
    pool = SimpleNamespace(loaded=lambda: [SimpleNamespace(id=m, runner=SimpleNamespace(scheduler=scheduler))
                                           for m in models])
    metrics.watch(pool, in_flight=lambda: running)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        metrics.exposition()
        times.append(time.perf_counter() - t0)
    return {"p50_s": pct(times, 0.5), "p95_s": pct(times, 0.95), "bytes": len(metrics.exposition())}


def model_counts(text: str) -> dict:
    """{model: {"loads": n, "unloads": n}} from a /metrics text (model_loads_total, model_unloads_total)."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for kind in ("loads", "unloads"):
                if sample.name == f"mlx_infer_model_{kind}_total":
                    out.setdefault(sample.labels["model"], {"loads": 0, "unloads": 0})[kind] = int(sample.value)
    return out


def active_bytes(text: str) -> float:
    """MLX's active bytes (arrays alive: weights, KV blocks) from a /metrics text."""
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "mlx_infer_memory_active_bytes")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def soak(url: str, pid: int, args) -> dict:
    prompts, rng = all_prompts(), random.Random(0)
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        apis = await apis_present(client, url)
        models = [m["id"] for m in (await client.get(url + "/v1/models")).json()["data"]]
        for api in apis:  # warm-up: every API once, then idle past the KV release
            await one(client, url, api, models[0], prompts[0], 8, True, None)
        await asyncio.sleep(args.kv_idle_release + 3)
        rss_start = rss_bytes(pid)
        active_start = active_bytes((await client.get(url + "/metrics")).text)
        began = time.monotonic()
        until = began + args.minutes * 60
        rows, busy, scrapes = [], [], {"scrapes": 0, "metrics_s": [], "health_s": []}

        def pick_model() -> str:
            if args.swap_every:
                return models[int((time.monotonic() - began) / args.swap_every) % len(models)]
            return rng.choice(models)

        async def client_loop(c):
            while time.monotonic() < until:
                stream = rng.random() < 0.5
                drop = rng.randint(2, 6) if stream and rng.random() < DROP_SHARE else None
                rows.append(await one(client, url, rng.choice(apis), pick_model(), rng.choice(prompts),
                                      args.max_tokens, stream, drop))

        async def sampler():
            while time.monotonic() < until:
                busy.append(rss_bytes(pid))
                await asyncio.sleep(SAMPLE_S)

        await asyncio.gather(*(client_loop(c) for c in range(args.clients)), sampler(),
                             scraper(client, url, args.clients, until, scrapes))
        wall = time.monotonic() - began
        await asyncio.sleep(args.kv_idle_release + 3)
        rss_idle = rss_bytes(pid)
        scraped = (await client.get(url + "/metrics")).text
        swaps, active_idle = model_counts(scraped), active_bytes(scraped)
    failed = [r for r in rows if not r["ok"]]
    ttft = [r["ttft_s"] for r in rows if r.get("ttft_s") is not None]
    return {"apis": apis, "models": models, "clients": args.clients, "minutes": args.minutes, "wall_s": wall,
            "max_tokens": args.max_tokens, "requests": len(rows), "streamed": sum(r["stream"] for r in rows),
            "dropped": sum(r["dropped"] for r in rows), "failed": len(failed),
            "failures": [{k: r.get(k) for k in ("api", "status", "error")} for r in failed[:20]],
            "by_api": {a: sum(r["api"] == a for r in rows) for a in apis},
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "rss_start_bytes": rss_start, "rss_busy_max_bytes": max(busy, default=0), "rss_idle_bytes": rss_idle,
            "mlx_active_start_bytes": active_start, "mlx_active_idle_bytes": active_idle,
            "kv_idle_release_s": args.kv_idle_release, "swap_every_s": args.swap_every, "model_loads": swaps,
            "scrapes": scrapes["scrapes"], "scrapes_busy": len(scrapes["metrics_s"]),
            "metrics_p50_s": pct(scrapes["metrics_s"], 0.5), "metrics_p95_s": pct(scrapes["metrics_s"], 0.95),
            "health_p50_s": pct(scrapes["health_s"], 0.5), "health_p95_s": pct(scrapes["health_s"], 0.95),
            "metrics_median_minus_health_s": (statistics.median(scrapes["metrics_s"]) -
                                              statistics.median(scrapes["health_s"])) if scrapes["metrics_s"] else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-idle-release", type=float, default=10.0, help="the server's --kv-idle-release, seconds")
    ap.add_argument("--swap-every", type=float, default=None, metavar="SECONDS",
                    help="every client asks for the next model every SECONDS (default: a random model per request)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an argument passed on to mlx-infer serve")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_infer", "serve", "--port", str(port), "--max-batch", str(args.clients),
           "--kv-idle-release", str(args.kv_idle_release), "--no-access-log", *args.serve_arg]
    proc = start("mlx-infer serve", cmd, port)
    try:
        got = asyncio.run(soak(f"http://127.0.0.1:{port}", proc.pid, args))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    got["exposition"] = exposition_cost(args.clients, got["apis"], got["models"])
    info = machine()
    mib = 2 ** 20
    print(machine_line(info))
    print(f"commit {commit}; {' '.join(cmd[1:])}")
    print(f"{got['clients']} clients for {got['wall_s'] / 60:.1f} min over {', '.join(got['apis'])} "
          f"({', '.join(f'{a} {n}' for a, n in got['by_api'].items())}), models {', '.join(got['models'])}, "
          f"{got['max_tokens']} tokens at most")
    print(f"requests {got['requests']} ({got['streamed']} streamed), dropped on purpose {got['dropped']}, "
          f"failed {got['failed']}")
    for f in got["failures"]:
        print(f"  failed: {f}")
    print("model loads / unloads: " + ", ".join(f"{m} {c['loads']} / {c['unloads']}" for m, c in got["model_loads"].items()))
    print(f"TTFT p50 {got['ttft_p50_s']:.2f} s, p95 {got['ttft_p95_s']:.2f} s (streamed requests, client side)")
    print(f"RSS {got['rss_start_bytes'] / mib:.0f} MiB at the start, {got['rss_busy_max_bytes'] / mib:.0f} MiB busy "
          f"(most), {got['rss_idle_bytes'] / mib:.0f} MiB after {got['kv_idle_release_s']:g} s idle "
          f"({got['rss_idle_bytes'] / got['rss_start_bytes'] - 1:+.1%} against the start); MLX active "
          f"{got['mlx_active_start_bytes'] / mib:.0f} MiB at the start, {got['mlx_active_idle_bytes'] / mib:.0f} MiB idle")
    print(f"GET /metrics at >= {got['clients']} running: {got['scrapes_busy']} of {got['scrapes']} scrapes, "
          f"round trip p50 {got['metrics_p50_s'] * 1000:.1f} ms, p95 {got['metrics_p95_s'] * 1000:.1f} ms; "
          f"GET /health then p50 {got['health_p50_s'] * 1000:.1f} ms, p95 {got['health_p95_s'] * 1000:.1f} ms")
    print(f"one exposition in process ({got['clients']} running, {got['exposition']['bytes']} bytes): "
          f"p50 {got['exposition']['p50_s'] * 1000:.2f} ms, p95 {got['exposition']['p95_s'] * 1000:.2f} ms")
    path = write_result("serve-soak", {"machine": info, "commit": commit, "command": cmd[1:], **got})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
