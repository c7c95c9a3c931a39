"""Resumable training checkpoints, written atomically.

Layout under the output directory:
    checkpoints/step-0000200/{drafter.safetensors, optimizer.safetensors, state.json}
    checkpoints/latest.json            {"dir": "step-0000200", "step": 200}

A checkpoint directory is written under a temporary name and renamed into place, then `latest.json` is
replaced (os.replace) to point at it: a crash at any moment leaves the previous checkpoint intact and
`latest.json` naming a complete one. Older step directories are removed after (keeping `keep`).

drafter.safetensors holds only the TRAINABLE parameters (DSpark's frozen embedding / lm_head copies come
from the target again); state.json holds the step, the Python RNG state of the anchor sampler, the
training settings (checked on resume) and the loss log.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import MlxInferError

CKPT_DIR = "checkpoints"


def _rng_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(obj) -> tuple:
    """A random.Random state from its JSON form."""
    return (obj[0], tuple(obj[1]), obj[2])


def save_training_state(out_dir, step: int, model, optimizer, rng_state, info: dict, keep: int = 2) -> Path:
    """Write a checkpoint of `step` (see the module docstring); returns its directory.

    Args:
        model: the drafter (its trainable parameters are saved).
        optimizer: an mlx optimizer (its whole state tree is saved).
        rng_state: `random.Random.getstate()` of the anchor sampler.
        info: JSON-able settings and logs stored in state.json.
    """
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "drafter.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    opt = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
    (tmp / "state.json").write_text(json.dumps({"step": int(step), "rng": _rng_to_json(rng_state), **info}))
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".latest-{os.getpid()}.json"
    pointer.write_text(json.dumps({"dir": name, "step": int(step)}))
    os.replace(pointer, root / "latest.json")
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out_dir) -> Optional[Path]:
    """The directory `latest.json` points at, or None when there is no checkpoint."""
    pointer = Path(out_dir) / CKPT_DIR / "latest.json"
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text())["dir"]
    except (ValueError, KeyError) as e:
        raise MlxInferError(f"{pointer} is corrupt ({e}); delete {Path(out_dir) / CKPT_DIR} to start over") from e
    path = pointer.parent / name
    if not path.is_dir():
        raise MlxInferError(f"{pointer} names {name}, which is missing; delete {pointer.parent} to start over")
    return path


def load_training_state(path: Path, model, optimizer) -> Tuple[int, tuple, dict]:
    """Restore the drafter's trainable parameters and the optimizer state from a checkpoint directory.

    Returns:
        (step, rng state, state.json dict).

    Raises:
        MlxInferError: a missing / unreadable file, or tensors that do not fit the drafter.
    """
    try:
        info = json.loads((path / "state.json").read_text())
        weights = mx.load(str(path / "drafter.safetensors"))
        opt = mx.load(str(path / "optimizer.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise MlxInferError(f"cannot read the training checkpoint {path}: {e}") from e
    expected = dict(tree_flatten(model.trainable_parameters()))
    if set(expected) != set(weights) or any(tuple(expected[k].shape) != tuple(weights[k].shape) for k in expected):
        raise MlxInferError(f"the training checkpoint {path} does not fit this drafter (other settings?)")
    model.update(tree_unflatten(list(weights.items())))
    optimizer.state = tree_unflatten(list(opt.items()))
    mx.eval(model.parameters(), optimizer.state)
    return int(info["step"]), rng_from_json(info["rng"]), info
