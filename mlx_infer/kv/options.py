"""The paged KV cache's user options, parsed and checked in plain Python (before any model work): the cache
kind, the KV budget, the block size and the eviction spec `POLICY:RATIO`. Each bad value is one
MlxInferError line naming the option."""

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..defaults import KV_CACHES
from ..errors import MlxInferError
from .policies import POLICIES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class EvictSpec:
    """An eviction request: policy (a name of kv.policies.POLICIES) and ratio (fraction of tokens evicted,
    0 < ratio < 1)."""

    policy: str
    ratio: float

    def __str__(self) -> str:
        return f"{self.policy}:{self.ratio:g}"


def check_kv_cache(kind: str) -> str:
    """`kind` lower-cased when it is one of KV_CACHES. Raises MlxInferError otherwise."""
    value = str(kind).strip().lower()
    if value not in KV_CACHES:
        raise MlxInferError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kind!r}")
    return value


def check_block_size(block_size) -> int:
    """`block_size` (an int, or a string of digits) as an int >= 1, tokens per KV block. Raises MlxInferError
    otherwise."""
    text = str(block_size).strip()
    if isinstance(block_size, bool) or not isinstance(block_size, (int, str)) or not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise MlxInferError(f"block_size must be an integer >= 1 (tokens per KV block), got {block_size!r}")
    return int(text)


def free_memory_bytes() -> int:
    """Memory the system can still give, bytes: MemAvailable of /proc/meminfo (Linux), else the free
    physical pages (os.sysconf), else 0 when unknown."""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def parse_budget(budget: Union[None, int, float, str]) -> Optional[int]:
    """The KV budget in bytes: None (no limit), an int of bytes, a string with a unit ("512MB", "2GiB";
    k/m/g alone are binary; no unit and no decimal point: bytes) or a fraction of free memory in (0, 1]
    written with a decimal point ("0.5", "1.0" or 0.5).

    Raises:
        MlxInferError: a value that does not parse, is not positive, or is a fraction when free memory is unknown.
    """
    if budget is None:
        return None
    hint = "give bytes (e.g. 512MB, 2GiB; a bare integer is bytes) or a fraction of free memory (e.g. 0.5, 1.0)"
    if isinstance(budget, bool):
        raise MlxInferError(f"kv_budget cannot be {budget!r}: {hint}")
    if isinstance(budget, int):
        if budget <= 0:
            raise MlxInferError(f"kv_budget must be positive, got {budget}: {hint}")
        return budget
    if isinstance(budget, float):
        number, unit, fraction = budget, "", True
    else:
        m = _SIZE.match(str(budget).lower())
        if not m or m.group(2) not in _UNITS:
            raise MlxInferError(f"kv_budget {budget!r} does not parse: {hint}")
        number, unit = float(m.group(1)), m.group(2)
        fraction = unit == "" and "." in m.group(1)
    if fraction:
        if not 0.0 < number <= 1.0:
            raise MlxInferError(f"kv_budget {budget!r}: a fraction of free memory must be in (0, 1]; {hint}")
        free = free_memory_bytes()
        if free <= 0:
            raise MlxInferError("kv_budget as a fraction needs the free memory, which is unknown here: give bytes")
        return int(number * free)
    value = int(number * _UNITS[unit])
    if value <= 0:
        raise MlxInferError(f"kv_budget must be positive, got {budget!r}: {hint}")
    return value


def parse_evict(evict: Optional[str]) -> Optional[EvictSpec]:
    """`POLICY:RATIO` (e.g. "h2o:0.5") as an EvictSpec; None (or "none"/"off") is no eviction.

    Raises:
        MlxInferError: no colon, an unknown policy, or a ratio that is not a number in (0, 1).
    """
    if evict is None or str(evict).strip().lower() in ("", "none", "off"):
        return None
    name, sep, ratio = str(evict).strip().lower().partition(":")
    if not sep:
        raise MlxInferError(f"an eviction spec is POLICY:RATIO (e.g. h2o:0.5), got {evict!r}")
    if name not in POLICIES:
        raise MlxInferError(f"unknown eviction policy {name!r} in {evict!r}: use one of {', '.join(POLICIES)}")
    try:
        value = float(ratio)
    except ValueError:
        raise MlxInferError(f"the eviction ratio in {evict!r} is not a number: give a fraction in (0, 1)") from None
    if not 0.0 < value < 1.0:
        raise MlxInferError(f"the eviction ratio in {evict!r} is the fraction of tokens evicted: it must be in (0, 1)")
    return EvictSpec(name, value)
