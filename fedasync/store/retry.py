"""Riding out a database that goes away for a while (a PostgreSQL restart, a failover).

:func:`retrying_transactions` decorates the :class:`~fedasync.store.store.Store` class: each of
its public methods is one transaction (``with self.session()``), committed whole or rolled back
whole, so a method that failed because the connection broke can simply be called again. When
one fails with a *transient* error (below) it is retried after a pause that doubles from
:data:`FIRST_DELAY_S` up to :data:`MAX_DELAY_S`, each retry logged as a warning, until it
succeeds or ``store.retry_for_s`` seconds (default :data:`DEFAULT_RETRY_FOR_S`) have passed
since the first failure; then the last error is raised as before (the run stops and can be
continued with ``--resume``). While it waits, the loop waits: no reply is acted on before it
is committed, so an update the server accepted is never lost.

Transient: the driver reported a lost connection (SQLAlchemy's ``connection_invalidated``),
or, on a database server (not SQLite), an ``OperationalError`` / ``InterfaceError`` (cannot
connect, the server is shutting down or starting up, deadlock, serialization failure).
SQLite's own ``OperationalError`` (a missing table, a read-only file) is a bug or a setup
error and is raised at once; a locked SQLite file already waits ``timeout`` seconds in the driver.

A nested call (a Store method that calls another) retries only at the outermost level. One
case is left to ``--resume``: a connection lost *during* COMMIT, after the server committed;
the retry then fails on the duplicate row and that error is raised.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Callable, Iterator, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

log = logging.getLogger("fedasync")

DEFAULT_RETRY_FOR_S = 120.0
FIRST_DELAY_S = 0.25
MAX_DELAY_S = 8.0
#: methods that are not one transaction each
NOT_RETRIED = frozenset({"close", "session", "batch"})
#: private methods that are one transaction each: ``Store._commit`` runs the writes collected by
#: ``Store.batch`` (the loop's one transaction per step) when the block ends, outside any public method
RETRIED_PRIVATE = frozenset({"_commit"})

#: the clock and the pause (tests replace them; a run never waits on a test's clock)
now: Callable[[], float] = time.monotonic
sleep: Callable[[float], None] = time.sleep

T = TypeVar("T", bound=type)
_depth = threading.local()


def is_transient(exc: BaseException, url: str) -> bool:
    """Worth retrying the whole transaction: the connection broke or the server is away."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    if url.startswith("sqlite"):
        return False
    return isinstance(exc, (OperationalError, InterfaceError))


def delays(first: float = FIRST_DELAY_S, cap: float = MAX_DELAY_S) -> Iterator[float]:
    """0.25, 0.5, 1, 2, 4, 8, 8, ... seconds."""
    d = first
    while True:
        yield d
        d = min(cap, d * 2)


def _reason(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"


def _retrying(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if getattr(_depth, "n", 0) > 0:  # inside another Store method: that one retries
            return fn(self, *args, **kwargs)
        budget = float(getattr(self, "retry_for_s", DEFAULT_RETRY_FOR_S))
        started = None
        pauses = delays()
        attempt = 0
        while True:
            _depth.n = 1
            try:
                result = fn(self, *args, **kwargs)
            except Exception as e:
                if budget <= 0 or not is_transient(e, str(getattr(self, "url", ""))):
                    raise
                t = now()
                started = t if started is None else started
                pause = next(pauses)
                if t - started + pause > budget:
                    log.error("store: %s failed for %.1f s (%s); giving up after %d retries",
                              name, t - started, _reason(e), attempt)
                    raise
                attempt += 1
                log.warning("store: %s failed (%s); retry %d in %.2f s (gives up after %.0f s)",
                            name, _reason(e), attempt, pause, budget)
                engine = getattr(self, "engine", None)
                if engine is not None:
                    engine.dispose()  # every pooled connection is suspect: start afresh
                sleep(pause)
                continue
            finally:
                _depth.n = 0
            if attempt:
                log.warning("store: %s succeeded after %d retries (%.1f s)", name, attempt, now() - started)
            return result

    wrapper.__fedasync_retrying__ = True
    return wrapper


def retrying_transactions(cls: T) -> T:
    """Class decorator: every public method of ``cls`` (but :data:`NOT_RETRIED`) retries whole on
    transient database errors; ``cls.retry_for_s`` (or an instance's) bounds the waiting."""
    for name, member in list(vars(cls).items()):
        if (name.startswith("_") and name not in RETRIED_PRIVATE) or name in NOT_RETRIED \
                or not inspect.isfunction(member):
            continue
        if getattr(member, "__fedasync_retrying__", False):
            continue
        setattr(cls, name, _retrying(name, member))
    if "retry_for_s" not in vars(cls):
        cls.retry_for_s = DEFAULT_RETRY_FOR_S
    return cls
