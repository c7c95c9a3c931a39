"""GGUF file -> an MLX model directory that mlx-lm loads.

A GGUF file is converted once into a directory (config.json with the quantization map,
model.safetensors, tokenizer files with the chat template) and kept in the user cache, so the
second load is as fast as loading any MLX model. `mlx-infer convert` writes the same directory
where the user asks.

Supported architectures: llama (SmolLM2, Llama 2/3), qwen2, qwen3, gemma3; each maps onto the
mlx-lm model class of the same family.
"""

import atexit
import errno
import hashlib
import json
import numbers
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
from gguf import GGUFReader

from ..defaults import GGML_BLOCK, GGUF_CONVERTER_VERSION
from ..errors import DiskWriteError, InvalidGGUFError, MlxInferError, ModelNotFoundError, UnsupportedModelError
from ..paths import CACHE_ENV, cache_dir, warn_not_cached
from .gguf_tensors import permute_rows_for_rope, tensor_to_mlx
from .gguf_tokenizer import build_tokenizer, eos_token_ids

#: GGUF architecture -> mlx-lm model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

#: GGUF per-layer tensor name -> mlx-lm module path (under model.layers.N).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: Gemma 3 has four norms per layer; its ffn_norm is the pre-feed-forward norm.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

ProgressFn = Callable[[int, int, str], None]

#: What a conversion that found no room says to do: into the cache, and into a folder the user chose.
CACHE_FULL_HINT = f"free space there, or set {CACHE_ENV} to a folder on a disk with room"
OUTPUT_FULL_HINT = "free space there, or choose an output directory on a disk with room"
#: The errno values of a write that found no room (a full disk, a quota, a file size limit).
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def open_gguf(path: Path):
    """Open a GGUF file with the `gguf` package's reader.

    Raises:
        ModelNotFoundError: no such file.
        InvalidGGUFError: not a GGUF file, truncated or corrupt.
    """
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}; check the path")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise InvalidGGUFError(f"{path} is not a GGUF file (bad magic); check the file or re-download it")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises many types on bad input
        raise InvalidGGUFError(
            f"{path} is truncated or corrupt (its header or tensor table cannot be read); re-download it"
        ) from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise InvalidGGUFError(f"{path} is truncated (tensor {t.name} runs past the end); re-download it")
    return reader


def read_fields(reader) -> dict:
    """GGUF metadata as {key: plain Python value} (lists for arrays)."""
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # an exotic field type we do not need
            continue
    return fields


def model_config(fields: dict, tensor_names: set) -> dict:
    """The Hugging Face-style config.json of a GGUF file's model, as mlx-lm reads it.

    Raises:
        UnsupportedModelError: an architecture mlx-infer does not map.
    """
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )

    def get(key, default=None):
        return fields.get(f"{arch}.{key}", default)

    for key in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length"):
        if not isinstance(get(key), numbers.Real):
            raise InvalidGGUFError(f"GGUF metadata {arch}.{key} is missing or not a number; the file is incomplete or corrupt")
    if not fields.get("tokenizer.ggml.tokens") and get("vocab_size") is None:
        raise InvalidGGUFError("GGUF has no vocabulary (tokenizer.ggml.tokens); the file is incomplete or corrupt")
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    n_kv = get("attention.head_count_kv", n_heads)
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": len(fields.get("tokenizer.ggml.tokens", [])) or int(get("vocab_size")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(
            f"RoPE scaling {get('rope.scaling.type')!r} in this GGUF is not supported; supported: linear"
        )
    if arch == "llama" and "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "this llama GGUF uses Llama 3.1 RoPE frequency factors (rope_freqs), not supported yet; "
            "convert the Hugging Face checkpoint with mlx_lm.convert instead"
        )
    if arch == "qwen2":
        config["attention_bias"] = True
    if arch == "gemma3":
        config["sliding_window"] = int(get("attention.sliding_window", 512))
        config["sliding_window_pattern"] = 6
        config["rope_local_base_freq"] = 10000.0
        # Gemma 3 scales queries by head_dim**-0.5, except the 27B (62 layers): hidden/heads.
        config["query_pre_attn_scalar"] = hidden // n_heads if config["num_hidden_layers"] == 62 else head_dim
    eos = eos_token_ids(fields, fields.get("tokenizer.ggml.tokens", []))
    if eos:
        config["eos_token_id"] = eos
    return config


