"""Deployment latency on loopback: `fedasync server` with N SuperNodes from `fedasync client`.

    python benchmarks/deploy_latency.py --supernodes 3 --versions 30 --name after
    python benchmarks/deploy_latency.py --supernodes 3 --versions 12 --no-warm --poll-interval 3 --name before

Starts a SuperLink (TLS and SuperNode authentication unless --insecure), N SuperNodes on
127.0.0.1 and the asynchronous server (FedAsync: one version per accepted update, signed
updates; a digits MLP whose local training takes well under 1 s), waits until it has applied
--versions updates, and reads from the store:

- per-update latency: dispatch (``dispatches.sent_wall``) to the reply taken by the server
  (``updates.received_wall``): the SuperNode's poll, the task process (a fork of the warm
  trainer, or with --no-warm a new ``flwr-clientapp`` process), local training, the way back;
- updates per minute in the steady state: accepted updates between the first and the last
  taken reply, divided by that time;
- start-up: from `fedasync server` to its first applied update (SuperLink, registration,
  ``flwr run``, the ServerApp, the hello to every node), and from the start of the last
  SuperNode to it. The SuperNodes start once the ServerApp waits for them (devices joining a
  running federation); --nodes-at-registration starts them as soon as their keys are registered
  (as the first version of this benchmark did).

--no-warm and --poll-interval 3 reproduce Flower's own per-message path (the "before" figures).
Writes ``deploy_latency[_NAME].json`` (with the machine's load average, ``uptime``) to --out
(default benchmarks/results) and prints it. Every process is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from fedasync.deploy.certs import make_certs
from fedasync.deploy.keys import make_supernode_auth_key
from fedasync.deploy.processes import stop_process
from fedasync.signing import generate_key, save_keypair
from fedasync.store import Store

FEDASYNC = str(Path(sys.executable).with_name("fedasync"))


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernodes", "--nodes", dest="nodes", type=int, default=3)
    ap.add_argument("--versions", type=int, default=12, help="accepted updates to wait for")
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--insecure", action="store_true", help="plain HTTP, no TLS or SuperNode auth")
    ap.add_argument("--no-warm", action="store_true", help="a new flwr-clientapp process per message (Flower's own)")
    ap.add_argument("--poll-interval", type=float, default=None, help="the SuperNodes' poll (fedasync client's default: 1)")
    ap.add_argument("--name", default="", help="results file deploy_latency_NAME.json")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--nodes-at-registration", dest="nodes_after_serverapp", action="store_false",
                    help="start the SuperNodes as soon as their keys are registered (while the ServerApp starts) "
                    "instead of once it waits for them")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, run directory)")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fedasync-bench-"))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    keys, certs, run_dir = work / "keys", work / "certs", work / "run"
    n = args.nodes
    for i in range(n):
        save_keypair(generate_key(), keys, f"client-{i}")
        make_supernode_auth_key(keys, f"supernode-{i}")
    make_certs(certs, ["127.0.0.1", "localhost"])
    cfg = work / "bench.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "deploy-latency", "seed": 0,
        "data": {"dataset": "digits", "num_clients": n, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 64},
        "train": {"local_epochs": args.local_epochs, "batch_size": 32, "lr": 0.1, "device": "cpu"},
        "server": {"strategy": "fedasync", "concurrency": n, "max_versions": args.versions,
                   "eval_every": max(1, args.versions // 3), "task_timeout": 600},
        "deploy": {"signing": True, "public_keys": str(keys), "node_discovery_timeout": 600},
    }))
    link, *node_ports = free_ports(n + 1)
    tls = (["--insecure", "--no-supernode-auth"] if args.insecure
           else ["--certs", str(certs), "--supernode-auth", str(keys)])
    procs: list[subprocess.Popen] = []

    def start(cmd, log, home):
        f = open(log, "wb")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, FLWR_HOME=str(home), PYTHONUNBUFFERED="1"), start_new_session=True)
        f.close()
        procs.append(p)
        return p

    node_opts = (["--no-warm"] if args.no_warm else []) + (
        ["--poll-interval", str(args.poll_interval)] if args.poll_interval is not None else [])
    load_start = _uptime()
    t0 = time.time()
    t_last_node = None
    try:
        server = start([FEDASYNC, "server", str(cfg), "--out", str(run_dir), "--port", str(link), *tls],
                       work / "server.out", work / "flwr" / "server")
        t_reg = time.monotonic()
        while not args.insecure and "SuperNode key(s)" not in (work / "server.out").read_text(errors="replace"):
            if server.poll() is not None or time.monotonic() - t_reg > 300:
                raise SystemExit("server did not register the keys:\n" + (work / "server.out").read_text()[-2000:])
            time.sleep(0.5)
        t_serverapp = None
        if args.nodes_after_serverapp:  # devices join a federation whose ServerApp is up
            while "waiting for clients" not in _text(run_dir / "server.log"):
                if server.poll() is not None or time.monotonic() - t_reg > 600:
                    raise SystemExit("the ServerApp did not start:\n" + _text(work / "server.out")[-2000:])
                time.sleep(0.2)
            t_serverapp = time.time()
        for i in range(n):
            node_tls = (["--insecure", "--no-supernode-auth"] if args.insecure else
                        ["--root-certificates", str(certs / "ca.crt"), "--auth-key", str(keys / f"supernode-{i}.key")])
            start([FEDASYNC, "client", "--superlink", f"127.0.0.1:{link}", "--partition-id", str(i),
                   "--num-partitions", str(n), "--signing-key", str(keys / f"client-{i}.key"),
                   "--port", str(node_ports[i]), *node_tls, *node_opts], work / f"client-{i}.log",
                  work / "flwr" / f"node-{i}")
            t_last_node = time.time()
        rc = server.wait(timeout=args.timeout)
        if rc != 0:
            raise SystemExit(f"server failed ({rc}):\n" + (work / "server.out").read_text()[-3000:])
    finally:  # every process by its PID (with what it started), all at once
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, len(procs))) as pool:
            list(pool.map(lambda p: stop_process(p, timeout=15), reversed(procs)))

    summary = json.loads((run_dir / "summary.json").read_text())
    store = Store(summary["store_url"], create=False)
    rid = summary["run_id"]
    sent = {d.task_id: d.sent_wall for d in store.dispatches(rid)}
    ups = [u for u in store.updates(rid) if u.accepted]
    lat = np.array([u.received_wall - sent[u.task_id] for u in ups])
    recv = sorted(u.received_wall for u in ups)
    window = recv[-1] - recv[0]
    report = {
        "nodes": n, "tls_and_auth": not args.insecure, "local_epochs": args.local_epochs,
        "updates_accepted": len(ups), "versions": summary["versions"],
        "latency_s": {"mean": float(lat.mean()), "p50": float(np.percentile(lat, 50)),
                      "p95": float(np.percentile(lat, 95)), "min": float(lat.min()), "max": float(lat.max())},
        "updates_per_minute": (len(recv) - 1) / window * 60 if window > 0 else None,
        "startup_to_first_update_s": recv[0] - t0,
        "last_supernode_to_first_update_s": recv[0] - t_last_node if t_last_node else None,
        "supernodes_started": ("after the ServerApp waited for them" if args.nodes_after_serverapp
                               else "at key registration"),
        "serverapp_ready_s": t_serverapp - t0 if t_serverapp else None,
        "warm_trainer": not args.no_warm, "poll_interval_s": args.poll_interval if args.poll_interval is not None
        else (3.0 if args.no_warm else 1.0),
        "local_train_s": _train_time(cfg),
        "failed_or_timeout_tasks": sum(d.status in ("failed", "timeout") for d in store.dispatches(rid)),
        "total_s": time.time() - t0,
        "final_accuracy": summary["final_accuracy"],
        "cpus": os.cpu_count(),
        "uptime_at_start": load_start,
        "uptime_at_end": _uptime(),
        "load_avg_1min_at_end": os.getloadavg()[0],
        "command": "python benchmarks/deploy_latency.py " + " ".join(sys.argv[1:]),
    }
    path = out / (f"deploy_latency_{args.name}.json" if args.name else "deploy_latency.json")
    from provenance import provenance, write_result  # benchmarks/: on sys.path when run as a script
    write_result(path, {"provenance": provenance(), **report})
    print(json.dumps(report, indent=2))
    print(f"wrote {path} (work directory {work})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _train_time(cfg_path: Path) -> float:
    """One local training of client 0, in this process (what a task spends training), seconds."""
    import torch

    from fedasync.config import load_config
    from fedasync.task.data import load_federated
    from fedasync.task.models import build_model
    from fedasync.task.train import local_train

    torch.set_num_threads(1)
    cfg = load_config(str(cfg_path), [])
    fed = load_federated(cfg.data, cfg.seed)
    model = build_model(cfg.model, fed.input_shape, fed.num_classes)
    x, y = fed.partitions[0]
    local_train(model, x, y, cfg.train, seed=0, device=torch.device("cpu"))  # first call: lazy init
    t = time.perf_counter()
    local_train(model, x, y, cfg.train, seed=1, device=torch.device("cpu"))
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
