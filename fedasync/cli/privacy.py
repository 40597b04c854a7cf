"""``fedasync privacy plan|report``: plan the budgets of a config, report what a run spent."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from fedasync.cli.common import console, fail, load_or_exit, store_or_exit
from fedasync.private import mask_url

privacy_app = typer.Typer(name="privacy", help="Differential privacy: plan budgets, report spend.",
                          no_args_is_help=True, add_completion=False)


def register(app: typer.Typer) -> None:
    app.add_typer(privacy_app, name="privacy")


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x == float("inf"):
        return "inf"
    return f"{x:.{digits}f}"


# -- plan ------------------------------------------------------------------------------------------


def run_sizes(cfg, config: str | None) -> tuple[list[int], object]:
    """Each client's training examples and the model factory the run of ``cfg`` uses (raises
    ``TaskError``/``ValueError``). A user task (``task:``) is imported as ``fedasync simulate``
    imports it, from the YAML's folder, and its sizes come from the function the run's assembly
    takes them from (:func:`fedasync.assembly.task_sources`: ``len(load_data(c, n)[0])``);
    without ``task:``, the built-in data's (``load_federated``) and ``None`` (the built-in model)."""
    if getattr(cfg, "task", None):
        from fedasync.assembly import task_sources
        from fedasync.task.interface import task_from_config

        task = task_from_config(cfg, base_dir=Path(config).resolve().parent if config else None)
        return list(task_sources(cfg, task)[0]), task.model
    from fedasync.task.data import load_federated

    return list(load_federated(cfg.data, cfg.seed).sizes()), None


def _plan_local(cfg, sizes: list[int]) -> list[dict]:
    from fedasync.privacy.budgets import format_clients, group_plans, milestones, plan_clients

    out = []
    for g in group_plans(plan_clients(cfg, sizes)):
        p = g.plan
        t = p.budget.planned_tasks
        out.append({
            "clients": format_clients(g.clients), "num_clients": len(g.clients),
            "records": [min(g.sizes), max(g.sizes)], "sample_rate": p.sample_rate, "steps_per_task": p.steps,
            "planned_tasks": t, "noise_multiplier": p.noise_multiplier,
            "noise": "auto" if p.noise_auto else "fixed", "max_grad_norm": p.max_grad_norm,
            "epsilon_budget": p.budget.epsilon, "delta": p.budget.delta, "accountant": p.accountant,
            "epsilon_after": {str(k): p.epsilon_after(k) for k in milestones(t)},
        })
    return out


def _plan_central(cfg) -> dict:
    from fedasync.privacy.budgets import central_epsilon, central_sample_rate, milestones
    from fedasync.privacy.tracker import CENTRAL_ASSUMPTION

    c = cfg.privacy.central_dp
    q = central_sample_rate(cfg.server.buffer_size, cfg.data.num_clients)
    releases = cfg.server.max_versions or 100
    return {
        "clip": c.clip, "noise_multiplier": c.noise_multiplier, "noise_std": c.noise_multiplier * c.clip,
        "buffer_size": cfg.server.buffer_size, "num_clients": cfg.data.num_clients, "sample_rate": q,
        "delta": c.delta, "accountant": c.accountant, "planned_releases": releases,
        "planned_from": "server.max_versions" if cfg.server.max_versions else "default (server.max_versions unset)",
        "epsilon_after": {str(k): central_epsilon(c.noise_multiplier, q, k, c.delta, c.accountant)
                          for k in milestones(releases)},
        "sampling_assumption": CENTRAL_ASSUMPTION,
    }


