"""What one client choice costs per policy: ``Scheduler.choose`` (and ``eligible``) alone, no loop.

    python benchmarks/scheduler_cost.py [--label after] [--clients 100,1000,10000] [--reps 200]

State, for each policy and client count ``N``: half the clients tried (dispatched once or more,
with replies of observed durations; some of those also a failure), 1% of the clients busy (a live
task, left out of the idle list as the loop does) and 5% exhausted (left out too); for
``budget_aware`` every client observed with a remaining epsilon (10% unbudgeted, 10% unable to
afford a task). ``fastest`` and ``staleness_aware`` are timed twice: with untried idle clients
(the start of a run) and with every idle client tried (steady state, the costly case). Each
figure is the median over ``--reps`` calls of one ``choose`` on the same idle list (the idle list
is built once, as :class:`fedasync.server.idle.IdleClients` builds it per fill).

Writes ``results/scheduler_cost.json``: under ``--label`` (``before``, ``after``, ...) the
milliseconds per call by ``policy/case`` and ``N``; other labels already there are kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from fedasync.server.idle import IdleClients
from fedasync.server.scheduler import make_scheduler

OUT = Path(__file__).resolve().parent / "results" / "scheduler_cost.json"


def build(name: str, n: int, all_tried: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    s = make_scheduler(name, seed)
    tried = list(range(n)) if all_tried else sorted(rng.choice(n, n // 2, replace=False).tolist())
    t = 0.0
    for v, c in enumerate(tried):
        for _ in range(1 + int(rng.integers(3))):
            s.on_dispatch(c, t, v)
            d = float(rng.lognormal(0.0, 1.0))
            s.on_reply(c, d, int(rng.integers(5)))
            t += 0.01
        if rng.random() < 0.05:
            s.on_dispatch(c, t, v)
            s.on_failure(c, float(rng.lognormal(0.0, 1.0)))
    for c in range(n):
        u = rng.random()
        s.observe_budget(c, None if u < 0.1 else float(rng.uniform(0, 8)), bool(u >= 0.2 or u < 0.1))
    busy = set(rng.choice(n, max(1, n // 100), replace=False).tolist())
    exhausted = set(rng.choice(n, n // 20, replace=False).tolist()) - busy
    idle = IdleClients(n)(busy, exhausted)
    return s, idle


def timed(f, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="after")
    ap.add_argument("--clients", default="100,1000,10000")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    sizes = [int(x) for x in args.clients.split(",")]
    cases = [("uniform", False), ("fair", False), ("fastest", False), ("fastest", True),
             ("staleness_aware", False), ("staleness_aware", True), ("budget_aware", False)]
    res: dict[str, dict[str, float]] = {}
    for name, all_tried in cases:
        key = f"{name}/{'all_tried' if all_tried else 'half_tried'}"
        res[key] = {}
        for n in sizes:
            s, idle = build(name, n, all_tried)
            ok = s.eligible(idle)
            res[key][str(n)] = round(timed(lambda: s.choose(ok), args.reps), 4)
            if name == "budget_aware":
                res.setdefault("budget_aware/eligible", {})[str(n)] = round(timed(lambda: s.eligible(idle), args.reps), 4)
        print(key, res[key], flush=True)
    res["idle_list"] = {str(n): round(timed(lambda: IdleClients(n)(set(range(0, n, 100)), set()), args.reps), 4)
                        for n in sizes}
    out = json.loads(OUT.read_text()) if OUT.exists() else {}
    out["unit"] = "milliseconds per call (median)"
    out[args.label] = res
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
