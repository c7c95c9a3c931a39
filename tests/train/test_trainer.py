"""Trainer smoke tests on a tiny random target (CPU, seconds): the loss falls and the drafter's greedy
acceptance on held-out sequences rises; the saved drafter loads with the existing loaders and decodes
losslessly; checkpoints resume to the same weights as an uninterrupted run."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_infer.errors import MlxInferError
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import SpecStats, speculative_tokens
from mlx_infer.speculative.drafters.dflash import DFlashDrafter, load_dflash_model
from mlx_infer.speculative.drafters.dspark import DSparkDrafter, load_dspark_model
from mlx_infer.speculative.target import embedding
from mlx_infer.train.features import all_features
from mlx_infer.train.state import latest_checkpoint
from mlx_infer.train.trainer import Trainer, TrainSettings


def settings(kind, **kw):
    base = dict(kind=kind, steps=200, lr=3e-3, block_size=4, layers=1, seqs_per_step=8, anchors=8, markov_rank=16,
                top_k=16, checkpoint_every=0, seed=0)
    base.update(kw)
    return TrainSettings(**base)


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_loss_falls_and_acceptance_rises(tmp_path, target, train_seqs, held_seqs, kind):
    trainer = Trainer(target, train_seqs, settings(kind))
    held = all_features(target, trainer.model.target_layer_ids, held_seqs, 16 if kind == "dspark" else 0)
    before = trainer.evaluate(held)
    log = trainer.run()
    after = trainer.evaluate(held)
    losses = [r["loss"] for r in log]
    assert len(log) == 200 and all(r["tokens_per_s"] > 0 for r in log)
    assert mean(losses[-20:]) < 0.8 * mean(losses[:20]), (losses[:20], losses[-20:])
    assert before["acceptance"] < 0.1 and after["acceptance"] > 0.3, (before, after)
    assert after["tau_tf"] > 1.6

    # the published format, read back by the existing loaders, drafts losslessly with some acceptance
    trainer.save(tmp_path)
    if kind == "dflash":
        model = load_dflash_model(tmp_path)
        drafter = lambda: DFlashDrafter(model, target)  # noqa: E731
    else:
        model = load_dspark_model(tmp_path)
        assert mx.array_equal(model.embed_tokens.weight, embedding(target).weight).item()  # frozen copy
        drafter = lambda: DSparkDrafter(model, target)  # noqa: E731
    for name, value in tree_flatten(trainer.model.parameters()):
        assert mx.array_equal(dict(tree_flatten(model.parameters()))[name], value).item(), name
    committed = rounds = 0
    for s in held_seqs[:4]:
        prompt = s.tokens[: s.start]
        stats = SpecStats()
        out = list(speculative_tokens(target, prompt, SamplingParams(), 24, drafter(), model.block_size, stats))
        assert out == list(plain_tokens(target, prompt, SamplingParams(), 24))
        committed, rounds = committed + stats.committed, rounds + stats.rounds
    assert committed / rounds > 1.3  # tau: more than one token per target forward


def test_resume_continues_exactly(tmp_path, target, train_seqs):
    s = settings("dflash", steps=24, checkpoint_every=8)
    whole = Trainer(target, train_seqs, s, out_dir=tmp_path / "whole")
    whole.run()

    first = Trainer(target, train_seqs, s, out_dir=tmp_path / "split")
    for _ in range(12):  # "crash" after step 12: the last checkpoint is step 8
        first.train_step()
        first.log.append({"step": first.step, "loss": 0.0, "tokens_per_s": 0.0})
        if first.step % 8 == 0:
            first.checkpoint()
    second = Trainer(target, train_seqs, s, out_dir=tmp_path / "split")
    assert second.resume() and second.step == 8
    assert second.optimizer.state["step"].item() == 8
    log = second.run()
    assert second.step == 24 and [r["step"] for r in log] == list(range(1, 25))
    a, b = dict(tree_flatten(whole.model.parameters())), dict(tree_flatten(second.model.parameters()))
    for k in a:
        assert mx.allclose(a[k], b[k], atol=1e-6).item(), k
    ckpt = latest_checkpoint(tmp_path / "split")
    assert ckpt.name == "step-0000024"
    assert json.loads((ckpt.parent / "latest.json").read_text())["step"] == 24
    assert not list(ckpt.parent.glob(".tmp-*"))


def test_resume_refuses_other_settings(tmp_path, target, train_seqs):
    Trainer(target, train_seqs, settings("dflash", steps=2), out_dir=tmp_path).run()
    other = Trainer(target, train_seqs, settings("dflash", steps=2, block_size=5), out_dir=tmp_path)
    with pytest.raises(MlxInferError, match="block_size"):
        other.resume()


def test_no_usable_sequence(target, train_seqs):
    short = [type(s)(s.tokens[: s.start + 2], s.start) for s in train_seqs[:3]]
    with pytest.raises(MlxInferError, match="long enough"):
        Trainer(target, short, settings("dflash"))

