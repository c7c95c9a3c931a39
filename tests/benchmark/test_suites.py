"""mlx_infer.benchmark: every suite on a tiny model against mlx-lm on the same weights (rows, ratios computed
from the rows' own values, KV bytes against the cache's layout, greedy speculative output equal to plain),
the shipped prompts, the report's files, and llama.cpp found through a `llama-bench` on PATH. No timing is
asserted: only that the measurements are there, positive and consistent."""

import json
import os
import stat
from pathlib import Path

import pytest

import mlx_infer
from gguf_factory import tiny_gguf
from mlx_infer.benchmark import peers, prompts
from mlx_infer.benchmark.defaults import SUITES
from mlx_infer.benchmark.report import write_report
from mlx_infer.benchmark.options import BenchOptions, parse_suites
from mlx_infer.benchmark.suites import run_suites
from mlx_infer.errors import MlxInferError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: The tiny model's shape: head dim 32, so that mlx-lm quantizes its KV (group size 32).
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
OPTIONS = BenchOptions(trials=1, max_tokens=4, lengths=(16, 64, 4096), contexts=(32,), batch_sizes=(1, 3),
                       kv_context=48, prompts_per_set=1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", "llama", hidden=LAYERS * 64,
                           heads=4, kv_heads=KV_HEADS, layers=LAYERS)
    return mlx_infer.load(str(path))


@pytest.fixture(scope="module")
def results(engine):
    seen = []
    out = run_suites(engine, list(SUITES), OPTIONS, on_run=lambda s, done, total: seen.append((s, done, total)))
    out["progress"] = seen
    return out


def by_system(suite: dict, case: str) -> dict:
    return {r["system"]: r for r in suite["rows"] if r["case"] == case}


def check_ratios(suite: dict) -> None:
    """Every mlx-infer row's ratio equals its value over the peer's (the peer's over its own for seconds)."""
    for row in suite["rows"]:
        if not row["system"].startswith("mlx-infer"):
            assert "ratios" not in row
            continue
        peer_rows = {r["system"]: r for r in suite["rows"] if r["case"] == row["case"] and "ratios" not in r}
        assert set(row["ratios"]) == set(peer_rows) and peer_rows
        for peer, ratios in row["ratios"].items():
            for metric, value in ratios.items():
                ours, theirs = row[metric], peer_rows[peer][metric]
                want = theirs / ours if metric.endswith("_s") else ours / theirs
                assert value == pytest.approx(want) and value > 0


def test_every_suite_runs_with_progress(results):
    assert list(results["suites"]) == list(SUITES)
    for name, suite in results["suites"].items():
        assert suite["rows"], name
        check_ratios(suite)
        ticks = [(d, t) for s, d, t in results["progress"] if s == name]
        assert ticks[0][0] == 0 and ticks[-1][0] == ticks[-1][1] > 0
        assert [d for d, _ in ticks] == list(range(ticks[-1][1] + 1))


def test_decode_suite(results):
    suite = results["suites"]["decode"]
    rows = by_system(suite, suite["rows"][0]["case"])
    assert set(rows) == {"mlx-infer", "mlx-lm"} | ({"llama.cpp"} if "llama.cpp" in rows else set())
    for r in rows.values():
        assert r["decode_tps"] > 0 and r["ttft_s"] > 0 and 1 <= r["tokens"] <= OPTIONS.max_tokens
    assert any(n.startswith("llama.cpp: ") for n in suite["notes"])


def test_prefill_and_long_fit_the_context(results, engine):
    prefill = results["suites"]["prefill"]
    assert sorted({r["context"] for r in prefill["rows"]}) == [16, 64]  # 4096 passes the tiny model's 512
    assert any("4096" in n and str(engine.context_length) in n for n in prefill["notes"])
    for r in prefill["rows"]:
        assert r["prefill_tps"] == pytest.approx(r["context"] / r["ttft_s"])
    assert {r["context"] for r in results["suites"]["long"]["rows"]} == {32}


def test_long_prompt_has_the_exact_length(engine):
    enc = lambda text: engine.encode(text, chat_template=False)  # noqa: E731
    tail = enc(prompts.LONG_TAIL)
    for n in (1, 5, 64, 300):
        ids = prompts.long_ids(enc, tail, n)
        assert len(ids) == n
        assert ids[-len(tail):] == tail or 2 * len(tail) > n


def test_spec_suite(results):
    suite = results["suites"]["spec"]
    assert {r["prompt_set"] for r in suite["rows"]} == set(prompts.PROMPT_SETS)
    for name in prompts.PROMPT_SETS:
        rows = by_system(suite, name)
        assert set(rows) == {"mlx-infer off", "mlx-infer lookup", "mlx-infer auto", "mlx-lm"}
        assert rows["mlx-infer off"]["speedup"] == 1.0
        for mode in ("off", "lookup", "auto"):
            r = rows[f"mlx-infer {mode}"]
            assert r["identical"] is True  # greedy speculative decoding is lossless
            assert r["speedup"] == pytest.approx(r["tps"] / rows["mlx-infer off"]["tps"])
            assert all(0.0 <= a <= 1.0 for a in r["acceptance"]) and r["tau"] >= 1.0
    widths = sorted(int(w) for w in suite["cost_curve"]["seconds"])
    assert widths[0] == 1 and widths[-1] >= 2
    assert all(s > 0 for s in suite["cost_curve"]["seconds"].values())


