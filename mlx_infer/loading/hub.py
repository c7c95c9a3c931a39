"""Local MLX / Hugging Face directories and Hugging Face repo ids (through huggingface_hub).

Downloads honour HF_HOME and HF_HUB_OFFLINE as huggingface_hub does. Offline and not cached is a
clear error naming the repo.
"""

import json
import os
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

from ..errors import ModelNotFoundError

#: Files an MLX / HF checkpoint needs (weights, config, tokenizer, chat template, custom code).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def looks_like_repo_id(name: str) -> bool:
    """'org/name' with no local file behind it."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and not Path(name).exists()


def local_model_dir(path: Path) -> Path:
    """Check that `path` is an MLX / HF model directory.

    Raises:
        ModelNotFoundError: missing directory, no config.json / safetensors in it, or a config.json that
            is not a JSON object.
    """
    if not path.is_dir():
        raise ModelNotFoundError(f"no model at {path}; give a .gguf file, an MLX model directory or a Hugging Face repo id")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; it is not an MLX / Hugging Face model directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"{path / 'config.json'} cannot be read as JSON ({e}); fix or replace it") from e
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{path / 'config.json'} is not a JSON object; fix or replace it")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{path} has no .safetensors weights; convert the checkpoint with mlx_lm.convert first")
    return path


def download_repo(repo_id: str, revision: str = None, local_only: bool = False) -> Path:
    """The local snapshot of a Hugging Face repo, downloading what is missing (never when local_only).

    Raises:
        ModelNotFoundError: offline and not cached, or no such repo.
    """
    offline = local_only or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=offline
        )
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"{repo_id} is not in the Hugging Face cache and the hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ''}; download it once while online or give a local path"
        ) from e
    except (RepositoryNotFoundError, GatedRepoError, HFValidationError) as e:
        raise ModelNotFoundError(
            f"Hugging Face repo {repo_id} was not found or is not accessible; check the name (and HF_TOKEN for gated repos)"
        ) from e
    except OSError as e:  # connection errors when not explicitly offline
        raise ModelNotFoundError(
            f"could not download {repo_id} ({type(e).__name__}); check the network or set HF_HUB_OFFLINE=1 to use the cache"
        ) from e
    return local_model_dir(Path(path))
