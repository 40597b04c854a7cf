"""The Flower side of the server: a Transport over Flower's Grid, and the ServerApp.

The asynchronous loop (``server/loop.py``) pushes one Message per dispatch with
``grid.push_messages`` and polls ``grid.pull_messages`` for the ids still outstanding. It
never calls ``send_and_receive`` and never waits for a round.

``app`` is the ServerApp that ``flwr run .`` uses (``[tool.flwr.app.components]``); the
``fedasync simulate`` command builds its own with :func:`make_server_app` so that several
strategies can share one start of the simulation engine.

``deploy_app`` is the ServerApp of a real federation (``fedasync server`` submits it to a
SuperLink with ``flwr run``; its run config ``job`` names the job file that command wrote in the
run directory, 0600, and its sha256: the run config reaches every SuperNode, the job holds the
store URL). It runs the loop under the **wall clock** over a :class:`DeployTransport`, which
learns which SuperNode is which client with a ``query`` message (the *hello*, see below).

Node <-> client mapping (deployment). Flower's Grid names nodes by id only, so the server asks
every new node ``query`` (group ``fedasync-hello``); the ClientApp answers from its node config:
``partition-id`` (the client id), ``num-partitions``, and the raw Ed25519 public key of its
``signing-key``. A node is mapped to client ``partition-id`` unless the id is out of range,
``num-partitions`` differs from ``data.num_clients``, another live node holds that client, or
(with SuperNode authentication) Flower registered a different node for that client's auth key.
The hello is a claim, not a proof: every update is still verified against the signing key
registered for its client (``bad_signature`` otherwise), and with SuperNode authentication only
nodes whose auth key was registered can connect at all. Nodes that leave are unmapped; new
ones are greeted every few seconds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedasync.assembly import assemble
from fedasync.config import Config, load_config
from fedasync.server.control import open_messages
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import Reply, TaskMsg
from fedasync.server.params import Params
from fedasync.wire import content_to_result, params_to_record, task_content

log = logging.getLogger("fedasync")

Params = dict[str, np.ndarray]


# -- the transport -----------------------------------------------------------------------


class GridTransport:
    """Pushes one Message per task and pulls replies as they become ready."""

    def __init__(self, grid: Grid, group_id: str = "fedasync", abort: Callable[[], bool] | None = None):
        self.grid = grid
        self.group_id = group_id
        self.abort = abort  # true: stop at once (a second Ctrl-C), raised as KeyboardInterrupt in this thread
        self._records: list[tuple[Params, ArrayRecord]] = []  # (params, its record), newest first: see _record

    def node_ids(self) -> list[int]:
        self._check_abort()
        return sorted(self.grid.get_node_ids())

    def _check_abort(self) -> None:
        """The simulation engine runs the ServerApp in a thread, which never sees a signal: the main
        thread's handler (``fedasync.runs``) asks through ``abort``, and the loop ends as interrupted."""
        if self.abort is not None and self.abort():
            raise KeyboardInterrupt

    def _record(self, params: Params) -> ArrayRecord:
        """The ArrayRecord of ``params``, built once per model (the loop sends one params object
        per version to many clients; Flower's strategies likewise share one record per round).
        The last two models are kept: a simulated ``stale`` attacker is sent an old model between
        the current one's tasks, which must not rebuild the current one's record each time."""
        for p, rec in self._records:
            if p is params:
                return rec
        rec = params_to_record(params)
        self._records = [(params, rec), *self._records[:1]]
        return rec

    def wait_for_nodes(self, n: int, timeout: float = 120.0, settle_s: float = 0.0) -> list[int]:
        """The connected nodes once there are ``n``, and (``settle_s`` > 0) no more joined for that long."""
        t0 = time.time()
        seen, since = -1, t0
        while True:
            nodes = self.node_ids()
            if len(nodes) != seen:
                seen, since = len(nodes), time.time()
            if len(nodes) >= n and time.time() - since >= settle_s:
                return nodes
            if time.time() - t0 > timeout:
                raise RuntimeError(f"only {len(nodes)} of {n} nodes connected after {timeout:.0f} s")
            time.sleep(0.2)

    def send(self, tasks: list[TaskMsg]) -> list[str | None]:
        self._check_abort()
        msgs = [
            Message(task_content(self._record(t.params), t.config), dst_node_id=t.node_id,
                    message_type="train", group_id=self.group_id)
            for t in tasks
        ]
        ids = [i for i in self.grid.push_messages(msgs)]
        if len(ids) != len(msgs):  # in deployment an oversized push logs an error and returns []
            log.error("push_messages accepted %d of %d messages", len(ids), len(msgs))
            return [None] * len(msgs)
        return [i or None for i in ids]

    def drain(self, message_ids: list[str], timeout: float = 60.0) -> int:
        """Pull (and drop) the replies of tasks a finished run left in flight, for at most
        ``timeout`` s; returns how many never came. Flower keeps an unpulled message and its reply,
        and the simulation engine walks every stored message for every node each time it looks
        for work: a run after one that left its tasks there was ~20 % slower on the same engine
        (``benchmarks/loop_overhead.py``)."""
        left, t0 = {m for m in message_ids if m}, time.monotonic()
        while left and time.monotonic() - t0 < timeout:
            left -= {r.metadata.reply_to_message_id for r in self.grid.pull_messages(list(left))}
            if left:
                time.sleep(0.02)
        return len(left)

    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]:
        out = []
        self._check_abort()
        if not message_ids:
            return out
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


