"""`mlx-infer doctor`: backend, memory, cache, default model, BLAS (and its fix on Linux)."""

import json
import platform
import re

import mlx.core as mx
import pytest
from cli_helpers import cli_env


def test_doctor_table(run_cli):
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    for label in ("MLX", "backend", "device", "memory", "BLAS", "default model", "model cache"):
        assert label in proc.stdout, label
    assert mx.__version__ in proc.stdout


def test_doctor_json(run_cli, tmp_path):
    proc = run_cli("doctor", "--json", env=cli_env(MLX_INFER_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["mlx_version"] == mx.__version__
    assert info["backend"] in ("metal", "cuda", "cpu")
    assert info["total_memory_bytes"] > 2**28
    assert info["cache_dir"] == str(tmp_path / "cache")
    assert info["cache"] == []
    assert info["default_model"]["where"] in ("installed package", "cache") or \
        info["default_model"]["where"].startswith("not present")
    if platform.system() == "Linux":
        assert info["blas"] == "reference" or info["blas"].startswith("openblas")
    if info["backend"] == "cpu":  # the paged KV's and the layers' kernels run where the quantized-KV attention one does
        assert info["paged_kv_kernels"] == {"attention": info["attention_kernel"], "repack": info["attention_kernel"],
                                            "write": info["attention_kernel"]}
        assert info["layer_kernels"] == {"rms_norm": info["attention_kernel"], "rope": info["attention_kernel"],
                                         "swiglu": info["attention_kernel"], "geglu": info["attention_kernel"]}
        # one-token steps are compiled where the paged-attention kernel reads their KV storage
        assert info["compiled_steps"] == (info["attention_kernel"] != "reference")


def test_doctor_names_an_unknown_instruction_set(run_cli):
    """A typo in MLX_INFER_KERNEL_ISA: one warning line, doctor names the ignored value (the kernels run the
    best variant this CPU has: tests/kernels/test_cpu_qmm.py)."""
    proc = run_cli("doctor", "--json", env=cli_env(MLX_INFER_KERNEL_ISA="bogus"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    if info["backend"] != "cpu" or info["kernels_missing"]:
        pytest.skip("the CPU kernels do not run here")
    assert info["kernel_isa_unknown"] == "bogus" and info["int8_activation_bits"] == []
    warning = [line for line in proc.stderr.splitlines() if "MLX_INFER_KERNEL_ISA" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: MLX_INFER_KERNEL_ISA=bogus names no kernel variant")
    assert "avx512vnni" in warning[0]  # the choices


def test_doctor_offers_int8_activations_where_the_cpu_has_them(run_cli):
    """Where the CPU can run an int8-activation variant and none was asked for, doctor names the setting
    (the best one first); asked for, it says they are on."""
    info = json.loads(run_cli("doctor", "--json", env=cli_env(MLX_INFER_KERNEL_ISA="")).stdout)
    if info["backend"] != "cpu" or info["kernels_missing"]:
        pytest.skip("the CPU kernels do not run here")
    if platform.system() == "Linux" and platform.machine() == "x86_64":  # the CPU's flags, read independently
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
        avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
        assert ("avx512vnni" in info["int8_activation_variants"]) == (avx512 and "avx512_vnni" in flags)
        assert ("avx2int8" in info["int8_activation_variants"]) == ({"avx2", "fma"} <= flags)
    assert info["int8_activation_bits"] == []
    text = run_cli("doctor", env=cli_env(MLX_INFER_KERNEL_ISA="")).stdout
    if info["int8_activation_variants"]:
        words = " ".join(re.sub(r"[│┃┆|]", " ", text).split())  # the table's cells, borders and wraps removed
        assert f"MLX_INFER_KERNEL_ISA={info['int8_activation_variants'][0]}" in words
        best = info["int8_activation_variants"][0]
        on = json.loads(run_cli("doctor", "--json", env=cli_env(MLX_INFER_KERNEL_ISA=best)).stdout)
        assert on["int8_activation_bits"] and on["kernels"] == f"cpu-{best}"


def test_doctor_lists_cached_models(run_cli, tmp_path):
    cache = tmp_path / "cache"
    (cache / "gguf" / "tiny-0123").mkdir(parents=True)
    (cache / "gguf" / "tiny-0123" / "model.safetensors").write_bytes(b"\0" * 3000)
    info = json.loads(run_cli("doctor", "--json", env=cli_env(MLX_INFER_CACHE=str(cache))).stdout)
    assert info["cache"] == [{"path": "gguf/tiny-0123", "bytes": 3000}]


@pytest.mark.skipif(platform.system() != "Linux", reason="the reference-BLAS hint is for Linux")
def test_doctor_says_how_to_fix_the_reference_blas(run_cli):
    proc = run_cli("doctor", "--json", env=cli_env(MLX_INFER_BLAS="reference"))
    info = json.loads(proc.stdout)
    if info["backend"] != "cpu":
        pytest.skip("MLX runs on a GPU here")
    assert info["blas"] == "reference" and info["cpu_fast_path"] is False
    assert "MLX_INFER_BLAS=reference" in info["blas_fix"]
    table = run_cli("doctor", env=cli_env(MLX_INFER_BLAS="reference"))
    assert "reference (slow)" in table.stdout and "MLX_INFER_BLAS=reference" in table.stdout


@pytest.mark.skipif(platform.system() != "Linux", reason="the reference-BLAS hint is for Linux")
def test_doctor_hint_when_openblas_is_missing(run_cli):
    proc = run_cli("doctor", "--json", env=cli_env(MLX_INFER_OPENBLAS="/no/such/libopenblas.so"))
    info = json.loads(proc.stdout)
    if info["backend"] != "cpu":
        pytest.skip("MLX runs on a GPU here")
    assert info["blas"] == "reference"
    assert "apt-get install libopenblas0-pthread" in info["blas_fix"]
    assert "MLX_INFER_OPENBLAS=" in info["blas_fix"]
    table = run_cli("doctor", env=cli_env(MLX_INFER_OPENBLAS="/no/such/libopenblas.so"))
    assert "libopenblas0-pthread" in table.stdout


def test_doctor_lists_models_only_and_counts_measurements(run_cli, tmp_path):
    cache = tmp_path / "cache"
    model = cache / "gguf" / "tiny-0123"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 2000)
    (cache / "default").mkdir()
    (cache / "default" / "SmolLM2.gguf").write_bytes(b"\0" * 500)
    (cache / "gguf" / ".tiny-0123.abcd").mkdir()  # a conversion under way
    for kind, n in (("cost", 3), ("prior", 1)):
        (cache / kind).mkdir()
        for i in range(n):
            (cache / kind / f"{i:016x}.json").write_text('{"ms": [1.0]}')
    env = cli_env(MLX_INFER_CACHE=str(cache))
    info = json.loads(run_cli("doctor", "--json", env=env).stdout)
    assert info["cache"] == [{"path": "default/SmolLM2.gguf", "bytes": 500},
                             {"path": "gguf/tiny-0123", "bytes": 2002}]
    assert info["measurements"] == [{"kind": "cost", "files": 3, "bytes": 3 * 13},
                                    {"kind": "prior", "files": 1, "bytes": 13}]
    table = run_cli("doctor", env=env).stdout
    assert "cost/" not in table and "prior/" not in table
    assert "cost: 3 files, prior: 1 file" in table


def test_doctor_flags_a_cache_that_cannot_be_written(run_cli, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"  # under a regular file: cannot be created, even by root
    env = cli_env(MLX_INFER_CACHE=str(cache), MLX_INFER_KERNELS="off")  # no kernel build in a temporary folder
    info = json.loads(run_cli("doctor", "--json", env=env).stdout)
    assert info["cache_dir"] == str(cache)
    assert info["cache_unwritable"] == "Not a directory"
    table = run_cli("doctor", env=env)
    assert table.returncode == 0, table.stderr
    assert "not writable" in table.stdout and "MLX_INFER_CACHE" in table.stdout
    ok = json.loads(run_cli("doctor", "--json", env=cli_env(MLX_INFER_CACHE=str(tmp_path / "c"), MLX_INFER_KERNELS="off")).stdout)
    assert ok["cache_unwritable"] is None


def test_doctor_kernels_checks_every_kernel_on_the_default_model(run_cli, tmp_path):
    """`doctor --kernels --json`: one row per kernel on this device with its error against the reference
    (the CPU kernels: real, below the tolerance) and whether it runs; a second run reads the cached check."""
    env = cli_env(MLX_INFER_CACHE=str(tmp_path / "cache"))
    proc = run_cli("doctor", "--kernels", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["model"] == "default" and report["mlx_version"] == mx.__version__
    rows = {c["name"]: c for c in report["kernels"]}
    assert list(rows) == ["qmm", "quant_attention", "paged_attention", "rmm_qmm"]
    assert "checking mlx-infer's kernels" in proc.stderr
    assert list((tmp_path / "cache" / "kernel-checks").glob("*.json"))
    if report["device"].startswith("cpu ") and not report["device"].endswith(" reference"):
        for c in rows.values():  # the CPU kernels at the default model's shapes (float16 scales)
            assert c["device"] == report["device"] and c["used"] and c["passed"], c
            assert 0 < c["max_error"] < c["tolerance"] == 1e-2, c
            assert c["time_s"] > 0 and c["mlx_time_s"] > 0
        assert rows["qmm"]["cases"] == 5 * 16  # its five quantized shapes (the tied lm_head too), rows 1..16
    again = run_cli("doctor", "--kernels", env=env)  # the table, from the cache
    assert again.returncode == 0, again.stderr
    assert "checking mlx-infer's kernels" not in again.stderr
    for text in ("quantized matmul", "quantized-KV attention", "paged attention", "RMM gathered product",
                 "max error", "MLX's time"):
        assert text in again.stdout, text
