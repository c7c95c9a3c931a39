"""Reading and writing drafter checkpoints: a directory with config.json + *.safetensors whose tensor names
are exactly the module's parameter names (no prefix). Every problem a user can cause is an MlxInferError."""

import json
from pathlib import Path
from typing import Dict, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ...errors import MlxInferError
from ...loading.hub import download_repo, looks_like_repo_id


def resolve_dir(path: Union[str, Path]) -> Path:
    """A local drafter directory, or the local snapshot of a Hugging Face repo id ('org/name').

    Raises:
        MlxInferError: no such directory (and not a reachable / cached repo id).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if isinstance(path, str) and looks_like_repo_id(path):
        return Path(download_repo(path))
    raise MlxInferError(f"no drafter at {path}; give a drafter directory (config.json + .safetensors) or a repo id")


def checkpoint_ident(directory: Path) -> str:
    """The directory and the size and modification time of each weights file: a key that changes when the
    checkpoint is rewritten in place (a drafter trained again into the same directory)."""
    files = sorted(directory.glob("*.safetensors"))
    stamps = ",".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return f"{directory.resolve()}|{stamps}"


def read_checkpoint(directory: Path) -> Tuple[dict, Dict[str, mx.array]]:
    """(config dict, {tensor name: array}) of a drafter directory.

    Raises:
        MlxInferError: no / unreadable config.json, no .safetensors, an unreadable weights file.
    """
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise MlxInferError(f"{directory} has no config.json; it is not a drafter checkpoint")
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise MlxInferError(f"{cfg_path} is not valid JSON ({e})") from e
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise MlxInferError(f"{directory} has no .safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises RuntimeError / ValueError for a corrupt file
            raise MlxInferError(f"cannot read {f}: {e}") from e
    return config, weights


def load_strict(module: nn.Module, weights: Dict[str, mx.array], what: str) -> None:
    """Set every parameter of `module` from `weights`; the names and shapes must match exactly.

    Raises:
        MlxInferError: a missing tensor, an unexpected one, or a wrong shape (named in the message).
    """
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise MlxInferError(f"{what} is missing tensor(s) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if extra:
        raise MlxInferError(f"{what} has unexpected tensor(s) {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}")
    for k, v in expected.items():
        if tuple(weights[k].shape) != tuple(v.shape):
            raise MlxInferError(f"{what}: tensor {k} has shape {list(weights[k].shape)}, the config implies {list(v.shape)}")
    module.update(tree_unflatten(list(weights.items())))
    mx.eval(module.parameters())


def write_checkpoint(directory: Union[str, Path], config: dict, module: nn.Module) -> Path:
    """Write config.json and model.safetensors (every parameter under its own name). Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(module.parameters())),
                        metadata={"format": "pt"})
    return out


def require(config: dict, key: str, what: str, kind=int):
    """config[key] as `kind`, or MlxInferError naming the key."""
    if key not in config or config[key] is None:
        raise MlxInferError(f"{what} config.json lacks {key!r}")
    try:
        return kind(config[key])
    except (TypeError, ValueError) as e:
        raise MlxInferError(f"{what} config.json: {key!r} = {config[key]!r} is not a {kind.__name__}") from e
