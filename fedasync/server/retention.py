"""Which model versions keep their parameters in the store (``store.checkpoint_every``).

Every version keeps its ``model_versions`` row (sha256, parent, metrics, times). Its parameters
are kept only while something needs them:

* the latest version (the model a resumed server starts from);
* a checkpoint every ``checkpoint_every`` versions (``0``: none; v0 is one when it is not 0);
* the base version of every task still live (a resumed simulation re-sends it as it was);
* the base version of every update still waiting in the strategy's buffer (a resumed server
  rebuilds the buffer from ``updates.pending_params`` and that base);
* the last ``keep_last`` versions (``server.average_last``: the server evaluates their mean, and
  a resumed server reloads them);
* the versions a simulated ``stale`` attacker may still be sent or was sent by a task in flight
  (``Policies.held_versions``: at most ``attack.lag`` + the tasks in flight);
* with the kardam filter, the base version of each client's last judged update (also
  ``Policies.held_versions``: at most one per client, what the filter holds in memory); with
  zeno++, the version its validation gradient was computed at.

:meth:`Retention.release` names the versions whose parameters nothing needs any more; the loop
passes them to the store call that makes them unneeded, so they are dropped in the same
transaction. Nothing here is O(versions), nor O(clients) without kardam: the set held is at
most the live tasks, the buffer and the last ``keep_last`` versions. Pure: no database, no Flower.
"""

from __future__ import annotations

from typing import Any, Iterable


class Retention:
    def __init__(self, checkpoint_every: int, save: bool = True, held: Iterable[int] = (), keep_last: int = 1) -> None:
        self.every = int(checkpoint_every)
        self.save = save
        self.keep_last = max(1, int(keep_last))
        self.held = {v for v in held if not self.is_checkpoint(v)}  # versions with params, not checkpoints
        self.pending_base: dict[int, int] = {}  # buffered task id -> its base version

    def is_checkpoint(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def stored(self, version: int) -> None:
        """``version``'s parameters were written."""
        if self.save and not self.is_checkpoint(version):
            self.held.add(version)

    def buffered(self, task_id: int, base_version: int) -> None:
        """An accepted update of ``task_id`` waits in the strategy's buffer."""
        self.pending_base[task_id] = base_version

    def release(self, current: int, live_bases: Iterable[int], pending: Iterable[int],
                other: Iterable[int] = ()) -> list[int]:
        """Versions whose parameters nothing needs now (and forget them): ``current`` is the latest
        version (kept with the ``keep_last - 1`` before it), ``live_bases`` the base versions of the
        live tasks, ``pending`` the task ids still buffered, ``other`` versions held for another
        reason (``Policies.held_versions``: a simulated attack's, kardam's, zeno++'s)."""
        if not self.save:
            return []
        pending = set(pending)
        if any(t not in pending for t in self.pending_base):
            self.pending_base = {t: v for t, v in self.pending_base.items() if t in pending}
        refs = {*range(current - self.keep_last + 1, current + 1), *live_bases, *self.pending_base.values(), *other}
        drop = sorted(v for v in self.held if v not in refs)
        self.held.difference_update(drop)
        return drop

    def release_for(self, srv: Any) -> list[int]:
        """:meth:`release` for a server (``version``, ``live`` tasks, ``strategy.pending()``, the
        versions its policy holds)."""
        return self.release(srv.version, (t.base_version for t in srv.live.values()), srv.strategy.pending(),
                            srv.policy.held_versions())
