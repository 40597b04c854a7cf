"""``fedasync runs``: list the runs in a store, or in every store of the run directories here."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.markup import escape
from rich import box
from rich.table import Table

from fedasync.cli.common import console, err_console, fail


def _stores_here() -> list[tuple[str, str]]:
    """(label, URL) of ``./fedasync.db`` and of each ``runs/*/fedasync.db`` (what ``simulate`` and
    ``server`` write by default), oldest run directory first."""
    paths = [Path("fedasync.db")] if Path("fedasync.db").is_file() else []
    paths += sorted(Path("runs").glob("*/fedasync.db"), key=lambda p: (p.stat().st_mtime, p.name))
    return [(p.parent.name or ".", f"sqlite:///{p}") for p in paths]


def runs(
    store: str = typer.Option(None, "--store", show_default=False,
                              help="SQLAlchemy URL of the store. Default: ./fedasync.db and every "
                                   "runs/*/fedasync.db here (the stores simulate and server write)."),
) -> None:
    """List the runs recorded in a store (by default, in the stores of the run directories here)."""
    from fedasync.store.opening import StoreOpenError, open_store

    stores = [(store, store)] if store is not None else _stores_here()
    if not stores:
        fail("no store here: no ./fedasync.db and no runs/*/fedasync.db; pass --store URL")
    many = store is None
    # from the run directories: the directory names the run and its time, so no name/created columns
    cols = ["run dir", "id"] if many else ["id", "name"]
    table = Table(*cols, "strategy", "mode", "status", "versions", "accuracy", *([] if many else ["created"]),
                  title=f"runs in {escape(store)}" if not many else "runs in ./fedasync.db and runs/*/fedasync.db",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in table.columns:
        col.overflow = "fold"  # a narrow terminal folds a long value, never cuts it
    for label, url in stores:
        try:
            st = open_store(url, "--store", must_exist=True)
        except StoreOpenError as e:
            if not many:
                fail(str(e))
            err_console.print(f"skipped {escape(label)}: {escape(str(e))}", highlight=False, soft_wrap=True)
            continue
        try:
            for r in st.list_runs():
                acc, versions = "", r.current_version
                if r.summary_json:
                    summary = json.loads(r.summary_json)
                    fa = summary.get("final_accuracy")
                    acc = f"{fa:.4f}" if fa is not None else ""
                    if r.mode in ("gossip", "ledger"):  # no global version: the summary counts its models
                        versions = summary.get("versions", versions)
                cells = [label, str(r.id)] if many else [str(r.id), r.name]
                cells += [r.strategy, r.mode, r.status, str(versions), acc]
                if not many:
                    cells.append(time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created_wall)))
                table.add_row(*(escape(c) for c in cells))
        finally:
            st.close()
    console.print(table)
