"""The wall-clock blocks (see report.py): fedasync against Flower's own FedAvg and FedAvgM in one engine
start (docs/benchmarks/quickstart.md), on the evaluation grid and, in the earlier files, under the old
protocol; and the README's MNIST and wall-clock sentences. Split from :mod:`report_blocks` on its
seam; every number is read from a file under ``benchmarks/results/``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from policy_runs import median
from report_blocks import OLD_PROTOCOL, _readme_mnist, fmt, load, made_by, protocol

#: the wall clock on the evaluation grid: each side at defaults (Flower also as FedAvgM with the
#: quickstart's tuned server momentum), then each side tuned; the earlier files (old protocol) when absent
WALL_GRID = "wall_clock_grid.json"
WALL_GRID_TUNED = "wall_clock_grid_tuned.json"
#: more seeds of the defaults comparison (FedBuff against Flower's FedAvgM), one engine start each
WALL_GRID_SEEDS = ("wall_clock_grid_seed1.json", "wall_clock_grid_seed2.json")


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
    s = wall_seeds(results)
    if s is not None and len(s["rows"]) > 1:
        flower = wall_label(s["flower"]).replace("Flower ", "Flower's own ")
        seeds = ", ".join(str(r["seed"]) for r in s["rows"])
        out += (f"; over {len(s['rows'])} seeds (seeds {seeds}, one engine start each), {fmt(s['ratio'], 2)}× sooner "
                f"than {flower} (median times' ratio, {fmt(s['lo'], 2)}–{fmt(s['hi'], 2)}× seed by seed)")
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


def _seed(w: dict) -> int:
    """The config seed of a wall-clock file: its own ``seed`` key, else ``--set seed=N`` of its command,
    else the packaged quickstart's (the script's default config)."""
    if "seed" in w:
        return int(w["seed"])
    argv = w.get("provenance", {}).get("argv", [])
    sets = [b for a, b in zip(argv, argv[1:]) if a == "--set" and b.startswith("seed=")]
    if sets:
        return int(sets[-1].split("=", 1)[1])
    from fedasync.config import load_config

    return load_config(None).seed


def wall_seeds(results: Path) -> dict | None:
    """FedBuff at defaults against Flower's strongest FedAvgM of ``wall_clock_grid.json`` on every seed
    file that holds both runs: per seed (seed, file, FedBuff's s, FedAvgM's s, ratio) and the medians;
    None without ``wall_clock_grid.json`` or a FedAvgM run in it."""
    if not (results / WALL_GRID).is_file():
        return None
    w0 = load(results, WALL_GRID)
    mine = _own_run(w0)
    tuned = [k for k in w0["runs"] if _flower(k) and ":" in k]
    if not tuned:
        return None
    key = min(tuned, key=lambda k: w0["speedup_vs"][k].get(mine) or float("inf"))  # the strongest Flower run
    rows = []
    for name in (WALL_GRID, *WALL_GRID_SEEDS):
        if not (results / name).is_file():
            continue
        w = load(results, name)
        if mine not in w["runs"] or key not in w["runs"]:
            continue
        rows.append({"seed": _seed(w), "file": name, "mine_s": w["runs"][mine].get("time_to_target_s"),
                     "flower_s": w["runs"][key].get("time_to_target_s"), "ratio": w["speedup_vs"][key].get(mine)})
    ma, mb = median([r["mine_s"] for r in rows]), median([r["flower_s"] for r in rows])  # a miss counts as infinite
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    ratio = rows[0]["ratio"] if len(rows) == 1 else (mb / ma if ma and mb else None)  # the median times' ratio
    return {"mine": mine, "flower": key, "rows": rows, "mine_s": ma, "flower_s": mb, "ratio": ratio,
            "lo": min(ratios, default=None), "hi": max(ratios, default=None)}


def _wall_seeds_table(results: Path) -> str:
    s = wall_seeds(results)
    if s is None or len(s["rows"]) < 2:
        return ""
    rows = [f"| seed | file | {wall_label(s['mine'])}: wall s to 90 % | {wall_label(s['flower'])}: wall s to 90 % "
            "| ratio |", "|---:|---|---:|---:|---:|"]

    def t(x: float | None) -> str:
        return "not reached" if x is None else fmt(x, 1)

    for r in s["rows"]:
        ratio = "-" if r["ratio"] is None else f"{fmt(r['ratio'], 2)}×"
        rows.append(f"| {r['seed']} | `{r['file']}` | {t(r['mine_s'])} | {t(r['flower_s'])} | {ratio} |")
    med = "-" if s["ratio"] is None else f"{fmt(s['ratio'], 2)}× ({fmt(s['lo'], 2)}–{fmt(s['hi'], 2)})"
    rows.append(f"| median | | {t(s['mine_s'])} | {t(s['flower_s'])} | {med} |")
    made = "; ".join(f"`{n}`: {made_by(results, n)}" for n in WALL_GRID_SEEDS if (results / n).is_file())
    return (f"\nAt defaults on {len(s['rows'])} seeds (the config's `seed`: the data partition and the clients' "
            f"speeds), one engine start each, the same settings otherwise ({made}). The median row is the "
            "median times' ratio, with the seeds' lowest and highest ratio:\n\n" + "\n".join(rows) + "\n")


def wall_clock_grid(results: Path) -> str:
    """The wall clock on the evaluation grid: every run against each Flower run of its engine start,
    at defaults (``wall_clock_grid.json``, and FedBuff against FedAvgM on more seeds) and tuned
    (``wall_clock_grid_tuned.json``)."""
    files = [n for n in (WALL_GRID, WALL_GRID_TUNED) if (results / n).is_file()]
    if not files:
        return f"Not run yet on the evaluation grid (`{WALL_GRID}`).\n"
    return _wall_grid_table(results, files[0]) + _wall_seeds_table(results) + "".join(
        "\n" + _wall_grid_table(results, n) for n in files[1:])


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


GENERATORS: dict[str, Callable[[Path], str]] = {
    "readme-mnist-wallclock": readme_mnist_wallclock,
    "wall-clock-table": wall_clock_table,
    "wall-clock-grid": wall_clock_grid,
    "wall-clock-runs": wall_clock_runs,
}
