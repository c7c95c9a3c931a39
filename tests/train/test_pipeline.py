"""The whole `train-drafter` pipeline on a tiny GGUF target with a tokenizer (tests/gguf_factory.py):
prompts -> the target's own answers -> training -> published checkpoint -> held-out tau; resume; the
CLI's one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from mlx_infer.errors import MlxInferError
from mlx_infer.speculative.drafters.dflash import load_dflash
from mlx_infer.speculative.drafters.dspark import load_dspark
from mlx_infer.train import TrainSettings, train_drafter

PROMPTS = "\n\n".join([
    "the quick brown fox", "hello world, hello there", "the capital of france is paris",
    "one two three four five", "a tokenizer for the tests", "stop here and there",
])


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text(PROMPTS + "\n")
    return p


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_pipeline_and_resume(tmp_path, tiny_engine, data, kind):
    out = tmp_path / "drafter"
    s = TrainSettings(kind=kind, steps=6, block_size=3, seqs_per_step=2, anchors=4, markov_rank=8, top_k=8,
                      checkpoint_every=3)
    report = train_drafter(tiny_engine, data, out, s, max_response_tokens=16, heldout=1, tau_tokens=6)
    assert report.steps == 6 and report.heldout_sequences == 1 and report.resumed_from == 0
    assert report.heldout is not None and report.heldout["tau"] >= 1.0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "train_report.json").read_text())["steps"] == 6
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 6
    (load_dflash if kind == "dflash" else load_dspark)(out, tiny_engine.model)  # fits the target

    with pytest.raises(MlxInferError, match="--resume"):
        train_drafter(tiny_engine, data, out, s, max_response_tokens=16, heldout=1, tau_tokens=0)
    s.steps = 9
    again = train_drafter(tiny_engine, data, out, s, max_response_tokens=16, heldout=1, tau_tokens=0, resume=True)
    assert again.resumed_from == 6 and again.steps == 9 and again.heldout is None


def test_empty_and_missing_data(tmp_path, tiny_engine):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(MlxInferError, match="no prompt"):
        train_drafter(tiny_engine, empty, tmp_path / "o", TrainSettings(steps=1))
    with pytest.raises(MlxInferError, match="no data file"):
        train_drafter(tiny_engine, tmp_path / "absent.txt", tmp_path / "o", TrainSettings(steps=1))
    with pytest.raises(MlxInferError, match=r"tap layers \[99\] are outside"):  # before any answer is generated
        train_drafter(tiny_engine, empty, tmp_path / "o2", TrainSettings(steps=1, taps=[0, 99]))
    assert not (tmp_path / "o2").exists()


def cli(*args):
    from mlx_infer.cli.app import app

    return CliRunner().invoke(app, ["train-drafter", *map(str, args)])


@pytest.mark.parametrize("args,match", [
    (["--data", "{tmp}/absent.txt"], "no data file"),
    (["--data", "{data}", "--steps", "0"], "--steps must be >= 1"),
    (["--data", "{data}", "--kind", "dflash", "--block-size", "1"], "--block-size must be >= 2"),
    (["--data", "{data}", "--taps", "1,x"], "--taps"),
    (["--data", "{data}", "--lr", "0"], "--lr must be > 0"),
])
def test_cli_bad_input_exits_2(tmp_path, data, args, match):
    args = [a.format(tmp=tmp_path, data=data) for a in args]
    result = cli(*args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and match in lines[-1] and "Traceback" not in result.output


def test_cli_trains_on_the_tiny_model(tmp_path, tiny_llama, data):
    result = cli("--model", tiny_llama[0], "--data", data, "--out", tmp_path / "d", "--steps", "4",
                 "--block-size", "3", "--max-response-tokens", "12", "--heldout", "1", "--tau-tokens", "4",
                 "--seqs-per-step", "2", "--anchors", "2", "--save-dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    assert "drafter:" in result.output and "held-out tau" in result.output
    assert (tmp_path / "d" / "config.json").is_file()
    import mlx.core as mx

    saved = mx.load(str(tmp_path / "d" / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in saved.values())
