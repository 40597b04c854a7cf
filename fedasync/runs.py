"""Running simulations and continuing stored runs, below the CLI.

:func:`run_configs` runs configs one after another (one start of Flower's simulation engine
for all, or in-process with ``backend="local"``) and writes each run's directory;
:func:`resume_config` is the config that continues a stored run (``--resume``), for
``fedasync simulate`` and ``fedasync server`` alike.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from fedasync.config import Config, ConfigError, apply_overrides, config_from_dict

#: label, config -> the progress callback of that run (or None)
ProgressFactory = Callable[[str, Config], Callable[[dict], None]]


class RunError(ValueError):
    """A run that cannot be started or continued as asked: one line naming the option."""


class EngineError(RuntimeError):
    """Flower's simulation engine (Ray) failed to start or crashed: one line, its root cause."""


def resume_config(config: Optional[str], set_: list[str], out: Optional[Path], run_id: int, cfg: Config,
                  mode: str) -> Config:
    """The config that continues run ``run_id``: its stored config (with ``--set``) when no CONFIG
    is given, else CONFIG (with ``--set``), which must agree with it on everything that defines the
    experiment (:func:`fedasync.server.resume.check_resume_config`). RunError if it cannot."""
    import yaml

    from fedasync.private import mask_url
    from fedasync.server.resume import check_resume_config
    from fedasync.store import default_sqlite_url
    from fedasync.store.opening import StoreOpenError, open_store

    url = cfg.store.url or (default_sqlite_url(out) if out is not None else None)
    if url is None:
        raise RunError("--resume: give --out DIR, the run's directory (it holds the store), or set store.url")
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).is_file():
        raise RunError(f"--resume: no store at {mask_url(url)}")
    try:
        st = open_store(url, "store.url" if cfg.store.url else "--out")
    except StoreOpenError as e:
        raise RunError(str(e)) from None
    try:
        run = st.get_run(run_id)
    except KeyError:
        raise RunError(f"--resume: no run {run_id} in {mask_url(url)}") from None
    finally:
        st.close()
    if run.mode != mode:
        raise RunError(f"--resume: run {run_id} is a {run.mode} run, not a {mode} run")
    if config is None:
        try:
            new = config_from_dict(apply_overrides(yaml.safe_load(run.config_yaml) or {}, set_))
        except ConfigError as e:
            raise RunError(str(e)) from None
        return new.model_copy(update={"store": cfg.store}) if cfg.store.url else new
    why = check_resume_config(run.config_yaml, cfg)
    if why:
        raise RunError(f"--resume {run_id}: {why}")
    return cfg


@contextmanager
def _signals_to(job) -> Iterator[None]:
    """SIGINT/SIGTERM while Flower's engine runs: handed to ``job`` (the first stops the run after
    the reply being handled, a second at once). The ServerApp runs in a thread that never sees a
    signal; a KeyboardInterrupt in this thread instead left it waiting for replies from an engine
    that had stopped (the command hung)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        job.request_stop(signum)
        logging.getLogger("fedasync").warning("%s: %s", signal.Signals(signum).name, "stopping at once" if job.abort
                                              else "stopping after the reply being handled (again to stop at once)")

    prev = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)


def ray_backend_config(actors: int, verbose: bool, environ: Mapping[str, str] = os.environ) -> dict:
    """Flower's Ray backend config: ``actors`` actors share this machine's cores; with
    ``RAY_ADDRESS`` set (an existing Ray cluster) Ray is not told the core count, which it
    refuses when it joins a cluster, and each actor takes one of the cluster's cores."""
    cpus = os.cpu_count() or 1
    init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose}
    if environ.get("RAY_ADDRESS"):
        return {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init}
    return {"client_resources": {"num_cpus": cpus / actors, "num_gpus": 0.0}, "init_args": {"num_cpus": cpus, **init}}


