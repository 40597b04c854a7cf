"""The Flower side of the server: a Transport over Flower's Grid, and the ServerApp.

The asynchronous loop (``server/loop.py``) pushes one Message per dispatch with
``grid.push_messages`` and polls ``grid.pull_messages`` for the ids still outstanding. It
never calls ``send_and_receive`` and never waits for a round.

``app`` is the ServerApp that ``flwr run .`` uses (``[tool.flwr.app.components]``); the
``fedasync simulate`` command builds its own with :func:`make_server_app` so that several
strategies can share one start of the simulation engine.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from fedasync.config import Config, load_config
from fedasync.server.loop import AsyncServer, Reply, TaskMsg
from fedasync.wire import content_to_result, task_content

log = logging.getLogger("fedasync")

Params = dict[str, np.ndarray]


# -- the transport -----------------------------------------------------------------------


class GridTransport:
    """Pushes one Message per task and pulls replies as they become ready."""

    def __init__(self, grid: Grid, group_id: str = "fedasync"):
        self.grid = grid
        self.group_id = group_id

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def wait_for_nodes(self, n: int, timeout: float = 120.0) -> list[int]:
        t0 = time.time()
        while True:
            nodes = self.node_ids()
            if len(nodes) >= n:
                return nodes
            if time.time() - t0 > timeout:
                raise RuntimeError(f"only {len(nodes)} of {n} nodes connected after {timeout:.0f} s")
            time.sleep(0.2)

    def send(self, tasks: list[TaskMsg]) -> list[str | None]:
        msgs = [
            Message(task_content(t.params, t.config), dst_node_id=t.node_id, message_type="train",
                    group_id=self.group_id)
            for t in tasks
        ]
        ids = [i for i in self.grid.push_messages(msgs)]
        if len(ids) != len(msgs):  # in deployment an oversized push logs an error and returns []
            log.error("push_messages accepted %d of %d messages", len(ids), len(msgs))
            return [None] * len(msgs)
        return [i or None for i in ids]

    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]:
        out = []
        for msg in self.grid.pull_messages(message_ids):
            mid = msg.metadata.reply_to_message_id
            if msg.has_error():
                out.append((mid, Reply(task_id=-1, error=f"code {msg.error.code}: {msg.error.reason}")))
                continue
            try:
                r = content_to_result(msg.content)
            except Exception as e:  # a malformed reply is a failed task, not a crash
                out.append((mid, Reply(task_id=-1, error=f"malformed reply: {e}")))
                continue
            out.append((mid, Reply(task_id=-1, params=r.get("params"), metrics=r["metrics"],
                                   refused=r.get("refused"), signature=r.get("signature"))))
        return out


# -- jobs: what a ServerApp run does ---------------------------------------------------


@dataclass
class Job:
    """One or more runs executed one after the other on the same Grid (simulation engine)."""

    configs: list[tuple[str, Config]]
    make_store: Callable[[str, Config], object]
    on_result: Callable[[str, Config, dict], None] = lambda label, cfg, summary: None
    progress: Callable[[str, Config], Callable[[dict], None]] | None = None
    expected_nodes: int = 1
    results: list[dict] = field(default_factory=list)
    error: BaseException | None = None
    error_text: str | None = None


def run_job(job: Job, grid: Grid) -> None:
    transport = GridTransport(grid)
    try:
        nodes = transport.wait_for_nodes(job.expected_nodes)
        for label, cfg in job.configs:
            store = job.make_store(label, cfg)
            progress = job.progress(label, cfg) if job.progress else None
            server = AsyncServer(cfg, transport, store, clock="virtual", progress=progress,
                                 node_for_client=lambda c, nodes=nodes: nodes[c % len(nodes)])
            summary = server.run()
            job.results.append(summary)
            job.on_result(label, cfg, summary)
    except BaseException as e:  # the engine runs us in a thread: hand the error back
        job.error = e
        job.error_text = traceback.format_exc()


def make_server_app(job: Job) -> ServerApp:
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        run_job(job, grid)

    return server_app


# -- the ServerApp of `flwr run .` ------------------------------------------------------

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run .``: run config keys ``config`` (YAML path) and ``overrides`` ("a.b=1;c=2")."""
    from fedasync.store import Store, default_sqlite_url
    from fedasync.outputs import new_run_dir, write_run_outputs

    rc = context.run_config
    path = str(rc.get("config", "")) or None
    overrides = [o for o in str(rc.get("overrides", "")).split(";") if o.strip()]
    cfg = load_config(path, overrides)
    out = new_run_dir(Path("runs"), cfg.name)

    def make_store(label: str, c: Config):
        return Store(c.store.url or default_sqlite_url(out))

    job = Job(configs=[(cfg.server.strategy, cfg)], make_store=make_store,
              on_result=lambda label, c, s: write_run_outputs(out, c, s),
              expected_nodes=min(cfg.data.num_clients, cfg.simulation.num_supernodes or cfg.data.num_clients))
    run_job(job, grid)
    if job.error is not None:
        raise job.error
    log.info("fedasync: wrote %s", out)
