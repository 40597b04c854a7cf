"""Server vs server-less on one scenario: time to the target accuracy for fedbuff (server), the
FLchain ledger, and gossip on a ring and on the exponential graph, with each gossip step order
(``gossip.step_order``: ``paper`` = AD-PSGD, the default, and ``symmetric``).

The scenario is the quickstart (digits, Dirichlet 0.5, MLP, log-normal speed profiles) with
``--peers`` clients/peers (default 16) and ``server.concurrency`` = peers, so the server keeps
every client busy as the peers keep themselves busy. Each variant runs through its own CLI
command (printed in the report):

- virtual clock (deterministic, comparable with ``fedasync simulate``): ``fedasync simulate
  --backend local``, ``fedasync ledger run --virtual``, ``fedasync gossip run --virtual``;
- with ``--wall``, also the multi-process modes: ``fedasync ledger|gossip run --emulate-speeds``
  (one process per peer; each peer sleeps its profile's task duration x ``clock.time_scale``),
  reporting wall-clock seconds from the moment every peer was ready.

    python benchmarks/serverless_compare.py                 # virtual clock only (a few minutes here)
    python benchmarks/serverless_compare.py --wall          # plus peer processes (several minutes)
    python benchmarks/serverless_compare.py --step-orders paper   # one gossip step order only

Every variant is evaluated on the same grid and scored by the same rule, the server's
(issue 34): the model current at every ``server.eval_every_s`` (default 2 virtual s; wall seconds
since the start for peer processes), and the time to target is the first grid time from which
the target holds ``server.target_hold`` evaluations in a row (default 3;
:func:`fedasync.server.evaluation.time_to_target`); each row records both. For gossip the table
gives the average model's accuracy, the worst peer's own model, and the consensus distance
``(1/N) Σ_i ||x_i - x̄||²`` when the run stopped and averaged over the run.

Writes ``benchmarks/results/serverless_compare.{json,md}``; when the results go to
``benchmarks/results/``, then runs ``benchmarks/report.py``, whose block ``serverless-compare``
of ``benchmarks/README.md`` (:func:`report_blocks_misc.serverless_compare`) is generated from
the JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- serverless:begin -->", "<!-- serverless:end -->"


def run_cmd(args: list[str], out: Path) -> tuple[dict, float]:
    """``fedasync ARGS --out OUT``; its summary.json and wall seconds."""
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "fedasync", *args, "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"failed: fedasync {shlex.join(args)}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    import yaml

    summary.setdefault("buffer_size", yaml.safe_load((out / "config.yaml").read_text())["server"]["buffer_size"])
    return summary, time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--wall", action="store_true", help="also run the multi-process modes (wall clock)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="clock.time_scale for --emulate-speeds")
    ap.add_argument("--wall-budget", type=float, default=300.0, help="server.max_wall_time of a process run")
    ap.add_argument("--step-orders", default="paper,symmetric",
                    help="gossip.step_order values to compare, comma-separated (paper: AD-PSGD)")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    n = a.peers
    orders = [o.strip() for o in a.step_orders.split(",") if o.strip()]
    if not orders or any(o not in ("paper", "symmetric") for o in orders):
        ap.error(f"--step-orders: expected paper and/or symmetric, got {a.step_orders!r}")
    common = ["--set", f"data.num_clients={n}", "--set", f"server.concurrency={n}"]
    virtual = [
        ("fedbuff (server)", "fedbuff", ["simulate", "--backend", "local", *common,
                                          "--set", "server.stop_at_target=true"]),
        ("ledger (FLchain)", "ledger", ["ledger", "run", "--virtual", "--peers", str(n), *common]),
    ]
    for topo in ("ring", "exponential"):
        for order in orders:
            virtual.append((f"gossip, {topo}, {order}", f"gossip-{topo}-{order}",
                            ["gossip", "run", "--virtual", "--peers", str(n), "--topology", topo, *common,
                             "--set", f"gossip.step_order={order}"]))
    emul = ["--emulate-speeds", "--set", f"clock.time_scale={a.time_scale}",
            "--set", f"server.max_wall_time={a.wall_budget}"]
    wall = {"ledger": ["ledger", "run", "--peers", str(n), *common, *emul]}
    for topo in ("ring", "exponential"):  # peer processes: the first step order only
        wall[f"gossip-{topo}-{orders[0]}"] = ["gossip", "run", "--peers", str(n), "--topology", topo, *common,
                                              "--set", f"gossip.step_order={orders[0]}", *emul]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedasync-serverless-") as tmp:
        for label, key, args in virtual:
            print(f"[virtual] fedasync {shlex.join(args)}", flush=True)
            s, secs = run_cmd(args, Path(tmp) / key)
            row = {"variant": label, "key": key, "command": "fedasync " + shlex.join(args),
                   "target": s["target_accuracy"], "target_hold": s["target_hold"],
                   "eval_every_s": s["eval_every_s"], "virtual_time_to_target_s": s["time_to_target_s"],
                   "updates_to_target": _updates_to_target(s), "final_accuracy": s["final_accuracy"],
                   "model_sha256": s["model_sha256"], "run_wall_s": round(secs, 1)}
            if key.startswith("gossip"):
                cd = [h["consensus_distance"] for h in s["history"]]
                row["step_order"] = s["step_order"]
                row["min_peer_accuracy_final"] = s["final_min_peer_accuracy"]
                row["consensus_distance_final"] = s["consensus_distance"]["final"]
                row["consensus_distance_mean"] = sum(cd) / len(cd)
                row["consensus_distance_max"] = s["consensus_distance"]["max"]
                row["spectral_gap"] = s["spectral_gap"]
            if a.wall and key in wall:
                print(f"[wall]    fedasync {shlex.join(wall[key])}", flush=True)
                w, _ = run_cmd(wall[key], Path(tmp) / f"{key}-wall")
                row.update({"wall_command": "fedasync " + shlex.join(wall[key]),
                            "wall_time_to_target_s": w["time_to_target_s"], "wall_stop_reason": w["stop_reason"],
                            "wall_final_accuracy": w["final_accuracy"]})
            rows.append(row)
            print(f"          -> {row['virtual_time_to_target_s']} virtual s to {row['target']}", flush=True)
    grids = {(r["eval_every_s"], r["target_hold"]) for r in rows}
    if len(grids) != 1:  # one grid and one rule, or the comparison is not one
        raise SystemExit(f"the variants were not evaluated on one grid: (eval_every_s, target_hold) {sorted(grids)}")
    a.results.mkdir(parents=True, exist_ok=True)
    from provenance import provenance, write_result  # benchmarks/: on sys.path when run as a script
    extra = {"time_scale": a.time_scale} if a.wall else {}
    write_result(a.results / "serverless_compare.json", {"provenance": provenance(), "peers": n, **extra, "rows": rows})
    from report_blocks_misc import serverless_compare  # the table README.md's block shows, from the JSON
    md = serverless_compare(a.results)
    (a.results / "serverless_compare.md").write_text(md)
    if a.results.resolve() == (ROOT / "benchmarks" / "results").resolve():
        import report  # the README's block `serverless-compare` is generated from the JSON
        for line in report.write(ROOT):
            print(f"rewrote {line}")
    print(md)
    return 0


def _updates_to_target(s: dict) -> int | None:
    """Local trainings done at the time to target (the first of the held evaluations; server: K per
    version)."""
    t = s.get("time_to_target_s")
    if t is None:
        return None
    h = next(h for h in s["history"] if h.get("virtual_time_s", h.get("time_s")) == t)
    if "events" in h:
        return int(h["events"])
    return int(h["version"]) * int(s["buffer_size"])


if __name__ == "__main__":
    raise SystemExit(main())
