"""The generated blocks of benchmarks/README.md (see report.py): the robust filters' calibration,
DP-SGD's overhead, privacy's utility against ε, the server-less comparison, the SQLite blob
measurement and the kardam filter's cost.

Each function reads its result files under ``benchmarks/results/`` and returns the block's
Markdown, opening with how the file was made (:func:`report_blocks.made_by`; for a file that is a
JSON list, which carries no provenance, the date of its first commit). A file made before the
evaluation grid (``server.eval_every_s``) that shows a time to target says so: its note is in
:data:`MISC_OLD_PROTOCOL`. The loop-overhead table of that README is
:func:`report_blocks_policy.loop_overhead_table`, shared with docs/benchmarks/scale.md.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Callable

from report_blocks import _first_commit_date, fmt, load, made_by, protocol

# Files of benchmarks/README.md made before the evaluation grid that show a time to target.
MISC_OLD_PROTOCOL = {
    "privacy_utility.json": "old protocol: the server evaluated every few versions and the time to target is "
                            "the first evaluation at or above it (no evaluation grid, the target not held)",
}

#: ``server.robust.zeno``'s defaults (fedasync/config.py): the row the calibration table marks
ZENO_DEFAULT = (1.0, 0.5)


def _made_by(results: Path, name: str) -> str:
    """:func:`report_blocks.made_by`, also for a file whose content is a list (no provenance)."""
    if isinstance(load(results, name), dict):
        return made_by(results, name)
    date = _first_commit_date(f"benchmarks/results/{name}")
    return f"(no provenance: made before {date or 'it was committed'})"


def _note(results: Path, name: str) -> str:
    note = MISC_OLD_PROTOCOL.get(name)
    if note is None and isinstance(load(results, name), dict):
        note = protocol(results, name)
    return f"; {note}" if note else ""


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def robust_calibration_table(results: Path) -> str:
    """zeno++'s share rejected per (rho, epsilon), median over seeds, and the other filters'
    false rejections (``robust_calibration.json``)."""
    name = "robust_calibration.json"
    d = load(results, name)
    runs = d["runs"]
    cols = ["sign_flip", "scale", "gaussian", "label_flip"]
    rows = ["| zeno++ rho | epsilon | honest | honest, versions 20-59 | " + " | ".join(cols) + " |",
            "|---|---|---:|---:|" + "---:|" * len(cols)]
    for i, z in enumerate(runs[0]["zeno"]):
        cells = [median(r["zeno"][i]["all"]["honest"] for r in runs),
                 median(r["zeno"][i]["versions_20_59"]["honest"] for r in runs),
                 *(median(r["zeno"][i]["all"][c] for r in runs) for c in cols)]
        head = [f"{z['rho']:g}", f"{z['epsilon']:g}"] + [f"{c:.3f}" for c in cells]
        if (z["rho"], z["epsilon"]) == ZENO_DEFAULT:
            head = [f"**{c}**" for c in head]
        rows.append("| " + " | ".join(head) + " |")
    neg = [r["honest_cosine_with_v"]["share_negative"] for r in runs]
    kardam = {k: median(r["kardam_false_rejection"][k] for r in runs) for k in runs[0]["kardam_false_rejection"]}
    norm = {k: median(r["norm_false_rejection"][k] for r in runs) for k in runs[0]["norm_false_rejection"]}
    acc = [r["final_accuracy"] for r in runs]
    return (f"`{name}`: {_made_by(results, name)}. Seeds {', '.join(str(r['seed']) for r in runs)}, "
            f"{fmt(runs[0]['updates'], 0)} updates ({runs[0]['versions']} versions, final accuracy "
            f"{min(acc):.2f}-{max(acc):.2f}) each; attacks scaled by {d['factor']:g}. Share rejected, median over "
            "seeds (honest = false rejections); the defaults in bold:\n\n" + "\n".join(rows) + "\n\n"
            f"Honest updates with a negative cosine with the validation gradient: {_pct(min(neg))}-{_pct(max(neg))} "
            "(per seed). Kardam's false rejections by `f/N`: "
            + ", ".join(f"{k}: {_pct(v)}" for k, v in kardam.items())
            + ". The norm filter's, by multiplier of the running median: "
            + ", ".join(f"{k}: {_pct(v)}" for k, v in norm.items())
            + f". The validation gradient (128 samples) costs {median(r['validation_gradient_ms_median'] for r in runs):.2f} "
            "ms (median of the seeds' medians).\n")


DP_MODES = [("hooks", "DP hooks"), ("functorch", "DP functorch"), ("ew", "DP ew"), ("ghost", "DP ghost")]


def dp_overhead_table(results: Path) -> str:
    """ms per local step, plain SGD against DP-SGD per ``grad_sample_mode`` (``dp_overhead.json``)."""
    name = "dp_overhead.json"
    d = load(results, name)
    a = d["args"]
    rows = ["| model | params | plain SGD | " + " | ".join(label for _, label in DP_MODES) + " |",
            "|---|---:|---:|" + "---:|" * len(DP_MODES)]
    for r in d["rows"]:
        rows.append(f"| {r['model']} | {fmt(r['params'], 0)} | {r['plain_ms']:.2f} | "
                    + " | ".join(f"{r[f'{m}_ms']:.2f} ({r[f'{m}_ratio']:.1f}×)" for m, _ in DP_MODES) + " |")
    acc = ", ".join(f"{k} {v:.1f} ms" for k, v in d["accounting_ms"].items())
    return (f"`{name}`: {_made_by(results, name)}.\n\n" + "\n".join(rows) + "\n\n"
            f"ms per local step (ratio to plain SGD), batch {a['batch_size']}, {a['steps']} steps per task, median of "
            f"{a['repeats']} rounds. Budget check before each task (ε of a fresh Opacus accountant for a long "
            f"history): {acc}.\n")


def privacy_utility_table(results: Path) -> str:
    """``examples/privacy.yaml`` at each ε and without DP (``privacy_utility.json``)."""
    name = "privacy_utility.json"
    runs = load(results, name)
    base = next((r for r in runs if r["epsilon_budget"] is None), None)
    target = runs[0]["target_accuracy"]
    rows = ["| run | σ | final acc | Δ vs no DP (points) | best acc | time to target "
            f"{target:g} (virtual s) | versions | ε max spent | exhausted | stop | wall s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in runs:
        sigma = ", ".join(f"{s:.3f}" for s in r["noise_multiplier"]) or "-"
        delta = f"{(r['final_accuracy'] - base['final_accuracy']) * 100:+.1f}" if base else "-"
        rows.append(f"| {r['run']} | {sigma} | {r['final_accuracy']:.4f} | {delta} | {r['best_accuracy']:.4f} | "
                    f"{fmt(r['time_to_target_s'], 1)} | {r['versions']} | {fmt(r['epsilon_max'], 3)} | "
                    f"{fmt(r['clients_exhausted'], 0)} | {r['stop_reason']} | {fmt(r['wall_s'], 1)} |")
    return f"`{name}`: {_made_by(results, name)}{_note(results, name)}.\n\n" + "\n".join(rows) + "\n"


def _f(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def serverless_compare(results: Path) -> str:
    """Server, ledger and gossip on one scenario and one evaluation grid (``serverless_compare.json``,
    written by ``benchmarks/serverless_compare.py``)."""
    name = "serverless_compare.json"
    d = load(results, name)
    rows, n = d["rows"], d["peers"]
    wall = any("wall_time_to_target_s" in r for r in rows)
    out = [f"`{name}`: {_made_by(results, name)}{_note(results, name)}.", "",
           f"Quickstart scenario (digits, Dirichlet α = 0.5, MLP, log-normal speeds, seed 0) with {n} clients / "
           f"peers; the server keeps all {n} busy (`server.concurrency={n}`, FedBuff K = 10). Virtual seconds come "
           "from the deterministic modes (the same speed profiles and task durations as `fedasync simulate`). "
           f"Every variant is evaluated on the same grid, every {_f(rows[0].get('eval_every_s'))} virtual s, and its "
           f"time to {rows[0]['target'] * 100:g} % is the first grid time from which accuracy ≥ "
           f"{rows[0]['target'] * 100:g} % holds for {rows[0].get('target_hold')} evaluations in a row (the server's "
           "rule, `server.eval_every_s`, `server.target_hold`); local trainings = updates the learners had made at "
           "that time; for gossip, the accuracy is the average model's, the worst peer's own model is shown beside "
           "it, and the consensus distance (1/N) Σ ||x_i − x̄||² is given when the run stopped and averaged over its "
           "measurements. Gossip step orders (`gossip.step_order`): `paper` = AD-PSGD / A(DP)²SGD (x_j ← (x_i + "
           "x_j)/2, x_i ← (x_i + x_j)/2 + Δ_i; the default), `symmetric` = both ← ((x_i + Δ_i) + x_j)/2.", "",
           "| variant | virtual s to target | local trainings to target | final acc. | worst peer acc. "
           "| consensus dist. at stop | consensus dist. mean |" + (" wall s to target (peer processes) |" if wall else ""),
           "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if wall else "")]
    for r in rows:
        line = (f"| {r['variant']} | {_f(r['virtual_time_to_target_s'])} | {r['updates_to_target'] or '—'} | "
                f"{_f(r['final_accuracy'], 3)} | {_f(r.get('min_peer_accuracy_final'), 3)} | "
                f"{_f(r.get('consensus_distance_final'), 4)} | {_f(r.get('consensus_distance_mean'), 4)} |")
        if wall:
            line += f" {_f(r.get('wall_time_to_target_s')) if 'wall_command' in r else 'n/a'} |"
        out.append(line)
    led = next((r for r in rows if r["key"] == "ledger"), None)
    srv = next((r for r in rows if r["key"] == "fedbuff"), None)
    out += ["", "Notes:", ""]
    if led and srv:
        same = led["model_sha256"] == srv["model_sha256"]
        out.append(f"- The ledger in virtual time {'is' if same else 'is NOT'} the FedBuff server's computation: "
                   f"final model sha256 {'identical' if same else 'differs'} ({led['model_sha256'][:16]}…); the "
                   "ledger adds signed, auditable blocks (`fedasync ledger verify` recomputes every aggregate).")
    for r in rows:
        if r["key"].startswith("gossip"):
            out.append(f"- {r['variant']}: spectral gap {r['spectral_gap']:.3g}, consensus distance at stop "
                       f"{r['consensus_distance_final']:.3g} (max {r['consensus_distance_max']:.3g}); final model "
                       f"sha256 {r['model_sha256'][:16]}….")
    if wall:
        ts = d.get("time_scale")
        out.append(f"- Wall-clock: one process per peer, `--emulate-speeds` with `clock.time_scale={ts}` (a peer "
                   f"sleeps its task's virtual duration × {ts}), counted from the moment every peer was ready. The "
                   "server row has no wall-clock figure: `simulate --backend local` runs its clients one after another.")
    out += ["", "Commands (virtual clock):", "", "```", *(r["command"] for r in rows)]
    if wall:
        out += ["# peer processes", *(r["wall_command"] for r in rows if "wall_command" in r)]
    out += ["```"]
    return "\n".join(out) + "\n"


def sqlite_blobs(results: Path) -> str:
    """Insert + commit of one ``fedavg_cnn``-sized blob per store layout (``sqlite_blobs.json``)."""
    name = "sqlite_blobs.json"
    d = load(results, name)

    def layout(r: dict) -> str:
        if r.get("file_beside_db"):
            return "a file beside the database"
        return f"{r['page_size'] // 1024} KiB pages, autocheckpoint {fmt(r['wal_autocheckpoint'], 0)} pages"

    rows = ["| layout | ms per blob |", "|---|---:|"] + [f"| {layout(r)} | {r['ms_per_blob']:.1f} |" for r in d["runs"]]
    return (f"`{name}`: {_made_by(results, name)}. {d['blobs']} blobs of {d['blob_mb']:.2f} MB "
            f"({fmt(d['params'], 0)} float32 parameters), {d['cpus']} CPUs, load average "
            f"{', '.join(f'{x:g}' for x in d['load_average'])}:\n\n" + "\n".join(rows) + "\n")


def kardam_cost(results: Path) -> str:
    """``Kardam.check`` alone per model (``kardam_cost.json``)."""
    name = "kardam_cost.json"
    d = load(results, name)
    rows = ["| model | parameters | clients | checks timed | ms per check, median | mean | base versions kept |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for m in d.values():
        rows.append(f"| `{m['model']}` | {fmt(m['parameters'], 0)} | {m['clients']} | {m['updates_timed']} | "
                    f"{m['check_ms_median']:.2f} | {m['check_ms_mean']:.2f} | {m['base_versions_kept']} |")
    return f"`{name}`: {_made_by(results, name)}.\n\n" + "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[Path], str]] = {
    "robust-calibration-table": robust_calibration_table,
    "dp-overhead-table": dp_overhead_table,
    "privacy-utility-table": privacy_utility_table,
    "serverless-compare": serverless_compare,
    "sqlite-blobs": sqlite_blobs,
    "kardam-cost": kardam_cost,
}
