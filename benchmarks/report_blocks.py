"""The generated blocks of the benchmark pages: one function per block name, each reading its result
files and returning the block's Markdown (:mod:`report` puts it between the block's markers).

Every number a block states is read from a file under ``benchmarks/results/``. A file made under
the old evaluation protocol (evaluated every N versions, settings tuned on the reported seed) is
said so by the block: the file's own ``protocol`` key, else :data:`OLD_PROTOCOL`.
"""

from __future__ import annotations

import json
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent

# Files made before the evaluation grid (server.eval_every_s): what their protocol was.
OLD_PROTOCOL = {
    "mnist-h1800.json": "old protocol: the server evaluated every ~20 updates on a 1,000-image test "
                        "subset, and FedBuff's settings were chosen on this same seed and subset",
    "wall_clock_vs_flower_lr15.json": "old protocol: Flower's FedAvg evaluated after every round of 20 "
                                      "updates, FedBuff every 10 updates, and `server_lr: 1.5` was tuned on MNIST",
    "wall_clock_vs_flower_lr15_2.json": "old protocol, as above",
}


def load(results: Path, name: str) -> dict:
    """A result file's content (``name`` relative to ``results``)."""
    return json.loads((results / name).read_text())


@lru_cache(maxsize=None)
def _first_commit_date(rel: str) -> str | None:
    out = subprocess.run(["git", "log", "--follow", "--format=%ad", "--date=short", "--", rel], cwd=ROOT,
                         capture_output=True, text=True)
    dates = out.stdout.split()
    return dates[-1] if out.returncode == 0 and dates else None


def made_by(results: Path, name: str) -> str:
    """How the file was made: its provenance's command, commit and date, or, for a file made
    before provenance was recorded, "(no provenance: made before <date of its first commit>)"."""
    data = load(results, name)
    prov = data.get("provenance")
    if prov:
        commit = (prov.get("commit") or "unknown")[:7] + ("+" if prov.get("dirty") else "")
        nproc = (prov.get("machine") or {}).get("nproc")
        return f"`{prov['command']}`, commit {commit}, {nproc} CPUs, {prov['date'][:10]}"
    date = _first_commit_date(f"benchmarks/results/{name}")
    return f"(no provenance: made before {date or 'it was committed'})"


def protocol(results: Path, name: str) -> str | None:
    """The old-protocol note of a file (its ``protocol`` key, else :data:`OLD_PROTOCOL`); None on the grid."""
    p = load(results, name).get("protocol")
    if p and p != "old":
        return None if p == "grid" else str(p)
    return OLD_PROTOCOL.get(name, "old protocol" if p == "old" else None)


def fmt(x: Any, nd: int = 1) -> str:
    """A figure as the tables print it: ``-`` for None, ints with thousands separators."""
    if x is None:
        return "-"
    if isinstance(x, int) or (isinstance(x, float) and nd == 0):
        return f"{round(x):,}"
    return f"{x:,.{nd}f}"


def spread(s: dict, nd: int) -> str:
    """``median (min–max)`` of a :func:`quickstart.run` summary entry; the median alone when all agree."""
    if s["median"] is None:
        return "-"
    parts = [f"{fmt(s['min'], nd)}–{fmt(s['max'], nd)}"] if s["min"] != s["max"] else []
    parts += [f"{s['missed']} missed"] if s.get("missed") else []
    return fmt(s["median"], nd) + (f" ({'; '.join(parts)})" if parts else "")


# --- the quickstart -------------------------------------------------------------------------

QS_HEAD = ("| strategy | versions | updates | rejected | time to 90 % (virtual s) | ratio vs fedavg | final acc | "
           "best acc | staleness mean / p95 |\n|---|---|---|---|---|---|---|---|---|\n")


def _qs_rows(summary: dict, prefix: str = "") -> str:
    rows = []
    for label, f in summary.items():
        rows.append(f"| {prefix}{label} | {spread(f['versions'], 0)} | {spread(f['updates'], 0)} | "
                    f"{spread(f['rejected'], 0)} | {spread(f['time_to_target_s'], 1)} | {spread(f['ratio'], 2)} | "
                    f"{spread(f['final_accuracy'], 4)} | {spread(f['best_accuracy'], 4)} | "
                    f"{spread(f['staleness_mean'], 2)} / {spread(f['staleness_p95'], 0)} |")
    return "\n".join(rows) + "\n"


