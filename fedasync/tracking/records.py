"""A run's tracking records: one per evaluation (a row of ``history.csv``), built from the run's
history and the store's dispatch and update rows, so that a resumed run's records cover the whole run.

A record is a flat dict: ``step`` (the evaluation's index in the run's history: 0, 1, 2, ...; the
evaluation grid of ``server.eval_every_s`` can evaluate one version at several grid times, so the
version would repeat), ``virtual_time_s``, ``async/version`` (the model version evaluated),
``eval/<metric>`` for every metric of the evaluation, and the figures of the run up to that
evaluation's virtual time (the updates received at or before it):

* ``train/loss``: the mean loss the clients reported with the updates accepted since the previous
  evaluation (absent when none reported one);
* ``async/staleness_mean``, ``async/staleness_max``: over the accepted updates so far;
* ``async/updates_received``, ``async/updates_accepted``, ``async/updates_rejected/<reason>``;
* ``privacy/epsilon_max``, ``privacy/epsilon_mean``: over every client, from the ε each reported
  (local DP only);
* ``participation/jain``, ``participation/never``: from the dispatches sent so far.

Histograms (per version, one value per client) are kept apart in :attr:`Record.histograms`:
``privacy/epsilon_clients`` (local DP) always, and with ``per_client`` also
``participation/dispatches_clients`` and ``async/staleness_clients`` (each client's mean staleness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


@dataclass
class Record:
    """One evaluation's figures: ``scalars`` (``step``, ``virtual_time_s`` and the tags above) and
    ``histograms`` (tag -> one value per client)."""

    scalars: dict[str, Any]
    histograms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.scalars["step"])

    @property
    def time(self) -> float:
        return float(self.scalars["virtual_time_s"])


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _key_up(u: Any) -> tuple:
    return round(float(u.received_virtual), 6), u.task_id


def _key_dis(d: Any) -> tuple:
    return round(float(d.sent_virtual), 6), d.task_id


class RecordBuilder:
    """The records of one run made one history row at a time, from the store's rows as they come
    (:meth:`add`, in any order and in as many parts as wanted): what :func:`records` makes in one
    pass and the live tracker (:mod:`fedasync.tracking.live`) as a run goes. A row's record counts
    the updates received and the dispatches sent at or before its virtual time (rounded to the
    microsecond), taken in the order (time, task id), so both make the same records once the rows
    up to that time are all added."""

    def __init__(self, num_clients: int, *, local_dp: bool = False, per_client: bool = False):
        self.n = n = max(int(num_clients), 1)
        self.local_dp, self.per_client = local_dp, per_client
        # added rows, sorted by (time, task id) when a row is made; those before ui/di are counted
        self.ups: list[Any] = []
        self.dis: list[Any] = []
        self.ui = self.di = 0
        self.index = 0  # the next record's step: the evaluation's index in the run's history
        self.received = self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.st_sum, self.st_max = 0.0, None
        self.losses: list[float] = []
        self.eps = [0.0] * n
        self.counts = [0] * n
        self.c_total = self.c_sq = self.seen = 0  # dispatches counted, sum of squared counts, clients dispatched
        self.st_by = [0.0] * n
        self.st_k = [0] * n

    def add(self, updates: Iterable[Any] = (), dispatches: Iterable[Any] = ()) -> None:
        """More of the store's update and dispatch rows (each added once)."""
        ups, dis = list(updates), list(dispatches)
        if ups:
            del self.ups[:self.ui]
            self.ui = 0
            self.ups.extend(ups)
            self.ups.sort(key=_key_up)
        if dis:
            del self.dis[:self.di]
            self.di = 0
            self.dis.extend(dis)
            self.dis.sort(key=_key_dis)

    def _count_updates(self, t: float) -> None:
        n, ups = self.n, self.ups
        while self.ui < len(ups) and round(float(ups[self.ui].received_virtual), 6) <= t:
            u = ups[self.ui]
            self.ui += 1
            self.received += 1
            c = u.client_id if 0 <= u.client_id < n else None
            if u.accepted:
                self.accepted += 1
                s = int(u.staleness)
                self.st_sum += s
                self.st_max = s if self.st_max is None else max(self.st_max, s)
                if c is not None:
                    self.st_by[c] += s
                    self.st_k[c] += 1
                if _finite(u.loss):
                    self.losses.append(float(u.loss))
            else:
                why = u.reason or "unknown"
                self.rejected[why] = self.rejected.get(why, 0) + 1
            if c is not None and _finite(u.epsilon):
                self.eps[c] = max(self.eps[c], float(u.epsilon))

    def _count_dispatches(self, t: float) -> None:
        dis = self.dis
        while self.di < len(dis) and round(float(dis[self.di].sent_virtual), 6) <= t:
            c = dis[self.di].client_id
            self.di += 1
            if 0 <= c < self.n:
                self.c_sq += 2 * self.counts[c] + 1  # (x+1)^2 - x^2
                self.seen += self.counts[c] == 0
                self.counts[c] += 1
                self.c_total += 1

    def record(self, row: dict) -> Record:
        """The record of the run's next history row (``version``, ``virtual_time_s``, metrics);
        its histograms fresh lists."""
        t = float(row["virtual_time_s"])
        self._count_updates(t)
        self._count_dispatches(t)
        n = self.n
        scalars: dict[str, Any] = {"step": self.index, "virtual_time_s": t, "async/version": int(row["version"])}
        self.index += 1
        scalars.update({f"eval/{k}": v for k, v in row.items() if k not in ("version", "virtual_time_s")})
        if self.losses:
            scalars["train/loss"] = sum(self.losses) / len(self.losses)
            self.losses = []
        scalars["async/staleness_mean"] = self.st_sum / self.accepted if self.accepted else None
        scalars["async/staleness_max"] = self.st_max
        scalars["async/updates_received"] = self.received
        scalars["async/updates_accepted"] = self.accepted
        scalars.update({f"async/updates_rejected/{r}": k for r, k in sorted(self.rejected.items())})
        hist: dict[str, list[float]] = {}
        if self.local_dp:
            scalars["privacy/epsilon_max"] = max(self.eps)
            scalars["privacy/epsilon_mean"] = sum(self.eps) / n
            hist["privacy/epsilon_clients"] = list(self.eps)
        c_sq, c_total = self.c_sq, self.c_total
        scalars["participation/jain"] = c_total * c_total / (n * c_sq) if c_sq else 1.0  # Jain's index
        scalars["participation/never"] = (n - self.seen) / n
        if self.per_client:
            hist["participation/dispatches_clients"] = [float(x) for x in self.counts]
            hist["async/staleness_clients"] = [self.st_by[c] / self.st_k[c] for c in range(n) if self.st_k[c]]
        return Record(scalars, hist)