def test_batch_suite(results):
    suite = results["suites"]["batch"]
    assert sorted({r["requests"] for r in suite["rows"]}) == [1, 3]
    for r in suite["rows"]:
        assert r["total_tps"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert 1 <= r["tokens"] <= r["requests"] * OPTIONS.max_tokens


def test_kv_suite_bytes(results, engine):
    """KV bytes per token against the layout: float32 K and V, and 8 / 4 bits with a float32 scale and bias
    per group of 32 values (mlx-lm's QuantizedKVCache); mlx-infer's quantized cache is no larger."""
    suite = results["suites"]["kv"]
    values = LAYERS * 2 * KV_HEADS * HEAD_DIM  # K and V, every layer
    groups = values // 32
    want = {None: values * 4, 8: values + groups * 8, 4: values // 2 + groups * 8}
    for bits, case in ((None, "float KV"), (8, "8-bit KV"), (4, "4-bit KV")):
        rows = by_system(suite, case)
        assert rows["mlx-lm"]["kv_bytes_per_token"] == want[bits]
        assert rows["mlx-infer"]["kv_bytes_per_token"] <= want[bits]
        assert rows["mlx-infer"]["decode_tps"] > 0
    assert by_system(suite, "float KV")["mlx-infer"]["kv_bytes_per_token"] == want[None]
    assert engine.kv_bits is None  # the engine's KV setting is back as it was


def test_kv_suite_leaves_out_what_the_model_cannot_quantize(tiny_engine):
    """Head dim 16: neither mlx-infer's quantized KV nor mlx-lm's holds it; the 4-bit case is left out with the
    reason, the float one runs."""
    out = run_suites(tiny_engine, ["kv"], BenchOptions(trials=1, max_tokens=2, kv_bits=(None, 4), kv_context=16))
    suite = out["suites"]["kv"]
    assert {r["case"] for r in suite["rows"]} == {"float KV"}
    assert set(by_system(suite, "float KV")) == {"mlx-infer", "mlx-lm"}
    assert any(n.startswith("4-bit KV left out: quantized KV needs a key head dim") for n in suite["notes"])


def test_report_files(results, tmp_path):
    from mlx_infer.benchmark.machine import describe
    from mlx_infer.benchmark.plots import write_plots

    machine = dict(describe(), kernels="quantized matmul cpu-avx2")
    files = write_report(tmp_path, results, machine, "mlx-infer bench --suite all", write_plots)
    text = (tmp_path / "report.md").read_text()
    for name in SUITES:
        assert f"\n## {name}: " in text
    assert "| case | system |" in text and "vs mlx-lm" in text
    assert f"- CPU / chip: {machine['cpu']}" in text and f"- MLX: {machine['mlx']}" in text
    assert "- kernels: quantized matmul cpu-avx2" in text
    saved = json.loads((tmp_path / "results.json").read_text())
    decode = saved["suites"]["decode"]["rows"][0]
    assert decode["system"] == "mlx-infer" and decode["ratios"]["mlx-lm"]["decode_tps"] > 0
    assert saved["machine"]["cores"] == os.cpu_count()
    assert json.loads((tmp_path / "machine.json").read_text()) == machine
    pngs = sorted(p.name for p in files if p.suffix == ".png")
    assert pngs == ["decode_by_context.png", "spec_speedup.png", "verify_cost.png"]
    for name in pngs:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000
        assert f"]({name})" in text


def test_report_without_matplotlib_says_why(results, tmp_path):
    write_report(tmp_path, results, {"cpu": "x"}, "cmd", None, "matplotlib is not installed")
    assert "Plots skipped: matplotlib is not installed." in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob("*.png"))


def test_parse_suites():
    assert parse_suites("all") == list(SUITES)
    assert parse_suites("Decode, spec,decode") == ["decode", "spec"]
    with pytest.raises(MlxInferError, match="unknown --suite bogus: use a comma-separated list of decode, prefill"):
        parse_suites("decode,bogus")


def test_prompts_are_shipped():
    sets = prompts.prompt_sets()
    assert list(sets) == list(prompts.PROMPT_SETS) and all(len(p) >= 2 for p in sets.values())
    toml = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"mlx_infer.benchmark" = ["prompts.jsonl"]' in toml


def test_llama_bench_on_path(tmp_path, monkeypatch):
    """Without llama-cpp-python, a `llama-bench` on PATH is the llama.cpp peer: its JSON rates become the
    decode tokens/s and the TTFT of the prompt."""
    script = tmp_path / "llama-bench"
    script.write_text("#!/bin/sh\necho '[{\"n_prompt\": 100, \"n_gen\": 0, \"avg_ts\": 400.0},"
                      " {\"n_prompt\": 0, \"n_gen\": 8, \"avg_ts\": 50.0}]'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(peers, "llama_cpp", None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    run, what = peers.llama_cpp_runner(tmp_path / "m.gguf", list(range(100)), 8)
    assert what == f"llama-bench ({script})"
    out = run()
    assert out["decode_tps"] == 50.0 and out["ttft_s"] == pytest.approx(0.25) and out["tokens"] == 8
    monkeypatch.setenv("PATH", "/nonexistent")
    assert peers.llama_cpp_runner(tmp_path / "m.gguf", [1], 8) == (
        None, "not found (pip install llama-cpp-python, or put llama-bench on PATH)")
