"""Known drafters per target (`models/registry.json`, installed as `mlx_infer.models`): what
`speculative="auto"` uses when the user names no drafter.

An entry matches a target when one of its `match` names occurs in the target's repo id, GGUF file name
or directory name, compared without case and punctuation ("SmolLM2-135M-Instruct" matches
`SmolLM2-135M-Instruct.Q4_1.gguf`). Shipped drafters (`path`) load from the package; published ones
(`repo`) only when already in the local Hugging Face cache, so that `auto` never downloads or waits
on the network.
"""

import json
import re
from pathlib import Path
from typing import List, Optional

from ..errors import MlxInferError


def models_dir() -> Path:
    """The folder of shipped drafters and registry.json (installed package, or the source checkout)."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "models", here.parent / "models"):
        if (candidate / "registry.json").is_file():
            return candidate
    return here / "models"


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def target_names(engine) -> List[str]:
    """Names that identify the engine's target: what the user asked for, the file read, the MLX dir."""
    src = engine.source
    names = [src.name, Path(src.path).name, Path(src.path).stem]
    return [n for n in names if n and n != "default"] or [Path(src.mlx_dir).name]


def registered(engine, registry: Optional[Path] = None) -> List[dict]:
    """The registry entries whose `match` fits the engine's target, in registry order.

    Raises:
        MlxInferError: registry.json is not valid JSON or lacks "drafters".
    """
    path = registry or models_dir() / "registry.json"
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())["drafters"]
    except (ValueError, KeyError) as e:
        raise MlxInferError(f"{path} is not a drafter registry ({e}); reinstall mlx-infer") from e
    names = [_norm(n) for n in target_names(engine)]
    return [e for e in entries if any(_norm(m) in n for m in e.get("match", []) for n in names)]


def registered_drafter(engine, registry: Optional[Path] = None, kinds=("dflash", "dspark")):
    """The first registered drafter (of one of `kinds`) that loads locally and fits the engine's target.

    Returns:
        A DFlashDrafter / DSparkDrafter, or None (no entry, not cached, or none fits: the caller uses lookup).
    """
    from ..loading.hub import download_repo
    from .drafters.load import block_drafter

    base = (registry or models_dir() / "registry.json").parent
    for entry in registered(engine, registry):
        if entry.get("kind") not in kinds:
            continue
        try:
            source = base / entry["path"] if "path" in entry else download_repo(entry["repo"], local_only=True)
            return block_drafter(entry["kind"], engine, str(source))
        except (MlxInferError, KeyError, OSError):
            continue
    return None