def records(history: list[dict], updates: Iterable[Any], dispatches: Iterable[Any], num_clients: int,
            *, local_dp: bool = False, per_client: bool = False) -> Iterator[Record]:
    """The records of a run whose evaluations are ``history`` (rows ``version``, ``virtual_time_s``,
    metrics), whose store holds ``updates`` (rows with ``received_virtual``, ``staleness``,
    ``accepted``, ``reason``, ``loss``, ``epsilon``, ``client_id``, ``task_id``) and ``dispatches``
    (rows with ``sent_virtual``, ``client_id``, ``task_id``); ``local_dp``: per-client ε figures. A
    generator: one record at a time (:class:`RecordBuilder`), its histograms fresh lists (nothing of
    10,000 clients' is kept per version)."""
    b = RecordBuilder(num_clients, local_dp=local_dp, per_client=per_client)
    b.add(updates, dispatches)
    for row in history:
        yield b.record(row)


#: history.csv columns of a ledger or gossip run that are no metric of their own
_SERVERLESS_SKIP = ("version", "time_s", "virtual_time_s", "wall_time_s")


def serverless_records(summary: dict) -> list[Record]:
    """The records of a ledger or gossip run, from its ``summary`` (``history``: ``version``,
    ``time_s`` (virtual with ``--virtual``, else wall seconds), ``accuracy``, ``loss``, ...): ``step``
    the row's index and ``async/version`` its model index, as a server run's records (the grid may
    evaluate one model at several times), ``eval/<metric>`` for each accuracy and loss column, ``<mode>/<column>`` for the others (the
    ledger's ``height``, gossip's ``consensus_distance``, ``events``); the last record also carries
    ``async/staleness_mean``/``max`` (the ledger's) and ``privacy/epsilon_max`` when the summary has them."""
    mode = str(summary.get("mode") or "serverless")
    out: list[Record] = []
    for i, row in enumerate(summary.get("history") or []):
        scalars: dict[str, Any] = {"step": i, "virtual_time_s": float(row["time_s"]),
                                   "async/version": int(row["version"])}
        for k, v in row.items():
            if k in _SERVERLESS_SKIP or not _finite(v):
                continue
            scalars[f"eval/{k}" if "accuracy" in k or k == "loss" else f"{mode}/{k}"] = v
        out.append(Record(scalars))
    if out:
        st = summary.get("staleness") or {}
        last = out[-1].scalars
        for k in ("mean", "max"):
            if _finite(st.get(k)):
                last[f"async/staleness_{k}"] = st[k]
        eps = (summary.get("privacy") or {}).get("epsilon_max")
        if _finite(eps):
            last["privacy/epsilon_max"] = eps
    return out
