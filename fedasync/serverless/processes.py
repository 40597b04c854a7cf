"""Peer processes: start ``python -m fedasync ...`` in its own process group, stop by PID.

What a peer must not show on its command line (the store URL, whose password ``ps`` would show
every user of the machine) goes in its environment (``env``), which only its owner can read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the environment variable a peer process reads its store URL from (``--store``'s default)
STORE_ENV = "FEDASYNC_STORE"


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m fedasync <argv>`` in its own process group, output to ``log_path`` (0600,
    in a 0700 directory), with ``env`` added to this process's environment."""
    from fedasync.private import open_private, private_dir

    private_dir(log_path.parent)
    f = open_private(log_path, "ab")
    env = dict(os.environ, **(env or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    try:
        return subprocess.Popen([sys.executable, "-m", "fedasync", *argv], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        f.close()


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 20.0) -> list[int | None]:
    """Wait up to ``grace_s`` for every process to exit, then SIGTERM, then SIGKILL, by PID.

    Returns the exit codes. Only the processes in ``procs`` (which this runner started) and
    their own process groups are signalled.
    """
    deadline = time.monotonic() + grace_s
    for p in procs:
        left = deadline - time.monotonic()
        if p.poll() is None and left > 0:
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pass
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the group this runner created for it (start_new_session)
            except (ProcessLookupError, PermissionError):
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return [p.poll() for p in procs]
