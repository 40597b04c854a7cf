"""The idle clients, in client-id order, without an O(clients) Python pass per dispatch.

The loop's candidates for a new task are the clients that are neither busy (a live task) nor
exhausted (and, in deployment, that have a node now). Busy clients are at most ``concurrency``
and exhausted ones only ever join, so the sorted list of clients not exhausted is cached (rebuilt
only when one joins) and the busy ones are cut out of a C-level copy of it by bisection. The
result is the same sorted list the scheduler always got. Pure.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Collection


class IdleClients:
    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self._base: list[int] = []
        self._exhausted = -1  # how many were exhausted when ``_base`` was built

    def __call__(self, busy: Collection[int], exhausted: Collection[int],
                 available: Collection[int] | None = None) -> list[int]:
        """Sorted ids of the clients not in ``busy`` nor ``exhausted`` (and in ``available``)."""
        if available is not None:  # deployment: few clients, the set changes as nodes come and go
            return [c for c in range(self.num_clients) if c not in busy and c not in exhausted and c in available]
        if len(exhausted) != self._exhausted:
            self._base = [c for c in range(self.num_clients) if c not in exhausted]
            self._exhausted = len(exhausted)
        idle = list(self._base)
        for c in sorted(busy, reverse=True):
            i = bisect_left(idle, c)
            if i < len(idle) and idle[i] == c:
                del idle[i]
        return idle
