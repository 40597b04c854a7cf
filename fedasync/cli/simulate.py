"""``fedasync simulate``: the asynchronous server plus simulated clients on one machine."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fedasync.cli.common import RunProgress, console, fail, load_or_exit, progress_bars, quiet_flower
from fedasync.config import Config, ConfigError, apply_overrides, config_from_dict


def parse_compare(spec: str, base: Config) -> list[tuple[str, Config]]:
    """``fedavg,fedbuff,fedasync`` or entries with server overrides: ``fedavg:backup_workers=4``.

    Every entry runs the identical scenario (data, partitions, profiles, seed); only the
    ``server`` section differs.
    """
    out: list[tuple[str, Config]] = []
    raw = base.model_dump(mode="json")
    for entry in [e.strip() for e in spec.split(",") if e.strip()]:
        name, *kvs = entry.split(":")
        sets = [f"server.strategy={name}"] + [f"server.{kv}" for kv in kvs]
        try:
            cfg = config_from_dict(apply_overrides(raw, sets))
        except ConfigError as e:
            fail(f"--compare {entry}: {e}")
        label = re.sub(r"[^A-Za-z0-9_.=-]+", "-", entry.replace(":", "-"))
        if label in [lbl for lbl, _ in out]:
            fail(f"--compare: {entry} is listed twice")
        out.append((label, cfg))
    if not out:
        fail("--compare: no strategy given")
    return out


def _summary_table(rows: dict[str, dict], title: str) -> Table:
    """One column per run, one row per figure: readable in 80 columns for a handful of runs."""
    t = Table(title=title)
    t.add_column("")
    for label in rows:
        t.add_column(label, justify="right")

    def fmt(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    figures = [
        ("versions", lambda s: str(s["versions"])),
        ("updates received", lambda s: str(s["updates_received"])),
        ("updates rejected", lambda s: str(s["updates_rejected"])),
        ("virtual time (s)", lambda s: fmt(s["virtual_time_s"], ".1f")),
        ("wall time (s)", lambda s: fmt(s["wall_time_s"], ".1f")),
        ("final accuracy", lambda s: fmt(s["final_accuracy"], ".4f")),
        ("best accuracy", lambda s: fmt(s["best_accuracy"], ".4f")),
        ("time to target (virtual s)", lambda s: fmt(s["time_to_target_s"], ".1f")),
        ("staleness mean / p95", lambda s: "-" if s["staleness"]["mean"] is None
         else f"{s['staleness']['mean']:.2f} / {s['staleness']['p95']:.0f}"),
        ("stopped by", lambda s: str(s.get("stop_reason") or "-")),
    ]
    for name, get in figures:
        t.add_row(name, *[get(s) for s in rows.values()])
    return t


def run_configs(
    configs: list[tuple[str, Config]],
    out_dirs: dict[str, Path],
    backend: str,
    show_progress: bool = True,
    resume: int | None = None,
    verbose: bool = False,
) -> dict[str, dict]:
    """Run each config in turn (one engine start for all) and write its outputs."""
    from fedasync.outputs import write_run_outputs
    from fedasync.server.loop import AsyncServer, LocalTransport
    from fedasync.store import Store, default_sqlite_url

    def make_store(label: str, cfg: Config) -> Store:
        out_dirs[label].mkdir(parents=True, exist_ok=True)
        return Store(cfg.store.url or default_sqlite_url(out_dirs[label]))

    summaries: dict[str, dict] = {}

    def on_result(label: str, cfg: Config, summary: dict) -> None:
        write_run_outputs(out_dirs[label], cfg, summary)
        summaries[label] = summary

    with progress_bars() as bars:
        progress = (lambda label, cfg: RunProgress(bars, label, cfg)) if show_progress else None
        if backend == "local":
            for label, cfg in configs:
                server = AsyncServer(cfg, LocalTransport(), make_store(label, cfg), clock="virtual",
                                     progress=progress(label, cfg) if progress else None, resume_run_id=resume)
                on_result(label, cfg, server.run())
        else:
            from flwr.simulation import run_simulation

            from fedasync.clients.app import app as client_app
            from fedasync.server.app import Job, make_server_app

            first = configs[0][1]
            n_nodes = first.simulation.num_supernodes or first.data.num_clients
            actors = first.simulation.num_actors
            cpus = os.cpu_count() or 1
            job = Job(configs=configs, make_store=make_store, on_result=on_result, progress=progress,
                      expected_nodes=n_nodes, resume_run_id=resume)
            run_simulation(
                server_app=make_server_app(job),
                client_app=client_app,
                num_supernodes=n_nodes,
                backend_config={"client_resources": {"num_cpus": cpus / actors, "num_gpus": 0.0},
                                "init_args": {"num_cpus": cpus, "include_dashboard": False,
                                              "log_to_driver": verbose}},
            )
            if job.error is not None:
                if isinstance(job.error, KeyboardInterrupt):
                    raise job.error
                raise RuntimeError(f"the ServerApp failed:\n{job.error_text}")
    return summaries


def simulate(
    config: Optional[str] = typer.Argument(None, help="YAML config (default: the packaged quickstart)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set server.concurrency=10 (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default runs/<name>-<time>/)."),
    compare: Optional[str] = typer.Option(
        None, "--compare", help="Run several strategies on the identical scenario: fedavg,fedbuff,fedasync "
        "(an entry may add server keys: fedavg:backup_workers=4)."),
    backend: Optional[str] = typer.Option(
        None, "--backend", help="flower (Flower's simulation engine, default) or local (in-process)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Flower's and Ray's logs."),
    resume: Optional[int] = typer.Option(
        None, "--resume", help="Continue run RUN_ID (stopped or killed) of the store in --out (or store.url)."),
) -> None:
    """Run the asynchronous server with simulated clients on this machine."""
    cfg = load_or_exit(config, set_)
    if resume is not None:
        from fedasync.cli.deploy import resume_config

        if compare:
            fail("--resume: cannot be combined with --compare")
        cfg = resume_config(config, set_, out, resume, cfg, mode="simulation")
    configs = parse_compare(compare, cfg) if compare else [(cfg.server.strategy, cfg)]
    if cfg.privacy.local_dp.enabled or cfg.privacy.central_dp.enabled:  # DP settings that cannot work: one line
        from fedasync.privacy.tracker import check_runnable

        for label, c in configs:
            try:
                check_runnable(c)
            except ValueError as e:
                fail(f"{label}: {e}" if compare else str(e))
    backend = backend or cfg.simulation.backend
    if backend not in ("flower", "local"):
        fail(f"--backend: {backend!r} is not one of flower, local")
    if resume is None and out is not None and out.exists() and any(out.iterdir()):
        fail(f"--out: {out} exists and is not empty")
    # nothing is written before every input has been checked
    from fedasync.outputs import new_run_dir, write_comparison

    if out is None:
        out = new_run_dir(Path("runs"), cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    out_dirs = {label: (out / label if compare else out) for label, _ in configs}
    quiet_flower(verbose)
    t0 = time.time()
    summaries = run_configs(configs, out_dirs, backend, resume=resume, verbose=verbose)
    console.print(_summary_table(summaries, f"{cfg.name} ({backend}, seed {cfg.seed})"))
    for label, s in summaries.items():  # privacy spent (DP runs)
        p = s.get("privacy")
        if p and p.get("epsilon_max") is not None:
            console.print(f"{label} privacy ({p['accountant']}, δ={p['delta']:g}): ε max {p['epsilon_max']:.3f}, "
                          f"mean {p['epsilon_mean']:.3f}; {p['clients_exhausted']} of {s['num_clients']} clients "
                          f"exhausted; stopped: {s['stop_reason']}", highlight=False)
    if compare:
        paths = write_comparison(out, summaries, cfg.server.target_accuracy)
        ratios = json.loads(paths["comparison"].read_text())["time_to_target_ratio"]
        first = configs[0][0]
        console.print("time-to-target ratio vs " + first + ": " + ", ".join(
            f"{k}={'-' if v is None else f'{v:.2f}'}" for k, v in ratios.items()))
        console.print(f"wrote {paths['comparison']} and {paths['plot']}")
    for label, d in out_dirs.items():
        s = summaries[label]
        console.print(f"[bold]{label}[/bold]: {d / 'summary.json'}, {d / 'history.csv'}, "
                      f"{d / 'accuracy.png'}, {d / 'config.yaml'}; store {s['store_url']}")
    for label, s in summaries.items():
        if s["stop_reason"] == "interrupted":
            console.print(f"{label}: stopped; continue with --resume {s['run_id']} --out {out_dirs[label]}")
    console.print(f"done in {time.time() - t0:.1f} s")
