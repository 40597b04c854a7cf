"""What the kardam filter costs per update, alone: ``Kardam.check`` on updates the size of a real
model (no loop, no Flower), in a steady state where every client has a previous update and a few
base versions are live, as in a FedBuff run.

    python benchmarks/kardam_cost.py [--models mlp,fedavg_cnn] [--clients 100] [--updates 300]

Each model's parameters come from the model registry (MNIST's 28x28x1 input, 10 classes). Every
update is its base version minus a small step (a client's pseudo-gradient), a new base version
every ``--buffer`` updates; the first ``--clients`` updates (each client's first: no coefficient
yet) are not timed; numpy's BLAS runs on one thread, as in the server loop. Writes
``results/kardam_cost.json``: per model, the parameter count and the median and mean milliseconds
per check, with the filter's kept base versions and the MB of what it remembers (each client's
last update and those base versions) at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from fedasync.config import ModelConfig
from fedasync.server.params import one_blas_thread
from fedasync.server.robust import Kardam
from fedasync.task.models import build_model, get_params


def measure(model: str, clients: int, updates: int, buffer: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x0 = get_params(build_model(ModelConfig(name=model), (1, 28, 28), 10))
    n = sum(a.size for a in x0.values())
    versions = {0: x0}
    f = Kardam(byzantine_fraction=0.03, window=100, warmup=10)
    times = []
    for t in range(clients + updates):
        v = t // buffer
        if v not in versions:  # the server's next model
            versions[v] = {k: a - 0.01 * rng.standard_normal(a.shape).astype(a.dtype) for k, a in versions[v - 1].items()}
            versions.pop(v - 4, None)
        base_v = max(0, v - int(rng.integers(0, 3)))  # staleness 0-2 versions
        base = versions[base_v]
        step = float(rng.uniform(0.5, 2.0)) * 0.01
        params = {k: (a - step * rng.standard_normal(a.shape)).astype(a.dtype) for k, a in base.items()}
        u = SimpleNamespace(client_id=t % clients, base_version=base_v, base_params=base, params=params,
                            staleness=v - base_v)
        t0 = time.perf_counter()
        f.check(u)
        if t >= clients:
            times.append(time.perf_counter() - t0)
    ms = [1000 * s for s in times]
    return {"model": model, "parameters": int(n), "clients": clients, "updates_timed": len(ms),
            "check_ms_median": round(statistics.median(ms), 3), "check_ms_mean": round(statistics.mean(ms), 3),
            "base_versions_kept": len(f.models),
            "kept_mb": round((sum(x.nbytes for x, _ in f.prev.values()) + sum(x.nbytes for x in f.models.values())) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,fedavg_cnn")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--updates", type=int, default=300)
    ap.add_argument("--buffer", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    out = {}
    for m in a.models.split(","):
        with one_blas_thread():  # as in the server loop (AsyncServer.run)
            r = measure(m, a.clients, a.updates, a.buffer)
        out[m] = r
        print(f"{m:12s} {r['parameters']:>9,d} parameters: {r['check_ms_median']:.2f} ms per check (median), "
              f"{r['check_ms_mean']:.2f} mean; {r['base_versions_kept']} base versions kept; "
              f"{r['kept_mb']:,.1f} MB of remembered models")
    path = Path(a.out) / "kardam_cost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    from provenance import provenance, write_result  # benchmarks/: on sys.path when run as a script
    write_result(path, {"provenance": provenance(), **out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
