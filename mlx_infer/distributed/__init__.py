"""One model over several processes and machines on MLX's distributed layer (`mx.distributed`), launched with
`mlx.launch` (docs/distributed.md).

    group = init_group("ring")                                # group.py: rank, size, backend, hosts
    shard = load_sharded(None, group, parallel="auto")        # load.py: this rank's part of the model
    for token in lockstep_tokens(shard, ids, params): ...     # generate.py: rank 0 decides, all ranks step

tensor.py (tensor parallel on the CPU kernel layers or MLX's), pipeline.py (contiguous layer ranges),
digest.py (the same model files on every rank), watchdog.py (bounded waits: a lost rank ends the job),
commands.py (rank 0's command loop between requests: heartbeats while idle), front.py (LeadEngine: rank 0's
engine for the chat and the server).
"""

from .generate import LockstepStats, lockstep_tokens
from .group import Group, broadcast_ints, broadcast_list, init_group, launched
from .load import Shard, choose_parallel, load_sharded

__all__ = ["Group", "LockstepStats", "Shard", "broadcast_ints", "broadcast_list", "choose_parallel", "init_group",
           "launched", "load_sharded", "lockstep_tokens"]