HELLO_GROUP = "fedasync-hello"


class DeployTransport(GridTransport):
    """A real federation's Grid: greets new nodes (the hello) to learn which client each is, and
    pulls no more often than every ``min_pull_interval`` seconds (each pull is an HTTP request).

    ``registered``: ``{client id: node id}`` that Flower assigned when the client's SuperNode
    auth key was registered (``fedasync server --supernode-auth``); a hello must agree with it.
    ``public_keys``: ``{client id: raw Ed25519 public key}``, only to warn early about a node
    whose signing key is not the registered one (its updates will be rejected).
    """

    def __init__(self, grid: Grid, num_clients: int, registered: dict[int, int] | None = None,
                 public_keys: dict[int, bytes] | None = None, on_node: Callable[[int, int, dict], None] | None = None,
                 refresh_every: float = 3.0, hello_timeout: float = 120.0, hello_retry: float = 30.0,
                 min_pull_interval: float = 0.5, group_id: str = "fedasync"):
        super().__init__(grid, group_id)
        self.num_clients = num_clients
        self.registered = dict(registered or {})
        self.public_keys = dict(public_keys or {})
        self.on_node = on_node
        self.refresh_every = refresh_every
        self.hello_timeout = hello_timeout
        self.hello_retry = hello_retry
        self.min_pull_interval = min_pull_interval
        self.run_id = 0
        self.nodes: dict[int, dict] = {}  # node id -> hello info (client_id None: not used)
        self.client_node: dict[int, int] = {}
        self.hello_pending: dict[str, tuple[int, float]] = {}  # message id -> (node id, sent at)
        self.hello_failed: dict[int, float] = {}  # node id -> when its hello failed
        self._last_refresh = -1e9
        self._last_hello_pull = -1e9
        self._last_pull = -1e9

    # -- what the loop asks ------------------------------------------------------------
    def available_clients(self) -> set[int]:
        return set(self.client_node)

    def node_for_client(self, client_id: int) -> int | None:
        return self.client_node.get(client_id)

    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]:
        now = time.monotonic()
        if now - self._last_pull < self.min_pull_interval:
            return []
        self._last_pull = now
        return super().poll(message_ids)

    # -- discovery ---------------------------------------------------------------------
    def refresh(self) -> None:
        now = time.monotonic()
        if self.hello_pending and now - self._last_hello_pull >= self.min_pull_interval:
            self._last_hello_pull = now
            self._pull_hellos(now)
        if now - self._last_refresh < self.refresh_every:
            return
        self._last_refresh = now
        current = set(self.grid.get_node_ids())
        for n in [n for n in self.nodes if n not in current]:
            info = self.nodes.pop(n)
            c = info.get("client_id")
            if c is not None and self.client_node.get(c) == n:
                del self.client_node[c]
                log.warning("node %d (client %d) left the federation", n, c)
                # nodes turned away because n served client c (a restarted device whose old node
                # id was still listed): forget that, greet them again
                for m in [m for m, i in self.nodes.items() if i.get("shadowed_by") == n]:
                    del self.nodes[m]
                    self.hello_failed.pop(m, None)
                    log.info("node %d: greeting it again (node %d, which served client %d, left)", m, n, c)
        waiting = {n for n, _ in self.hello_pending.values()}
        new = sorted(n for n in current if n not in self.nodes and n not in waiting
                     and now - self.hello_failed.get(n, -1e9) >= self.hello_retry)
        if new:
            self._send_hellos(new, now)

    def _send_hellos(self, nodes: list[int], now: float) -> None:
        msgs = [Message(RecordDict({"hello": ConfigRecord({"run_id": int(self.run_id),
                                                           "num_clients": int(self.num_clients)})}),
                        dst_node_id=n, message_type="query", group_id=HELLO_GROUP, ttl=self.hello_timeout)
                for n in nodes]
        ids = list(self.grid.push_messages(msgs))
        if len(ids) != len(msgs):
            log.error("hello: push_messages accepted %d of %d messages", len(ids), len(msgs))
            for n in nodes:
                self.hello_failed[n] = now
            return
        for n, mid in zip(nodes, ids):
            if mid:
                self.hello_pending[mid] = (n, now)
            else:
                self.hello_failed[n] = now
        log.info("hello sent to %d new node(s)", len(nodes))

    def _pull_hellos(self, now: float) -> None:
        for msg in self.grid.pull_messages(list(self.hello_pending)):
            mid = msg.metadata.reply_to_message_id
            if mid not in self.hello_pending:
                continue
            node, _ = self.hello_pending.pop(mid)
            if msg.has_error():
                log.warning("hello to node %d failed: code %s: %s", node, msg.error.code, msg.error.reason)
                self.hello_failed[node] = now
                continue
            try:
                info = json.loads(msg.content["hello"]["json"])
            except Exception as e:
                log.warning("hello from node %d is malformed: %s", node, e)
                self.hello_failed[node] = now
                continue
            self._map(node, info)
        for mid, (node, sent) in list(self.hello_pending.items()):
            if now - sent > self.hello_timeout:
                del self.hello_pending[mid]
                self.hello_failed[node] = now
                log.warning("hello to node %d: no answer after %.0f s", node, self.hello_timeout)

    def _map(self, node: int, info: dict) -> None:
        """Decide whether ``node`` serves the client its hello names."""
        c = info.get("partition_id")
        why, shadowed_by = None, None
        if not isinstance(c, int) or not 0 <= c < self.num_clients:
            why = f"partition-id {c!r} is not a client id in 0-{self.num_clients - 1}"
        elif info.get("num_partitions") not in (None, self.num_clients):
            why = f"num-partitions {info.get('num_partitions')} differs from data.num_clients {self.num_clients}"
        elif c in self.registered and self.registered[c] != node:
            why = f"claims client {c}, whose SuperNode auth key is registered to node {self.registered[c]}"
        elif (other := next((k for k, n in self.registered.items() if n == node and k != c), None)) is not None:
            why = f"claims client {c}, but its SuperNode auth key is client {other}'s"
        elif c in self.client_node and self.client_node[c] != node and self.client_node[c] in self.nodes:
            why = f"claims client {c}, already served by node {self.client_node[c]}"
            shadowed_by = self.client_node[c]
        if why:
            log.warning("node %d is not used: %s", node, why)
            self.nodes[node] = {**info, "client_id": None, "rejected": why, "shadowed_by": shadowed_by}
            return
        key = str(info.get("public_key") or "")
        expected = self.public_keys.get(c)
        if expected is not None and key != expected.hex():
            log.warning("node %d (client %d) signs with key %s, not the registered one: its updates will be "
                        "rejected as bad_signature", node, c, key[:16] or "(none)")
        self.nodes[node] = {**info, "client_id": c}
        self.client_node[c] = node
        log.info("node %d is client %d (device %s)", node, c, info.get("device", "?"))
        if self.on_node is not None:
            self.on_node(c, node, info)


