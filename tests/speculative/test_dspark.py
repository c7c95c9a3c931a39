"""DSpark drafter (DeepSpec): DeepSpec-format round trip, malformed checkpoints, the confidence-scheduled
verify length (Algorithm 1 with the early break; threshold), and losslessness with every schedule."""

import json
import random

import mlx.core as mx
import pytest
from block_drafters import random_dflash, random_dspark
from distribution import check_lossless, cycle_scenario

from mlx_infer.errors import MlxInferError
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import MODES, SpecOptions, SpecState, SpecStats, speculative_tokens
from mlx_infer.speculative.confidence import ConfidenceSchedule, verify_length
from mlx_infer.speculative.drafters.dflash import DFlashDrafter, save_dflash_model
from mlx_infer.speculative.drafters.dspark import DSparkDrafter, load_dspark, load_dspark_model, save_dspark_model
from mlx_infer.speculative.schedule import CostCurve

#: verify cost: width 2 costs 1.5x a plain step, wider ones barely more (Algorithm 1 then keeps long prefixes
#: only while the survival stays high).
CURVE = CostCurve({1: 1.0, 2: 1.5, 3: 1.55, 4: 1.6, 5: 1.65})


def test_verify_length_early_break():
    # position 1 does not pay (1.3 / 1.5 < 1): stop, although verifying 5 would (2.5 / 1.65 > 1)
    assert verify_length([0.3, 1, 1, 1, 1], CURVE) == 0
    assert verify_length([0.9, 0.9, 0.9, 0.1], CURVE) == 3
    assert verify_length([1.0] * 4, CostCurve({1: 1.0, 2: 1.0})) == 4
    assert verify_length([0.9, 0.8, 0.5], threshold=0.5) == 2  # survival 0.9, 0.72, 0.36
    assert verify_length([0.2, 0.1]) == 2  # no rule: keep all
    assert ConfidenceSchedule(threshold=0.95)([0.9]) == 0


@pytest.mark.parametrize("confidence,with_markov", [(True, True), (True, False), (False, True)])
def test_round_trip(tmp_path, target, confidence, with_markov):
    model = random_dspark(seed=4, block=5, confidence=confidence, with_markov=with_markov)
    model._base_config = {"model_type": "llama", "hidden_act": "silu", "layer_types": ["full_attention"] * 9}
    save_dspark_model(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 5 and cfg["hidden_act"] == "silu"
    assert cfg["markov_rank"] == 8 and cfg["enable_confidence_head"] == confidence and cfg["layer_types"] == ["full_attention"] * 2
    names = set(mx.load(str(tmp_path / "model.safetensors")))
    assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "fc.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert ({"confidence_head.proj.weight", "confidence_head.proj.bias"} <= names) == confidence
    loaded = load_dspark_model(tmp_path)
    feats = mx.random.normal((1, 7, 64), key=mx.random.key(1))
    context = list(range(8))
    logits, drafts = [], []
    for m in (model, loaded):
        d = DSparkDrafter(m, target)
        d.begin(context, SamplingParams(), hidden=feats)
        logits.append(d.logits(d.block_hidden(context)))
        d.begin(context, SamplingParams(), hidden=feats)
        drafts.append((d.propose(context, 5).tokens, d.last_confidence))
    assert mx.array_equal(logits[0], logits[1]).item()
    assert drafts[0] == drafts[1]


def _saved(tmp_path, **kw):
    save_dspark_model(random_dspark(seed=4, **kw), tmp_path)
    return tmp_path


@pytest.mark.parametrize("edit,match", [
    (lambda w, c: w.pop("markov_head.markov_w1.weight"), "missing tensor.*markov_w1"),
    (lambda w, c: w.update({"confidence_head.proj.weight": mx.zeros((1, 32))}), "confidence_head.proj.weight has shape"),
    (lambda w, c: c.update(markov_head_type="gated"), "markov_head_type"),
    (lambda w, c: c.pop("mask_token_id"), "mask_token_id"),
    (lambda w, c: c.update(architectures=["LlamaForCausalLM"]), "not one of"),
])
def test_malformed_checkpoint(tmp_path, edit, match):
    path = _saved(tmp_path)
    w = dict(mx.load(str(path / "model.safetensors")))
    cfg = json.loads((path / "config.json").read_text())
    edit(w, cfg)
    mx.save_safetensors(str(path / "model.safetensors"), w)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MlxInferError, match=match):
        load_dspark_model(path)


def test_mismatched_target(tmp_path, target, make_tiny):
    with pytest.raises(MlxInferError, match="num_target_layers 4"):
        load_dspark(_saved(tmp_path, target_layers=4, ids=(1, 3)), target)
    with pytest.raises(MlxInferError, match="hidden size 32"):
        DSparkDrafter(random_dspark(seed=4), make_tiny(hidden=16))


