"""``fedasync simulate``: the asynchronous server plus simulated clients on one machine."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fedasync.cli.common import (TRACK_HELP, RunProgress, console, fail, load_or_exit, progress_bars, quiet_flower,
                                 summary_table, track_or_exit)
from fedasync.config import Config, ConfigError
from fedasync.outputs import plot_file
from fedasync.private import mask_url
from fedasync.runs import EngineError, RunError, resume_config


def parse_compare(spec: str, base: Config) -> list[tuple[str, Config]]:
    """``fedavg,fedbuff,fedasync`` or entries with server overrides: ``fedavg:backup_workers=4``.

    Every entry runs the identical scenario (data, partitions, profiles, seed); only the
    ``server`` section differs (:func:`fedasync.api.compare_configs`; a bad entry exits 2).
    """
    from fedasync.api import compare_configs

    try:
        return compare_configs(spec, base)
    except ConfigError as e:
        fail(str(e))


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
    track: Optional[str] = typer.Option(None, "--track", help=TRACK_HELP),
) -> None:
    """Run the asynchronous server with simulated clients on this machine."""
    from fedasync import api
    from fedasync.assembly import TargetError
    from fedasync.privacy.budgets import PrivacyError
    from fedasync.privacy.tracker import CalibrationBar
    from fedasync.task.interface import TaskError

    set_ = track_or_exit(track, set_)
    cfg = load_or_exit(config, set_)
    base_dir = Path(config).resolve().parent if config else None
    if resume is not None:
        if compare:
            fail("--resume: cannot be combined with --compare")
        try:
            cfg = resume_config(config, set_, out, resume, cfg, mode="simulation")
        except RunError as e:
            fail(str(e))
    configs = parse_compare(compare, cfg) if compare else [(cfg.server.strategy, cfg)]
    backend = backend or cfg.simulation.backend
    existed = out is not None and out.exists()
    try:  # every input checked, then the run directory made (api.prepare)
        with progress_bars() as bars:  # DP noise calibration: a bar (a minute or two for 100 clients)
            out = api.prepare(configs, backend=backend, out=out, resume=resume, compared=bool(compare),
                              calibration=CalibrationBar(bars))
    except (ConfigError, RunError, TaskError, ValueError) as e:
        fail(str(e))
    quiet_flower(verbose)
    t0 = time.time()
    try:
        with progress_bars() as bars:
            out_dirs, results = api.execute(configs, out, compared=bool(compare), base_dir=base_dir, backend=backend,
                                            resume=resume, verbose=verbose, existed=existed,
                                            progress=lambda label, c: RunProgress(bars, label, c))
    except EngineError as e:  # not bad input: exit 1, one line (--verbose shows Flower's and Ray's logs)
        fail(str(e), code=1)
    except (TaskError, TargetError, PrivacyError) as e:  # a task that cannot be loaded or run, a target
        fail(str(e))                                       # metric it does not report: nothing written
    summaries = {label: r.summary for label, r in results.items()}
    console.print(summary_table(summaries, f"{cfg.name} ({backend}, seed {cfg.seed})"))
    for label, s in summaries.items():  # privacy spent (DP runs)
        p = s.get("privacy")
        if p and p.get("epsilon_max") is not None:
            console.print(f"{escape(label)} privacy ({p['accountant']}, δ={p['delta']:g}): "
                          f"ε max {p['epsilon_max']:.3f}, mean {p['epsilon_mean']:.3f}; {p['clients_exhausted']} "
                          f"of {s['num_clients']} clients exhausted; stopped: {s['stop_reason']}", highlight=False)
    skipped = [label for label, _ in configs if label not in summaries]
    if skipped:  # interrupted: the entries after the stopped one never started
        console.print(escape("not run (interrupted): " + ", ".join(skipped)))
    if compare and not skipped:
        from fedasync.outputs import write_comparison

        paths = write_comparison(out, summaries)
        ratios = json.loads(paths["comparison"].read_text())["time_to_target_ratio"]
        first = configs[0][0]
        console.print(escape("time-to-target ratio vs " + first + ": " + ", ".join(
            f"{k}={'-' if v is None else f'{v:.2f}'}" for k, v in ratios.items())))
        console.print(escape(f"wrote {paths['comparison']} and {paths['plot']}"))
    for label, s in summaries.items():
        d = out_dirs[label]
        console.print(f"[bold]{escape(label)}[/bold]: " + escape(
            f"{d / 'summary.json'}, {d / 'history.csv'}, {d / plot_file(s)}, {d / 'participation.png'}, "
            f"{d / 'metrics.jsonl'}, {d / 'config.yaml'}; store {mask_url(s['store_url'])}"))
    if "tensorboard" in cfg.tracking.backends:
        console.print(escape(f"tensorboard: tensorboard --logdir {out}"), highlight=False)
    if "mlflow" in cfg.tracking.backends:
        where = cfg.tracking.mlflow_uri or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        console.print(escape(f"mlflow: experiment {cfg.tracking.experiment or cfg.name} in {mask_url(where)}"),
                      highlight=False)
    for label, s in summaries.items():
        if s["stop_reason"] == "interrupted":
            console.print(escape(f"{label}: stopped; continue with --resume {s['run_id']} --out {out_dirs[label]}"))
    console.print(f"done in {time.time() - t0:.1f} s")
