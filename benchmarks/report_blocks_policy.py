"""The generated blocks of docs/benchmarks/scale.md and scheduling-robustness.md (see report.py).

Each function reads its result files under ``benchmarks/results/`` and returns the block's
Markdown. A file made before the evaluation grid (``server.eval_every_s``) is said so by the block:
its note is in :data:`POLICY_OLD_PROTOCOL`. Scale and loop-cost files evaluate nothing, so no
protocol applies to them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from report_blocks import fmt, load, made_by, protocol

# Files of these pages made before the evaluation grid: what their protocol was.
POLICY_OLD_PROTOCOL = {
    "scheduling.json": "old protocol: the server evaluated every few versions and a run's time to 90 % is "
                       "its first evaluation at or above 90 % (no evaluation grid, the target not held)",
}


def _note(results: Path, name: str) -> str:
    note = POLICY_OLD_PROTOCOL.get(name) or protocol(results, name)
    return f"; {note}" if note else ""


# --- docs/benchmarks/scale.md ------------------------------------------------------------------

def _scale_rows(d: dict, label: Callable[[dict], str]) -> list[str]:
    order = sorted(d["runs"], key=lambda r: (r["backend"] != "local", r["clients"]))
    return [f"| {label(r)} | {fmt(r['clients'], 0)} | {fmt(r['updates'], 0)} | {fmt(r['wall_s'], 0)} s | "
            f"{fmt(r['wall_ms_per_update'], 1)} | {fmt(r['peak_rss_total_mb'], 0)} MB | {fmt(r['store_mb'], 1)} MB | "
            f"{fmt(r['load_average_1m_at_start'], 1)} |" for r in order]


def _ms(d: dict, backend: str, clients: int) -> float:
    return next(r["wall_ms_per_update"] for r in d["runs"] if r["backend"] == backend and r["clients"] == clients)


def scale_table(results: Path) -> str:
    """Clients × backend (``scale.json``, a loaded machine; ``scale-quiet/scale.json``, a quiet one)
    and the ratios the goals are stated on."""
    loaded, quiet = load(results, "scale.json"), load(results, "scale-quiet/scale.json")
    backend = lambda r: "local" if r["backend"] == "local" else "Flower, 2 actors"  # noqa: E731
    rows = ["| backend | clients | updates | wall | ms / update | peak RSS, all processes | store | load at start |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows += _scale_rows(loaded, backend)
    rows += _scale_rows({"runs": [r for r in quiet["runs"]]}, lambda r: f"**{backend(r)}, quiet machine**")
    loc = _ms(loaded, "local", 10000) / _ms(loaded, "local", 100)
    fl = _ms(loaded, "flower", 10000) / _ms(loaded, "flower", 100)
    fq = _ms(quiet, "flower", 10000) / _ms(quiet, "flower", 100)
    q10k = next(r for r in quiet["runs"] if r["clients"] == 10000)
    rss = max(r["peak_rss_total_mb"] for r in loaded["runs"] if r["backend"] == "flower")
    rss_local = max(r["peak_rss_total_mb"] for r in loaded["runs"] if r["backend"] == "local")
    per_update = [r["store_mb"] * 1e3 / r["updates"] for r in loaded["runs"] + quiet["runs"] if r["updates"] >= 20000]
    return (f"`scale.json`: {made_by(results, 'scale.json')}; `scale-quiet/scale.json`: "
            f"{made_by(results, 'scale-quiet/scale.json')}.\n\n" + "\n".join(rows) + "\n\n"
            f"Per-update wall time of 10,000 clients against 100 (goal ≤ 1.5×): {loc:.2f}× in-process, "
            f"{fl:.2f}× on Flower's engine under load, {fq:.2f}× on a quiet machine (engine start included). "
            f"10,000 clients × {fmt(q10k['updates'], 0)} updates on Flower's engine, quiet machine: "
            f"{fmt(q10k['wall_s'], 0)} s (goal ≤ 10 min) and {fmt(q10k['peak_rss_total_mb'] / 1e3, 2)} GB peak RSS over "
            f"every process (goal ≤ 4 GB); at most {fmt(rss / 1e3, 2)} GB on Flower's engine and "
            f"{fmt(rss_local / 1e3, 2)} GB in-process under load. The store: "
            f"{min(per_update):.1f}-{max(per_update):.1f} KB per update.\n")


def scale_cnn_store(results: Path) -> str:
    """The store of 10,000 ``fedavg_cnn`` versions (``scale-quiet/scale.json``'s ``cnn_store``)."""
    c = load(results, "scale-quiet/scale.json")["cnn_store"]
    return (f"A store for {fmt(c['versions'], 0)} FedAsync versions of `fedavg_cnn` (`scale-quiet/scale.json`, "
            f"`cnn_store`; {made_by(results, 'scale-quiet/scale.json')}): **{fmt(c['store_mb'], 0)} MB** (goal ≤ 1 GB), "
            f"{fmt(c['params_files_mb'], 0)} MB of it in {c['params_files']} parameter files beside the database; "
            f"{fmt(c['wall_s'], 0)} s, {fmt(c['peak_rss_total_mb'] / 1e3, 2)} GB peak RSS, final accuracy "
            f"{fmt(c['final_accuracy'], 3)}.\n")


def scheduler_cost(results: Path) -> str:
    """A scheduler's choice at 100 and 10,000 clients, before and after its numpy statistics."""
    name = "scheduler_cost.json"
    d = load(results, name)
    rows = ["| scheduler / case | 100 clients | 10,000 clients | 10,000 clients, before |", "|---|---:|---:|---:|"]
    for k, v in d["after"].items():
        rows.append(f"| {k} | {v['100']:.4f} | {v['10000']:.4f} | {d['before'].get(k, {}).get('10000', '-')} |")
    return f"`{name}` ({d['unit']}): {made_by(results, name)}.\n\n" + "\n".join(rows) + "\n"


LOOP_ROWS = [("mlp", "wall", "MLP", "arrival (`fedasync server`, wall clock)"),
             ("mlp", "virtual", "MLP", "virtual finish (`fedasync simulate`)"),
             ("fedavg_cnn", "wall", "`fedavg_cnn` on MNIST", "arrival"),
             ("fedavg_cnn", "virtual", "`fedavg_cnn` on MNIST", "virtual finish")]


def loop_overhead_table(results: Path) -> str:
    """Each fedasync loop against the bare Flower loop in the same order (``loop_overhead.json``)."""
    name = "loop_overhead.json"
    d = load(results, name)
    rows = ["| model (parameters) | order | bare Flower | fedasync | ratio (goal ≥ 0.85) | the 3 pairs |",
            "|---|---|---:|---:|---:|---|"]
    for model, order, label, how in LOOP_ROWS:
        m = d[model]
        bare = m["bare_flower_updates_per_s" if order == "wall" else "bare_flower_virtual_order_updates_per_s"]
        ours = m["fedasync_wall_updates_per_s" if order == "wall" else "fedasync_virtual_updates_per_s"]
        pairs = ", ".join(f"{p[-1]:.2f}" for p in m[f"pairs_{order}"])
        rows.append(f"| {label} ({fmt(m['num_params'], 0)}) | {how} | {bare:.1f} /s | {ours:.1f} /s | "
                    f"**{m[f'ratio_{order}']:.2f}** | {pairs} |")
    nm = d.get("fedavg_cnn_bare_new_model_every_10")
    out = f"`{name}`: {made_by(results, name)}.\n\n" + "\n".join(rows) + "\n"
    if nm:
        out += (f"\nThe bare loop against itself building a new record every {nm['bare_new_model_every']} replies "
                f"(`fedavg_cnn_bare_new_model_every_10`): **{nm['ratio_wall']:.2f} / {nm['ratio_virtual']:.2f}** "
                f"(arrival / virtual order; {nm['machine_cpu_wall']['bare_new_model']['cpu_ms_per_update']:.1f} vs "
                f"{nm['machine_cpu_wall']['bare']['cpu_ms_per_update']:.1f} ms of machine CPU per update).\n")
    return out


FLOOR = [("reply_sha256", "the reply's sha256"), ("aggregation_share", "FedBuff's float64 aggregation (its share)"),
         ("buffered_update_write", "the buffered reply's file"), ("finite_check", "the finite check"),
         ("version_sha256_share", "the version's sha256 (its share)"), ("task_record_share", "its Flower record (its share)")]


def loop_cpu_table(results: Path) -> str:
    """CPU per update: the machine's in each loop (``loop_overhead.json``) and the loop's own
    without the engine, with the array work it cannot skip (``loop_cost.json``)."""
    lo, lc = load(results, "loop_overhead.json")["fedavg_cnn"]["machine_cpu_wall"], load(results, "loop_cost.json")
    c = lc["fedavg_cnn"]
    f = c["floor"]
    floor = ", ".join(f"{label} {f[k]:.2f}" for k, label in FLOOR)
    bare, ours = lo["bare"], lo["fedasync"]
    rows = ["| `fedavg_cnn`, arrival order | CPU per update |", "|---|---:|",
            f"| bare Flower loop, whole machine ({bare['busy'] * 100:.0f} % busy) | {bare['cpu_ms_per_update']:.1f} ms |",
            f"| fedasync loop, whole machine ({ours['busy'] * 100:.0f} % busy) | {ours['cpu_ms_per_update']:.1f} ms |",
            f"| the fedasync loop's own CPU without the engine (`loop_cost.py`, median of {len(c['runs'])}) | "
            f"{c['loop_cpu_ms_median']:.1f} ms |",
            f"| of which array work it cannot skip (`floor`): {floor} | {f['total_ms']:.1f} ms |"]
    ideal = bare["cpu_ms_per_update"] + f["total_ms"]
    return (f"`loop_overhead.json`: {made_by(results, 'loop_overhead.json')}; `loop_cost.json`: "
            f"{made_by(results, 'loop_cost.json')}.\n\n" + "\n".join(rows) + "\n\n"
            f"In the same engine start the fedasync loop adds {ours['cpu_ms_per_update'] - bare['cpu_ms_per_update']:.1f} "
            f"ms per update to the bare loop's {bare['cpu_ms_per_update']:.1f}: its own {c['loop_cpu_ms_median']:.1f} and "
            f"the rest in place (the engine's threads and the loop share the GIL and the caches). A loop that spent "
            f"nothing beyond the floor would cost {bare['cpu_ms_per_update']:.1f} + {f['total_ms']:.1f} = {ideal:.1f} ms: "
            f"**≈ {bare['cpu_ms_per_update'] / ideal:.2f}** of the bare loop.\n")


# --- docs/benchmarks/scheduling-robustness.md ---------------------------------------------------

def _per_seed(runs: list[dict], label: str, key: str, nd: int, seeds: list[int]) -> str:
    by = {r["seed"]: r.get(key) for r in runs if r["label"] == label}
    return " / ".join(fmt(by.get(s), nd) for s in seeds)


def scheduling_table(results: Path) -> str:
    """The scheduling and delay-compensation grid (``scheduling.json``) and its goals."""
    name = "scheduling.json"
    d = load(results, name)
    seeds = sorted({r["seed"] for r in d["runs"]})
    rows = [f"| run | time to 90 % (virtual s), seeds {' / '.join(map(str, seeds))} | median | final accuracy, median "
            "| Jain's index | mean staleness |", "|---|---|---|---|---|---|"]
    for label, m in d["medians"].items():
        rows.append(f"| {label} | {_per_seed(d['runs'], label, 'time_to_90_s', 1, seeds)} | {fmt(m['time_to_90_s'])} | "
                    f"{fmt(m['final_accuracy'], 4)} | {fmt(m['jain'], 3)} | {fmt(m['staleness_mean'], 2)} |")
    g, med = d["goals"], d["medians"]
    met = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    ratio = lambda a, b: med[b]["time_to_90_s"] / med[a]["time_to_90_s"]  # noqa: E731
    return (f"{d['scenario']}; `{d['command']}`: {made_by(results, name)}{_note(results, name)}.\n\n"
            + "\n".join(rows) + "\n\nGoals (issue 10), on the medians (`goals` of the file):\n"
            f"- `fastest` reaches 90 % **{g['fastest_speedup_vs_uniform']:.2f}× sooner** than `uniform` (goal ≥ 1.3×) "
            f"and ends {-g['fastest_accuracy_drop_points']:.2f} points {'higher' if g['fastest_accuracy_drop_points'] < 0 else 'lower'} "
            f"(goal: at most 1 point lower): {met(g['fastest_goal_met'])}; its Jain's index is {fmt(med['fastest']['jain'], 2)}.\n"
            f"- `fair`: Jain's index **{g['fair_jain']:.3f}** (goal ≥ 0.95) and time to 90 % **{g['fair_time_ratio_vs_uniform']:.2f}×** "
            f"`uniform`'s (goal ≤ 1.2): {met(g['fair_goal_met'])}.\n"
            f"- FedAsync against its polynomial weighting, median time to 90 %: `dc_asgd` "
            f"{g['fedasync-dc_asgd_time_vs_polynomial']:.2f}×, `dc_asgd` with `lambda` 10 "
            f"{g['fedasync-dc_asgd-l10_time_vs_polynomial']:.2f}×, `adaptive` {g['fedasync-adaptive_time_vs_polynomial']:.2f}× "
            f"(beats it: {', '.join(k.split('_beats')[0].removeprefix('fedasync-') for k, v in g.items() if k.endswith('_beats_polynomial') and v) or 'none'}).\n"
            f"- Not goals: `staleness_aware` reaches 90 % {ratio('staleness_aware', 'uniform'):.2f}× sooner than `uniform` "
            f"with Jain's index {fmt(med['staleness_aware']['jain'], 2)}; FedBuff with `adaptive` "
            f"{ratio('fedbuff-adaptive', 'uniform'):.2f}× sooner.\n")


def robustness_table(results: Path) -> str:
    """The filters' defaults on seeds they were not calibrated on (``robustness.json``) and their goals."""
    name = "robustness.json"
    d = load(results, name)
    seeds = d["seeds"]
    rows = ["| strategy / attack / defense | seeds | final accuracy per seed | median | time to 90 % (virtual s) per seed "
            "| median | true rejections | false rejections |", "|---|---|---|---|---|---|---|---|"]
    for label, m in d["medians"].items():
        rows.append(f"| {label} | {' / '.join(map(str, m['seeds']))} | "
                    f"{_per_seed(d['runs'], label, 'final_accuracy', 4, m['seeds'])} | {fmt(m['final_accuracy'], 4)} | "
                    f"{_per_seed(d['runs'], label, 'time_to_90_s', 1, m['seeds'])} | {fmt(m['time_to_90_s'])} | "
                    f"{fmt(m['true_rejection_rate'], 3)} | {fmt(m['false_rejection_rate'], 3)} |")
    g = d["goals"]
    fr = {k.split("_")[2]: v for k, v in g.items() if k.startswith("fedbuff_clean_") and k.endswith("_false_rejection")}
    sf = d["medians"].get("fedbuff/sign_flip/zeno++")
    met = all(v for k, v in g.items() if k.endswith("_goal_met"))
    out = (f"Seeds {', '.join(map(str, seeds))} (the defaults were calibrated on seeds "
           f"{', '.join(map(str, d['calibration_seeds']))}): {made_by(results, name)}{_note(results, name)}.\n\n"
           + "\n".join(rows) + "\n\n"
           f"Goals (issue 11), on the medians (`goals` of the file): on clean runs "
           + ", ".join(f"{k} rejects {v * 100:.1f} %" for k, v in fr.items()) + " of honest updates (goal: at most 5 %)")
    if sf:
        out += (f"; under `sign_flip` zeno++ rejects {sf['true_rejection_rate'] * 100:.1f} % of the attackers' updates "
                f"and ends {g['fedbuff_sign_flip_zeno_points_below_clean']:.2f} points below the clean run, reaching 90 % "
                f"in {g['fedbuff_sign_flip_zeno_time_ratio']:.2f}× its time (goal: at most 2 points and 1.5×)")
    return out + f": {'**every goal met**' if met else '**not every goal met**'}.\n"


GENERATORS: dict[str, Callable[[Path], str]] = {
    "scale-table": scale_table,
    "scale-cnn-store": scale_cnn_store,
    "scheduler-cost": scheduler_cost,
    "loop-overhead-table": loop_overhead_table,
    "loop-cpu-table": loop_cpu_table,
    "scheduling-table": scheduling_table,
    "robustness-table": robustness_table,
}