SCHEDULES = {"all": None, "threshold": ConfidenceSchedule(threshold=0.3), "cost": ConfidenceSchedule(curve=CURVE)}


@pytest.mark.parametrize("vocab", [64, 8])
def test_greedy_identical(make_tiny, vocab):
    target = make_tiny(seed=1, vocab=vocab, scale=3.0)
    ps = []
    for k in range(14):
        r = random.Random(100 + k)
        ps.append([r.randrange(vocab) for _ in range(r.randrange(1, 20))])
    bases = [list(plain_tokens(target, p, SamplingParams(), 14)) for p in ps]
    cut = accepted = 0
    for block, (name, schedule) in zip([2, 4, 7], SCHEDULES.items()):
        model = random_dspark(seed=block, vocab=vocab, block=block)
        for p, base in zip(ps, bases):
            stats = SpecStats()
            drafter = DSparkDrafter(model, target, schedule)
            out = list(speculative_tokens(target, p, SamplingParams(), 14, drafter, block, stats))
            assert out == base, (name, block, p)
            assert len(stats.proposed) <= block and stats.mode == "dspark"
            if schedule is not None:  # rounds whose block was cut before its last slot
                cut += stats.rounds - (stats.proposed[block - 1] if len(stats.proposed) == block else 0)
            accepted += sum(stats.accepted)
    assert cut > 0  # some rounds verified fewer than the block
    if vocab == 8:
        assert accepted > 0


@pytest.fixture(scope="module")
def cycle(make_tiny):
    return cycle_scenario(make_tiny)


def bigram_dspark(scenario, block: int):
    """A random DSpark (backbone weights x 0.3) with copies of the target's embedding and head, as DSpark
    checkpoints carry them, and a full-rank Markov head holding the target's bigram table: its drafts are often,
    not always, what the target samples."""
    vocab = scenario.joint.vocab
    model = random_dspark(seed=22, vocab=vocab, block=block, rank=vocab, scale=0.3)
    model.update({"embed_tokens": {"weight": scenario.target.model.embed_tokens.weight},
                  "lm_head": {"weight": scenario.target.lm_head.weight},
                  "markov_head": {"markov_w1": {"weight": mx.eye(vocab)},
                                  "markov_w2": {"weight": mx.array(scenario.table.T)}}})
    mx.eval(model.parameters())
    return model


def test_sampling_same_distribution(cycle):
    """Drafts of 4 tokens drawn left to right through the Markov head, with q: the first 5 tokens are jointly
    distributed as plain sampling's (temperature, top-k, top-p, repetition penalty), against the exact joint
    and its noise floor (distribution.py), with acceptance at draft positions 2..4 strictly between 0 and 1."""
    model = bigram_dspark(cycle, block=4)
    check_lossless(cycle, lambda: DSparkDrafter(model, cycle.target), 4, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,gamma", [("all", 2), ("all", 8), ("threshold", 8), ("cost", 8)])
def test_sampling_same_distribution_large(cycle, schedule, gamma):
    """Larger samples, and the confidence schedules, where the verified length depends on the drafted tokens'
    confidences (the chain then only has to be exercised to position 2)."""
    model = bigram_dspark(cycle, block=gamma)
    check_lossless(cycle, lambda: DSparkDrafter(model, cycle.target, SCHEDULES[schedule]), gamma, 4000,
                   depth=None if schedule == "all" else 2)


def test_spec_state_builds_block_drafters(tmp_path, target, make_target):
    assert "dflash" in MODES and "dspark" in MODES
    state = SpecState(make_target(target, names=("tiny",)))
    save_dflash_model(random_dflash(seed=3), tmp_path)
    d = state.drafter(SpecOptions("dflash", str(tmp_path)))
    assert isinstance(d, DFlashDrafter) and d.max_draft == 3 and d.target_layer_ids == [0, 1]
    again = state.drafter(SpecOptions("dflash", str(tmp_path)))
    assert again is not d and again.model is d.model  # a fresh drafter state, the weights loaded once
    ready = DSparkDrafter(random_dspark(seed=4), target)
    assert state.drafter(SpecOptions("dspark", ready)) is ready
    with pytest.raises(MlxInferError, match="no dflash drafter is known for this model; pass --draft-model"):
        state.drafter(SpecOptions("dflash"))  # nothing registered for "tiny"
    for mode in ("lookup", "layerskip"):  # modes that draft without a model refuse one instead of loading it
        with pytest.raises(MlxInferError, match=f"speculative='{mode}' uses no draft model"):
            SpecOptions(mode, str(tmp_path))
