"""The generated blocks of docs/benchmarks/mnist.md and deployment.md (see report.py): the MNIST
runs at 150 virtual s, the other seed, local DP on ``fedavg_cnn`` and on ``dp_cnn``, the goals, and
the deployment goals. Every number is read from the file the block names."""

from __future__ import annotations

from pathlib import Path
from statistics import mean, median
from typing import Callable

from report_blocks import OLD_PROTOCOL, fmt, load, made_by, protocol

# The MNIST files of this page made before the evaluation grid, and what their protocol was.
MNIST_OLD = {
    "mnist.json": "old protocol: the server evaluated every ~20 updates on a 1,000-image test subset",
    "mnist-seed1.json": "old protocol: evaluated every ~20 updates on a 1,000-image test subset, each run "
                        "stopped at its first evaluation at ≥ 97 %, with FedBuff's settings chosen on seed 0",
    "mnist-dp-h600.json": "old protocol: evaluated every ~20 updates on a 1,000-image test subset",
    "archive/mnist-dp-b64-h300.json": "old protocol, as above",
    "archive/mnist-dp-k20-h200.json": "old protocol, as above",
    "mnist-dp-dpcnn.json": "old protocol: evaluated every 2 versions on a 1,000-image test subset, every try "
                           "scored on the seed it is reported on",
}


def _note(results: Path, name: str) -> str:
    return protocol(results, name) or MNIST_OLD.get(name) or OLD_PROTOCOL.get(name, "")


def _src(results: Path, name: str) -> str:
    """"`name`: how it was made; its protocol" for a block's first line."""
    note = _note(results, name)
    return f"`{name}`: {made_by(results, name)}" + (f"; {note}" if note else "")


def _pct(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{nd}f} %"


# --- the runs to 150 virtual s ------------------------------------------------------------------

H150_LABELS = {"fedbuff": "fedbuff (`server_lr` 1.0, uniform)",
               "fedbuff_dp8": "fedbuff_dp8 (`server_lr` 1.0, uniform, {pt} planned tasks)"}


