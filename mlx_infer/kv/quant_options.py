"""Quantized-KV options (`--kv-bits`, `--kv-scheme`, `--kv-quant-start`; in Python also kv_group_size and
kv_residual), parsed and
checked in plain Python before any model work; each bad value is one MlxInferError line naming it."""

import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

from ..defaults import KV_SCHEMES
from ..errors import MlxInferError
from .defaults import KIVI_RESIDUAL, KV_GROUP_SIZE, KV_ROTATE_BITS

#: Bit widths of quantized K / V.
KV_BITS = (4, 8)
#: Group sizes along head_dim (affine) or along tokens (KIVI keys).
KV_GROUP_SIZES = (32, 64, 128)

_BITS = re.compile(r"^(?:([0-9]+)|k([0-9]+)v([0-9]+))$")


@dataclass(frozen=True)
class KVQuant:
    """How a request's KV cache is quantized.

    Attributes:
        k_bits, v_bits: 4 or 8.
        scheme: "affine" or "kivi".
        group_size: values per scale / bias (along head_dim; KIVI keys: along tokens).
        start: tokens kept in float before quantization begins (0: from the first token); at the
            threshold the float context is quantized in place.
        residual: KIVI's float window of the most recent tokens (0 for affine).
        rotate_k, rotate_v: affine only: each group of K (V) values is Hadamard-rotated before quantizing,
            and attention runs in the rotated basis (kv/rotation.py); False: MLX's plain codes, as mlx-lm
            stores them.
    """

    k_bits: int
    v_bits: int
    scheme: str = "affine"
    group_size: int = KV_GROUP_SIZE
    start: int = 0
    residual: int = 0
    rotate_k: bool = False
    rotate_v: bool = False

    def __str__(self) -> str:
        """"8", "k8v4", "kivi-4"; a rotation other than kv_quant's default adds "@rot" (every store rotated)
        or "@norot" (none), as bench/ppl.py names the settings."""
        bits = str(self.k_bits) if self.k_bits == self.v_bits else f"k{self.k_bits}v{self.v_bits}"
        if self.scheme == "kivi":
            return f"kivi-{bits}"
        rotated = (self.rotate_k, self.rotate_v)
        if rotated == default_rotation(self.k_bits, self.v_bits):
            return bits
        if all(rotated) or not any(rotated):
            return bits + ("@rot" if all(rotated) else "@norot")
        return bits + ("@rotk" if self.rotate_k else "@rotv")


def default_rotation(k_bits: int, v_bits: int) -> Tuple[bool, bool]:
    """(rotate K, rotate V) of the affine scheme by default: the stores of KV_ROTATE_BITS bits."""
    return k_bits in KV_ROTATE_BITS, v_bits in KV_ROTATE_BITS


def parse_kv_bits(kv_bits: Union[None, int, str]):
    """`8`, `4`, `k8v4` (K and V apart) as (k_bits, v_bits); None, "none", "off", "16", "float" as None.

    Raises:
        MlxInferError: anything else.
    """
    if kv_bits is None or str(kv_bits).strip().lower() in ("", "none", "off", "float", "16"):
        return None
    if isinstance(kv_bits, bool):
        raise MlxInferError(f"kv_bits cannot be {kv_bits!r}: give 8, 4 or kXvY (e.g. k8v4)")
    m = _BITS.match(str(kv_bits).strip().lower())
    bits = (int(m.group(1)),) * 2 if m and m.group(1) else ((int(m.group(2)), int(m.group(3))) if m else None)
    if bits is None or any(b not in KV_BITS for b in bits):
        raise MlxInferError(f"kv_bits must be 8, 4 or kXvY with X, Y in {{4, 8}} (e.g. k8v4), got {kv_bits!r}")
    return bits