def mlx_name(gguf_name: str, arch: str) -> Optional[str]:
    """The mlx-lm module path of a GGUF tensor name ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj'),
    with the parameter suffix split off by the caller; None for tensors mlx-lm does not use."""
    base = gguf_name.rsplit(".", 1)[0]
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        names = _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        if parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def convert_weights(reader, config: dict, arch: str, progress: Optional[ProgressFn] = None) -> dict:
    """Every tensor of a GGUF file as mlx-lm-named MLX arrays.

    Returns:
        {"model.layers.0.self_attn.q_proj.weight": array, "...scales": ..., ...}.

    Raises:
        UnsupportedModelError: an unknown tensor or tensor type.
    """
    weights = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = mlx_name(t.name, arch)
        if name is None:
            if t.name == "rope_freqs.weight":
                continue
            raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no place in the {arch} model; the file is not a plain {arch} model")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        suffix = t.name.rsplit(".", 1)[1]
        if len(shape) == 2 and shape[-1] % GGML_BLOCK != 0 and t.tensor_type.name not in ("F32", "F16", "BF16"):
            raise InvalidGGUFError(f"tensor {t.name} has {shape[-1]} columns, not a multiple of the block size")
        arrays = tensor_to_mlx(t.data, t.tensor_type, shape, t.name)
        if suffix == "bias":
            arrays = {"bias": arrays["weight"]}
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads"] if name.endswith("q_proj") else config["num_key_value_heads"]
            arrays = permute_rows_for_rope(arrays, heads)
        if arch == "gemma3" and name.endswith("norm"):
            # llama.cpp stores Gemma's RMSNorm weights as (1 + w); mlx-lm adds the 1 itself.
            arrays = {"weight": arrays["weight"] - 1.0}
        for key, a in arrays.items():
            weights[f"{name}.{key}"] = a
        mx.eval(list(arrays.values()))
        if progress:
            progress(i + 1, total, t.name)
    return weights


def quantization_config(weights: dict) -> Optional[dict]:
    """mlx-lm's quantization map: a default plus per-module bits where they differ.

    mlx-lm infers each module's bits from its packed shape, but writing them out keeps the
    directory readable by other MLX runtimes.
    """
    per_module = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        w = weights[f"{module}.weight"]
        group = GGML_BLOCK
        bits = w.shape[-1] * 32 // (scales.shape[-1] * group)
        per_module[module] = {"group_size": group, "bits": int(bits)}
    if not per_module:
        return None
    bit_counts = {}
    for q in per_module.values():
        bit_counts[q["bits"]] = bit_counts.get(q["bits"], 0) + 1
    default_bits = max(bit_counts, key=bit_counts.get)
    config = {"group_size": GGML_BLOCK, "bits": default_bits}
    config.update({m: q for m, q in per_module.items() if q["bits"] != default_bits})
    return config


def staging_dir(out_dir: Path) -> Path:
    """A new private directory next to `out_dir` (same file system), to write a conversion into and
    rename onto `out_dir` when it is complete.

    Raises:
        OSError: the parent of out_dir cannot be created or written (NotADirectoryError when a file
            is in the way).
    """
    existing = next(p for p in out_dir.parents if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file", str(existing))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))


def convert_gguf(path: Path, out_dir: Path, progress: Optional[ProgressFn] = None) -> Path:
    """Write the MLX model directory of a GGUF file into `out_dir`.

    The output is checked first (before the slow part): the directory is written next to `out_dir`
    under a temporary name and renamed at the end, so an interrupted or failed conversion leaves
    nothing half-written.

    Args:
        path: the .gguf file.
        out_dir: the directory to create; must not exist yet or be empty.
        progress: called as progress(done, total, tensor_name) after each tensor.

    Returns:
        out_dir.

    Raises:
        ModelNotFoundError, InvalidGGUFError, UnsupportedModelError: see `open_gguf`, `model_config`.
        MlxInferError: out_dir exists and is not empty, or cannot be written.
        DiskWriteError: the disk filled up while writing (nothing is left of the conversion).
    """
    path, out_dir = Path(path), Path(out_dir)
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}; check the path")
    if out_dir.exists() and not out_dir.is_dir():
        raise MlxInferError(f"{out_dir} exists and is not a directory; choose a new output directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise MlxInferError(f"{out_dir} exists and is not empty; choose a new output directory")
    try:
        staging = staging_dir(out_dir)
    except OSError as e:
        raise MlxInferError(
            f"cannot write {out_dir} ({e.strerror or type(e).__name__}); choose a writable output directory"
        ) from e
    return write_conversion(path, staging, out_dir, progress, full_hint=OUTPUT_FULL_HINT)


def no_room_error(folder: Path, cause: BaseException, needed_bytes: int, hint: str) -> DiskWriteError:
    """The one-line error of a conversion that could not write its files into `folder`: what failed, the
    space free there (when it can be read), what the model needs, and `hint` (what to do)."""
    lines = (cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)).splitlines()
    what = lines[0] if lines else type(cause).__name__
    try:
        free = f"{shutil.disk_usage(folder).free / 1e6:.1f} MB free there"
    except OSError:
        free = "free space unknown"
    return DiskWriteError(f"cannot write the converted model into {folder} ({what}; {free}, the model needs "
                          f"about {needed_bytes / 1e6:.1f} MB): {hint}")