# -- jobs: what a ServerApp run does ---------------------------------------------------


@dataclass
class Job:
    """One or more runs executed one after the other on the same Grid (simulation engine)."""

    configs: list[tuple[str, Config]]
    make_store: Callable[[str, Config], object]
    on_result: Callable[[str, Config, dict], None] = lambda label, cfg, summary: None
    progress: Callable[[str, Config], Callable[[dict], None]] | None = None
    expected_nodes: int = 1
    settle_s: float = 0.0  # then wait until no node has joined for this long (flwr run: its federation's size)
    resume_run_id: int | None = None  # continue this run (the first config only)
    # label, config, resumed -> the run's parts (fedasync.assembly.assemble), built before its store
    make_parts: Callable[[str, Config, bool], Any] | None = None
    results: list[dict] = field(default_factory=list)
    error: BaseException | None = None
    error_text: str | None = None
    # Ctrl-C/SIGTERM, set by the main thread (fedasync.runs): the first stops the run after the reply
    # being handled, a second at once (``abort``); no further config starts
    stop_signal: int | None = None
    abort: bool = False
    server: AsyncServer | None = None
    started: bool = False  # run_job has begun (in the engine's ServerApp thread)
    done: threading.Event = field(default_factory=threading.Event)  # run_job has returned

    def request_stop(self, signum: int) -> None:
        if self.stop_signal is not None:
            self.abort = True
        self.stop_signal = signum
        if self.server is not None:
            self.server.stop.signal = signum


