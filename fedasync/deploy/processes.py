"""Flower's processes: starting them (the right executables and environment, dying with their
parent), waiting for their ports, stopping them and what they started (by PID and start time,
from /proc), and the ``flower-supernode`` command line of one device."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from fedasync.deploy import DeployError


def child_env(**extra: str) -> dict[str, str]:
    """The environment for Flower's processes: this interpreter's bin directory first on PATH,
    since flower-supernode and flower-superlink start further Flower executables by name
    (flower-superexec, flwr-clientapp, flwr-serverapp) even when the venv is not activated."""
    env = dict(os.environ, **extra)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def exe(name: str) -> str:
    """A console script of this environment (next to the interpreter), else on PATH."""
    p = Path(sys.executable).with_name(name)
    if p.exists():
        return str(p)
    found = shutil.which(name)
    if not found:
        raise DeployError(f"{name}: not found (is flwr installed in this environment?)")
    return found


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM when its parent dies, even by SIGKILL (no orphan SuperLink)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def parse_address(addr: str, what: str = "--superlink") -> tuple[str, int]:
    """``HOST:PORT`` (or ``[IPv6]:PORT``) -> (host, port); DeployError naming ``what`` if not."""
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", addr.strip())
    if not m or not 0 < int(m.group(2)) < 65536:
        raise DeployError(f"{what}: expected HOST:PORT, got {addr!r}")
    return m.group(1), int(m.group(2))


def check_port_free(host: str, port: int) -> None:
    """DeployError (exit 2, naming ``--port``) when ``host:port`` cannot be bound because something
    (another SuperLink) listens there: Flower's gRPC server binds with SO_REUSEPORT, so a second
    SuperLink would start "fine" and our run would be submitted to the first one."""
    import errno

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        return  # a host we cannot resolve: the SuperLink says so itself
    for family, stype, proto, _, addr in infos[:1]:
        with socket.socket(family, stype, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise DeployError(f"--port: {host}:{port} is in use") from None


SUPERNODE_HOST = "127.0.0.1"  # where flower-supernode serves its local Runtime API (Flower's default --host)


def free_local_port(host: str = SUPERNODE_HOST) -> int:
    """A TCP port nothing is bound to on ``host`` now, chosen by the OS (a bind to port 0): the
    local port of a SuperNode started without ``--port``, so that several on one host differ."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid`` from /proc (Linux), None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below ``pid`` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    info = {}
    for p in entries:
        st = proc_stat(p)
        if st is not None:
            info[p] = st
            children.setdefault(st[0], []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, info[c][2]))
            todo.append(c)
    return out


def alive(pid: int, start: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def stop_process(proc: subprocess.Popen, timeout: float = 10.0, tree: bool = True) -> None:
    """SIGTERM, then SIGKILL after ``timeout``: the process we started, by its PID, and (``tree``)
    the processes it started (Flower's SuperExec, ServerApp and ClientApp processes), found by
    walking /proc before it is stopped; each is checked by PID and start time before a signal."""
    below = descendants(proc.pid) if tree else []
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass
    # Flower's children exit when their parent does (they watch it); give them a moment
    t0 = time.monotonic()
    while any(alive(p, s) for p, s in below) and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [(p, s) for p, s in below if alive(p, s)]
        for p, s in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if left and sig == signal.SIGTERM:
            time.sleep(2.0)


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


MAX_POLL_INTERVAL = 3600


def supernode_command(superlink: str, partition_id: int, num_partitions: int, data: Optional[Path] = None,
                      root_certificates: Optional[Path] = None, insecure: bool = False,
                      auth_key: Optional[Path] = None, signing_key: Optional[Path] = None,
                      port: Optional[int] = None, device: Optional[str] = None,
                      privacy_state_dir: Optional[Path] = None, max_wait_time: Optional[float] = None,
                      poll_interval: float = 1.0, warm: bool = True,
                      privacy_policy: Optional[Path] = None, task: Optional[str] = None) -> list[str]:
    """The command line of one device's SuperNode: Flower's ``flower-supernode`` run by
    :mod:`fedasync.deploy.supernode` (its idle poll every ``poll_interval`` seconds; ``warm``: a
    warm trainer next to it instead of a new ``flwr-clientapp`` process per message)."""
    node = {"partition-id": partition_id, "num-partitions": num_partitions, "deployed": True}
    if data is not None:
        node["data-path"] = str(data.resolve())
    if signing_key is not None:
        node["signing-key"] = str(signing_key.resolve())
    if device:
        node["device"] = device
    if privacy_state_dir is not None:
        node["privacy-state-dir"] = str(privacy_state_dir.resolve())
    if privacy_policy is not None:  # the device's DP policy (fedasync.privacy.policy), as JSON
        node["privacy-policy"] = str(privacy_policy.resolve())
    if task is not None:  # the device's own task module (fedasync.task.interface), imported by its ClientApp
        node["task"] = task
    node_config = " ".join(f"{k}={json.dumps(v)}" for k, v in node.items())
    if not 0 < poll_interval <= MAX_POLL_INTERVAL:  # inf or 1e300: Flower would sleep for ever
        raise DeployError(f"--poll-interval: {poll_interval:g} is not in (0, {MAX_POLL_INTERVAL}] seconds")
    cmd = [sys.executable, "-m", "fedasync.deploy.supernode", "--poll-interval", f"{poll_interval:g}",
           *([] if warm else ["--no-warm"]), "--", "--superlink", superlink, "--node-config", node_config]
    if insecure:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(root_certificates.resolve())]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key.resolve())]
    if port is not None:
        cmd += ["--port", str(port)]
    if max_wait_time is not None:
        cmd += ["--max-wait-time", str(max_wait_time)]
    return cmd
