"""`mlx-infer bench --suite`: the decode suite on the default model against mlx-lm (tiny lengths, 1 trial),
its --json and --report files, and the flags' one-line errors. (bench without --suite: test_cli_kv.py,
test_cli_rmm.py, test_cli_help.py.)"""

import json

from cli_helpers import assert_user_error, cli_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_decode_suite_on_the_default_model(run_cli, default_gguf, tmp_path):
    report = tmp_path / "report"
    proc = run_cli("bench", "--suite", "decode", "-n", "4", "-t", "1", "--json", "--report", report)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"] == "default" and out["trials"] == 1 and out["max_tokens"] == 4
    rows = {r["system"]: r for r in out["suites"]["decode"]["rows"]}
    assert {"mlx-infer", "mlx-lm"} <= set(rows)
    ours, peer = rows["mlx-infer"], rows["mlx-lm"]
    assert ours["ratios"]["mlx-lm"]["decode_tps"] == ours["decode_tps"] / peer["decode_tps"]
    assert "bench decode" in proc.stderr  # the progress bar
    text = (report / "report.md").read_text()
    assert "## decode: " in text and "| mlx-infer |" in text and "vs mlx-lm" in text and "## Machine" in text
    assert "Command: `mlx-infer bench --suite decode" in text
    machine = json.loads((report / "machine.json").read_text())
    assert machine["backend"] and machine["mlx"] and machine["mlx_lm"] and machine["cores"] >= 1
    assert machine["kernels"].startswith(("quantized matmul", "CPU kernels off"))
    assert json.loads((report / "results.json").read_text())["suites"]["decode"]["rows"] == out["suites"]["decode"]["rows"]
    png = (report / "decode_by_context.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 1000


def test_suite_errors(run_cli):
    assert_user_error(run_cli("bench", "--suite", "decode,fast"), "unknown --suite fast")
    assert_user_error(run_cli("bench", "--report", "/tmp/x"), "--report writes the results of --suite")
    assert_user_error(run_cli("bench", "--suite", "prefill", "--lengths", "128,abc"), "--lengths takes comma-separated")
    assert_user_error(run_cli("bench", "--suite", "spec", "-c", "2"), "drop --concurrency")


def test_help_names_the_bench_extra_whole(run_cli):
    # rich reads "[bench]" as markup unless escaped: the hint must say what to install
    env = {**cli_env(), "COLUMNS": "300"}
    out = run_cli("bench", "--help", env=env).stdout
    assert "pip install 'mlx-infer[bench]'" in " ".join(out.split())