def run_job(job: Job, grid: Grid) -> None:
    job.started = True
    transport = GridTransport(grid, abort=lambda: job.abort or (job.stop_signal is not None and job.server is None))
    try:
        nodes = transport.wait_for_nodes(job.expected_nodes, settle_s=job.settle_s)
        if job.settle_s:
            log.info("fedasync: %d node(s) connected; client c runs on node c %% %d", len(nodes), len(nodes))
        for i, (label, cfg) in enumerate(job.configs):
            if job.stop_signal is not None:
                break
            resume = job.resume_run_id if i == 0 else None
            parts = (job.make_parts or (lambda _l, c, r: assemble(c, resume=r)))(label, cfg, resume is not None)
            store = job.make_store(label, cfg)
            progress = job.progress(label, cfg) if job.progress else None
            server = AsyncServer(cfg, transport, store, clock="virtual", progress=progress,
                                 node_for_client=lambda c, nodes=nodes: nodes[c % len(nodes)],
                                 resume_run_id=resume, parts=parts)
            job.server = server
            if job.stop_signal is not None:  # a signal while it was being built
                server.stop.signal = job.stop_signal
            summary = server.run()
            job.server = None
            job.results.append(summary)
            job.on_result(label, cfg, summary)
            if job.stop_signal is not None:
                break
            if i + 1 < len(job.configs):  # the next run starts on an engine without this one's leftovers
                transport.drain(open_messages(server))
    except BaseException as e:  # the engine runs us in a thread: hand the error back
        job.error = e
        job.error_text = traceback.format_exc()
    finally:
        job.done.set()


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
    from fedasync.private import private_sqlite, private_umask

    rc = context.run_config
    path = str(rc.get("config", "")) or None
    overrides = [o for o in str(rc.get("overrides", "")).split(";") if o.strip()]
    cfg = load_config(path, overrides)
    base_dir = Path(path).resolve().parent if path else None  # where `task:` is imported from
    out = new_run_dir(Path("runs"), cfg.name)

    def make_store(label: str, c: Config):
        url = c.store.url or default_sqlite_url(out)
        private_sqlite(url)
        return Store(url)

    # the federation's size is Flower's config (options.num-supernodes), not ours: without
    # simulation.num_supernodes, take the nodes that connect (no new one for 2 s)
    n = cfg.simulation.num_supernodes
    job = Job(configs=[(cfg.server.strategy, cfg)], make_store=make_store,
              on_result=lambda label, c, s: write_run_outputs(out, c, s),
              expected_nodes=min(cfg.data.num_clients, n or 1), settle_s=0.0 if n else 2.0,
              make_parts=lambda label, c, resumed: assemble(c, base_dir=base_dir, resume=resumed))
    with private_umask():  # the run directory (0700) and what the run creates in it (0600)
        run_job(job, grid)
    if job.error is not None:
        raise job.error
    log.info("fedasync: wrote %s", out)


# -- the ServerApp of a real federation (`fedasync server`) ------------------------------

deploy_app = ServerApp()


@deploy_app.main()
def deploy_main(grid: Grid, context: Context) -> None:
    """Run config ``job``: ``{"job_file": PATH, "sha256": HEX}``, the job ``fedasync server``
    wrote (:func:`fedasync.deploy.run.read_job`, :func:`run_deployment`)."""
    from fedasync.deploy.run import read_job

    run_deployment(grid, read_job(str(context.run_config.get("job", ""))))


def _write_status(out: Path, **status: Any) -> None:
    """``server-status.json`` (0600), its ``store_url`` with the password masked."""
    from fedasync.private import mask_url, write_private

    if status.get("store_url"):
        status["store_url"] = mask_url(status["store_url"])
    tmp = write_private(out / "server-status.json.tmp",
                        json.dumps({"pid": os.getpid(), "time": time.time(), **status}, indent=2) + "\n")
    tmp.replace(out / "server-status.json")


