"""Liveness: no update can stall a run.

* **Every new model version is finite.** A finite but huge update times a ``server.server_lr``
  above 1 (or central-DP noise) can overflow the model to inf; from then on every reply would be
  ``non_finite`` and the run would never end. :func:`aggregate` hands an accepted update to the
  strategy and checks the model it returns (every array, :func:`~fedasync.server.validation.all_finite`)
  before the loop commits anything. A non-finite model is discarded
  (:meth:`~fedasync.server.strategies.Strategy.discard`): the updates it was made of (fedasync: that
  one; fedbuff: the buffered ones; fedavg: the round's) are rejected ``non_finite_model``, the
  previous version stays, and so does the strategy's state, except that its buffer no longer holds
  them (fedbuff's held updates, under central DP, enter the buffer as after a release; a fedavg
  round is open again). The updates buffered earlier had been counted accepted: their rows are
  rewritten rejected in the reply's transaction (``Store.record_reply(rejected=...)``) and the
  loop's counts follow. A central-DP release stays counted (its noise was drawn), and a robust
  filter that remembers each client's last judged update (kardam) keeps remembering it.
* **A deployment with no client waits, not for ever** (:func:`wait_for_clients`).
* **A run that accepts nothing stops.** :func:`rejected_in_a_row` counts the taken replies since
  the last accepted update that still stands (:class:`Liveness`, loop state: it survives a
  resume); at ``server.max_rejected_in_a_row`` (0 or null: never) the run stops with
  ``stop_reason`` ``no_progress`` and one error line.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fedasync.server.validation import all_finite

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer
    from fedasync.server.strategies import Update

log = logging.getLogger("fedasync")

NON_FINITE_MODEL = "non_finite_model"
NO_PROGRESS = "no_progress"


def model_finite(params: dict[str, np.ndarray]) -> bool:
    """Whether every value of every array of ``params`` is finite."""
    return all(all_finite(np.asarray(a)) for a in params.values())


class Liveness:
    """What the loop keeps to count the replies taken since the last accepted update that still
    stands (``srv.received`` numbers the taken replies): the number of the last one accepted and
    not discarded since (``accepted_at``), of the one that made the current version
    (``version_at``), and each buffered update's staleness and number (``pending``). An update
    discarded with a non-finite model no longer counts as accepted: the count then runs from the
    latest update still standing (the current version's, or a held one's under central DP), so
    a run whose every aggregation overflows stops too. Loop state (``resume.loop_state``)."""

    def __init__(self) -> None:
        self.accepted_at = self.version_at = 0
        self.pending: dict[int, tuple[int, int]] = {}  # buffered task id -> (staleness, reply number)
        self.logged = False

    def state_dict(self) -> dict[str, Any]:
        return {"accepted_at": self.accepted_at, "version_at": self.version_at,
                "pending": [[t, s, i] for t, (s, i) in self.pending.items()]}

    def load_state_dict(self, d: dict[str, Any] | None, received: int) -> None:
        """``d`` None (a loop state written before): the count starts again at ``received``."""
        d = d or {"accepted_at": received, "version_at": received, "pending": []}
        self.accepted_at, self.version_at = int(d["accepted_at"]), int(d["version_at"])
        self.pending = {int(t): (int(s), int(i)) for t, s, i in d["pending"]}


def rejected_in_a_row(srv: AsyncServer) -> int:
    """The replies taken since the last accepted update that still stands."""
    return srv.received - srv.liveness.accepted_at


def aggregate(srv: AsyncServer, upd: Update) -> tuple[Any, str | None, dict[int, str]]:
    """``srv.strategy.add`` of an accepted ``upd`` (the reply numbered ``srv.received``), checked:
    ``(new model or None, None, {})``, or, when the new model is not finite,
    ``(None, "non_finite_model", {earlier task: reason})`` with the strategy put back (see the
    module docstring) and the earlier updates' counts undone."""
    live = srv.liveness
    before = srv.strategy.undo_state()
    new = srv.strategy.add(srv.params, upd, srv.version)
    if new is None:  # buffered: kept, should the aggregation it joins be discarded
        live.pending[upd.task_id] = (upd.staleness, srv.received)
        return None, None, {}
    made_of = srv.strategy.last_aggregated()
    popped = {t: live.pending.pop(t, None) for t in made_of}
    if model_finite(new):
        live.version_at = srv.received
        return new, None, {}
    srv.strategy.discard(before)
    earlier = [t for t in made_of if t != upd.task_id]
    for t in earlier:
        srv.accepted -= 1
        if popped[t] is not None:  # (None: buffered before a resume from a loop state without it)
            srv.staleness.remove(popped[t][0])
    srv.rejections[NON_FINITE_MODEL] = srv.rejections.get(NON_FINITE_MODEL, 0) + len(earlier)
    live.accepted_at = max([live.version_at] + [i for _, i in live.pending.values()])
    log.warning("the update(s) of task(s) %s made a non-finite model: rejected (%s); the model stays at "
                "version %d", ", ".join(map(str, made_of)), NON_FINITE_MODEL, srv.version)
    return None, NON_FINITE_MODEL, {t: NON_FINITE_MODEL for t in earlier}


def taken(srv: AsyncServer, reason: str | None) -> None:
    """A taken reply, accepted (``reason`` None) or rejected."""
    if reason is None:
        srv.liveness.accepted_at = srv.received


def stalled(srv: AsyncServer) -> bool:
    """Whether the last ``server.max_rejected_in_a_row`` replies taken have no accepted update that
    still stands (logged once)."""
    limit = srv.cfg.server.max_rejected_in_a_row
    if not limit or rejected_in_a_row(srv) < limit:
        return False
    if not srv.liveness.logged:
        srv.liveness.logged = True
        log.error("no update accepted in the last %d replies (server.max_rejected_in_a_row: %d): the run stops "
                  "(%s)", rejected_in_a_row(srv), limit, NO_PROGRESS)
    return True


def wait_for_clients(srv: AsyncServer) -> bool:
    """Wall clock: nothing could be dispatched. Wait (discovering nodes) while some client that
    is not exhausted may still appear; False once ``deploy.node_discovery_timeout`` has passed."""
    if srv.virtual or srv.available_clients is None:
        return False
    if len(srv.exhausted) >= srv.cfg.data.num_clients:
        return False
    now = time.monotonic()
    if srv._no_client_since is None:
        srv._no_client_since = now
        log.info("waiting for clients (nodes) to connect")
    if now - srv._no_client_since > srv.cfg.deploy.node_discovery_timeout:
        return False
    srv._refresh()
    time.sleep(max(srv.cfg.server.poll_interval, 0.2))
    return True
