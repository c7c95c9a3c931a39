"""Run under `mlx.launch` by the distributed tests (or as one process): load a shard, generate in lockstep,
write this rank's result as JSON to OUT_DIR/rank<r>.json.

    python rank_script.py OUT_DIR MODEL|default PARALLEL [MAX_TOKENS] [PROMPT_IDS_JSON] [LAYERS]

MODEL may hold "%r", replaced by the rank (each rank its own file: the mismatched-files test).

Env: KILL_RANK=r and KILL_AFTER=n: rank r exits abruptly (os._exit) after n tokens (a rank lost mid-request);
HANG_RANK=r: rank r stops answering after KILL_AFTER tokens (sleeps, its sockets open).
"""

import json
import os
import sys
import time
from pathlib import Path

import mlx_infer  # noqa: F401  (first: the optimized BLAS)
import mlx.core as mx
import numpy as np

from mlx_infer.distributed import LockstepStats, init_group, load_sharded, lockstep_tokens
from mlx_infer.distributed.watchdog import on_terminate
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.sampling import SamplingParams


def main() -> int:
    out_dir, model, parallel = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    prompt = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    layers = sys.argv[6] if len(sys.argv) > 6 else "kernels"
    group = init_group("any")
    on_terminate(group.rank)
    kill_rank, kill_after = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_AFTER", "0"))
    hang_rank = int(os.environ.get("HANG_RANK", "-1"))
    try:
        model = model.replace("%r", str(group.rank))
        shard = load_sharded(None if model == "default" else model, group, parallel, layers=layers)
        tok = shard.tokenizer
        ids = prompt if prompt is not None else tok.encode("The capital of France is")
        stats = LockstepStats()
        tokens = []
        for t in lockstep_tokens(shard, ids if group.is_root else None, SamplingParams(max_tokens=max_tokens),
                                 eos_ids=(), stats=stats):
            tokens.append(t)
            if group.rank == kill_rank and len(tokens) == kill_after:
                os._exit(9)
            if group.rank == hang_rank and len(tokens) == kill_after:
                time.sleep(3600)
        # the last logits of the whole sequence, for the tolerance checks
        logits = shard.model(mx.array([ids + tokens[:-1]], dtype=mx.uint32))[0].astype(mx.float32)
        mx.eval(logits)
    except MlxInferError as e:
        if group.is_root:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / f"logits{group.rank}.npy", np.array(logits))  # [T, V]
    (out_dir / f"rank{group.rank}.json").write_text(json.dumps({
        "rank": group.rank, "size": group.size, "parallel": shard.parallel, "detail": shard.detail,
        "prompt": ids, "tokens": tokens,
        "decode_s": stats.decode_s, "broadcast_s": stats.broadcast_s, "steps": len(stats.step_s),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
