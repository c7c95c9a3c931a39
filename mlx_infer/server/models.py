"""The models a server answers for: a request's `model` picks one (a lease, held while the request runs).

`OneModel` serves one loaded engine under one id; pool.ModelPool serves several, loaded on demand (keep_alive,
least-recently-used eviction), with the same methods (`listing`, `find`, `lease`, `close`).

What can be served is described by ModelFile (name, where, format, size on disk): `describe` for a --model
argument, `scan_dir` for a --models-dir, `cached_conversions` for the GGUF conversions in mlx-infer's cache
(`mlx-infer models`)."""

from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, List, Optional

from ..batch import BatchRunner
from ..errors import MlxInferError, ModelNotFoundError
from ..loading import default, hub
from ..paths import cache_dir
from .protocol import APIError

#: The name the embedded default model is served under (and what --model takes for it).
DEFAULT_NAME = "default"


@dataclass
class ModelFile:
    """A model a server can serve, before it is loaded.

    Attributes:
        name: the id requests name it by (a GGUF file's stem, a directory's name, a repo id as given,
            "default" for the embedded model).
        spec: what mlx_infer.load takes for it (a path, a repo id; None: the embedded default).
        format: "gguf", "mlx-dir", "hf-repo" or "default".
        path: the file or directory on disk (None: a repo id not downloaded here).
        size: bytes on disk (a directory's files summed; None: not on disk).
    """

    name: str
    spec: Optional[str]
    format: str
    path: Optional[Path]
    size: Optional[int]


def disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (links not followed)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def is_model_dir(path: Path) -> bool:
    """Whether a directory holds an MLX / Hugging Face model (its config.json)."""
    return path.is_dir() and (path / "config.json").is_file()


def describe(spec: Optional[str]) -> ModelFile:
    """The ModelFile of a --model argument (a .gguf file, a model directory, a Hugging Face repo id, None or
    "default": the embedded model), without loading it.

    Raises:
        ModelNotFoundError: a path that is not there and is no repo id.
    """
    if spec is None or spec == DEFAULT_NAME:
        path = default.locate()
        return ModelFile(DEFAULT_NAME, None, "default", path, disk_size(path) if path else None)
    path = Path(spec).expanduser()
    if path.is_file():
        return ModelFile(path.stem, spec, "gguf", path, disk_size(path))
    if path.is_dir():
        return ModelFile(path.name, spec, "mlx-dir", path, disk_size(path))
    if path.suffix.lower() == ".gguf":
        raise ModelNotFoundError(f"no GGUF file at {path.resolve()}; check the path")
    if hub.looks_like_repo_id(spec):
        return ModelFile(spec, spec, "hf-repo", None, None)
    raise ModelNotFoundError(f"no model at {spec!r}; give a .gguf file, an MLX model directory or a Hugging Face "
                             "repo id (org/name)")


def scan_dir(folder: str) -> List[ModelFile]:
    """The models in a --models-dir: its .gguf files and its model directories (with a config.json), by name.

    Raises:
        MlxInferError: `folder` is not a directory.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise MlxInferError(f"--models-dir {folder}: not a directory; give a folder of .gguf files and MLX model "
                            "directories")
    found = [describe(str(p)) for p in sorted(root.iterdir())
             if (p.is_file() and p.suffix.lower() == ".gguf") or is_model_dir(p)]
    return sorted(found, key=lambda m: m.name)


def cached_conversions() -> List[ModelFile]:
    """The GGUF conversions in mlx-infer's cache (cache_dir()/gguf: one MLX directory per GGUF file's content,
    named STEM-KEY), by name."""
    folder = cache_dir() / "gguf"
    if not folder.is_dir():
        return []
    return [ModelFile(p.name, str(p), "mlx-dir", p, disk_size(p)) for p in sorted(folder.iterdir()) if is_model_dir(p)]


@dataclass
class Served:
    """A model ready for requests: its id, its engine (tokenizer and chat template, on the event loop's thread)
    and the runner that decodes its requests (continuous batching on its own thread)."""

    id: str
    engine: Any
    runner: BatchRunner


def model_not_found(name: str, known: List[str]) -> APIError:
    """OpenAI's 404 `model_not_found` for a model name the server does not serve."""
    return APIError(404, f"model {name!r} is not served here; this server serves {', '.join(map(repr, known))} "
                         "(see GET /v1/models)", "model", code="model_not_found")


def model_object(name: str, loaded: bool) -> dict:
    """OpenAI's model object, with `loaded`: whether the model is in memory now."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "mlx-infer", "loaded": loaded}


class OneModel:
    """One engine served under one id. A request naming no model, or this one, gets it; any other name is a 404.

    Args:
        served: the model.
    """

    def __init__(self, served: Served):
        self.served = served

    def listing(self) -> List[dict]:
        """OpenAI's model objects of what can be served."""
        return [model_object(self.served.id, True)]

    def find(self, name: str) -> dict:
        """The model object of `name`; raises APIError 404 model_not_found."""
        if name != self.served.id:
            raise model_not_found(name, [self.served.id])
        return self.listing()[0]

    @asynccontextmanager
    async def lease(self, name: Optional[str], keep_alive: Optional[float] = None) -> AsyncIterator[Served]:
        """The model a request names (None: the default), held until the request ends.

        Raises:
            APIError: 404 model_not_found for a name not served.
        """
        if name is not None and name != self.served.id:
            raise model_not_found(name, [self.served.id])
        yield self.served

    def close(self) -> None:
        self.served.runner.close()