def mnist_h150_table(results: Path) -> str:
    """``mnist.json``: five strategies to 150 virtual s."""
    name = "mnist.json"
    d = load(results, name)
    rows = ["| run | updates | to 80 % (virtual s) | to 90 % | final acc (1,000 eval images) | final acc (10,000 test) "
            "| ε max | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        pt = next((s.split("=")[1] for s in reversed(r.get("overrides") or []) if "planned_tasks=" in s), "?")
        label = H150_LABELS.get(r["run"], r["run"]).format(pt=pt)
        rows.append(f"| {label} | {fmt(r['updates'], 0)} | {fmt(r.get('time_to_80_s'))} | {fmt(r.get('time_to_90_s'))} | "
                    f"{fmt(r['final_accuracy'], 4)} | {fmt(r.get('final_accuracy_full_test'), 4)} | "
                    f"{fmt(r.get('epsilon_max'), 2)} | {fmt(r['wall_s'], 0)} |")
    return (f"{_src(results, name)}; {fmt(d['wall_s'], 0)} s wall in all.\n\n" + "\n".join(rows) + "\n")


# --- the other seed -----------------------------------------------------------------------------

def mnist_seed1(results: Path) -> str:
    """``mnist-seed1.json``: FedBuff and FedAvg on seed 1, each stopped at 97 %."""
    name = "mnist-seed1.json"
    d = load(results, name)
    fb = next(r for r in d["rows"] if r["run"] == "fedbuff")
    fa = next(r for r in d["rows"] if r["run"] == "fedavg")
    return (f"**Another seed** (`seed: 1`: other partitions, client speeds and initial model; {_src(results, name)}): "
            f"FedBuff with the same settings reaches 97 % at {fmt(fb['time_to_97_s'])} virtual s "
            f"({fmt(fb['wall_s'], 0)} s wall), FedAvg at {fmt(fa['time_to_97_s'])} ({fmt(fa['wall_s'], 0)} s wall): "
            f"**{fa['time_to_97_s'] / fb['time_to_97_s']:.2f}×**.\n")


# --- local DP on fedavg_cnn ---------------------------------------------------------------------

def mnist_dp_h600(results: Path) -> str:
    """``mnist-dp-h600.json`` and the two shorter tries in ``archive/``."""
    name = "mnist-dp-h600.json"
    r = load(results, name)["rows"][0]
    out = (f"{_src(results, name)}. To {fmt(r['virtual_time_s'], 0)} virtual s: **{_pct(r['final_accuracy'])}** on "
           f"the evaluation subset (70 % at {fmt(r['time_to_70_s'], 0)} s, 80 % at {fmt(r['time_to_80_s'], 0)} s), "
           f"{_pct(r['final_accuracy_full_test'])} on all 10,000 test images; {fmt(r['updates'], 0)} updates, "
           f"the largest ε spent {r['epsilon_max']:.2f}, {r['clients_exhausted']} clients' budgets exhausted; "
           f"{fmt(r['wall_s'], 0)} s wall.")
    tries = [("archive/mnist-dp-b64-h300.json", "batches of 64 with 5 local steps"),
             ("archive/mnist-dp-k20-h200.json", "a buffer of 20 at `server_lr` 1.0")]
    for arch, what in tries:
        if not (results / arch).is_file():
            continue
        a = load(results, arch)["rows"][0]
        at = fmt(a["virtual_time_s"], 0)
        out += (f" {what.capitalize()} (`{arch}`, {made_by(results, arch).strip('()')}; {_note(results, arch)}): "
                f"{_pct(a['final_accuracy'])} at {at} virtual s against this run's "
                f"{_pct(_acc_at(r['history'], a['virtual_time_s']))} at the same time.")
    return out + "\n"


def _acc_at(history: list[dict], t: float) -> float | None:
    """The accuracy of the last evaluation at or before virtual time ``t``."""
    past = [h for h in history if h["virtual_time_s"] <= t]
    return past[-1]["accuracy"] if past else None


# --- local DP on dp_cnn -------------------------------------------------------------------------

DPCNN_TRIES = {
    "fedbuff_dpcnn_no_dp_h60": "no DP (`fedbuff_dpcnn`, 60 virtual s)",
    "dpcnn_b16_p30": "batches of 16, uniform scheduler",
    "dpcnn_b64_p30": "batches of 64",
    "dpcnn_p120": "16, more tasks",
    "dpcnn_p120_examples": "+ updates weighted by examples",
    "dpcnn_p120_examples_slr0.75": "+ `server_lr` 0.75",
    "dpcnn_p120_examples_k20": "+ buffer of 20",
    "dpcnn_p120_k20_repeat_every_version_kept": "same again, every version kept (for tail averages)",
    "dpcnn_p120_k20_budget_aware": "+ `budget_aware` scheduler (`fedbuff_dp8_dpcnn` until then)",
    "dpcnn_p60_k20_budget_aware": "same, 60 planned tasks",
    "dpcnn_p120_k20_budget_aware_lr0.2": "same (120), local `lr` 0.2",
    "dpcnn_p120_k20_budget_aware_lr0.3": "same, local `lr` 0.3",
}


def _in_order(rows: list[dict], labels: dict[str, str]) -> list[dict]:
    """The rows ``labels`` names, in its order (a label may refer to the row above it)."""
    by_run = {r["run"]: r for r in rows}
    return [by_run[k] for k in labels if k in by_run]


def _planned(r: dict) -> str:
    keys = (r.get("overrides") or []) + (r.get("sets") or [])
    return next((s.split("=")[1] for s in reversed(keys) if "planned_tasks=" in s), "-")


def mnist_dpcnn_tries(results: Path) -> str:
    """``mnist-dp-dpcnn.json``'s first tries (batches of 16, 10 local steps), one row each."""
    name = "mnist-dp-dpcnn.json"
    rows = ["| try | planned tasks | σ (median) | updates | final (1,000 eval) | final (10,000 test) | "
            "mean 380-560 s | best | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in _in_order(load(results, name)["rows"], DPCNN_TRIES):
        sig = r.get("noise_multiplier") or []
        win = [h["accuracy"] for h in r["history"] if 380 <= h["virtual_time_s"] <= 560]
        plateau = fmt(mean(win), 3) if win and r["virtual_time_s"] >= 560 else "-"
        rows.append(f"| {DPCNN_TRIES[r['run']]} | {_planned(r) if sig else '-'} | "
                    f"{fmt(median(sig), 2) if sig else '-'} | {fmt(r['updates'], 0)} | {fmt(r['final_accuracy'], 3)} | "
                    f"{fmt(r['final_accuracy_full_test'], 3)} | {plateau} | {fmt(r['best_accuracy'], 3)} | "
                    f"{fmt(r['wall_s'], 0)} |")
    return f"{_src(results, name)}.\n\n" + "\n".join(rows) + "\n"


DPCNN_STEPS = {
    "dpcnn_b32_s5_lr0.2": "batches of 32, 5 steps, local `lr` 0.2",
    "dpcnn_b32_s5_lr0.2_normalized": "same, inputs normalized (`data.normalize`)",
    "dpcnn_b64_s5_lr0.2": "batches of 64, 5 steps, `lr` 0.2",
    "dpcnn_b64_s5_lr0.2_normalized": "same, inputs normalized",
    "dpcnn_b64_s5_lr0.2_normalized_repeat": "same again",
    "dpcnn_b64_s5_lr0.3": "batches of 64, 5 steps, `lr` 0.3",
    "fedbuff_dp8_dpcnn": "**`fedbuff_dp8_dpcnn`** (64, 5 steps, `lr` 0.3, `server.average_last: 20`)",
    "fedbuff_dp8_dpcnn_repeat": "**same again**",
    "fedbuff_dp8_dpcnn_repeat2": "**and a third time**",
    "fedbuff_dp8_dpcnn_after_dp_fixes_1": "**after the DP-SGD fixes** (exact `q = 1/k`, `n // k` averaging), run 1",
    "fedbuff_dp8_dpcnn_after_dp_fixes_2": "**after the fixes, run 2**",
    "fedbuff_dp8_dpcnn_after_dp_fixes_3": "**after the fixes, run 3**",
}


def _mean_last_20(r: dict) -> float | None:
    """The mean of the run's last 20 versions on the 10,000 test images: measured afterwards from
    its store (``full_test_mean_of_last``), else what the server reported with ``average_last: 20``."""
    tail = r.get("full_test_mean_of_last") or {}
    if "20" in tail:
        return tail["20"]
    return r["final_accuracy_full_test"] if "server.average_last=20" in (r.get("overrides") or []) else None


def mnist_dpcnn_steps(results: Path) -> str:
    """``mnist-dp-dpcnn.json``'s later tries (fewer, larger private steps) and the row's repeats."""
    name = "mnist-dp-dpcnn.json"
    d = load(results, name)
    rows = ["| try (120 planned tasks, `budget_aware`, buffer 20) | final (1,000 eval) | last version (10,000 test) | "
            "mean of last 20 (10,000 test) | best (1,000 eval) | wall s |", "|---|---:|---:|---:|---:|---:|"]
    row_runs = []
    for r in _in_order(d["rows"], DPCNN_STEPS):
        last = (r.get("full_test_mean_of_last") or {}).get("1")
        m20 = _mean_last_20(r)
        if r["run"].startswith("fedbuff_dp8_dpcnn"):
            row_runs.append(m20)
        rows.append(f"| {DPCNN_STEPS[r['run']]} | {fmt(r['final_accuracy'], 3)} | {fmt(last, 4)} | {fmt(m20, 4)} | "
                    f"{fmt(r['best_accuracy'], 3)} | {fmt(r['wall_s'], 0)} |")
    runs = [x for x in row_runs if x is not None]
    out = f"{_src(results, name)}.\n\n" + "\n".join(rows) + "\n"
    if runs:
        out += (f"\nThe row `fedbuff_dp8_dpcnn`, {len(runs)} runs: mean of the last 20 versions "
                f"{', '.join(_pct(x, 2) for x in runs)}; their mean {_pct(mean(runs), 2)}, spread "
                f"{100 * (max(runs) - min(runs)):.2f} points.\n")
    return out


def mnist_goals(results: Path) -> str:
    """The issue's goals against ``mnist-h1800.json`` (accuracy), ``mnist-dp-h600.json`` and ``mnist-dp-dpcnn.json``."""
    h = load(results, "mnist-h1800.json")
    nodp = next(r for r in h["rows"] if r["run"] == "fedbuff")["final_accuracy_full_test"]
    c20 = next(r for r in h["rows"] if r["run"] == "fedbuff_c20")
    dp = load(results, "mnist-dp-h600.json")["rows"][0]
    c20_at = _acc_at(c20["history"], dp["virtual_time_s"]) if c20.get("history") else None
    runs = [_mean_last_20(r) for r in load(results, "mnist-dp-dpcnn.json")["rows"]
            if r["run"].startswith("fedbuff_dp8_dpcnn")]
    runs = [x for x in runs if x is not None]
    gaps = [100 * (nodp - x) for x in runs]
    within = sum(g <= 4 for g in gaps)
    avg_gap = 100 * (nodp - mean(runs))
    return (f"FedBuff's final accuracy on the 10,000 test images: **{_pct(nodp, 2)}** (goal ≥ 98.5 %: "
            f"{'met' if nodp >= 0.985 else 'missed'}; `mnist-h1800.json`); its time to 97 % against FedAvg's is in "
            f"the 1,800-s table above. Local DP at ε = 8 on `fedavg_cnn` itself: {_pct(dp['final_accuracy'])} at "
            f"{fmt(dp['virtual_time_s'], 0)} virtual s on the evaluation subset"
            + (f" against {_pct(c20_at)} for `fedbuff_c20` without DP at the same virtual time" if c20_at else "")
            + f" (`mnist-dp-h600.json`). On `dp_cnn`, `fedbuff_dp8_dpcnn` in {len(runs)} runs "
            f"(`mnist-dp-dpcnn.json`, the mean of the last 20 versions on the 10,000 test images): "
            f"{', '.join(_pct(x, 2) for x in runs)}, {', '.join(f'{g:.2f}' for g in gaps)} points behind FedBuff "
            f"without DP. Goal within 4 points: {'**met on average**' if avg_gap <= 4 else '**missed on average**'} "
            f"({_pct(mean(runs), 2)}, {avg_gap:.2f} behind), in {within} of {len(runs)} runs. Every file here: old "
            "protocol (see each block above).\n")


# --- docs/benchmarks/deployment.md --------------------------------------------------------------

def deployment_goals(results: Path) -> str:
    """Issue 12's goals judged on the quiet runs, and the archived first "before"."""
    before = load(results, "deploy_latency_before_idle.json")
    after = load(results, "deploy_latency_after_idle.json")
    ten = load(results, "deploy_latency_10nodes_idle.json")
    p50, gain, first = after["latency_s"]["p50"], after["updates_per_minute"] / before["updates_per_minute"], \
        after["last_supernode_to_first_update_s"]
    done = ten["updates_accepted"] >= ten["versions"] and not ten.get("failed_or_timeout_tasks")
    met = p50 <= 5 and gain >= 3 and first <= 15 and done
    out = (f"Goals (issue 12 §1) on the quiet machine: p50 ≤ 5 s ({p50:.1f} s), throughput ≥ 3× ({gain:.1f}×), first "
           f"update ≤ 15 s after the last SuperNode starts ({first:.1f} s), and the 10-SuperNode run completes "
           f"({ten['updates_accepted']} of {ten['versions']} updates, {ten.get('failed_or_timeout_tasks', 0)} failed "
           f"tasks): **{'met' if met else 'not met'}**. With 10 devices on {ten['cpus']} cores ten trainers import torch "
           f"at once, hence {ten['last_supernode_to_first_update_s']:.0f} s to the first update there.")
    arch = "archive/deploy_latency.json"
    if (results / arch).is_file():
        a = load(results, arch)
        out += (f" `{arch}` is the first \"before\" ({made_by(results, arch).strip('()')}): {a['latency_s']['p50']:.1f} s p50, "
                f"{a['updates_per_minute']:.1f} updates/min, SuperNodes started at key registration.")
    return out + "\n"


GENERATORS: dict[str, Callable[[Path], str]] = {
    "mnist-h150-table": mnist_h150_table,
    "mnist-seed1": mnist_seed1,
    "mnist-dp-h600": mnist_dp_h600,
    "mnist-dpcnn-tries": mnist_dpcnn_tries,
    "mnist-dpcnn-steps": mnist_dpcnn_steps,
    "mnist-goals": mnist_goals,
    "deployment-goals": deployment_goals,
}
