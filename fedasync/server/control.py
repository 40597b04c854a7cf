"""Stopping a run: from outside (SIGINT/SIGTERM, and in deployment the store's ``stopping``
status), and when no client can be given a task.

The loop asks :meth:`StopControl.requested` before each step; a first signal stops it after the
reply being handled, a second raises ``KeyboardInterrupt`` (stop at once).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger("fedasync")


class StopControl:
    """``poll_store`` (deployment) is asked at most once a second whether the run is ``stopping``
    (``fedasync server``'s Ctrl-C, from another process)."""

    def __init__(self, poll_store: Callable[[], bool] | None = None):
        self.poll_store = poll_store
        self.signal: int | None = None
        self._asked = False
        self._last_check = 0.0

    def requested(self) -> bool:
        if self.signal is not None or self._asked:
            return True
        if self.poll_store is None or time.monotonic() - self._last_check < 1.0:
            return False
        self._last_check = time.monotonic()
        try:
            self._asked = bool(self.poll_store())
        except Exception:  # the store being briefly unreachable is not a stop request
            return False
        return self._asked

    @contextmanager
    def signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM while inside: stop after the reply being handled; a second one stops at
        once. Only in the main thread (elsewhere Python cannot install handlers)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.signal is not None:
                raise KeyboardInterrupt
            self.signal = signum
            log.warning("%s: stopping after the reply being handled (again to stop at once)",
                        signal.Signals(signum).name)

        prev = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                prev[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        try:
            yield
        finally:
            for sig, h in prev.items():
                signal.signal(sig, h)


def no_task_reason(num_clients: int, exhausted: int, deployment: bool) -> str:
    """Why no task is live and none could be dispatched (``exhausted``: clients out of privacy
    budget; ``deployment``: clients come and go with their nodes). Logged."""
    n, k = num_clients, exhausted
    if deployment and k < n:
        log.warning("stopping (no_client_available): no client could be given a task within "
                    "deploy.node_discovery_timeout (%d of %d exhausted their privacy budget)", k, n)
        return "no_client_available"
    if k == n:
        log.warning("stopping (no_client_can_train): all %d clients have exhausted their privacy "
                    "budget (privacy_budget_exhausted); see `fedasync privacy report`", n)
    else:
        log.warning("stopping (no_client_can_train): no client could be given a task "
                    "(%d of %d exhausted their privacy budget, the others are unavailable)", k, n)
    return "no_client_can_train"