def quickstart_table(results: Path) -> str:
    """The quickstart comparison at defaults: medians over the seeds (min–max)."""
    name = "quickstart_comparison.json"
    d = load(results, name)
    many = len(d["seeds"]) > 1
    how = (f"seeds {', '.join(str(x) for x in d['seeds'])} (medians, min–max in brackets)" if many
           else f"seed {d['seeds'][0]}")
    where = ("in-process on the `local` backend" if d["backend"] == "local" else "on Flower's simulation engine")
    out = (f"The packaged quickstart under four strategies, to {fmt(d['horizon_s'], 0)} virtual s, {how}, every key "
           f"at its default, {where}: {made_by(results, name)}"
           + (f"; {d['protocol']}" if d.get("protocol") else "") + ".\n\n" + QS_HEAD + _qs_rows(d["summary"]))
    s = d["summary"]
    r = {k: s[k]["ratio"]["median"] for k in s}
    if r.get("fedbuff") and r.get("fedasync"):
        missed = any(s[k]["ratio"].get("missed") for k in s)
        out += (f"\n{'Median over the seeds' if many else 'In this run'}"
                f"{' where both runs reached 90 %' if missed else ''}, FedBuff reaches 90 % test accuracy {fmt(r['fedbuff'], 2)}× sooner than "
                f"synchronous FedAvg on the virtual clock and FedAsync {fmt(r['fedasync'], 2)}× sooner")
        b = r.get("fedavg-backup_workers=4")
        out += (f"; FedAvg with backup workers (b = 4) {fmt(b, 2)}×.\n" if b else ".\n")
    return out


def seed_ratios(d: dict, row: dict) -> list[float]:
    """FedAvg's time over ``row``'s strategy's, seed by seed, in the same comparison of a tune.py file
    (seeds where either did not reach the target left out)."""
    idx = {r["strategy"]: r["point"] for r in d["report"] if r["comparison"] == row["comparison"]}
    if "fedavg" not in idx:
        return []
    base = {r["seed"]: r["time_to_target_s"] for r in d["report_runs"][f"fedavg/{idx['fedavg']}"]}
    return sorted(base[r["seed"]] / r["time_to_target_s"] for r in d["report_runs"][f"{row['strategy']}/{row['point']}"]
                  if r["time_to_target_s"] and base.get(r["seed"]))


def _span(r: dict) -> str:
    """`` (min–max)`` of a tune.py report row's times; empty when they agree."""
    return f" ({fmt(r['min_s'], 1)}–{fmt(r['max_s'], 1)})" if r["min_s"] != r["max_s"] else ""


def _ratio_span(d: dict, row: dict) -> str:
    rs = seed_ratios(d, row)
    return f"{fmt(rs[0], 2)}–{fmt(rs[-1], 2)}" if rs and row["strategy"] != "fedavg" else "-"


def tuning_table(results: Path, name: str) -> str:
    """A ``benchmarks/tune.py`` file as a block: defaults vs defaults and, when it was tuned
    (``budget`` > 1), tuned vs tuned: each strategy's grid of the same size scored on validation
    over the tuning seeds, the chosen point and the defaults reported on test over other seeds."""
    d = load(results, name)
    p = d["protocol"]
    seeds = lambda xs: ", ".join(str(x) for x in xs)  # noqa: E731
    grid = (f"the target on test (`{p['report_metric']}`, held for `server.target_hold` evaluations in a row on the "
            f"{p['eval_every_s']:g}-s grid)")
    if p["budget"] > 1:
        out = (f"Tuned on validation, reported on test: each strategy gets {p['budget']} points of its knobs "
               f"({'; '.join(f'{k}: ' + ', '.join(p['knobs'][k]) for k in p['strategies'])}), scored by the median "
               f"time to {p['target']:g} `{p['tune_metric']}` ({p['val_fraction']:g} of the training data held out) "
               f"over seeds {seeds(p['tune_seeds'])}; the defaults and the chosen point then run on seeds "
               f"{seeds(p['report_seeds'])} to {fmt(p['horizon'], 0)} virtual s, {grid}: {made_by(results, name)}.\n\n")
    else:
        out = (f"Defaults vs defaults (not tuned: `--budget 1`): every key as the YAML sets it, seeds "
               f"{seeds(p['report_seeds'])}, {p['val_fraction']:g} of the training data held out as validation "
               f"(as the tuned protocol does), to {fmt(p['horizon'], 0)} virtual s, {grid}: "
               f"{made_by(results, name)}.\n\n")
    out += (f"| comparison | strategy | setting | time to {p['target']:g} on test (virtual s) | reached | ratio vs fedavg "
            "| per seed |\n|---|---|---|---|---|---|---|\n")
    for r in d["report"]:
        setting = ", ".join(f"`{k.split('.')[-1]}` {v:g}" for k, v in r["overrides"].items())
        out += (f"| {r['comparison']} | {r['strategy']} | {setting} | {fmt(r['median_s'], 1)}{_span(r)} | "
                f"{r['reached']} | {fmt(r['ratio_vs_fedavg'], 2)} | {_ratio_span(d, r)} |\n")
    return out + ("\nThe ratio is FedAvg's median over the strategy's; *per seed*: FedAvg's time over the strategy's "
                  "on the same seed, lowest and highest.\n")


