"""Running tests/distributed/rank_script.py under `mlx.launch -n N --backend ring` on 127.0.0.1 (a module of
its own: test modules import it, never conftest)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "rank_script.py"
#: Per-launch limit, there only to fail a hang (loading the default model on each rank of a busy 2-core
#: machine takes about a minute).
TIMEOUT_S = 900


def mlx_launch() -> Optional[str]:
    """The `mlx.launch` of the interpreter running the tests (its venv's bin dir), else PATH's."""
    here = Path(sys.executable).parent / "mlx.launch"
    return str(here) if here.exists() else shutil.which("mlx.launch")


def free_port_block(n: int = 4) -> int:
    """A port p such that p .. p + n - 1 were free just now (the ring backend listens on consecutive ports
    from --starting-port; tests running at once must not share them)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_free(base + i) for i in range(1, n)):
            return base
    raise RuntimeError("no block of free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch(args: List[str], n: int = 2, env: Optional[dict] = None,
           script: Optional[Path] = SCRIPT) -> subprocess.CompletedProcess:
    """`mlx.launch -n N --backend ring --python <this python> -- script args...` on this machine (script None:
    the python arguments are `args`, e.g. -m mlx_infer generate ...)."""
    cmd = [mlx_launch(), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port_block(2 * n)),
           "--python", sys.executable, "--", *([str(script)] if script is not None else []), *args]
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=full_env)


def one_process(args: List[str], env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """The same script as one plain process (group size 1)."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        full_env.pop(name, None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=full_env)


def result(out: Path, rank: int) -> dict:
    """A rank's JSON result, with its logits [T, V] float32 under "logits"."""
    data = json.loads((out / f"rank{rank}.json").read_text())
    data["logits"] = np.load(out / f"logits{rank}.npy")
    return data
