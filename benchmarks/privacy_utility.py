"""Privacy vs utility: examples/privacy.yaml at epsilon 1, 3, 8 and without DP.

Every run is the identical scenario (data, partitions, client speeds, seed) through the
in-process backend; only ``privacy.local_dp.epsilon`` changes (the per-client overrides of the
example are dropped so every client has the same budget). The noise multiplier is calibrated
by Opacus for each epsilon and the example's ``planned_tasks``.

    python benchmarks/privacy_utility.py                 # writes benchmarks/results/privacy_utility.{md,json}
    python benchmarks/privacy_utility.py --epsilons 8 --set train.lr=0.3

Reported per run: final and best test accuracy, virtual time to the example's target
accuracy, versions, stop reason, the largest epsilon any client spent, the noise multiplier,
and wall-clock seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(cfg, workdir: Path) -> dict:
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store, default_sqlite_url

    workdir.mkdir(parents=True, exist_ok=True)
    store = Store(default_sqlite_url(workdir))
    t0 = time.perf_counter()
    try:
        server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
        summary = server.run()
        sigmas = sorted({round(p.noise_multiplier, 6) for p in server.privacy.plans}) if server.privacy else []
    finally:
        store.close()
    summary["bench_wall_s"] = time.perf_counter() - t0
    summary["noise_multipliers"] = sigmas
    return summary


def main(argv: list[str] | None = None) -> int:
    from fedasync.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "fedasync" / "examples" / "privacy.yaml"))
    ap.add_argument("--epsilons", default="1,3,8", help="comma-separated epsilons (a no-DP run is always added)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra KEY=VALUE overrides")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory for the tables")
    args = ap.parse_args(argv)

    epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    runs: list[tuple[str, list[str]]] = [
        (f"eps={e:g}", [f"privacy.local_dp.epsilon={e}", "privacy.overrides=[]"]) for e in epsilons
    ]
    runs.append(("no DP", ["privacy.local_dp.enabled=false", "privacy.overrides=[]"]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, sets) in enumerate(runs):
            cfg = load_config(args.config, args.sets + sets)
            s = run_one(cfg, Path(tmp) / f"run{i}")
            p = s.get("privacy") or {}
            rows.append({
                "run": label,
                "epsilon_budget": cfg.privacy.local_dp.epsilon if cfg.privacy.local_dp.enabled else None,
                "noise_multiplier": s["noise_multipliers"],
                "final_accuracy": s["final_accuracy"],
                "best_accuracy": s["best_accuracy"],
                "target_accuracy": s["target_accuracy"],
                "time_to_target_s": s["time_to_target_s"],
                "versions": s["versions"],
                "updates": s["updates_accepted"],
                "stop_reason": s["stop_reason"],
                "epsilon_max": p.get("epsilon_max"),
                "clients_exhausted": p.get("clients_exhausted"),
                "wall_s": round(s["bench_wall_s"], 1),
            })
            print(f"{label}: final acc {s['final_accuracy']:.4f}, best {s['best_accuracy']:.4f}, "
                  f"time to target {s['time_to_target_s']}, {s['versions']} versions, "
                  f"eps max {p.get('epsilon_max')}, {s['bench_wall_s']:.1f} s", flush=True)

    base = rows[-1]["final_accuracy"]
    lines = [
        f"config: {Path(args.config).name} {' '.join(args.sets)}".rstrip(),
        "",
        "| run | σ | final acc | Δ vs no DP (points) | best acc | time to target "
        f"{rows[0]['target_accuracy']} (virtual s) | versions | ε max spent | exhausted | stop | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sig = ", ".join(f"{x:.3f}" for x in r["noise_multiplier"]) or "-"
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        em = "-" if r["epsilon_max"] is None else f"{r['epsilon_max']:.3f}"
        ex = "-" if r["clients_exhausted"] is None else str(r["clients_exhausted"])
        lines.append(f"| {r['run']} | {sig} | {r['final_accuracy']:.4f} | {100 * (r['final_accuracy'] - base):+.1f} | "
                     f"{r['best_accuracy']:.4f} | {ttt} | {r['versions']} | {em} | {ex} | {r['stop_reason']} | "
                     f"{r['wall_s']} |")
    table = "\n".join(lines)
    print()
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "privacy_utility.md").write_text(table + "\n")
    (out / "privacy_utility.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwrote {out / 'privacy_utility.md'} and {out / 'privacy_utility.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
