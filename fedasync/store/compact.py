"""Forgetting a blob without leaving its page behind (SQLite).

A row written with a parameter blob that stays in the row (under 256 KiB: ``blobs.py``) fills
its B-tree leaf page: SQLite keeps up to ~4 KB of a large cell on the leaf and appends each new
row of an increasing key on a new page. An ``UPDATE ... SET parameters = NULL`` shrinks the
cell in place but never merges the page with its neighbours (SQLite rebalances a page after an
insert only when it overflows), so every version that once held parameters keeps a page of its
own, almost empty: the quickstart FedAsync store was 18.9 MB, ``model_versions`` 17.7 MB of
pages for 2.1 MB of kept parameters. ``auto_vacuum`` does not help (those pages are in use, not
free); ``VACUUM`` does, but rewrites the whole file.

:func:`settle` follows such an ``UPDATE`` in the same transaction: it takes the shrunk rows
out and puts them back, a ``DELETE`` rebalances (an underfull page is merged with its siblings;
freed pages go to the free list, which the next blobs reuse) and each row goes back under its
own rowid with the same values, so every query, order and value is what the ``UPDATE`` alone
gave. Other databases need nothing (PostgreSQL keeps large values out of line, TOAST, and
autovacuum reclaims the dead tuples): :func:`settle` does nothing there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Integer, Table, bindparam, delete, literal_column, select, text
from sqlalchemy.engine import Connection

_INSERTS: dict[tuple[str, tuple[str, ...]], Any] = {}


def _columns(table: Table) -> list:
    """What to select to put a row back as it was: its columns, and its rowid (as ``_rowid_``)
    unless a column is the rowid (a single INTEGER PRIMARY KEY)."""
    pk = list(table.primary_key.columns)
    if len(pk) == 1 and isinstance(pk[0].type, Integer):
        return list(table.c)
    return [literal_column("rowid").label("_rowid_"), *table.c]


def _insert(table: Table, names: tuple[str, ...]):
    key = (table.name, names)
    if key not in _INSERTS:
        cols = ", ".join('rowid' if n == "_rowid_" else f'"{n}"' for n in names)
        stmt = text(f'INSERT INTO "{table.name}" ({cols}) VALUES ({", ".join(":" + n for n in names)})')
        _INSERTS[key] = stmt.bindparams(*(bindparam(n, type_=Integer() if n == "_rowid_" else table.c[n].type)
                                          for n in names))
    return _INSERTS[key]


def settle(c: Connection, table: Table, *where: Any) -> int:
    """On SQLite, rewrite the rows of ``table`` matching ``where`` in place (delete, insert the same
    values under the same rowid) so the pages they shrank out of are merged; elsewhere nothing.
    Call it after an ``UPDATE`` that set a blob column to NULL. Returns the rows rewritten."""
    if c.dialect.name != "sqlite":
        return 0
    rows = [dict(r) for r in c.execute(select(*_columns(table)).where(*where)).mappings()]
    if not rows:
        return 0
    c.execute(delete(table).where(*where))
    c.execute(_insert(table, tuple(rows[0])), rows)
    return len(rows)
