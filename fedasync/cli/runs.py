"""``fedasync runs``: list the runs in a store."""

from __future__ import annotations

import json
import time

import typer
from rich.table import Table

from fedasync.cli.common import console, store_or_exit


def runs(
    store: str = typer.Option("sqlite:///fedasync.db", "--store", help="SQLAlchemy URL of the store."),
) -> None:
    """List the runs recorded in a store."""
    st = store_or_exit(store, "--store", must_exist=True)
    table = Table(title=f"runs in {store}")
    for col in ("id", "name", "strategy", "mode", "status", "versions", "accuracy", "created"):
        table.add_column(col)
    for r in st.list_runs():
        acc, versions = "", r.current_version
        if r.summary_json:
            summary = json.loads(r.summary_json)
            fa = summary.get("final_accuracy")
            acc = f"{fa:.4f}" if fa is not None else ""
            if r.mode in ("gossip", "ledger"):  # no global version: the summary counts its models
                versions = summary.get("versions", versions)
        table.add_row(str(r.id), r.name, r.strategy, r.mode, r.status, str(versions), acc,
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_wall)))
    console.print(table)
