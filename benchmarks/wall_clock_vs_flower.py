"""Wall-clock seconds to 90 % accuracy: Flower's own FedAvg against fedasync's FedBuff and FedAsync.

One start of Flower's simulation engine (Ray, ``--actors`` actors, one SuperNode per client)
runs, one after the other:

1. a warm-up: one short task per node, so that every actor has imported torch and built the
   data and model before any timing starts (reported as ``warmup_s``, with the engine start);
2. Flower's ``flwr.serverapp.strategy.FedAvg`` (``flower-fedavg``; ``flower-fedavg:server_lr=X:server_momentum=Y``
   is Flower's ``FedAvgM`` with that server learning rate and momentum) and its ``start()`` loop, ``fraction_train`` =
   ``server.concurrency / data.num_clients`` (20 of 100 clients per round, as fedasync's
   quickstart), central evaluation with ``evaluate_fn`` after every round, no client-side
   evaluation (``fraction_evaluate=0``: fedasync evaluates centrally too);
3. fedasync's FedBuff and FedAsync (the quickstart's server settings), on the wall clock
   (replies taken as they arrive, as in a deployment).

Both sides use the same ClientApp code and data: this module's ClientApp hands a fedasync task
straight to ``fedasync.clients.app.train``; a FedAvg message (``arrays`` + ``config``) is turned
into the same task for client ``partition-id`` and goes through the same function, whose reply
is turned back into ``arrays`` + ``metrics`` (``num-examples``). With ``clock.emulate`` every
task really lasts ``task_duration(client profile, steps, model size, seed, task id) x
--time-scale`` seconds (training included): a slow client is as slow under FedAvg as under
FedBuff.

Time to target, the same rule on both sides: each side's model is read on one grid of wall
seconds since its server started (``--eval-every``, default ``server.eval_every_s`` x
``--time-scale``, i.e. the quickstart's grid of virtual seconds); the time to target is the first
grid time from which the accuracy is at or above ``server.target_accuracy`` (0.90) for
``server.target_hold`` grid times in a row (``fedasync.server.evaluation.time_to_target``), and each
run stops once it has held. fedasync's server evaluates on that grid itself (the model current at
each grid time); Flower's FedAvg evaluates every round's model, and its value at a grid time is the
one of the last round finished by then (the same step function).

Flower's engine runs its actors' messages on a ``ThreadPoolExecutor()`` whose default size is
``min(32, cpus + 4)`` (6 on a 2-core machine): with 20 actors only 6 tasks would sleep at a
time. ``--pool per-actor`` (default) gives the executor one thread per actor, for both sides.
Ray starts its actors with niceness 15; on a machine busy with other work that starves both
sides' clients, so ``--worker-niceness`` (default 0) runs them at normal priority, both sides.

    python benchmarks/wall_clock_vs_flower.py --time-scale 4 --actors 20
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedasync.clients.app import train as fedasync_train
from fedasync.config import Config, load_config
from fedasync.wire import content_to_result, params_to_record, record_to_params, task_content

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402  (benchmarks/ is this script's folder)

app = ClientApp()

#: Flower's FedAvg tasks get ids above every fedasync task id (their jitter draws differ)
FLOWER_TASK_BASE = 10_000_000


def _durations(plan_json: str, _cache: dict = {}):  # noqa: B006  (a per-process cache; the app is pickled by value)
    """Client profiles, steps per client, model size, clock config: what a duration needs."""
    if plan_json not in _cache:
        from fedasync.config import ClockConfig
        from fedasync.server.clock import make_profiles

        plan = json.loads(plan_json)
        clock = ClockConfig(**plan["clock"])
        _cache[plan_json] = (make_profiles(plan["num_clients"], clock, plan["seed"]), plan["steps"],
                             plan["model_bytes"], clock)
    return _cache[plan_json]


@app.train()
def train(msg: Message, context: Context) -> Message:
    if "task" in msg.content:  # fedasync: the packaged ClientApp's own function
        return fedasync_train(msg, context)
    # Flower's FedAvg: the same task for this node's client, through the same function
    from fedasync.server.clock import task_duration
    from fedasync.server.transport import task_seed

    conf = msg.content["config"]
    plan = json.loads(str(conf["fedasync-plan"]))
    c = int(context.node_config["partition-id"])
    rnd = int(conf["server-round"])
    tid = FLOWER_TASK_BASE + rnd * plan["num_clients"] + c
    profiles, steps, model_bytes, clock = _durations(str(conf["fedasync-plan"]))
    dur = task_duration(profiles[c], steps[c], model_bytes, clock, plan["seed"], tid)
    arrays = msg.content["arrays"]
    task = {"task_id": tid, "client_id": c, "run_id": 0, "base_version": rnd - 1, "seed": task_seed(plan["seed"], tid),
            "sleep_s": dur * plan["time_scale"], "setup": plan["setup"]}
    msg.content = task_content(record_to_params(arrays), task)
    reply = fedasync_train(msg, context)
    r = content_to_result(reply.content)
    out = RecordDict({"arrays": params_to_record(r["params"]),
                      "metrics": MetricRecord({"num-examples": int(r["metrics"]["num_examples"]),
                                               "train_loss": float(r["metrics"]["loss"])})})
    return Message(out, reply_to=msg)


# -- the server side ---------------------------------------------------------------------


class Curve:
    """One run on the grid: rows like a server's history (``virtual_time_s``: the grid time, wall
    seconds since the server started) and the time to target by fedasync's one rule."""

    def __init__(self, target: float, hold: int, every_s: float):
        from fedasync.server.evaluation import accuracy_goal

        self.goal, self.hold, self.every_s = accuracy_goal(target), hold, every_s
        self.rounds: list[tuple[float, float]] = []  # Flower: (s since start, accuracy) of each round's model
        self.rows: list[dict] = []
        self.reached: float | None = None

    def flower_round(self, t: float, acc: float) -> bool:
        """Round model ``acc`` available at ``t``: the grid rows up to ``t``; whether the target held."""
        from fedasync.server.evaluation import grid_value, time_to_target

        self.rounds.append((t, float(acc)))
        grid = [k * self.every_s for k in range(int(t / self.every_s) + 1)]
        values = grid_value([r[0] for r in self.rounds], [r[1] for r in self.rounds], grid)
        self.rows = [{"virtual_time_s": round(g, 6), "accuracy": v} for g, v in zip(grid, values) if v is not None]
        self.reached = time_to_target(self.rows, self.goal, self.hold)
        return self.reached is not None

    def fedasync_history(self, history: list[dict]) -> None:
        """A fedasync run's own history (evaluated on the grid by its server)."""
        from fedasync.server.evaluation import time_to_target

        self.rows = [{"virtual_time_s": h["virtual_time_s"], "accuracy": h.get("accuracy")} for h in history]
        self.reached = time_to_target(self.rows, self.goal, self.hold)


