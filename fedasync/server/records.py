"""The rows the loop records for a reply (``updates``, ``replays``), read from untrusted fields.

A reply's metrics and parameters come from a client: every number is coerced here
(:func:`as_int`, :func:`as_float`, :func:`safe_sha`), so a malformed reply is recorded and
rejected, never a reason for the run to stop.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fedasync.server.strategies import params_sha256
from fedasync.server.transport import Live, Reply
from fedasync.server.validation import MAX_EXAMPLES


def as_int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return None


def as_float(x: Any) -> float | None:
    """A finite float, or None."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float's range
        return None
    return f if math.isfinite(f) else None


def safe_sha(params: Any) -> str | None:
    """sha256 of a reply's parameters, or None when there are none or they cannot be hashed."""
    if params is None:
        return None
    try:
        return params_sha256(params)
    except Exception:
        return None


class Digests:
    """The sha256 of each reply's parameters, for its row. With signatures the check hashed them
    already (and kept it on the reply); a big model's are hashed in a thread while the loop checks
    and adds the update (hashlib and numpy let go of the GIL, so both run at once)."""

    BIG = 1 << 20  # bytes of parameters from which hashing goes to the thread

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def of(self, reply: Reply, signing: bool) -> Callable[[], str | None]:
        """A function that returns the digest (waiting for it if it is being made)."""
        try:
            big = not signing and sum(a.nbytes for a in reply.params.values()) >= self.BIG
        except Exception:  # no params, or not arrays: hashed (or not) as they are
            big = False
        if not big:
            return lambda: reply.params_sha256 or safe_sha(reply.params)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedasync-sha256")
        return self._pool.submit(safe_sha, reply.params).result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def update_row(t: Live, reply: Reply, *, version_at_arrival: int, staleness: int, weight: float | None,
               num_examples: int, reason: str | None, pending: bool, now: float,
               params_sha256: str | None) -> dict:
    """The ``updates`` row of a taken reply (``pending``: accepted and still in the strategy's
    buffer, so its parameters are kept for a resume; ``params_sha256``: :func:`safe_sha` of the
    reply's parameters)."""
    m = reply.metrics
    return {
        "client_id": t.client_id, "base_version": t.base_version,
        "version_at_arrival": version_at_arrival, "staleness": staleness, "weight": weight,
        "num_examples": num_examples if num_examples <= MAX_EXAMPLES else None,  # (bad_num_examples)
        "loss": as_float(m.get("loss")), "epsilon": as_float(m.get("epsilon")),
        "params_sha256": params_sha256,
        "accepted": reason is None, "reason": reason, "received_virtual": now,
        "pending_params": reply.params if pending else None,
        "filter_params": None,  # the loop sets it when the robust filter remembers this update
    }


def replay_row(mid: str | None, reply: Reply, closed: dict[str, tuple[int, int]], now: float) -> dict:
    """The ``replays`` row of a reply that matches no open task (``closed``: message id -> (task
    id, client id) of the tasks already handled)."""
    m = reply.metrics if isinstance(reply.metrics, dict) else {}
    tid, client = closed.get(mid, (None, None))
    if tid is None:
        tid = as_int(m.get("task_id")) if m.get("task_id") is not None else (reply.task_id if reply.task_id >= 0
                                                                              else None)
    if client is None:
        client = as_int(m.get("client_id"))
    return {
        "task_id": tid, "client_id": client, "message_id": None if mid is None else str(mid)[:100],
        "reason": "replay", "params_sha256": safe_sha(reply.params), "received_virtual": now,
    }
