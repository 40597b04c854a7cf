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


#: the wall clock on the evaluation grid: each side at defaults (Flower also as FedAvgM with the
#: quickstart's tuned server momentum), then each side tuned; the earlier files (old protocol) when absent
WALL_GRID = "wall_clock_grid.json"
WALL_GRID_TUNED = "wall_clock_grid_tuned.json"


def _flower(key: str) -> bool:
    """Whether a wall-clock run is one of Flower's (``flower-fedavg[:...]``), not fedasync's."""
    return key.startswith("flower-fedavg")


def _own_run(w: dict) -> str:
    """The key of a wall-clock file's fedasync run (its one run that is not Flower's)."""
    return next(k for k in w["runs"] if not _flower(k))


def wall_label(key: str) -> str:
    """A wall-clock run's name: ``flower-fedavg[:k=v...]`` (FedAvgM with options), ``fedbuff[:k=v...]``."""
    name, *kvs = key.split(":")
    opts = ", ".join(f"`{kv.split('=')[0]}` {kv.split('=')[1]}" for kv in kvs)
    if name == "flower-fedavg":
        return f"Flower FedAvgM, {opts}" if kvs else "Flower FedAvg"
    if not kvs:
        return WALL_LABELS.get(key, key)
    return f"fedasync {'FedBuff' if name == 'fedbuff' else name}, {opts}"


def _wall_ratios(results: Path, name: str) -> list[str]:
    """"R× sooner than <Flower run> (T s)" for the file's fedasync run against each of its Flower runs."""
    w = load(results, name)
    mine = _own_run(w)
    out = []
    for key, r in w["runs"].items():
        if _flower(key):
            label = wall_label(key).replace("Flower ", "Flower's own ")
            ratio = w["speedup_vs"][key].get(mine)
            out.append(f"{fmt(ratio, 2)}× sooner than {label} ({fmt(r['time_to_target_s'], 1)} s)" if ratio
                       else f"{label} did not reach it in {fmt(r['wall_s'], 0)} s")
    return out


def _readme_wallclock(results: Path) -> str:
    if not (results / WALL_GRID).is_file():
        ratios = []
        for name in ("wall_clock_vs_flower_lr15.json", "wall_clock_vs_flower_lr15_2.json"):
            w = load(results, name)
            ratios.append((name, w["speedup_vs_flower_fedavg"]["fedbuff:server_lr=1.5"],
                           w["speedup_vs_flower_fedavg"]["fedbuff"]))
        return (" On the wall clock, against Flower's own FedAvg in the same engine, FedBuff with `server_lr: 1.5` "
                "reached 90 % " + " and ".join(f"{fmt(a, 2)}×" for _, a, _ in ratios) + " sooner, FedBuff at the "
                "quickstart's own settings " + " and ".join(f"{fmt(b, 2)}×" for _, _, b in ratios) + " ("
                + ", ".join(f"`{n}`" for n, _, _ in ratios) + f"; {OLD_PROTOCOL['wall_clock_vs_flower_lr15.json']}).")
    w = load(results, WALL_GRID)
    fb = w["runs"].get("fedbuff", {}).get("time_to_target_s")
    out = (f" On the wall clock (Flower's simulation engine, the quickstart's clock ×{w['time_scale']:g}, both sides read "
           f"on one grid of {w['eval_every_wall_s']:g} wall s, the target held {w['target_hold']} in a row), FedBuff "
           f"at defaults reached {w['target_accuracy'] * 100:g} % in {fmt(fb, 1)} s: " + "; ".join(_wall_ratios(results, WALL_GRID))
           + f" (`{WALL_GRID}`, one engine start)")
    if (results / WALL_GRID_TUNED).is_file():
        mine = _own_run(load(results, WALL_GRID_TUNED))
        out += (f"; tuned against tuned ({wall_label(mine)}, the quickstart's tuned point): "
                + "; ".join(_wall_ratios(results, WALL_GRID_TUNED)) + f" (`{WALL_GRID_TUNED}`)")
    return out + "."


def readme_mnist_wallclock(results: Path) -> str:
    """The README's MNIST and wall-clock sentences."""
    return _readme_mnist(results) + _readme_wallclock(results) + "\n"


# --- docs/benchmarks/quickstart.md: the wall clock --------------------------------------------

WALL_LABELS = {
    "flower-fedavg": "Flower FedAvg",
    "fedbuff:server_lr=1.5:scheduler.name=fastest": "fedasync FedBuff, `server_lr: 1.5`, `scheduler.name: fastest`",
    "fedbuff:server_lr=1.5": "fedasync FedBuff, `server_lr: 1.5`",
    "fedbuff": "fedasync FedBuff as the quickstart sets it (`server_lr: 1.0`)",
    "fedbuff:scheduler.name=fastest": "fedasync FedBuff, `scheduler.name: fastest`",
    "fedasync": "fedasync FedAsync",
}