class TargetReached(Exception):
    """Ends Flower's start() loop once the target has held on the grid."""


def flower_options(keys: list[str]) -> dict[str, float]:
    """``server_lr=X`` / ``server_momentum=Y`` of a ``flower-fedavg:...`` run as Flower's FedAvgM arguments."""
    names = {"server_lr": "server_learning_rate", "server_momentum": "server_momentum"}
    out = {}
    for k in keys:
        key, _, value = k.partition("=")
        if key not in names or not value:
            raise SystemExit(f"--runs: flower-fedavg takes server_lr=X and server_momentum=Y, not {k!r}")
        out[names[key]] = float(value)
    return out


def _flower(grid: Grid, cfg: Config, tl: Curve, max_wall_s: float, time_scale: float,
            options: dict[str, float] | None = None) -> dict:
    """Flower's FedAvg; with ``options`` (server_learning_rate, server_momentum) Flower's FedAvgM."""
    from flwr.serverapp.strategy import FedAvg, FedAvgM

    from fedasync.server.transport import client_setup_json
    from fedasync.task.data import load_federated, load_test
    from fedasync.task.models import build_model, init_params, set_params
    from fedasync.task.train import evaluate, steps_for

    fed = load_federated(cfg.data, cfg.seed)
    x_test, y_test = load_test(cfg.data, cfg.seed)
    model = build_model(cfg.model, fed.input_shape, fed.num_classes)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    plan = {"num_clients": cfg.data.num_clients, "seed": cfg.seed, "clock": cfg.clock.model_dump(mode="json"),
            "steps": [steps_for(cfg.train, len(p[1])) for p in fed.partitions],
            "model_bytes": int(sum(a.nbytes for a in params.values())), "time_scale": time_scale,
            "setup": client_setup_json(cfg)}
    t_start = time.perf_counter()
    rounds = {"n": 0}

    class TimedFedAvg(FedAvgM if options else FedAvg):
        """Flower's FedAvg (FedAvgM with ``options``); only counts its rounds."""

        def configure_train(self, server_round, arrays, config, grid):
            msgs = list(super().configure_train(server_round, arrays, config, grid))
            rounds["n"] = server_round
            return msgs

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        t = 0.0 if server_round == 0 else time.perf_counter() - t_start  # the round's model exists from t
        set_params(model, {k: arrays[k].numpy() for k in arrays.keys()})
        loss, acc = evaluate(model, x_test, y_test)
        if tl.flower_round(t, acc):
            raise TargetReached
        if time.perf_counter() - t_start > max_wall_s:
            raise TargetReached  # out of time: reported as not reached
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = TimedFedAvg(fraction_train=cfg.server.concurrency / cfg.data.num_clients, fraction_evaluate=0.0,
                           min_available_nodes=cfg.data.num_clients, **(options or {}))
    try:
        strategy.start(grid=grid, initial_arrays=params_to_record(params), num_rounds=100_000,
                       train_config=ConfigRecord({"fedasync-plan": json.dumps(plan)}), evaluate_fn=evaluate_fn)
    except TargetReached:
        pass
    return {"rounds": rounds["n"], "updates": rounds["n"] * int(cfg.server.concurrency)}