def ray_address_problem(environ: Mapping[str, str] = os.environ, timeout: float = 3.0) -> str | None:
    """Why ``RAY_ADDRESS`` names no cluster that can be joined, in one line, or None. An address
    ``host:port`` (or ``ray://host:port``) where nothing accepts a connection is found here in
    ``timeout`` seconds: Ray itself retries it for minutes before it fails. ``auto``, ``local`` and
    what cannot be parsed are left to Ray."""
    import socket

    addr = environ.get("RAY_ADDRESS", "").strip()
    m = re.fullmatch(r"(?:ray://)?\[?([^\s\[\]/]+?)\]?:(\d{1,5})", addr)
    if not m or not 0 < int(m.group(2)) < 65536:
        return None
    host, port = m.group(1), int(m.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = "no answer" if isinstance(e, socket.timeout) else (e.strerror or type(e).__name__)
        return (f"RAY_ADDRESS={addr}: no Ray cluster at {host}:{port} ({why}); start one there "
                "(ray start --head) or unset RAY_ADDRESS to run on this machine")
    return None


def run_configs(
    configs: list[tuple[str, Config]],
    out_dirs: dict[str, Path],
    backend: str,
    progress: ProgressFactory | None = None,
    resume: int | None = None,
    verbose: bool = False,
    task: Any = None,
    base_dir: Path | None = None,
    on_parts: Callable[[str, Any], None] | None = None,
    track_root: Path | None = None,
) -> dict[str, dict]:
    """Run each config in turn (one engine start for all) and write its outputs; the summaries
    by label. Each run's parts come from :func:`fedasync.assembly.assemble` (``task``: the Python
    API's task object; ``base_dir``: where ``task:`` is imported from), built before its store is
    opened; ``on_parts(label, parts)`` sees them; ``track_root``: ``--compare``'s folder, where its
    runs share one MLflow store (``tracking``). The run directories are 0700 and what the run
    creates (the store, its blobs, the outputs) 0600: :func:`fedasync.private.private_umask` is
    held throughout."""
    from fedasync.private import private_umask

    with private_umask():
        return _run_configs(configs, out_dirs, backend, progress, resume, verbose, task, base_dir, on_parts,
                            track_root)


def _run_configs(configs: list[tuple[str, Config]], out_dirs: dict[str, Path], backend: str,
                 progress: ProgressFactory | None, resume: int | None, verbose: bool, task: Any = None,
                 base_dir: Path | None = None, on_parts: Callable[[str, Any], None] | None = None,
                 track_root: Path | None = None) -> dict[str, dict]:
    from fedasync.assembly import assemble
    from fedasync.outputs import write_run_outputs
    from fedasync.private import private_dir, private_sqlite
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store, default_sqlite_url
    from fedasync.tracking.live import LiveTracking, abandon_live

    def make_store(label: str, cfg: Config) -> Store:
        private_dir(out_dirs[label])
        url = cfg.store.url or default_sqlite_url(out_dirs[label])
        private_sqlite(url)
        return Store(url)

    summaries: dict[str, dict] = {}

    def on_result(label: str, cfg: Config, summary: dict) -> None:
        write_run_outputs(out_dirs[label], cfg, summary, root=track_root, label=label)
        summaries[label] = summary

    def make_parts(label: str, cfg: Config, resumed: bool):
        parts = assemble(cfg, task=task, base_dir=base_dir, resume=resumed)
        if on_parts is not None:
            on_parts(label, parts)
        return parts

    def live(label: str, cfg: Config, source: Callable[[], Any]) -> LiveTracking:
        """The run's progress callback (``progress``'s, if any) that also logs its records as it runs."""
        return LiveTracking(out_dirs[label], cfg, inner=progress(label, cfg) if progress else None, source=source,
                            root=track_root, label=label, resume=resume is not None and label == configs[0][0])

    if backend == "local":
        try:
            for label, cfg in configs:
                parts = make_parts(label, cfg, resume is not None)
                made: list[AsyncServer] = []
                server = AsyncServer(cfg, LocalTransport(), make_store(label, cfg), clock="virtual",
                                     progress=live(label, cfg, lambda made=made: made[0] if made else None),
                                     resume_run_id=resume, parts=parts)
                made.append(server)
                on_result(label, cfg, server.run())
                if summaries[label]["stop_reason"] == "interrupted":  # Ctrl-C stops the command, not one run
                    break
        finally:  # a run that failed: its live tracker's files closed as they stand
            abandon_live(out_dirs.values())
        return summaries
    from flwr.simulation import run_simulation

    from fedasync.clients.app import app as client_app
    from fedasync.server.app import Job, make_server_app

    first = configs[0][1]
    n_nodes = first.simulation.num_supernodes or first.data.num_clients
    job = Job(configs=configs, make_store=make_store, on_result=on_result,
              progress=lambda label, cfg: live(label, cfg, lambda: job.server),
              expected_nodes=n_nodes, resume_run_id=resume, make_parts=make_parts)
    try:
        with _signals_to(job):
            run_simulation(server_app=make_server_app(job), client_app=client_app, num_supernodes=n_nodes,
                           backend_config=ray_backend_config(first.simulation.num_actors, verbose))
    except Exception as e:  # Ray did not start, the engine crashed: the ServerApp thread would wait
        job.abort = True    # for replies forever (the command hung); it ends its run as interrupted
        if job.started:
            job.done.wait(60)
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise EngineError(f"Flower's simulation engine failed: {type(cause).__name__}: {cause}") from e
    finally:
        abandon_live(out_dirs.values())
    if job.error is not None:
        if isinstance(job.error, KeyboardInterrupt):
            raise job.error
        raise RuntimeError(f"the ServerApp failed:\n{job.error_text}")
    return summaries
