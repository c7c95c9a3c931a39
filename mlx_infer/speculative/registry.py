"""Known drafters per target (`models/registry.json`, installed as `mlx_infer.models`): what
`speculative="auto"` uses when the user names no drafter.

An entry matches a target when one of its `match` names occurs in the target's repo id, GGUF file name
or directory name, compared without case and punctuation ("SmolLM2-135M-Instruct" matches
`SmolLM2-135M-Instruct.Q4_1.gguf`). Shipped drafters (`path`) load from the package; published ones
(`repo`) only when already in the local Hugging Face cache, so that `auto` never downloads or waits
on the network. This module only reads the data; resolve.py loads what it names.
"""

import json
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

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


def target_names(name: str, path: str, mlx_dir: str) -> Tuple[str, ...]:
    """Names that identify a target: what the user asked for (`name`), the file read (`path`), else its MLX
    directory."""
    names = [name, Path(path).name, Path(path).stem]
    return tuple(n for n in names if n and n != "default") or (Path(mlx_dir).name,)


def registry_path() -> Path:
    """The installed registry.json."""
    return models_dir() / "registry.json"


def registered(names: Sequence[str], registry: Optional[Path] = None) -> List[dict]:
    """The registry entries whose `match` fits a target known by `names` (target_names), in registry order;
    each entry's "path" is made absolute (relative to the registry's folder).

    Raises:
        MlxInferError: registry.json is not valid JSON or lacks "drafters".
    """
    path = registry or registry_path()
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())["drafters"]
    except (ValueError, KeyError) as e:
        raise MlxInferError(f"{path} is not a drafter registry ({e}); reinstall mlx-infer") from e
    normed = [_norm(n) for n in names]
    found = [dict(e) for e in entries if any(_norm(m) in n for m in e.get("match", []) for n in normed)]
    for e in found:
        if "path" in e:
            e["path"] = str(path.parent / e["path"])
    return found
