"""Stopping a run: from outside (SIGINT/SIGTERM, and in deployment the store's ``stopping``
status), and when no client can be given a task; and cancelling the backup workers' tasks that a
synchronous round dropped (:func:`cancel_dropped`).

The loop asks :meth:`StopControl.requested` before each step; a first signal stops it after the
reply being handled, a second raises ``KeyboardInterrupt`` (stop at once).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer

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


def no_task_reason(srv: "AsyncServer") -> str:
    """Why no task is live and none could be dispatched; logged. First, every client the
    scheduler will not pick because its next task would exceed its privacy budget
    (``budget_aware``, which never sends such a task, so the client never refuses one) is marked
    exhausted like a client that refused (reason ``next_task_over_budget``): the stop message and
    ``fedasync privacy report`` then count it as out of budget, not as unavailable."""
    n = srv.cfg.data.num_clients
    rest = [c for c in range(n) if c not in srv.exhausted]
    for c in sorted(set(rest) - set(srv.policy.eligible(rest))):
        srv.exhausted.add(c)
        srv.store.mark_exhausted(srv.run_id, c, NEXT_TASK_OVER_BUDGET)
    k = len(srv.exhausted)
    if srv.available_clients is not None and k < n:  # deployment: clients come and go with their nodes
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


#: why a client the ``budget_aware`` scheduler would never pick again is marked exhausted
NEXT_TASK_OVER_BUDGET = "next_task_over_budget"


#: the error a dispatch cancelled by its round's close is recorded with (status ``cancelled``)
ROUND_CLOSED = "round_closed"


def backups_spend(srv: "AsyncServer") -> bool:
    """Whether :func:`cancel_dropped` takes the cancelled backups' replies for their privacy spend
    (local DP under the virtual clock), so that a resume resends them rather than cancelling them."""
    return srv.virtual and srv.cfg.privacy.local_dp.enabled


def cancel_dropped(srv: "AsyncServer") -> list[int]:
    """Synchronous FedAvg with backup workers (Chen et al. 2016): when a round closes after its
    first ``m`` replies, the ``b`` tasks still live are cancelled: recorded ``cancelled`` (error
    ``round_closed``) and taken out of the live set, so that all ``m + b`` clients restart together
    on the new model. Under the wall clock a late reply of such a task is still pulled and rejected
    as ``round_closed`` without occupying a slot; under the virtual clock it is never taken.
    Every live task of a synchronous run whose base is not the current version is such a task (a
    round's tasks all carry its version), which is also how resume finds them after a crash.

    Under local DP a backup's client trained all the same, and its next task carries the privacy
    record that composes its budget: so under the virtual clock the loop waits for the cancelled
    tasks' replies here and takes them (rejected ``round_closed``, their spend recorded) before any
    of their clients is sent another task (under the wall clock the late reply records it)."""
    if not srv.strategy.synchronous:
        return []
    dropped = sorted(tid for tid, t in srv.live.items() if t.base_version != srv.version)
    spent = backups_spend(srv)
    if spent:
        srv._wait_for(dropped)
    late = []
    for tid in dropped:
        t = srv.live.pop(tid)
        reply = srv.arrived.pop(tid, None)
        srv.store.set_dispatch_status(srv.run_id, tid, "cancelled", ROUND_CLOSED)
        if (spent or not srv.virtual) and reply is not None:  # already pulled, behind the round's m-th reply
            late.append((t, reply))
        elif not srv.virtual and t.message_id is not None:
            srv.cancelled[t.message_id] = t
    for t, reply in late:
        srv.take_cancelled(t, reply)
    return dropped


def open_messages(srv: "AsyncServer") -> list[str]:
    """Message ids of ``srv``'s tasks still in flight and of its cancelled backups (after a run:
    what it left on the Grid, for ``GridTransport.drain``)."""
    return [t.message_id for t in srv.live.values() if t.message_id] + list(srv.cancelled)
