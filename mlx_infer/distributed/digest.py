"""The model files' digest, compared across ranks before any weight is used.

    check_same_model(group, model_digest(source.mlx_dir))   # DistributedError on every rank when one differs

Ranks that load different weights (another quantization of the same model, a stale copy on one Mac) would
run in lockstep and produce garbage without any error, so every rank digests its model directory and the
digests are compared: an all_gather of each rank's 32 bytes.
"""

import hashlib
from pathlib import Path
from typing import List

import mlx.core as mx

from ..errors import DistributedError
from .defaults import DIGEST_SAMPLE_BYTES, DIGEST_SAMPLES
from .group import Group
from .watchdog import guarded

__all__ = ["check_same_model", "model_digest"]

#: The files of an MLX model directory besides the weights that change what it computes.
_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json", "chat_template.jinja", "tokenizer.model")


def _sampled(path: Path) -> bytes:
    """A safetensors file's identity: its size, its header (every tensor's name, dtype, shape and offsets)
    and DIGEST_SAMPLES blocks of DIGEST_SAMPLE_BYTES at evenly spaced offsets (the whole file when it is
    smaller than those)."""
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        if size <= DIGEST_SAMPLES * DIGEST_SAMPLE_BYTES * 2:
            h.update(f.read())
            return h.digest()
        header_len = int.from_bytes(f.read(8), "little")
        h.update(f.read(min(header_len, size - 8)))
        step = size // DIGEST_SAMPLES
        for i in range(DIGEST_SAMPLES):
            f.seek(i * step)
            h.update(f.read(DIGEST_SAMPLE_BYTES))
    return h.digest()


def model_digest(mlx_dir: Path) -> bytes:
    """sha256 (32 bytes) over an MLX model directory's config and tokenizer files (whole) and its
    *.safetensors files (`_sampled`: size, header and spread samples, so a 40 GB model digests in well
    under a second). Files are taken in name order; the directory's own path does not count."""
    mlx_dir = Path(mlx_dir)
    h = hashlib.sha256()
    for name in _SMALL_FILES:
        path = mlx_dir / name
        if path.is_file():
            h.update(f"{name}\0".encode() + path.read_bytes())
    for path in sorted(mlx_dir.glob("*.safetensors")):
        h.update(_sampled(path))
    return h.digest()


def check_same_model(group: Group, digest: bytes) -> None:
    """Compare every rank's digest (all_gather) and fail on every rank when they differ.

    Raises:
        DistributedError: the ranks whose files differ from rank 0's, or a peer lost.
    """
    if group.size == 1:
        return
    mine = mx.array(list(digest), dtype=mx.uint8)[None]  # [1, 32]
    gathered = mx.distributed.all_gather(mine, group=group.group)  # [size, 32]
    rows: List[List[int]] = guarded(lambda: gathered.tolist(), "comparing the model files", group.rank)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        ranks = ", ".join(map(str, differ))
        raise DistributedError(f"the model files differ between ranks (rank{'s' if len(differ) > 1 else ''} "
                               f"{ranks} against rank 0): give every rank the same model (same file, same "
                               "conversion)")