def run_deployment(grid: Grid, job: dict) -> dict:
    """The deployment ServerApp's work. ``job`` keys: ``config_yaml`` (the full config), ``out``
    (run directory), ``resume`` (run id or null), ``public_keys`` ({client id: raw key hex}),
    ``registered`` ({client id: node id} from SuperNode-auth registration).

    Writes ``server-status.json`` (state starting|running|done|failed, run id, store URL with its
    password masked) for ``fedasync server`` to follow, and at the end the same files as
    ``simulate``. The run directory is 0700 and everything created in it 0600 (umask 077 held)."""
    from fedasync.private import private_umask

    with private_umask():
        return _run_deployment(grid, job)


def _run_deployment(grid: Grid, job: dict) -> dict:
    import yaml

    from fedasync.config import config_from_dict
    from fedasync.outputs import write_run_outputs
    from fedasync.private import open_private, private_dir, private_sqlite
    from fedasync.store import Store, default_sqlite_url

    out = private_dir(job["out"])
    open_private(out / "server.log", "a").close()
    handler = logging.FileHandler(out / "server.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    _write_status(out, state="starting")
    run_id = None
    store = None
    try:
        cfg = config_from_dict(yaml.safe_load(job["config_yaml"]))
        url = cfg.store.url or default_sqlite_url(out)
        private_sqlite(url)
        store = Store(url)
        keys = {int(c): bytes.fromhex(h) for c, h in (job.get("public_keys") or {}).items()}
        registered = {int(c): int(n) for c, n in (job.get("registered") or {}).items()}

        def on_node(c: int, node: int, info: dict) -> None:
            store.register_clients(server.run_id, [{"client_id": c, "node_id": str(node),
                                                    "public_key": str(info.get("public_key") or "")}])

        transport = DeployTransport(grid, cfg.data.num_clients, registered=registered,
                                    public_keys=keys if cfg.deploy.signing else None, on_node=on_node,
                                    hello_timeout=max(60.0, cfg.deploy.node_discovery_timeout))

        def progress(ev: dict) -> None:  # the last evaluation's metrics (the task's; accuracy as acc)
            m = ev.get("metrics") or {}
            shown = f"acc={m['accuracy']:.4f}" if "accuracy" in m else \
                " ".join(f"{k}={v:.4g}" for k, v in m.items()) or "acc=-"
            log.info("v%d  updates=%d accepted=%d live=%d %s", ev["version"], ev["updates"], ev["accepted"],
                     ev["live"], shown)

        from fedasync.privacy.tracker import set_calibration_progress  # DP noise calibration: `fedasync server`'s bar

        set_calibration_progress(lambda: lambda d, t: _write_status(out, state="starting", calibration=[d, t]))
        parts = assemble(cfg, mode="deployment", resume=job.get("resume") is not None, base_dir=job.get("base_dir"))
        from fedasync.tracking.live import LiveTracking  # the records logged as the run goes (issue 35)

        live = LiveTracking(out, cfg, inner=progress, source=lambda: server, resume=job.get("resume") is not None)
        server = AsyncServer(cfg, transport, store, clock="wall", mode="deployment", progress=live,
                             resume_run_id=job.get("resume"), node_for_client=transport.node_for_client,
                             available_clients=transport.available_clients,
                             public_keys=keys if cfg.deploy.signing else None, parts=parts)
        run_id = server.run_id
        transport.run_id = run_id
        _write_status(out, state="running", run_id=run_id, store_url=store.url)
        summary = server.run()
        write_run_outputs(out, cfg, summary)
        _write_status(out, state="done", run_id=run_id, store_url=store.url, stop_reason=summary["stop_reason"])
        return summary
    except BaseException as e:
        text = traceback.format_exc()
        log.error("the deployment ServerApp failed:\n%s", text)
        from fedasync.tracking.live import abandon_live

        abandon_live([out])
        if store is not None and run_id is not None:
            try:
                store.set_run_status(run_id, "failed", f"{type(e).__name__}: {e}"[:200])
            except Exception:
                pass
        _write_status(out, state="failed", run_id=run_id, store_url=None if store is None else store.url,
                      error=f"{type(e).__name__}: {e}", traceback=text)
        raise
    finally:
        log.removeHandler(handler)
        handler.close()