@privacy_app.command("plan")
def plan(
    config: Optional[str] = typer.Argument(None, help="YAML config (default: the packaged quickstart)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set privacy.local_dp.epsilon=3 (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Per group of identical clients: q, steps per task, planned tasks, σ and the ε expected.
    A user task's (``task:``, imported from the YAML's folder) from its own clients' data."""
    from contextlib import nullcontext

    from fedasync.cli.common import progress_bars
    from fedasync.privacy.tracker import CalibrationBar
    from fedasync.privacy.budgets import PrivacyError
    from fedasync.privacy.tracker import check_runnable
    from fedasync.task.interface import TaskError

    cfg = load_or_exit(config, set_)
    p = cfg.privacy
    if not p.local_dp.enabled and not p.central_dp.enabled:
        fail(f"{config or 'quickstart'}: privacy.local_dp and privacy.central_dp are both disabled: nothing to plan")
    sizes, model = None, None
    if p.local_dp.enabled or cfg.task:  # a task that does not load is one line, whatever is planned
        try:
            sizes, model = run_sizes(cfg, config)
        except TaskError as e:
            fail(str(e))
        except (ValueError, OSError, RuntimeError) as e:  # the built-in data, the task's own code
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            fail(f"task {cfg.task}: {line}" if cfg.task else line)
    try:  # the noise calibration: a bar (a minute or two for 100 clients); with --json, lines on stderr
        with nullcontext() if as_json else progress_bars() as bars:
            check_runnable(cfg, sizes, model, progress=None if bars is None else CalibrationBar(bars))
        local = _plan_local(cfg, sizes) if p.local_dp.enabled else None
        central = _plan_central(cfg) if p.central_dp.enabled else None
    except (PrivacyError, ValueError) as e:
        fail(str(e))
    if as_json:
        console.print_json(json.dumps({"local_dp": local, "central_dp": central}))
        return
    if local is not None:
        deltas = {g["delta"] for g in local}
        one_delta = len(deltas) == 1
        title = (f"{cfg.name}: local DP-SGD per client ({p.local_dp.accountant} accountant, clip "
                 f"{p.local_dp.max_grad_norm}, {p.local_dp.grad_sample_mode}"
                 + (f", δ={deltas.pop():.0e})" if one_delta else ")"))
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
        cols = ["clients", "n", "q", "steps", "T", "σ", "budget"] + ([] if one_delta else ["δ"]) + [
            "ε@1", "ε@T/2", "ε@T"]
        for col in cols:
            t.add_column(col, justify="left" if col == "clients" else "right", no_wrap=True)
        for g in local:
            lo, hi = g["records"]
            eps = list(g["epsilon_after"].values())
            eps = [eps[0], eps[min(1, len(eps) - 1)], eps[-1]]
            row = [g["clients"], str(lo) if lo == hi else f"{lo}-{hi}", f"{g['sample_rate']:.4g}",
                   str(g["steps_per_task"]), str(g["planned_tasks"]),
                   f"{g['noise_multiplier']:.4g}" + ("" if g["noise"] == "auto" else " (fixed)"),
                   _fmt(g["epsilon_budget"], 2)] + ([] if one_delta else [f"{g['delta']:.0e}"])
            t.add_row(*row, *[_fmt(e) for e in eps])
        console.print(t)
        console.print("n: records per client; q = 1/ceil(n/batch_size): Poisson sample rate (as Opacus derives "
                      "it); steps: DP-SGD steps per task; T: planned tasks; σ: noise multiplier (Opacus "
                      "get_noise_multiplier for ε, δ, q, steps × T unless fixed); ε@k: ε after k tasks. A client "
                      "whose next task would take it past its ε budget refuses to train.", highlight=False)
    if central is not None:
        c = central
        t = Table(title=f"{cfg.name}: central DP at the server (fedbuff, {c['accountant']} accountant)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ["clip", "σ", "K", "N", "q=K/N", "δ", "R", "ε@1", "ε@R/2", "ε@R"]:
            t.add_column(col, justify="right", no_wrap=True)
        eps = list(c["epsilon_after"].values())
        eps = [eps[0], eps[min(1, len(eps) - 1)], eps[-1]]
        t.add_row(_fmt(c["clip"], 3), f"{c['noise_multiplier']:.4g}", str(c["buffer_size"]), str(c["num_clients"]),
                  f"{c['sample_rate']:.4g}", f"{c['delta']:.0e}", str(c["planned_releases"]), *[_fmt(e) for e in eps])
        console.print(t)
        console.print(f"N clients, K updates per aggregation; R: releases planned ({c['planned_from']}), one "
                      "per aggregation (model version); ε@k: client-level ε after k releases.", highlight=False)
        console.print(f"sampling assumption: {c['sampling_assumption']}.", highlight=False)


# -- report ----------------------------------------------------------------------------------------


def _store_url(store: str) -> str:
    if "://" in store:
        if store.startswith("sqlite:///") and not os.path.exists(store[len("sqlite:///"):]):
            fail(f"--store: no database at {store}")
        return store
    path = Path(store)
    if path.is_dir():
        path = path / "fedasync.db"
    if not path.is_file():
        fail(f"--store: no database at {path}")
    return f"sqlite:///{path.resolve()}"


def report_rows(store, run_id: int) -> list[dict]:
    """Per client of ``run_id``: {client, epsilon, delta, accountant, history, ...} (plus client -1: central DP)."""
    import yaml

    from fedasync.config import config_from_dict
    from fedasync.privacy.budgets import central_history, history_json, resolve_budgets

    run = store.get_run(run_id)
    cfg = config_from_dict(yaml.safe_load(run.config_yaml))
    p = cfg.privacy
    if not p.local_dp.enabled and not p.central_dp.enabled:
        raise ValueError(f"run {run_id}: no privacy accounting (privacy.local_dp and privacy.central_dp were disabled)")
    rows: list[dict] = []
    if p.local_dp.enabled:
        budgets = resolve_budgets(p, cfg.data.num_clients)
        for c in store.clients(run_id):
            st = json.loads(c.accountant_state) if c.accountant_state else {}
            b = budgets[c.client_id]
            rows.append({
                "client": c.client_id, "epsilon": float(c.epsilon or 0.0), "delta": b.delta,
                "accountant": st.get("accountant", p.local_dp.accountant), "history": history_json(st.get("history")),
                "epsilon_budget": b.epsilon, "tasks_done": int(c.tasks_done or 0), "exhausted": bool(c.exhausted),
            })
    if p.central_dp.enabled:
        spend = [s for s in store.privacy_spend(run_id) if s.client_id == -1]
        releases = sum(s.steps for s in spend)
        last = spend[-1] if spend else None
        from fedasync.privacy.budgets import central_sample_rate

        q = central_sample_rate(cfg.server.buffer_size, cfg.data.num_clients)
        rows.append({
            "client": -1, "scope": "central", "epsilon": float(last.epsilon) if last else 0.0,
            "delta": p.central_dp.delta, "accountant": p.central_dp.accountant,
            "history": history_json(central_history(p.central_dp.noise_multiplier, q, releases)),
            "epsilon_budget": None, "tasks_done": releases, "exhausted": False,
        })
    return rows


@privacy_app.command("report")
def report(
    store: str = typer.Option("sqlite:///fedasync.db", "--store",
                              help="SQLAlchemy URL of the store, or a run directory / .db file."),
    run: Optional[int] = typer.Option(None, "--run", help="Run id (default: the latest run in the store)."),
    as_json: bool = typer.Option(False, "--json", help="Print [{client, epsilon, delta, accountant, history}, ...]."),
) -> None:
    """Per client: ε spent, δ, tasks done, exhausted or not."""
    st = store_or_exit(_store_url(store), "--store", must_exist=True)
    try:
        runs = st.list_runs()
        if not runs:
            fail(f"--store: no runs in {mask_url(st.url)}")
        if run is None:
            run = runs[-1].id
        elif run not in {r.id for r in runs}:
            fail(f"--run: no run {run} in {mask_url(st.url)} (runs: {', '.join(str(r.id) for r in runs)})")
        try:
            rows = report_rows(st, run)
        except ValueError as e:
            fail(str(e))
    finally:
        st.close()
    if as_json:
        from fedasync.outputs import strict_json

        print(json.dumps(strict_json(rows), allow_nan=False))
        return
    t = Table(title=f"privacy spent in run {run} ({store})")
    for col in ["client", "ε spent", "ε budget", "δ", "accountant", "tasks done", "exhausted"]:
        t.add_column(col, justify="right")
    for r in rows:
        name = "server (central DP)" if r["client"] == -1 else str(r["client"])
        done = f"{r['tasks_done']} releases" if r["client"] == -1 else str(r["tasks_done"])
        t.add_row(name, _fmt(r["epsilon"], 4), _fmt(r["epsilon_budget"], 2), f"{r['delta']:.1e}", r["accountant"],
                  done, "yes" if r["exhausted"] else "no")
    console.print(t)
    local = [r for r in rows if r["client"] >= 0]
    if local:
        eps = [r["epsilon"] for r in local]
        console.print(f"ε max {max(eps):.4f}, mean {sum(eps) / len(eps):.4f}; "
                      f"{sum(r['exhausted'] for r in local)} of {len(local)} clients exhausted", highlight=False)