def _nonnegative_int(value, name: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not (text.isascii() and text.isdigit()):
        raise MlxInferError(f"{name} must be an integer >= 0 (tokens), got {value!r}")
    return int(text)


def kv_quant(kv_bits: Union[None, int, str], kv_scheme: str = "affine", kv_quant_start: Union[int, str] = 0,
             kv_group_size: Union[int, str] = KV_GROUP_SIZE,
             kv_residual: Union[int, str] = KIVI_RESIDUAL,
             kv_rotate: Optional[bool] = None) -> Optional[KVQuant]:
    """The KVQuant of these options, or None for a float cache (kv_bits None). kv_rotate: the Hadamard
    rotation of affine K/V stores (None: the default, the 4-bit stores of the affine scheme and none of
    KIVI's; True: every affine store; False: none).

    Raises:
        MlxInferError: a bad kv_bits, an unknown scheme, a negative start, a group size other than 32 / 64
            / 128, or a KIVI residual that is not a multiple of the group size; kv_rotate not a bool, or
            True with KIVI; or a scheme, start, rotation or group size given without kv_bits.
    """
    bits = parse_kv_bits(kv_bits)
    scheme = str(kv_scheme).strip().lower()
    if scheme not in KV_SCHEMES:
        raise MlxInferError(f"kv_scheme must be one of {', '.join(KV_SCHEMES)}, got {kv_scheme!r}")
    start = _nonnegative_int(kv_quant_start, "kv_quant_start")
    group = _nonnegative_int(kv_group_size, "kv_group_size")
    if group not in KV_GROUP_SIZES:
        raise MlxInferError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {kv_group_size!r}")
    if bits is None:
        if scheme != "affine" or start:
            raise MlxInferError("kv_scheme and kv_quant_start apply to a quantized KV cache: give kv_bits 8, 4 "
                                "or kXvY (e.g. k8v4)")
        if kv_rotate is not None or group != KV_GROUP_SIZE:
            raise MlxInferError("kv_rotate and kv_group_size apply to a quantized KV cache: give kv_bits 8, 4 or "
                                "kXvY (e.g. k8v4)")
        return None
    residual = _nonnegative_int(kv_residual, "kv_residual") if scheme == "kivi" else 0
    if residual % group:
        raise MlxInferError(f"kv_residual ({residual}) must be a multiple of kv_group_size ({group})")
    if kv_rotate is not None and not isinstance(kv_rotate, bool):
        raise MlxInferError(f"kv_rotate must be True or False, got {kv_rotate!r}")
    if kv_rotate and scheme == "kivi":
        raise MlxInferError("kv_rotate applies to kv_scheme='affine': KIVI quantizes keys per channel, which a "
                            "rotation across channels would undo; drop kv_rotate or use kv_scheme='affine'")
    if scheme != "affine":
        rotated = (False, False)
    elif kv_rotate is None:
        rotated = default_rotation(*bits)
    else:
        rotated = (kv_rotate, kv_rotate)
    return KVQuant(bits[0], bits[1], scheme, group, start, residual, *rotated)


def check_paged_quant(quant: KVQuant) -> None:
    """Whether the paged cache's blocks can hold `quant`: the affine scheme, quantized from the first token.

    Raises:
        MlxInferError: KIVI (its keys are quantized per channel along tokens, in groups of whole token
            chunks, which do not fit rows of token blocks), or a float prefix (kv_quant_start > 0: a block
            pool's rows are quantized when written).
    """
    if quant.scheme != "affine":
        raise MlxInferError("kv_scheme='kivi' quantizes keys per channel along tokens, which does not fit the paged "
                            "cache's token blocks: use kv_scheme='affine' with kv_cache='paged' (or KIVI with "
                            "kv_cache='dense')")
    if quant.start:
        raise MlxInferError(f"kv_quant_start={quant.start} (a float prefix) needs the dense KV cache: the paged cache "
                            "quantizes every token when it is written; drop kv_quant_start or use kv_cache='dense'")


def check_head_dims(quant: KVQuant, k_dim: int, v_dim: int) -> None:
    """Whether the kernels can hold this model's K / V heads quantized: each head dim a multiple of 32 and
    of the group size.

    Raises:
        MlxInferError: naming the dim and the group sizes that would fit it (or float KV when none does).
    """
    for name, dim in (("key", k_dim), ("value", v_dim)):
        if dim % 32 or dim % quant.group_size:
            fits = [g for g in KV_GROUP_SIZES if dim % g == 0 and dim % 32 == 0]
            hint = f"try kv_group_size={' or '.join(map(str, fits))} or float KV" if fits else "use float KV"
            raise MlxInferError(f"quantized KV needs a {name} head dim that is a multiple of 32 and of the group "
                                f"size ({quant.group_size}); this model's is {dim}: {hint}")


def fit_group_size(quant: KVQuant, k_dim: int, v_dim: int) -> KVQuant:
    """quant itself when its group size divides both head dims, else with the largest group size of
    KV_GROUP_SIZES that does (a head dim of 96 takes groups of 32); unchanged when none does
    (check_head_dims then says so). For a group size the caller did not choose."""
    if not (k_dim % quant.group_size or v_dim % quant.group_size):
        return quant
    fits = [g for g in KV_GROUP_SIZES if k_dim % g == 0 and v_dim % g == 0 and quant.residual % g == 0]
    return replace(quant, group_size=max(fits)) if fits else quant
