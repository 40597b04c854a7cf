"""Updates per second of the fedasync loop vs a bare Flower push/pull loop, same engine.

All loops run inside one start of Flower's simulation engine, against the same no-op ClientApp
(it echoes the model back), keeping the same number of tasks in flight. The fedasync loop does
everything it does in a real run (validation, FedBuff, the SQLite store with the crash-safe
records of every dispatch, reply and buffered update) except evaluation. Two orders of taking
replies, each against the bare loop that takes them the same way:

* ``wall``: replies in arrival order (``fedasync server`` in deployment, the wall-clock
  benchmark). Bare loop: push a message whenever one comes back, nothing else.
* ``virtual``: replies in virtual-finish order (``fedasync simulate``: the deterministic run).
  The loop may take the reply of the task that finishes first in virtual time only, so it waits
  for it while later ones are ready. Bare loop: the same, with the same clients and virtual
  durations, and nothing else. Flower's engine looks for new messages every 0.1 s
  (``vce_api.add_messages_to_queue``), so whenever the task that finishes first was sent since
  the last look, both virtual-order loops wait for the engine; that cost is the clock's, not the
  loop's, and the arrival-order bare loop (``bare_flower_updates_per_s``) does not pay it.

    python benchmarks/loop_overhead.py [--model mlp|fedavg_cnn] [--updates 1500] [--concurrency 20]
                                       [--clock wall,virtual] [--repeat 3] [--set KEY=VALUE ...]
                                       [--bare-new-model-every N] [--out benchmarks/results]

Each order runs ``--repeat`` bare/fedasync pairs back to back (the machine's load drifts from
minute to minute on 2 cores); the pair with the median ratio is reported, all pairs are kept.

Results go to ``loop_overhead.json`` under the model's name, with the machine's load average
before and after (the ratios are what is compared; all loops share the load). On Linux each pair
also records the whole machine's CPU time per update of each loop and how busy the machine was
(``/proc/stat``: the engine's actors are other processes): when the bare loop already keeps every
core busy, each millisecond of CPU the fedasync loop adds per update costs throughput, whichever
thread spends it (``benchmarks/loop_cost.py`` measures the part of it no fedasync loop can skip).

The bare loops send one model record throughout (the baseline), while a server's model changes.
``--bare-new-model-every 10`` asks whether that flatters them: instead of the fedasync loop, each
pair's second loop is the same bare loop building a new model record every 10 replies (as often
as the FedBuff loop, K = 10, makes a version); results under ``<model>_bare_new_model_every_N``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from fedasync.config import load_config
from fedasync.server.app import GridTransport
from fedasync.server.control import open_messages
from fedasync.server.loop import AsyncServer
from fedasync.store import Store
from fedasync.wire import params_to_record, record_to_params, reply_content, task_content

noop = ClientApp()


@noop.train()
def _echo(msg: Message, context: Context) -> Message:
    params = record_to_params(msg.content["params"])
    return Message(reply_content({"params": params, "metrics": {"num_examples": 1, "loss": 0.0}}), reply_to=msg)


def model_records(params, every: int):
    """The bare loops' model: ``record(done)`` is its ArrayRecord after ``done`` replies. Built
    once (``every`` 0, the baseline: Flower's strategies share one record per round), or anew
    from a changed model every ``every`` replies, as a server whose model changes each K updates
    must (the fedasync loop sends a new version every ``server.buffer_size`` replies)."""
    built: dict[int, object] = {}

    def record(done: int):
        n = done // every if every else 0
        if n not in built:
            built.clear()
            built[n] = params_to_record({k: (v + 1e-6 * n).astype(v.dtype) if n else v for k, v in params.items()})
        return built[n]
    return record


def bare_loop(grid: Grid, nodes: list[int], params, n_updates: int, concurrency: int, every: int = 0) -> float:
    sent = done = 0
    record = model_records(params, every)

    def push(k: int) -> list[str]:
        nonlocal sent
        # round-robin over the nodes: a node runs one message at a time
        rec = record(done)
        msgs = [Message(task_content(rec, {"task_id": sent + i}), dst_node_id=nodes[(sent + i) % len(nodes)],
                        message_type="train") for i in range(k)]
        sent += k
        return list(grid.push_messages(msgs))

    t0 = time.perf_counter()
    outstanding = set(push(concurrency))
    while done < n_updates:
        replies = list(grid.pull_messages(list(outstanding)))
        for r in replies:
            outstanding.discard(r.metadata.reply_to_message_id)
            done += 1
        if replies:
            outstanding.update(push(min(len(replies), max(0, n_updates - done - len(outstanding)))))
        else:
            time.sleep(0.005)
    return time.perf_counter() - t0


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from ``/proc/stat``; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def cpu_use(before, after, updates: int) -> dict | None:
    """The machine's CPU ms per update between two :func:`machine_cpu` readings, and how busy it was."""
    if before is None or after is None or updates <= 0:
        return None
    busy, total = after[0] - before[0], after[1] - before[1]
    return {"cpu_ms_per_update": round(1e3 * busy / updates, 2), "busy": round(busy / total, 3) if total else None}


#: per order of taking replies: (bare loop's key, fedasync loop's key) in the results
KEYS = {"wall": ("bare_flower_updates_per_s", "fedasync_wall_updates_per_s"),
        "virtual": ("bare_flower_virtual_order_updates_per_s", "fedasync_virtual_updates_per_s")}


def compared(clock: str, every: int) -> tuple[str, str, str]:
    """What each pair's bare loop is compared with: its key in the results, its name in the
    machine CPU figures, and its label: the fedasync loop, or (``every``) the bare loop with a
    new model record every ``every`` replies."""
    if every:
        return f"bare_new_model_every_{every}_{clock}_updates_per_s", "bare_new_model", f"new model every {every}"
    return KEYS[clock][1], "fedasync", "fedasync"


def bare_virtual_loop(grid: Grid, node_of: list[int], params, n_updates: int, concurrency: int, cfg,
                      examples: list[int], every: int = 0) -> float:
    """The bare loop in virtual-finish order: each task's virtual duration is drawn as fedasync
    draws it (same clients, round-robin), and only the earliest unfinished one may be taken."""
    from fedasync.server.clock import make_profiles, task_duration
    from fedasync.task.train import steps_for

    n_clients = len(node_of)
    profiles = make_profiles(n_clients, cfg.clock, cfg.seed)
    steps = [steps_for(cfg.train, n) for n in examples]
    nbytes = int(sum(a.nbytes for a in params.values()))
    record = model_records(params, every)
    live: dict[str, float] = {}  # message id -> virtual finish
    arrived: set[str] = set()
    now, sent, done = 0.0, 0, 0

    def push(k: int) -> None:
        nonlocal sent
        tids = range(sent, sent + k)
        rec = record(done)
        msgs = [Message(task_content(rec, {"task_id": t}), dst_node_id=node_of[t % n_clients],
                        message_type="train") for t in tids]
        for t, mid in zip(tids, grid.push_messages(msgs)):
            c = t % n_clients
            live[mid] = now + task_duration(profiles[c], steps[c], nbytes, cfg.clock, cfg.seed, t)
        sent += k

    t0 = time.perf_counter()
    push(concurrency)
    while done < n_updates:
        first = min(live, key=lambda m: (live[m], m))
        while first not in arrived:
            got = [r.metadata.reply_to_message_id for r in grid.pull_messages([m for m in live if m not in arrived])]
            arrived.update(got)
            if first not in arrived:
                time.sleep(0.005)
        now = live.pop(first)
        arrived.discard(first)
        done += 1
        if done + len(live) < n_updates:
            push(1)
    return time.perf_counter() - t0


def loop_config(model: str, overrides: list[str], updates: int, clients: int = 100, concurrency: int = 20,
                k: int = 10):
    """The measured loop's config (also ``benchmarks/loop_cost.py``'s): FedBuff with a buffer of
    ``k``, ``concurrency`` tasks in flight, ``updates`` updates, no stop but the versions, no
    evaluation; ``overrides`` (the data) before the loop's own keys."""
    return load_config(None, [f"model.name={model}", *overrides, f"data.num_clients={clients}",
                              "server.strategy=fedbuff", f"server.concurrency={concurrency}",
                              f"server.buffer_size={k}", f"server.max_versions={updates // k}",
                              "server.max_virtual_time=null", "server.eval_every=1000000",
                              "server.poll_interval=0.005"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=20)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--clock", default="wall,virtual", help="which orders to measure (wall, virtual)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="bare/fedasync pairs per order; the pair with the median ratio is reported")
    ap.add_argument("--model", default="mlp", help="model.name (mlp, cnn, fedavg_cnn where registered)")
    ap.add_argument("--bare-new-model-every", type=int, default=0, metavar="N",
                    help="compare the bare loop with itself sending a new model record every N replies, "
                         "instead of with the fedasync loop; results under '<model>_bare_new_model_every_N'")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config KEY=VALUE")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    if args.bare_new_model_every < 0:
        ap.error("--bare-new-model-every: 0 or more")
    bad = [c for c in args.clock.split(",") if c not in KEYS]
    if bad:
        ap.error(f"--clock: {', '.join(bad)} (known: {', '.join(KEYS)})")
    load_before = os.getloadavg()
    from fedasync.config import ConfigError

    try:
        cfg = loop_config(args.model, args.overrides, args.updates, args.clients, args.concurrency)
    except ConfigError as e:
        raise SystemExit(f"{e} (is {args.model} in the model registry of this checkout?)")
    result: dict = {}

    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            transport = GridTransport(grid)
            nodes = transport.wait_for_nodes(args.clients)
            from fedasync.task.models import init_params

            from fedasync.task.data import load_federated

            fed = load_federated(cfg.data, cfg.seed)
            params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
            result["model"], result["num_params"] = args.model, int(sum(a.size for a in params.values()))
            bare_loop(grid, nodes, params, 100, args.concurrency)  # warm the actors
            node_of = [nodes[c % len(nodes)] for c in range(args.clients)]
            result.update({"updates": args.updates, "concurrency": args.concurrency, "clients": args.clients})
            result["repeat"] = args.repeat
            result["bare_new_model_every"] = args.bare_new_model_every
            every = args.bare_new_model_every
            for clock in args.clock.split(","):
                bare = KEYS[clock][0]
                fed_key, other, _ = compared(clock, every)

                def run_bare(n: int) -> float:
                    if clock == "wall":
                        return bare_loop(grid, nodes, params, args.updates, args.concurrency, n)
                    return bare_virtual_loop(grid, node_of, params, args.updates, args.concurrency, cfg,
                                             [len(p[1]) for p in fed.partitions], n)

                ratios, cpu = [], []
                for _ in range(args.repeat):  # bare, fedasync, bare, fedasync, ...: the same load drifts
                    c0 = machine_cpu()
                    t_bare = run_bare(0)
                    c1 = machine_cpu()
                    if every:
                        t_fed, n_fed = run_bare(every), args.updates
                        c2 = machine_cpu()
                    else:
                        with tempfile.TemporaryDirectory() as d:
                            store = Store(f"sqlite:///{d}/bench.db")
                            server = AsyncServer(cfg, transport, store, clock=clock,
                                                 node_for_client=lambda c: node_of[c])
                            server._evaluate = lambda: None  # the loop without evaluation (the bare loops have none)
                            t0 = time.perf_counter()
                            n_fed = server.run()["updates_received"]
                            t_fed = time.perf_counter() - t0
                            c2 = machine_cpu()
                            store.close()
                            # the tasks it left in flight: pulled, so that the next loop starts on the same
                            # engine (a bare loop after an undrained fedasync loop ran ~20 % slower)
                            transport.drain(open_messages(server))
                    ratios.append((args.updates / t_bare, n_fed / t_fed))
                    cpu.append({"bare": cpu_use(c0, c1, args.updates),
                                other: cpu_use(c1, c2, n_fed)})
                # the pair with the median ratio; every pair is kept
                result[f"pairs_{clock}"] = [[round(b, 2), round(f, 2), round(f / b, 3)] for b, f in ratios]
                i = sorted(range(len(ratios)), key=lambda j: ratios[j][1] / ratios[j][0])[len(ratios) // 2]
                b, f = ratios[i]
                result[bare], result[fed_key], result[f"ratio_{clock}"] = b, f, f / b
                if cpu[i]["bare"] is not None:
                    result[f"machine_cpu_{clock}"] = cpu[i]  # of the reported pair
                    result[f"machine_cpu_pairs_{clock}"] = cpu
            if "bare_flower_updates_per_s" in result and "fedasync_virtual_updates_per_s" in result:
                # the figure the issue started from: the deterministic loop against the arrival-order bare loop
                result["ratio_virtual_over_bare_arrival"] = (result["fedasync_virtual_updates_per_s"]
                                                             / result["bare_flower_updates_per_s"])
        except BaseException as e:  # report errors from the engine's thread
            result["error"] = repr(e)

    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cpus = os.cpu_count() or 1
    run_simulation(server_app=server_app, client_app=noop, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": cpus / 2, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": cpus, "include_dashboard": False}})
    if "error" in result:
        raise SystemExit(f"benchmark failed: {result['error']}")
    result["load_average_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    result["cpus"] = os.cpu_count()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "loop_overhead.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old = old if all(isinstance(v, dict) for v in old.values()) else {}  # the flat layout before --model
    key = args.model if not args.bare_new_model_every else \
        f"{args.model}_bare_new_model_every_{args.bare_new_model_every}"
    old[key] = result
    path.write_text(json.dumps(old, indent=2) + "\n")
    for clock, (bare, _) in KEYS.items():
        fed, other, label = compared(clock, args.bare_new_model_every)
        if fed in result:
            print(f"{clock:7s} order: bare Flower {result[bare]:7.1f}  {label} {result[fed]:7.1f} updates/s"
                  f"  ratio {result[f'ratio_{clock}']:.2f}")
            use = result.get(f"machine_cpu_{clock}")
            if use:
                print(f"{'':14s}machine CPU per update: bare {use['bare']['cpu_ms_per_update']:.1f} ms "
                      f"(busy {use['bare']['busy']:.0%}), {label} {use[other]['cpu_ms_per_update']:.1f} ms "
                      f"(busy {use[other]['busy']:.0%})")
    print(f"wrote {args.out / 'loop_overhead.json'}")


if __name__ == "__main__":
    main()
