"""Deferred measurements (SpecState.defer_measurements, behind Engine.defer_measurements and `mlx-infer
generate`): a speculative="auto" request whose one-time measurements are not cached answers plainly and
measures nothing; `prepare` measures and caches them; the next request, on a fresh state too, reads them
from the disk cache and speculates. Without it (the Python API's default) the first request measures."""

import json

import pytest
from block_drafters import random_dflash
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import SpecOptions, SpecState, SpecStats, calibrate, cost
from mlx_infer.speculative.cost import NotMeasuredError
from mlx_infer.speculative.drafters.dflash import save_dflash_model
from mlx_infer.speculative.schedule import Prior

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """An empty measurement cache ($MLX_INFER_CACHE), and the two measurements replaced by fixed values that
    make speculation pay (a flat verify cost curve; a block drafter agreeing 90% of the time at 0.01 s a
    pass), each call recorded. What is cached and read back goes through the real disk cache."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path / "cache"))
    calls = []

    def curve(target, max_width, compiled):
        calls.append("cost")
        return {"seconds": {str(w): 1.0 + 0.01 * (w - 1) for w in range(1, max_width + 1)}, "plain_step": 1.0}

    def prior(target, drafter):
        calls.append("prior")
        return Prior(0.9, calibrate.PRIOR_WEIGHT, 0.01)

    monkeypatch.setattr(cost, "_measure_consistent", curve)
    monkeypatch.setattr(calibrate, "measure_block_prior", prior)
    return calls


@pytest.fixture
def registry(tmp_path):
    """A registry.json naming a dflash drafter for the target ("tiny")."""
    save_dflash_model(random_dflash(seed=7), tmp_path / "d")
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"drafters": [{"match": ["tiny"], "kind": "dflash", "path": "d"}]}))
    return path


def run_auto(state: SpecState):
    """(the tokens of a speculative="auto" request, None when it decodes plainly; its SpecStats)."""
    stats = SpecStats()
    tokens = state.tokens(PROMPT, SamplingParams(), 8, SpecOptions("auto"), stats,
                          make_prompt_cache(state.target.model))
    return (list(tokens) if tokens is not None else None), stats


def cached_files(tmp_path, kind: str) -> list:
    return sorted((tmp_path / "cache" / kind).glob("*.json"))


def test_deferred_auto_answers_plainly_then_prepare_caches_and_the_next_requests_use_it(
        target, make_target, registry, measured, tmp_path):
    state = SpecState(make_target(target), registry=registry)
    state.defer_measurements = True
    tokens, stats = run_auto(state)
    assert tokens is None and stats.mode == "off"  # plain decoding: the request's tokens come from elsewhere
    assert measured == [] and cached_files(tmp_path, "cost") == [] and cached_files(tmp_path, "prior") == []

    said = []
    state.prepare(SpecOptions("auto"), say=said.append)  # what the CLI runs once the answer is out
    assert sorted(measured) == ["cost", "prior"]
    assert len(cached_files(tmp_path, "cost")) == 1 and len(cached_files(tmp_path, "prior")) == 1
    assert [s.split(" (")[0] for s in said] == ["measuring this model's verify cost by width",
                                                "measuring how often the dflash drafter agrees with the model"]

    tokens, stats = run_auto(state)  # the same state: the block drafter is chosen now (not latched while unmeasured)
    assert tokens and len(tokens) == 8 and stats.mode == "lookup+dflash"

    fresh = SpecState(make_target(target), registry=registry)  # a new process: from the disk cache
    fresh.defer_measurements = True
    again, fresh_stats = run_auto(fresh)
    assert again == tokens and fresh_stats.mode == "lookup+dflash"
    assert sorted(measured) == ["cost", "prior"]  # nothing measured again


def test_without_deferring_the_first_auto_request_measures_first(target, make_target, registry, measured, tmp_path):
    """The Python API's default: the first request measures (inside its TTFT), as before."""
    state = SpecState(make_target(target), registry=registry)
    tokens, stats = run_auto(state)
    assert sorted(measured) == ["cost", "prior"] and tokens and stats.mode == "lookup+dflash"
    assert len(cached_files(tmp_path, "cost")) == 1


def test_reading_the_cache_only_never_measures(target, make_target, registry, measured):
    """cached_cost_curve / cached_drafter_prior raise NotMeasuredError where cost_curve / drafter_prior
    would measure: nothing cached, or a curve too narrow for the width asked."""
    t = make_target(target)
    with pytest.raises(NotMeasuredError):
        cost.cached_cost_curve(t, 4)
    cost.cost_curve(t, 4)
    assert cost.cached_cost_curve(t, 4).seconds == {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.03}
    with pytest.raises(NotMeasuredError):
        cost.cached_cost_curve(t, 6)
    drafter = SpecState(t, registry=registry).drafter(SpecOptions("dflash"))
    with pytest.raises(NotMeasuredError):
        calibrate.cached_drafter_prior(t, drafter)
    calibrate.drafter_prior(t, drafter)
    assert calibrate.cached_drafter_prior(t, drafter).acceptance == 0.9
    assert measured == ["cost", "prior"]
