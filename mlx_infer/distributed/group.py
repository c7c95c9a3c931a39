"""The process group of a run under `mlx.launch`, and the lockstep primitives its ranks share.

    group = init_group("ring")                  # mx.distributed.init; size 1 outside mlx.launch
    ids = broadcast_ints(group, ids)            # rank 0's list of ints on every rank (int32 all_sum)

Every rank runs the same forward in the same order (the collectives inside the sharded model pair up
only then), so whatever decides a forward's input (the prompt's token ids, each sampled token, whether to
stop) is rank 0's, sent to the others by `broadcast_ints`: an all_sum of rank 0's values and zeros from the
other ranks, the broadcast every backend has (the ring backend has no broadcast of its own).
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from ..errors import DistributedError, MlxInferError
from .defaults import BACKENDS
from .watchdog import guarded

__all__ = ["Group", "broadcast_ints", "hosts_from_env", "init_group", "launched"]


@dataclass
class Group:
    """A group of ranks (size 1: a plain process).

    Attributes:
        group: the mx.distributed.Group (None when size is 1 and no backend was asked for).
        backend: the backend asked for ("ring", "jaccl", "mpi", "nccl", "any"), or "none".
        rank, size: this process's rank and the group's size.
        hosts: the hosts of the launch's host file (ring: "ip:port" of each rank), [] when none.
    """

    group: Optional[mx.distributed.Group]
    backend: str
    rank: int = 0
    size: int = 1
    hosts: List[str] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        """Whether this is rank 0, the rank that reads input and writes output."""
        return self.rank == 0

    def describe(self) -> str:
        """One line for `doctor`: backend, size, rank and hosts."""
        hosts = f", hosts {' '.join(self.hosts)}" if self.hosts else ""
        return f"{self.backend}, size {self.size}, rank {self.rank}{hosts}"


def launched() -> bool:
    """Whether this process was started by `mlx.launch` (it sets MLX_RANK), or by mpirun (OMPI_COMM_WORLD_RANK)."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def hosts_from_env() -> List[str]:
    """The hosts of `mlx.launch`'s host file (MLX_HOSTFILE: a path to, or, as some launchers pass it, the
    JSON text of, a list of each rank's addresses), one entry per rank; [] when there is none or it cannot
    be read."""
    text = os.environ.get("MLX_HOSTFILE", "").strip()
    if not text:
        return []
    if not text.startswith("["):
        try:
            text = Path(text).read_text().strip()
        except OSError:
            return []
    try:
        hosts = json.loads(text) if text else []
    except ValueError:
        return []
    return [",".join(h) if isinstance(h, list) else str(h) for h in hosts]


def init_group(backend: str = "any", strict: bool = False) -> Group:
    """Join the group `mlx.launch` started this process in (mx.distributed.init).

    Args:
        backend: "any" (the first that works: MPI, ring, JACCL, NCCL, as MLX orders them), "ring", "jaccl",
            "mpi" or "nccl".
        strict: raise when the backend cannot start (a launched process always is strict).

    Returns:
        The Group; size 1 outside `mlx.launch`.

    Raises:
        MlxInferError: an unknown backend.
        DistributedError: a launched process whose backend could not start (peers unreachable, a
            backend this machine lacks).
    """
    if backend not in BACKENDS:
        raise MlxInferError(f"unknown distributed backend {backend!r}; use one of {', '.join(BACKENDS)}")
    strict = strict or launched()
    try:
        group = mx.distributed.init(strict=strict, backend=backend)
    except RuntimeError as e:  # MLX's own message, kept on one line
        raise DistributedError(f"the {backend} backend could not start ({' '.join(str(e).split())}); check "
                               "the hosts and that every rank runs under the same mlx.launch") from e
    if group.size() == 1 and not launched():
        return Group(None, "none")
    return Group(group, backend if backend != "any" else _launched_backend(), group.rank(), group.size(),
                 hosts_from_env())


def _launched_backend() -> str:
    """The backend "any" found, from what the launcher set: mpirun (OMPI_*), JACCL (MLX_IBV_DEVICES or
    MLX_JACCL_COORDINATOR), NCCL (NCCL_HOST_IP), ring (MLX_HOSTFILE); "any" when none of those."""
    env = os.environ
    for name, backend in (("OMPI_COMM_WORLD_RANK", "mpi"), ("MLX_IBV_DEVICES", "jaccl"),
                          ("MLX_JACCL_COORDINATOR", "jaccl"), ("NCCL_HOST_IP", "nccl"), ("MLX_HOSTFILE", "ring")):
        if name in env:
            return backend
    return "any"


def broadcast_ints(group: Group, values: Optional[Sequence[int]], length: int, what: str = "inputs") -> List[int]:
    """Rank 0's `values` on every rank: an int32 all_sum of rank 0's values and zeros elsewhere.

    Args:
        group: the Group (size 1: `values` back as they are).
        values: rank 0's ints (|v| < 2**31); ignored on the other ranks (None there).
        length: how many ints (every rank must pass the same length: send it first with length 1 when
            only rank 0 knows it).
        what: what is sent, for the error of a step that does not finish.

    Returns:
        The ints, length `length`.

    Raises:
        DistributedError: a peer lost or silent past the step timeout (watchdog.guarded).
    """
    if group.size == 1:
        return list(values)
    mine = mx.array(list(values), dtype=mx.int32) if group.is_root else mx.zeros((length,), dtype=mx.int32)
    if mine.shape != (length,):
        raise DistributedError(f"rank 0 broadcasts {mine.shape[0]} {what}, the others expect {length}")
    out = mx.distributed.all_sum(mine, group=group.group)
    return guarded(lambda: out.tolist(), f"broadcasting {what}", group.rank)


def broadcast_list(group: Group, values: Optional[Sequence[int]], what: str = "inputs") -> List[int]:
    """Rank 0's list of ints of any length on every rank (its length first, then the list)."""
    (n,) = broadcast_ints(group, [len(values)] if group.is_root else None, 1, f"the length of {what}")
    return broadcast_ints(group, values, n, what) if n else []