def _fedasync(grid: Grid, cfg: Config, tl: Curve, workdir: Path) -> dict:
    from fedasync.server.app import GridTransport
    from fedasync.server.control import open_messages
    from fedasync.server.loop import AsyncServer
    from fedasync.store import Store

    transport = GridTransport(grid)
    nodes = transport.node_ids()
    store = Store(f"sqlite:///{workdir / (cfg.server.strategy + '.db')}")

    server = AsyncServer(cfg, transport, store, clock="wall", node_for_client=lambda c: nodes[c % len(nodes)])
    summary = server.run()  # evaluated on the wall grid, stopped once the target held (server.stop_at_target)
    tl.fedasync_history(summary["history"])
    store.close()
    # the tasks it left in flight: their replies pulled (Flower would keep them, and its engine walks
    # every stored message for every node: the next run would be slower), waiting as long as a task
    transport.drain(open_messages(server), timeout=600.0)
    return {"versions": summary["versions"], "updates": summary["updates_received"],
            "stop_reason": summary["stop_reason"], "staleness_mean": summary["staleness"]["mean"]}


def _warmup(grid: Grid, cfg: Config, sleep_s: float) -> float:
    """One short task per node: every actor imports torch and builds data and model first."""
    from fedasync.server.app import GridTransport
    from fedasync.server.transport import TaskMsg, client_setup_json
    from fedasync.task.data import load_federated
    from fedasync.task.models import init_params

    t0 = time.perf_counter()
    transport = GridTransport(grid, group_id="warmup")
    nodes = transport.wait_for_nodes(cfg.data.num_clients, timeout=600)
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    setup = client_setup_json(cfg)
    tasks = [TaskMsg(i, c, nodes[c], params, {"task_id": i, "client_id": c, "run_id": 0, "base_version": 0,
                                              "seed": i, "sleep_s": sleep_s, "setup": setup})
             for i, c in enumerate(range(cfg.data.num_clients))]
    waiting = set(i for i in transport.send(tasks) if i)
    while waiting:
        for mid, _ in transport.poll(list(waiting)):
            waiting.discard(mid)
        time.sleep(0.05)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=None, help="YAML config (default: the packaged quickstart)")
    ap.add_argument("--time-scale", type=float, default=4.0, help="wall seconds per virtual second")
    ap.add_argument("--actors", type=int, default=20, help="Ray actors (tasks that can run at once)")
    ap.add_argument("--pool", choices=["per-actor", "flower-default"], default="per-actor",
                    help="the engine's worker threads: one per actor, or Flower's min(32, cpus + 4)")
    ap.add_argument("--runs", default="fedbuff,flower-fedavg,fedasync",
                    help="comma-separated: flower-fedavg (Flower's FedAvgM with :server_lr=X:server_momentum=Y), "
                         "or a fedasync strategy with optional server keys as in --compare (fedbuff:scheduler.name=fastest)")
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="niceness of the Ray actors, both sides (Ray's default 15 starves them on a busy machine)")
    ap.add_argument("--max-wall", type=float, default=2400.0, help="give up on a run after this many seconds")
    ap.add_argument("--eval-every", type=float, default=None,
                    help="the grid, wall seconds (default: server.eval_every_s x --time-scale), both sides")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--verbose", action="store_true", help="Flower's and Ray's logs")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/wall_clock_vs_flower.json"))
    args = ap.parse_args()

    from flwr.simulation import run_simulation

    from fedasync.cli.common import quiet_flower

    common = ["clock.emulate=true", f"clock.time_scale={args.time_scale}",
              "server.max_virtual_time=null", "server.max_versions=null",
              "server.stop_at_target=true", f"server.max_wall_time={args.max_wall}",
              f"simulation.num_actors={args.actors}", *args.sets]
    base = load_config(args.config, common)
    every = args.eval_every or (base.server.eval_every_s or 2.0) * args.time_scale
    common.append(f"server.eval_every_s={every}")  # fedasync's wall clock: wall seconds since the start
    target, hold = base.server.target_accuracy or 0.9, base.server.target_hold
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if args.pool == "per-actor":  # both sides: the engine's executor gets one thread per actor
        import flwr.server.superlink.fleet.vce.vce_api as vce

        vce.ThreadPoolExecutor = functools.partial(concurrent.futures.ThreadPoolExecutor,
                                                   max_workers=max(args.actors, 1))
    quiet_flower(args.verbose)
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # read by the raylet run_simulation starts
    load0 = os.getloadavg()
    result: dict = {"provenance": provenance(sys.argv),
                    "command": "python " + " ".join(sys.argv), "time_scale": args.time_scale,
                    "actors": args.actors, "pool": args.pool, "worker_niceness": args.worker_niceness,
                    "num_clients": base.data.num_clients, "seed": base.seed,
                    "concurrency": base.server.concurrency, "target_accuracy": target,
                    "eval_every_wall_s": every, "target_hold": hold,
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "loadavg_before": load0},
                    "runs": {}}
    t_engine = time.perf_counter()
    timing: dict = {}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        timing["engine_start_s"] = time.perf_counter() - t_engine
        result["engine_start_s"] = round(timing["engine_start_s"], 2)
        result["warmup_s"] = round(_warmup(grid, base, sleep_s=min(1.0, 0.5 * args.time_scale)), 2)
        save()
        with tempfile.TemporaryDirectory() as d:
            for name in runs:
                tl = Curve(target, hold, every)
                t0 = time.perf_counter()
                print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
                if name.split(":")[0] == "flower-fedavg":  # flower-fedavg[:server_lr=X][:server_momentum=Y]
                    info = _flower(grid, base, tl, args.max_wall, args.time_scale, flower_options(name.split(":")[1:]))
                else:
                    # "fedbuff" or, as in --compare, "fedbuff:scheduler.name=fastest" (server keys)
                    strategy, *keys = name.split(":")
                    cfg = load_config(args.config, [*common, f"server.strategy={strategy}",
                                                    *(f"server.{k}" for k in keys)])
                    info = _fedasync(grid, cfg, tl, Path(d))  # (its leftover tasks drained)
                result["runs"][name] = {
                    "time_to_target_s": None if tl.reached is None else round(tl.reached, 2),
                    "wall_s": round(time.perf_counter() - t0, 2), "evaluations": len(tl.rows),
                    "best_accuracy": max((r["accuracy"] for r in tl.rows if r["accuracy"] is not None), default=None),
                    "loadavg_after": os.getloadavg(), **info,
                    "curve": [(r["virtual_time_s"], r["accuracy"]) for r in tl.rows]}
                print(f"  {name}: {result['runs'][name]['time_to_target_s']} s to {target:.0%}", flush=True)
                save()
        def ratios(base_t):
            return {n: (None if not base_t or not r["time_to_target_s"] else round(base_t / r["time_to_target_s"], 3))
                    for n, r in result["runs"].items()}

        result["speedup_vs_flower_fedavg"] = ratios(result["runs"].get("flower-fedavg", {}).get("time_to_target_s"))
        result["speedup_vs"] = {n: ratios(r["time_to_target_s"]) for n, r in result["runs"].items()
                                if n.startswith("flower-fedavg")}  # each Flower run (FedAvg, FedAvgM) as the base
        save()

    cpus = os.cpu_count() or 1
    run_simulation(server_app=server_app, client_app=app, num_supernodes=base.data.num_clients,
                   backend_config={"client_resources": {"num_cpus": cpus / args.actors, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": cpus, "include_dashboard": False,
                                                 "log_to_driver": False}})
    result["total_wall_s"] = round(time.perf_counter() - t_engine, 1)
    result["machine"]["loadavg_after"] = os.getloadavg()
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    for n, r in result["runs"].items():
        print(f"{n:>32}: {r['time_to_target_s']} s to {target:.0%} ({r['wall_s']} s wall)")


if __name__ == "__main__":
    main()
