"""``fedasync simulate``: the asynchronous server plus simulated clients on one machine."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from fedasync.cli.common import (RunProgress, check_store_or_exit, console, data_or_exit, fail, load_or_exit,
                                 progress_bars, quiet_flower, summary_table)
from fedasync.config import Config, ConfigError, apply_overrides, config_from_dict
from fedasync.private import mask_url
from fedasync.runs import EngineError, RunError, ray_address_problem, resume_config, run_configs


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
        label = re.sub(r"[^A-Za-z0-9_.=+-]+", "-", entry.replace(":", "-"))
        if label in [lbl for lbl, _ in out]:
            fail(f"--compare: {entry} is listed twice")
        out.append((label, cfg))
    if not out:
        fail("--compare: no strategy given")
    return out


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
        if compare:
            fail("--resume: cannot be combined with --compare")
        try:
            cfg = resume_config(config, set_, out, resume, cfg, mode="simulation")
        except RunError as e:
            fail(str(e))
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
    data_or_exit(cfg)  # data and model (the --compare entries differ only in server)
    from fedasync.outputs import make_run_dir, out_dir_problem, remove_if_empty, write_comparison

    out_problem = out_dir_problem(out, resume)
    if out_problem:
        fail(out_problem)
    for label, c in configs:  # a store that cannot be opened: one line, before anything is written
        check_store_or_exit(c.store.url, "store.url")
    ray_problem = ray_address_problem() if backend == "flower" else None
    if ray_problem:  # Ray would retry an address where nothing listens for minutes
        fail(ray_problem)
    # nothing is written before every input has been checked
    existed = out is not None and out.exists()
    try:
        out = make_run_dir(out, cfg.name)
    except ValueError as e:  # a file on the way, no permission: one line (nothing written yet)
        fail(str(e))
    out_dirs = {label: (out / label if compare else out) for label, _ in configs}
    quiet_flower(verbose)
    t0 = time.time()
    try:
        with progress_bars() as bars:
            summaries = run_configs(configs, out_dirs, backend, resume=resume, verbose=verbose,
                                    progress=lambda label, c: RunProgress(bars, label, c))
    except EngineError as e:  # not bad input: exit 1, one line (--verbose shows Flower's and Ray's logs)
        if not existed:  # the directory made above, when the engine failed before a run wrote to it
            remove_if_empty(out)
        fail(str(e), code=1)
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
        paths = write_comparison(out, summaries, cfg.server.target_accuracy)
        ratios = json.loads(paths["comparison"].read_text())["time_to_target_ratio"]
        first = configs[0][0]
        console.print(escape("time-to-target ratio vs " + first + ": " + ", ".join(
            f"{k}={'-' if v is None else f'{v:.2f}'}" for k, v in ratios.items())))
        console.print(escape(f"wrote {paths['comparison']} and {paths['plot']}"))
    for label, s in summaries.items():
        d = out_dirs[label]
        console.print(f"[bold]{escape(label)}[/bold]: " + escape(
            f"{d / 'summary.json'}, {d / 'history.csv'}, {d / 'accuracy.png'}, {d / 'participation.png'}, "
            f"{d / 'config.yaml'}; store {mask_url(s['store_url'])}"))
    for label, s in summaries.items():
        if s["stop_reason"] == "interrupted":
            console.print(escape(f"{label}: stopped; continue with --resume {s['run_id']} --out {out_dirs[label]}"))
    console.print(f"done in {time.time() - t0:.1f} s")
