"""One device's SuperNode as ``fedasync client`` runs it.

``python -m fedasync.deploy.supernode [--poll-interval S] [--no-warm] -- <flower-supernode args>``
runs Flower's ``flower-supernode`` in this process with two changes:

- **poll interval**: Flower's SuperNode asks the SuperLink for a message every 3 s when it has
  none (a constant in ``flwr.supernode.start_client_internal``) and checks for the ClientApp's
  reply every 0.5 s; here the first is ``--poll-interval`` (default 1 s) and the second 0.05 s
  (a local check). That module's ``time`` is replaced by a stand-in whose ``sleep`` maps those
  two values, and its ``pull_objects`` retries after 0.05 s instead of 1 s; everything else is
  Flower's.
- **warm trainer** (unless ``--no-warm``): the SuperNode runs with ``--isolation process`` and
  a watchdog thread keeps one :mod:`fedasync.clients.warm` trainer running next to it, told this
  SuperNode's Runtime API port (``--port``, which ``fedasync client`` always passes) and pid: it
  serves that port only once this process listens there; the first
  is forked from this process once Flower is imported (before any thread starts), a trainer that
  dies is started again as ``python -m fedasync.clients.warm`` after a growing pause; the
  trainer exits when the SuperNode does.

With ``--no-warm`` the SuperNode starts Flower's SuperExec and a fresh ``flwr-clientapp``
process per message, as plain ``flower-supernode`` does.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import threading
import time

REPLY_CHECK_S = 0.05
FLOWER_POLL_S = 3  # the values flwr.supernode.start_client_internal sleeps (1.42)
FLOWER_REPLY_CHECK_S = 0.5


class PollClock:
    """Stands in for the ``time`` module inside ``flwr.supernode.start_client_internal``."""

    def __init__(self, poll_interval: float, reply_check: float = REPLY_CHECK_S):
        self.poll_interval = poll_interval
        self.reply_check = reply_check

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_POLL_S:
            seconds = self.poll_interval
        elif seconds == FLOWER_REPLY_CHECK_S:
            seconds = min(seconds, self.reply_check)
        time.sleep(seconds)


def patch_poll(poll_interval: float) -> bool:
    """Shorten the SuperNode's idle poll; False (and Flower's 3 s) if Flower's module moved.
    Also: the message's objects are asked for again after 0.05 s (doubling up to 1 s) instead of
    Flower's 1 s (doubling up to 10 s) when the SuperLink does not have them all yet."""
    try:
        import flwr.supernode.start_client_internal as sci
    except ImportError:
        return False
    if getattr(sci, "time", None) is not time:
        return False
    sci.time = PollClock(poll_interval)
    pull = getattr(sci, "pull_objects", None)
    if callable(pull):
        sci.pull_objects = functools.partial(pull, initial_backoff=0.05, backoff_cap=1.0)
    return True


def runtime_port(flower_args: list[str]) -> int:
    """The SuperNode's Runtime API port from its arguments (Flower's default 9094)."""
    for i, a in enumerate(flower_args):
        if a == "--port" and i + 1 < len(flower_args):
            return int(flower_args[i + 1])
        if a.startswith("--port="):
            return int(a.split("=", 1)[1])
    return 9094


class TrainerWatchdog:
    """Keeps one warm trainer process running next to this SuperNode."""

    def __init__(self, port: int, max_pause: float = 30.0):
        self.port = port
        self.max_pause = max_pause
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "fedasync.clients.warm", "--runtime-api-address", f"127.0.0.1:{self.port}",
                "--parent-pid", str(os.getpid())]

    def fork_first(self) -> int:
        """The first trainer, forked from this process before the SuperNode starts any thread:
        it finds Flower already imported (a second interpreter would import it again)."""
        from fedasync.deploy.processes import die_with_parent

        args = self.command()[3:]  # the SuperNode's pid, taken here
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the trainer
            try:
                die_with_parent()
                from fedasync.clients.warm import main as trainer

                trainer(args)
            finally:
                os._exit(0)
        return pid

    def run(self, first_pid: int | None = None) -> None:
        from fedasync.deploy.processes import die_with_parent

        pause = 1.0
        pid = first_pid
        while True:
            t0 = time.monotonic()
            self.starts += 1
            if pid is not None:
                rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                pid = None
            else:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
                rc = self.proc.wait()
            pause = 1.0 if time.monotonic() - t0 > 60 else min(pause * 2, self.max_pause)
            print(f"fedasync client: the warm trainer exited ({rc}); starting it again in {pause:.0f} s",
                  file=sys.stderr, flush=True)
            time.sleep(pause)

    def start(self) -> threading.Thread:
        first = self.fork_first()
        t = threading.Thread(target=self.run, args=(first,), name="fedasync-trainer-watchdog", daemon=True)
        t.start()
        return t


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, flower_args = argv[:i], argv[i + 1:]
    else:
        own, flower_args = argv, []
    ap = argparse.ArgumentParser(description="fedasync SuperNode (started by `fedasync client`)")
    ap.add_argument("--poll-interval", type=float, default=1.0)
    ap.add_argument("--no-warm", action="store_true")
    args = ap.parse_args(own)
    if not patch_poll(args.poll_interval):
        print("fedasync client: this Flower's SuperNode poll cannot be changed; it polls every 3 s",
              file=sys.stderr, flush=True)
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if not args.no_warm:
        if "--isolation" not in flower_args:
            flower_args += ["--isolation", "process"]
        import fedasync.clients.app  # noqa: F401  (shared with the trainer forked next)
        import flwr.supernode.runtime.run_clientapp  # noqa: F401

        TrainerWatchdog(runtime_port(flower_args)).start()

    sys.argv = ["flower-supernode", *flower_args]
    try:
        flower_supernode()
    except RuntimeError as e:  # another process took the port after `fedasync client` checked it
        if "Runtime HTTP API failed to start" not in str(e):
            raise
        print(f"fedasync client: error: --port: 127.0.0.1:{runtime_port(flower_args)} is in use (another "
              "SuperNode?): give another --port, or none for a free one", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