def write_model_files(staging: Path, weights: dict, config: dict, tokenizer, hint: str) -> None:
    """Write the converted model (model.safetensors, config.json, the tokenizer's files) into `staging`.

    Raises:
        DiskWriteError: a file found no room (MLX's failed write of the weights, which carries no errno,
            or an OSError ENOSPC / EDQUOT / EFBIG); `hint` says what to do.
        OSError: another failure to write.
    """
    needed = sum(int(w.nbytes) for w in weights.values())
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    except RuntimeError as e:  # MLX: "[write] Unable to write N bytes"
        raise no_room_error(staging.parent, e, needed, hint) from e
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(str(staging))
    except OSError as e:
        if e.errno in NO_ROOM_ERRNOS:
            raise no_room_error(staging.parent, e, needed, hint) from e
        raise


def write_conversion(path: Path, staging: Path, out_dir: Path, progress: Optional[ProgressFn] = None,
                     reader=None, full_hint: str = CACHE_FULL_HINT) -> Path:
    """Convert a GGUF file into `staging` (from `staging_dir`), then rename it onto `out_dir`.

    `reader` is the file already opened by `open_gguf` (None: opened here). `staging` is removed
    when anything fails, so nothing half-written is left. Raises as `convert_gguf`, and DiskWriteError
    (saying `full_hint`) when the files find no room.
    """
    try:
        if reader is None:
            reader = open_gguf(path)
        fields = read_fields(reader)
        tensor_names = {t.name for t in reader.tensors}
        config = model_config(fields, tensor_names)
        tokenizer = build_tokenizer(fields)
        weights = convert_weights(reader, config, fields["general.architecture"], progress)
        if (quant := quantization_config(weights)) is not None:
            config["quantization"] = quant
            config["quantization_config"] = quant
        config["mlx_infer"] = {"source": path.name, "converter_version": GGUF_CONVERTER_VERSION}
        write_model_files(staging, weights, config, tokenizer, full_hint)
        if out_dir.exists():
            out_dir.rmdir()
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


#: Files whose content digest the conversion cache remembers (cache_dir()/gguf/digests.json), the most recent.
DIGEST_INDEX_SIZE = 256


def content_digest(path: Path) -> str:
    """sha256 of the file's bytes (hex), remembered in cache_dir()/gguf/digests.json by path, size,
    modification time and inode, so that a file is read through once (about 0.1 s per 100 MB here) and
    again only when it changes. An index that cannot be read or written is ignored (the file is hashed)."""
    st = path.stat()
    stat_key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    index_path = cache_dir() / "gguf" / "digests.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    digest = index.get(stat_key)
    if isinstance(digest, str):
        return digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    index.pop(stat_key, None)
    index[stat_key] = digest
    kept = dict(list(index.items())[-DIGEST_INDEX_SIZE:])
    try:  # atomic: a reader sees the old index or the new one
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f"digests.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept))
        tmp.replace(index_path)
    except OSError:
        pass  # (the conversion itself warns when the cache cannot be written)
    return digest


def cached_conversion(path: Path, progress: Optional[ProgressFn] = None) -> Path:
    """The cached MLX directory of a GGUF file, converting it on first use.

    The cache key is the file's content (sha256, `content_digest`) and the converter version: the same
    file installed in several virtual environments (whose installers stamp it with the time of each
    install) or copied elsewhere is converted once, and an edited or replaced file is converted again.
    A conversion already in the cache is used even when the cache is read-only; when the cache cannot
    be written, the file is converted into a temporary directory (removed when the process exits) with
    one warning. A cache whose disk fills up while converting raises DiskWriteError (naming the folder
    and MLX_INFER_CACHE), leaving nothing of the conversion behind.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}; check the path")
    key = hashlib.sha256(f"{content_digest(path)}|{GGUF_CONVERTER_VERSION}".encode()).hexdigest()[:16]
    out_dir = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (out_dir / "config.json").is_file():
        return out_dir
    reader = open_gguf(path)  # a bad file is the error, whatever the cache
    try:
        staging = staging_dir(out_dir)
    except OSError as e:
        warn_not_cached(out_dir.parent, e, "converting into a temporary directory (again on every run)")
        scratch = Path(tempfile.mkdtemp(prefix="mlx-infer-gguf-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        out_dir = scratch / out_dir.name
        staging = staging_dir(out_dir)
    return write_conversion(path, staging, out_dir, progress, reader)
