"""Runs one command of the CPU kernels' build (cmake) so that it never outlives the Python that started it.

Run as a script by path, never imported (mlx_infer.kernels.cpu starts it with `python -I`, so it imports
only the standard library and costs ~20 ms):

    python -I build_guard.py LOCK TIMEOUT_S -- cmake --build ...

It holds an exclusive flock on LOCK (a file in the build tree) while the command and every process it
started (make, the compilers: one process group of their own) may still run, so that a later build never
touches a tree whose builder is alive. It stops that whole process group (SIGTERM, then SIGKILL after
STOP_GRACE_S) when

- its stdin reaches end of file: the parent closed the pipe, or died in any way (Ctrl-C, SIGTERM, even
  SIGKILL: the kernel closes the parent's end of the pipe), so no compiler is left running as an orphan;
- the command runs past TIMEOUT_S seconds (exit status 124);
- it is itself sent SIGTERM, SIGINT or SIGHUP.

Its exit status is the command's (128 + N when signal N stopped it). Output: the command's, on its own
stdout (the parent reads it for the log and the progress line).
"""

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

#: Seconds the stopped group has to exit after SIGTERM, and again after SIGKILL.
STOP_GRACE_S = 5.0
#: Exit status when the command ran past its time limit (as coreutils' timeout).
TIMED_OUT = 124


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after STOP_GRACE_S to what is left; returns once the
    group is gone (or after a second grace period: a process stuck in the kernel cannot be waited for)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            child.poll()  # reap the leader: a zombie keeps its group alive
            if not _group_alive(child.pid):
                return
            time.sleep(0.05)


def main(argv: list) -> int:
    """argv: [LOCK, TIMEOUT_S, '--', command...]. Returns the exit status (see the module docstring)."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: build_guard.py LOCK TIMEOUT_S -- COMMAND...", file=sys.stderr)
        return 2
    lock_path, timeout_s, cmd = argv[0], float(argv[1]), argv[3:]
    stopped = threading.Event()

    def on_signal(signum, frame):
        stopped.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)

        def watch_parent():
            while os.read(0, 4096):  # b"" at end of file: the parent is gone or gave up (unbuffered: no
                pass  # lock of sys.stdin's is held when the interpreter exits)
            stopped.set()

        threading.Thread(target=watch_parent, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while child.poll() is None and not stopped.is_set() and time.monotonic() < deadline:
            stopped.wait(0.1)
        timed_out = child.poll() is None and not stopped.is_set()
        stop_group(child)  # (also any process the command left behind when it exited by itself)
        rc = child.wait()
        if timed_out:
            print(f"build_guard: {' '.join(cmd[:2])} ran past {timeout_s:.0f} s; stopped", flush=True)
            return TIMED_OUT
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