def wall_clock_table(results: Path) -> str:
    """One engine start's wall-clock runs (``wall_clock_vs_flower_lr15.json``)."""
    name = "wall_clock_vs_flower_lr15.json"
    w = load(results, name)
    rows = ["| run | wall s to 90 % | vs Flower FedAvg | rounds / versions | updates |", "|---|---:|---:|---:|---:|"]
    order = sorted(w["runs"], key=lambda k: k != "flower-fedavg")
    for k in order:
        r = w["runs"][k]
        n = f"{r['rounds']} rounds" if "rounds" in r else fmt(r.get("versions"), 0)
        rows.append(f"| {WALL_LABELS.get(k, k)} | {fmt(r['time_to_target_s'], 1)} | "
                    f"{fmt(w['speedup_vs_flower_fedavg'].get(k), 2)}× | {n} | {fmt(r['updates'], 0)} |")
    return (f"`{name}`: {made_by(results, name)}; {protocol(results, name)}.\n\n" + "\n".join(rows) + "\n")


def _wall_grid_table(results: Path, name: str) -> str:
    w = load(results, name)
    bases = [k for k in w["runs"] if _flower(k)]
    rows = ["| run | wall s to 90 % | best acc | " + " | ".join(f"vs {wall_label(b)}" for b in bases)
            + " | rounds / versions | updates |", "|---|---:|---:|" + "---:|" * len(bases) + "---:|---:|"]
    for k, r in w["runs"].items():
        n = f"{r['rounds']} rounds" if "rounds" in r else fmt(r.get("versions"), 0)
        vs = " | ".join(f"{fmt(w['speedup_vs'][b].get(k), 2)}×" for b in bases)
        rows.append(f"| {wall_label(k)} | {fmt(r['time_to_target_s'], 1)} | {fmt(r['best_accuracy'], 4)} | {vs} | {n} | "
                    f"{fmt(r['updates'], 0)} |")
    return (f"`{name}`: {made_by(results, name)}; {w['actors']} actors; grid every {w['eval_every_wall_s']:g} wall s on "
            f"both sides, the target held {w['target_hold']} grid times in a row; engine start and warm-up "
            f"{fmt(w.get('engine_start_s', 0) + w.get('warmup_s', 0), 0)} s, not counted.\n\n" + "\n".join(rows) + "\n")


def wall_clock_grid(results: Path) -> str:
    """The wall clock on the evaluation grid: every run against each Flower run of its engine start,
    at defaults (``wall_clock_grid.json``) and tuned (``wall_clock_grid_tuned.json``)."""
    files = [n for n in (WALL_GRID, WALL_GRID_TUNED) if (results / n).is_file()]
    if not files:
        return f"Not run yet on the evaluation grid (`{WALL_GRID}`).\n"
    return "\n".join(_wall_grid_table(results, n) for n in files)


# Each wall-clock file and, for a file without a Flower run, the file whose Flower run it is set against.
WALL_FILES = ["wall_clock_vs_flower.json", "archive/wall_clock_vs_flower_idle1.json",
              "archive/wall_clock_vs_flower_fastest.json", "archive/wall_clock_vs_flower_loaded.json",
              "archive/wall_clock_vs_flower_idle2.json", "wall_clock_vs_flower_lr15.json",
              "wall_clock_vs_flower_lr15_2.json"]
WALL_PAIRED = {"archive/wall_clock_vs_flower_fastest.json": ("archive/wall_clock_vs_flower_idle1.json",
                                                             "fedbuff:scheduler.name=fastest")}


def wall_clock_runs(results: Path) -> str:
    """Every wall-clock run's ratio to Flower's FedAvg, grouped by FedBuff's (or FedAsync's) settings."""
    groups: dict[str, list[str]] = {}
    for name in WALL_FILES:
        if not (results / name).is_file():
            continue
        w = load(results, name)
        if name in WALL_PAIRED:
            other, label = WALL_PAIRED[name]
            flower = load(results, other)["runs"]["flower-fedavg"]["time_to_target_s"]
            (key, r), = w["runs"].items()
            groups.setdefault(label, []).append(f"{flower / r['time_to_target_s']:.2f} (`{name}`, against "
                                                f"`{other}`'s Flower run)")
            continue
        for key, ratio in w.get("speedup_vs_flower_fedavg", {}).items():
            if key != "flower-fedavg" and ratio is not None:
                groups.setdefault(key, []).append(f"{ratio:.2f} (`{name}`)")
    rows = ["| settings | runs: × Flower's FedAvg to 90 % | ≥ 5× |", "|---|---|---|"]
    for key, runs in groups.items():
        hit = sum(float(r.split()[0]) >= 5 for r in runs)
        rows.append(f"| {WALL_LABELS.get(key, key)} | {', '.join(runs)} | {hit} of {len(runs)} |")
    alone = "archive/wall_clock_flower_alone.json"
    if (results / alone).is_file():
        a = load(results, alone)["runs"]["flower-fedavg"]
        rows.append(f"\nFlower's FedAvg alone on a fresh engine (`{alone}`): {fmt(a['time_to_target_s'], 1)} s, "
                    f"{a['rounds']} rounds.")
    return "\n".join(rows) + "\n\nEvery file above: " + OLD_PROTOCOL["wall_clock_vs_flower_lr15.json"] + ".\n"


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
    "readme-mnist-wallclock": readme_mnist_wallclock,
    "wall-clock-table": wall_clock_table,
    "wall-clock-grid": wall_clock_grid,
    "wall-clock-runs": wall_clock_runs,
    "mnist-h1800-table": mnist_h1800_table,
    "mnist-sweep-table": mnist_sweep_table,
    "deployment-table": deployment_table,
}