def quickstart_tuning(results: Path) -> str:
    """The quickstart's ``quickstart_tuning.json`` (:func:`tuning_table`)."""
    return tuning_table(results, "quickstart_tuning.json")


#: MNIST under the tuning protocol: the full protocol's file when it is complete, else defaults vs defaults
MNIST_GRID_FILES = ("mnist_tuning.json", "mnist_defaults.json")


def mnist_grid_file(results: Path) -> str | None:
    """The MNIST file of :data:`MNIST_GRID_FILES` to publish (the first complete one), or None."""
    for name in MNIST_GRID_FILES:
        if (results / name).is_file() and load(results, name).get("complete"):
            return name
    return None


def mnist_grid(results: Path) -> str:
    """MNIST on the evaluation grid (``benchmarks/tune.py``), and what is not measured yet."""
    name = mnist_grid_file(results)
    if name is None:
        return "MNIST has not been run on the evaluation grid yet.\n"
    out = tuning_table(results, name)
    if load(results, name)["protocol"]["budget"] <= 1:
        out += ("\nTuned vs tuned on MNIST is **not measured yet** under this protocol: it runs every grid point on "
                "the tuning seeds, then the chosen points on the report seeds (the command in the text above; its "
                "run cache keeps every finished run, so it can be finished over several sittings, and the "
                "defaults' runs above are reused).\n")
    return out


# --- MNIST and the wall clock: the README's sentences ----------------------------------------

def _row(d: dict, run: str) -> dict:
    return next(r for r in d["rows"] if r["run"] == run)


def _readme_mnist(results: Path) -> str:
    """The README's MNIST sentence: the grid file (defaults, tuned when measured), else the old run."""
    name = mnist_grid_file(results)
    if name is None:
        m = load(results, "mnist-h1800.json")
        fb = _row(m, "fedbuff")
        note = protocol(results, "mnist-h1800.json")
        return (f"On MNIST (`fedavg_cnn`, 100 clients), FedBuff tuned to `server_lr: 1.5`, the `fastest` scheduler "
                f"and 30 tasks in flight reaches 97 % in {fmt(fb['time_to_97_s'], 1)} virtual s, "
                f"{fmt(fb['speedup_97_vs_fedavg'], 2)}× sooner than FedAvg (`benchmarks/results/mnist-h1800.json`, "
                f"{made_by(results, 'mnist-h1800.json').strip('()')}" + (f"; {note}" if note else "") + ").")
    d = load(results, name)
    p = d["protocol"]
    rows = {(r["comparison"], r["strategy"]): r for r in d["report"]}
    seeds = ", ".join(str(x) for x in p["report_seeds"])

    def pair(kind: str) -> str:
        fa, fb = rows[(kind, "fedavg")], rows[(kind, "fedbuff")]
        return (f"FedBuff reaches {p['target'] * 100:g} % test accuracy in {fmt(fb['median_s'], 1)} virtual s"
                f"{_span(fb)}, FedAvg{'M' if kind == 'tuned' else ''} in {fmt(fa['median_s'], 1)}{_span(fa)}: "
                f"**{fmt(fb['ratio_vs_fedavg'], 2)}×** (medians over seeds {seeds}, {_ratio_span(d, fb)}× seed by seed; "
                f"FedBuff {fb['reached']}, FedAvg {fa['reached']} reached)")

    out = (f"On MNIST (`fedavg_cnn`, 100 clients, Dirichlet α = 0.3), on the {p['eval_every_s']:g}-s evaluation grid "
           f"of the whole test set: at defaults {pair('defaults')}")
    if ("tuned", "fedbuff") in rows:
        out += f"; tuned vs tuned (each over {p['budget']} points on validation seeds), {pair('tuned')}"
    else:
        out += ("; tuned vs tuned is not measured yet under this protocol (the old protocol's figure, FedBuff "
                "tuned on the seed it was reported on, is in the MNIST benchmark page)")
    return out + f" (`{name}`: {made_by(results, name)})."


# --- docs/benchmarks/mnist.md ------------------------------------------------------------------

