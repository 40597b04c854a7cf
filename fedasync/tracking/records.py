"""A run's tracking records: one per evaluation (a row of ``history.csv``), built from the run's
history and the store's dispatch and update rows, so that a resumed run's records cover the whole run.

A record is a flat dict: ``step`` (the model version), ``virtual_time_s``, ``eval/<metric>`` for every
metric of the evaluation, and the figures of the run up to that evaluation's virtual time (the
updates received at or before it):

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


def records(history: list[dict], updates: Iterable[Any], dispatches: Iterable[Any], num_clients: int,
            *, local_dp: bool = False, per_client: bool = False) -> Iterator[Record]:
    """The records of a run whose evaluations are ``history`` (rows ``version``, ``virtual_time_s``,
    metrics), whose store holds ``updates`` (rows with ``received_virtual``, ``staleness``,
    ``accepted``, ``reason``, ``loss``, ``epsilon``, ``client_id``) and ``dispatches`` (rows with
    ``sent_virtual``, ``client_id``); ``local_dp``: per-client ε figures. A generator: one record
    at a time, its histograms fresh lists (nothing of 10,000 clients' is kept per version)."""
    ups = sorted(updates, key=lambda u: (round(float(u.received_virtual), 6), u.task_id))
    dis = sorted(dispatches, key=lambda d: (round(float(d.sent_virtual), 6), d.task_id))
    n = max(int(num_clients), 1)
    i = j = 0
    received = accepted = 0
    rejected: dict[str, int] = {}
    st_sum, st_max = 0.0, None
    losses: list[float] = []
    eps = [0.0] * n
    counts = [0] * n
    c_total = c_sq = seen = 0  # dispatches counted, the sum of their squared counts, clients dispatched
    st_by = [0.0] * n
    st_k = [0] * n
    for row in history:
        t = float(row["virtual_time_s"])
        while i < len(ups) and round(float(ups[i].received_virtual), 6) <= t:
            u = ups[i]
            i += 1
            received += 1
            c = u.client_id if 0 <= u.client_id < n else None
            if u.accepted:
                accepted += 1
                s = int(u.staleness)
                st_sum += s
                st_max = s if st_max is None else max(st_max, s)
                if c is not None:
                    st_by[c] += s
                    st_k[c] += 1
                if _finite(u.loss):
                    losses.append(float(u.loss))
            else:
                rejected[u.reason or "unknown"] = rejected.get(u.reason or "unknown", 0) + 1
            if c is not None and _finite(u.epsilon):
                eps[c] = max(eps[c], float(u.epsilon))
        while j < len(dis) and round(float(dis[j].sent_virtual), 6) <= t:
            c = dis[j].client_id
            j += 1
            if 0 <= c < n:
                c_sq += 2 * counts[c] + 1  # (x+1)^2 - x^2
                seen += counts[c] == 0
                counts[c] += 1
                c_total += 1
        scalars: dict[str, Any] = {"step": int(row["version"]), "virtual_time_s": t}
        scalars.update({f"eval/{k}": v for k, v in row.items() if k not in ("version", "virtual_time_s")})
        if losses:
            scalars["train/loss"] = sum(losses) / len(losses)
            losses = []
        scalars["async/staleness_mean"] = st_sum / accepted if accepted else None
        scalars["async/staleness_max"] = st_max
        scalars["async/updates_received"] = received
        scalars["async/updates_accepted"] = accepted
        scalars.update({f"async/updates_rejected/{r}": k for r, k in sorted(rejected.items())})
        hist: dict[str, list[float]] = {}
        if local_dp:
            scalars["privacy/epsilon_max"] = max(eps)
            scalars["privacy/epsilon_mean"] = sum(eps) / n
            hist["privacy/epsilon_clients"] = list(eps)
        scalars["participation/jain"] = c_total * c_total / (n * c_sq) if c_sq else 1.0  # Jain's index
        scalars["participation/never"] = (n - seen) / n
        if per_client:
            hist["participation/dispatches_clients"] = [float(x) for x in counts]
            hist["async/staleness_clients"] = [st_by[c] / st_k[c] for c in range(n) if st_k[c]]
        yield Record(scalars, hist)


#: history.csv columns of a ledger or gossip run that are no metric of their own
_SERVERLESS_SKIP = ("version", "time_s", "virtual_time_s", "wall_time_s")


def serverless_records(summary: dict) -> list[Record]:
    """The records of a ledger or gossip run, from its ``summary`` (``history``: ``version``,
    ``time_s`` (virtual with ``--virtual``, else wall seconds), ``accuracy``, ``loss``, ...):
    ``eval/<metric>`` for each accuracy and loss column, ``<mode>/<column>`` for the others (the
    ledger's ``height``, gossip's ``consensus_distance``, ``events``); the last record also carries
    ``async/staleness_mean``/``max`` (the ledger's) and ``privacy/epsilon_max`` when the summary has them."""
    mode = str(summary.get("mode") or "serverless")
    out: list[Record] = []
    for row in summary.get("history") or []:
        scalars: dict[str, Any] = {"step": int(row["version"]), "virtual_time_s": float(row["time_s"])}
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
