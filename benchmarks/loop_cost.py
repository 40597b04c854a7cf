"""The fedasync loop's own CPU per update, without Flower's engine: the server loop (FedBuff,
K = 10, 20 tasks in flight, the SQLite store, wall clock, no evaluation) over an in-process
transport whose client echoes the model back through the wire format (each reply a fresh buffer,
as a pulled message's). What ``benchmarks/loop_overhead.py`` compares with a bare Flower loop is
this cost plus the engine's; this one isolates the part fedasync can change.

    python benchmarks/loop_cost.py [--model fedavg_cnn] [--updates 800] [--repeat 3] [--set KEY=VALUE ...]

MNIST from ``~/.cache/fedasync/mnist.npz`` when it is there (``benchmarks/mnist.py`` builds it),
else the config's data set. Writes ``results/loop_cost.json`` (per model: the loop's CPU per
update in ms, user and system, the echo's share subtracted; every repeat kept, the median shown).

It also measures ``floor``: the CPU per update of the array work no version of this loop can
leave out while it keeps its guarantees, each piece alone on the same model: the reply's sha256
(the audit record), the finiteness check (a bad update is rejected before it touches the model),
the write of a buffered update's parameters (a kill -9 resumes bit-identically), 1/K of FedBuff's
float64 aggregation, and 1/K of the new version's sha256 and of the record Flower sends it in.
What the loop spends beyond ``floor`` is bookkeeping in Python and SQL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_overhead import loop_config  # noqa: E402  (the loop loop_overhead.py measures)
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store
from fedasync.wire import params_to_record, record_to_params

MNIST = Path.home() / ".cache" / "fedasync" / "mnist.npz"


def measure(cfg) -> dict:
    echo_cpu = [0.0]

    def echo(params, config):
        t = time.process_time()
        rec = params_to_record(params)
        for k in list(rec.keys()):
            rec[k].data = bytes(rec[k].data)  # a fresh buffer, as a message pulled from the engine
        out = {"params": record_to_params(rec), "metrics": {"num_examples": 1, "loss": 0.0}}
        echo_cpu[0] += time.process_time() - t
        return out

    with tempfile.TemporaryDirectory() as d:
        store = Store(f"sqlite:///{d}/bench.db")
        server = AsyncServer(cfg, LocalTransport(echo), store, clock="wall", node_for_client=lambda c: 0)
        server._evaluate = lambda: None  # as in loop_overhead.py
        t0, w0 = os.times(), time.perf_counter()
        s = server.run()
        t1, wall = os.times(), time.perf_counter() - w0
        store.close()
    n = s["updates_received"]
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    return {"updates": n, "loop_cpu_ms": round(1e3 * (cpu - echo_cpu[0]) / n, 3),
            "user_ms": round(1e3 * (t1.user - t0.user) / n, 3),
            "system_ms": round(1e3 * (t1.system - t0.system) / n, 3),
            "echo_cpu_ms": round(1e3 * echo_cpu[0] / n, 3), "wall_ms": round(1e3 * wall / n, 3)}


def floor(cfg, k: int = 10, reps: int = 20) -> dict:
    """CPU ms per update of each piece of unavoidable array work (median of ``reps``), and their sum."""
    import numpy as np

    from fedasync.server.params import mean_step, params_sha256
    from fedasync.server.validation import all_finite
    from fedasync.store.blobs import BlobFiles
    from fedasync.store.codec import pack_parts
    from fedasync.task.data import load_federated
    from fedasync.task.models import init_params

    fed = load_federated(cfg.data, cfg.seed)
    model = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    rng = np.random.default_rng(0)
    replies = [{n: (a + rng.standard_normal(a.shape).astype(a.dtype) * 1e-3) for n, a in model.items()}
               for _ in range(k)]

    def cpu_ms(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t = time.process_time()
            fn()
            ts.append(time.process_time() - t)
        return 1e3 * statistics.median(ts)

    with tempfile.TemporaryDirectory() as d:
        blobs = BlobFiles(Path(d))

        def write_buffered() -> None:  # as the store does: a spare file written over, then given back
            blobs.put("u", pack_parts(replies[0]))
            blobs.delete(["u"], spare=True)

        new = mean_step(model, [(r, model) for r in replies], [1.0] * k, float(k), 1.0)
        out = {
            "reply_sha256": cpu_ms(lambda: params_sha256(replies[0])),
            "finite_check": cpu_ms(lambda: all(all_finite(a) for a in replies[0].values())),
            "buffered_update_write": cpu_ms(write_buffered),
            "aggregation_share": cpu_ms(lambda: mean_step(model, [(r, model) for r in replies],
                                                          [0.5] * k, float(k), 1.0)) / k,
            "version_sha256_share": cpu_ms(lambda: params_sha256(new)) / k,
            "task_record_share": cpu_ms(lambda: params_to_record(new)) / k,
        }
    out = {key: round(v, 3) for key, v in out.items()}
    out["total_ms"] = round(sum(out.values()), 3)
    out["buffer_size"] = k
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fedavg_cnn")
    ap.add_argument("--updates", type=int, default=800)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config KEY=VALUE")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    data = ["data.dataset=files", f"data.path={MNIST}"] if MNIST.is_file() else []
    cfg = loop_config(args.model, [*data, *args.overrides], args.updates)  # loop_overhead.py's loop
    runs = []
    for i in range(args.repeat):
        runs.append(measure(cfg))
        print(f"[loop_cost] {args.model} run {i + 1}: {runs[-1]}", flush=True)
    med = statistics.median(r["loop_cpu_ms"] for r in runs)
    fl = floor(cfg)
    print(f"[loop_cost] {args.model} floor (ms of CPU per update): {fl}", flush=True)
    result = {"model": args.model, "data": "mnist.npz" if data else cfg.data.dataset, "loop_cpu_ms_median": med,
              "runs": runs, "floor": fl, "cpus": os.cpu_count()}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "loop_cost.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old[args.model] = result
    path.write_text(json.dumps(old, indent=2) + "\n")
    print(f"{args.model}: the loop's own CPU {med:.2f} ms per update (median of {len(runs)}), of which "
          f"{fl['total_ms']:.2f} ms is array work it cannot skip; wrote {path}")


if __name__ == "__main__":
    main()