def mnist_h1800_table(results: Path) -> str:
    """MNIST to 1,800 virtual s: ``mnist-h1800.json`` and ``mnist-h1800-lr1-uniform.json``'s FedBuff."""
    rows = ["| run | updates | to 90 % (virtual s) | to 95 % | to 97 % | vs FedAvg to 97 % | final acc (1,000 eval) "
            "| final acc (10,000 test) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    m = load(results, "mnist-h1800.json")
    extra = [dict(r, run="fedbuff_lr1_uniform") for r in load(results, "mnist-h1800-lr1-uniform.json")["rows"]
             if r["run"] == "fedbuff"]
    fedavg97 = _row(m, "fedavg")["time_to_97_s"]
    for r in m["rows"] + extra:
        ratio = fedavg97 / r["time_to_97_s"] if r.get("time_to_97_s") else None
        rows.append(f"| {r['run']} | {fmt(r['updates'], 0)} | {fmt(r.get('time_to_90_s'))} | "
                    f"{fmt(r.get('time_to_95_s'))} | {fmt(r.get('time_to_97_s'))} | {fmt(ratio, 2)}× | "
                    f"{fmt(r['final_accuracy'], 3)} | {fmt(r.get('final_accuracy_full_test'), 4)} |")
    return (f"`mnist-h1800.json`: {made_by(results, 'mnist-h1800.json')}; `mnist-h1800-lr1-uniform.json`: "
            f"{made_by(results, 'mnist-h1800-lr1-uniform.json')}; {protocol(results, 'mnist-h1800.json')}.\n\n"
            + "\n".join(rows) + "\n")


def mnist_sweep_table(results: Path) -> str:
    """FedBuff's sweep (``mnist_fedbuff_sweep.json``), fastest to 97 % first."""
    name = "mnist_fedbuff_sweep.json"
    d = load(results, name)
    rows = ["| variant | server keys | to 90 % (virtual s) | to 97 % | vs FedAvg to 97 % |", "|---|---|---:|---:|---:|"]
    for r in sorted(d["rows"], key=lambda r: (r["time_to_97_s"] is None, r["time_to_97_s"] or 0)):
        keys = ", ".join(f"`{o.removeprefix('server.')}`" for o in r["overrides"]) or "(`mnist.yaml` as is)"
        ratio = d["fedavg_time_to_97_s"] / r["time_to_97_s"] if r["time_to_97_s"] else None
        rows.append(f"| {r['variant']} | {keys} | {fmt(r['time_to_90_s'])} | {fmt(r['time_to_97_s'])} | "
                    f"{fmt(ratio, 2)}× |")
    return (f"`{name}` (FedAvg to 97 %: {fmt(d['fedavg_time_to_97_s'])} virtual s): {made_by(results, name)}; "
            "old protocol: every variant scored on the seed and the 1,000 evaluation images it is reported on.\n\n"
            + "\n".join(rows) + "\n")


# --- docs/benchmarks/deployment.md ----------------------------------------------------------------

DEPLOY_ROWS = [("before: `flwr-clientapp` per message, 3 s poll (`--no-warm --poll-interval 3`)", "deploy_latency_before_idle.json"),
               ("**after**: warm trainer, 1 s poll", "deploy_latency_after_idle.json"),
               ("after, 10 SuperNodes (concurrency 10)", "deploy_latency_10nodes_idle.json"),
               ("after, shared machine", "deploy_latency_after_final.json"),
               ("after, 10 SuperNodes, shared machine", "deploy_latency_10nodes_final.json"),
               ("before, machine overloaded", "deploy_latency_before_loaded.json"),
               ("after, machine overloaded", "deploy_latency_after_loaded.json")]


def _load_1min(uptime: str) -> float:
    return float(uptime.split("load average:")[1].split(",")[0])


def deployment_table(results: Path) -> str:
    """Per-update latency on loopback SuperNodes, one file per row (:data:`DEPLOY_ROWS`)."""
    rows = ["| path | SuperNodes | p50 per update | p95 | updates/min | first update after the last SuperNode "
            "started | load average (1 min) | file |", "|---|---|---|---|---|---|---|---|"]
    base = load(results, DEPLOY_ROWS[0][1])["updates_per_minute"]
    for label, name in DEPLOY_ROWS:
        d = load(results, name)
        loads = sorted(_load_1min(d[k]) for k in ("uptime_at_start", "uptime_at_end"))
        gain = f" ({d['updates_per_minute'] / base:.1f}×)" if name == DEPLOY_ROWS[1][1] else ""
        rows.append(f"| {label} | {d['nodes']} | {d['latency_s']['p50']:.1f} s | {d['latency_s']['p95']:.1f} s | "
                    f"{d['updates_per_minute']:.1f}{gain} | {d['last_supernode_to_first_update_s']:.1f} s | "
                    f"{loads[0]:.1f}–{loads[1]:.1f} | `{name}` |")
    made = sorted({made_by(results, n) for _, n in DEPLOY_ROWS})
    return "Every file: " + "; ".join(made) + ".\n\n" + "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[Path], str]] = {
    "quickstart-table": quickstart_table,
    "quickstart-tuning": quickstart_tuning,
    "mnist-grid": mnist_grid,
    "mnist-h1800-table": mnist_h1800_table,
    "mnist-sweep-table": mnist_sweep_table,
    "deployment-table": deployment_table,
}
