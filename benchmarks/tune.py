"""The tuning protocol (issue 34): tune on validation with the same budget per strategy, report on test.

For a YAML scenario and a list of strategies:

1. **Grid.** Each strategy gets knobs: the client learning rate ``train.lr`` (0.5x, 1x, 2x the
   config's) for all; ``server.server_lr`` (1.0, 1.5, 2.0) and ``server.server_momentum`` (0, 0.9)
   for fedavg (FedAvgM) and fedbuff; ``server.concurrency`` (0.5x, 1x, 2x) for all: tasks in flight
   for the asynchronous ones, the cohort size for fedavg (``server.clients_per_round`` instead where
   the config sets it; it follows ``concurrency`` otherwise). A knob the config schema or the
   strategy refuses is left out (printed). Every strategy gets the SAME number of grid points
   (``--budget``, cut to the smallest candidate set): its defaults first, then the candidates that
   change one knob, then two, ..., each group in a seeded order (``--grid-seed``).
2. **Tuning** on ``--tune-seeds`` (default 100,101): each grid point runs once per seed with
   ``data.val_fraction`` (default 0.1: a validation split carved out of the training pool, which no
   client trains on) and ``server.target`` = ``--target`` on ``--target-metric`` (default
   ``val_accuracy``), evaluated on the grid ``server.eval_every_s`` (``--eval-every-s``) with the
   config's ``server.target_hold``, stopping at the target. A point's score is the median time to
   the target over the tuning seeds (not reached: infinite); ties go to the higher median best
   validation metric, then to the earlier point. The tuning runs never look at the test set:
   ``--tune-test-samples N`` evaluates it on a seeded subset of N there (a full pass of MNIST's
   10,000 images costs 8 s on one core, at every grid time).
3. **Report** on ``--report-seeds`` (default 1,2,3, never tuning seeds): each strategy's defaults
   and its best point, the same data and grid, the target on the TEST metric (``accuracy``):
   medians with min-max, the number of seeds that reached it, and the ratio fedavg / strategy, for
   "defaults vs defaults" and "tuned vs tuned".

Everything runs in-process (``fedasync.simulate``, backend ``local``), ``--jobs`` processes at a
time (one torch thread each); progress lines go to stderr. ``--budget 1`` is defaults vs defaults:
no tuning runs, only the report's "defaults" rows. One JSON goes to
``benchmarks/results/<--name>.json`` (``--out`` to put it elsewhere) through
``benchmarks/provenance.py``: the command, commit, machine and date, the budget, every variant's
scores and histories, the chosen configs and the report rows.

**Run cache** (``--cache``, default ``benchmarks/.cache/tune/``, not in git; ``--no-cache`` off): each
finished simulation is kept as ``<sha256 of its config>.json`` with the commit it ran on, and a
later invocation with the same config takes it from there instead of running it again, so a
protocol too long for one sitting (MNIST: hours per strategy on two cores) is finished over several,
and a defaults-vs-defaults run is reused by the full protocol. A simulated run is a pure function
of its config, seed and code: every run records its ``commit``, and the result file lists the
commits its runs came from (``cache``); clear the folder after a change that moves results.

    python benchmarks/tune.py --config fedasync/examples/quickstart.yaml --strategies fedavg,fedbuff,fedasync \
        --target 0.9 --budget 4 --horizon 600 --jobs 2 --name quickstart_tuning

The protocol, its reasons and its cost: docs/howto/tuning.md.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from provenance import provenance, write_result  # noqa: E402

LR_FACTORS = (0.5, 1.0, 2.0)
SERVER_LR = (1.0, 1.5, 2.0)
MOMENTUM = (0.0, 0.9)
CONCURRENCY_FACTORS = (0.5, 1.0, 2.0)
HISTORY_KEYS = ("version", "virtual_time_s", "accuracy", "loss", "val_accuracy", "val_loss")


class TuneError(ValueError):
    """Bad input: one line naming the flag."""


# -- configs --------------------------------------------------------------------------------------


def _get(raw: dict, dotted: str) -> Any:
    node = raw
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(raw: dict, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def strategy_bases(config: str | Path, strategies: list[str], sets: list[str] | None = None) -> dict[str, dict]:
    """Each strategy's config as a dict: the YAML (with ``sets``) as ``--compare`` makes it per
    strategy (``fedasync.api.compare_configs``: keys of the other strategies reset)."""
    from fedasync.api import compare_configs
    from fedasync.config import load_config

    base = load_config(str(config), list(sets or []))
    return {label: cfg.model_dump(mode="json") for label, cfg in compare_configs(",".join(strategies), base)}


def _validates(raw: dict) -> str | None:
    """None when ``raw`` is a config this code accepts and can build a strategy of, else why not."""
    from fedasync.config import config_from_dict
    from fedasync.server.strategies import make_strategy

    try:
        cfg = config_from_dict(copy.deepcopy(raw))
        make_strategy(cfg.server, cfg.weighting, cfg.seed)
    except ValueError as e:  # a refusal (ConfigError is one) drops the knob; anything else is a bug: raised
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def knobs_for(strategy: str, raw: dict, overrides: dict[str, list] | None = None,
              notes: list[str] | None = None) -> dict[str, list]:
    """The knob values of ``strategy`` (module docstring), each including the config's own value;
    ``overrides`` replace a knob's values; a knob whose values do not validate is left out."""
    lr = float(_get(raw, "train.lr"))
    knobs: dict[str, list] = {"train.lr": sorted({round(lr * f, 6) for f in LR_FACTORS})}
    server = raw["server"]
    if strategy in ("fedavg", "fedbuff"):
        knobs["server.server_lr"] = sorted(set(SERVER_LR) | {float(server.get("server_lr", 1.0))})
        if "server_momentum" in server:
            knobs["server.server_momentum"] = sorted(set(MOMENTUM) | {float(server["server_momentum"])})
    # every strategy's parallelism: tasks in flight for the asynchronous ones, FedAvg's cohort
    # (clients_per_round, which follows concurrency unless the config sets it) (issue 34)
    key = "clients_per_round" if strategy == "fedavg" and server.get("clients_per_round") else "concurrency"
    c = int(server[key])
    knobs[f"server.{key}"] = sorted({max(1, round(c * f)) for f in CONCURRENCY_FACTORS})
    for key, values in (overrides or {}).items():
        if key in knobs:
            knobs[key] = list(values)
    out = {}
    for key, values in knobs.items():
        bad = None
        for v in values:
            trial = copy.deepcopy(raw)
            _set(trial, key, v)
            bad = bad or _validates(trial)
        if bad:
            if notes is not None:
                notes.append(f"{strategy}: knob {key} left out ({bad})")
            continue
        out[key] = values
    return out


def candidates(knobs: dict[str, list], defaults: dict[str, Any], seed: int) -> list[dict]:
    """Every combination of ``knobs``: ``defaults`` first, then by the number of knobs changed from
    it, each group in a seeded order."""
    names = sorted(knobs)
    base = {k: defaults[k] for k in names}
    combos = [dict(zip(names, vals)) for vals in itertools.product(*(knobs[k] for k in names))]
    rng = random.Random(seed)
    rest = [c for c in combos if c != base]
    rng.shuffle(rest)
    rest.sort(key=lambda c: sum(c[k] != base[k] for k in names))
    return [base] + rest


def grids(bases: dict[str, dict], budget: int, seed: int, overrides: dict[str, list] | None = None,
          notes: list[str] | None = None) -> tuple[dict[str, list[dict]], int, dict[str, dict]]:
    """(points per strategy, the common budget, knobs per strategy): every strategy gets the same
    number of points, ``budget`` or the smallest candidate set if that is smaller."""
    knobs = {s: knobs_for(s, raw, overrides, notes) for s, raw in bases.items()}
    cands = {s: candidates(knobs[s], {k: _get(bases[s], k) for k in knobs[s]}, seed) for s in bases}
    n = min([budget] + [len(c) for c in cands.values()])
    if n < budget and notes is not None:
        notes.append(f"budget cut from {budget} to {n}: the smallest candidate set "
                     f"({', '.join(f'{s} {len(c)}' for s, c in cands.items())})")
    return {s: c[:n] for s, c in cands.items()}, n, knobs


def run_config(raw: dict, point: dict, *, seed: int, metric: str, target: float, val_fraction: float,
               eval_every_s: float | None, horizon: float | None, test_samples: int | None = None) -> dict:
    """``raw`` with the grid point, the seed, the validation split, the target and the grid applied;
    ``test_samples``: ``data.test_samples`` (the tuning runs, which score on validation only)."""
    out = copy.deepcopy(raw)
    for key, value in point.items():
        _set(out, key, value)
    out["seed"] = int(seed)
    out["data"]["val_fraction"] = float(val_fraction)
    if test_samples is not None:
        out["data"]["test_samples"] = int(test_samples)
    srv = out["server"]
    srv.update(target_accuracy=None, target={"metric": metric, "value": float(target), "mode": "max"},
               stop_at_target=True)
    if eval_every_s is not None:
        srv.pop("eval_every", None)
        srv["eval_every_s"] = float(eval_every_s)
    if horizon is not None:
        srv["max_virtual_time"] = float(horizon)
    return out


# -- running --------------------------------------------------------------------------------------


def run_one(job: dict) -> dict:
    """One simulation (backend local, one torch thread) of ``job["config"]``: its time to target,
    stop reason, counts and compact history."""
    import torch

    import fedasync

    torch.set_num_threads(1)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tune-") as d:
        r = fedasync.simulate(job["config"], backend="local", out=d)
    s = r.summary
    return {"seed": job["config"]["seed"], "time_to_target_s": s.get("time_to_target_s"),
            "stop_reason": s.get("stop_reason"), "versions": s.get("versions"),
            "virtual_time_s": s.get("virtual_time_s"), "wall_s": round(time.time() - t0, 2),
            "final_metrics": s.get("final_metrics"),
            "history": [{k: (round(h[k], 5) if isinstance(h[k], float) else h[k]) for k in HISTORY_KEYS if k in h}
                        for h in r.history]}


def config_key(config: dict) -> str:
    """The run cache's key of a run: sha256 of its config as canonical JSON."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cached(cache: Path | None, config: dict) -> dict | None:
    """The cached result of the run of ``config``, or None (no cache, not there, unreadable)."""
    if cache is None:
        return None
    path = cache / f"{config_key(config)}.json"
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry["result"] if entry.get("config") == config else None


def keep(cache: Path | None, config: dict, result: dict) -> None:
    """Store ``result`` in the run cache (``write_result``: a temporary file renamed into place)."""
    if cache is not None:
        write_result(cache / f"{config_key(config)}.json", {"config": config, "result": result})


def run_all(jobs: list[dict], workers: int, phase: str, cache: Path | None = None,
            commit: str | None = None) -> list[dict]:
    """Results of ``jobs`` in their order; ``workers`` processes (1: this process). A job in the run
    cache ``cache`` is taken from it; every new result records ``commit`` and goes into the cache."""
    out: list[dict | None] = [None] * len(jobs)
    t0 = time.time()

    def done(i: int, res: dict, hit: bool = False) -> None:
        out[i] = res
        j = jobs[i]
        if not hit:
            res["commit"] = commit
            keep(cache, j["config"], res)
        ttt = res["time_to_target_s"]
        how = "from the cache" if hit else f"{res['wall_s']:.0f} s wall"
        print(f"[tune] {phase} {j['strategy']} point {j['point_index']} seed {res['seed']}: "
              f"{'not reached' if ttt is None else f'{ttt:.1f} s'} ({res['stop_reason']}, {how}; "
              f"{sum(o is not None for o in out)}/{len(jobs)}, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    todo = []
    for i, j in enumerate(jobs):
        res = cached(cache, j["config"])
        if res is None:
            todo.append(i)
        else:
            done(i, res, hit=True)
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            done(i, run_one(jobs[i]))
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
            futures = {ex.submit(run_one, jobs[i]): i for i in todo}
            for f in as_completed(futures):
                done(futures[f], f.result())
    return out  # type: ignore[return-value]


def _t(v: float | None) -> float:
    return math.inf if v is None else float(v)


def stats(runs: list[dict]) -> dict:
    """Median, min and max time to target (None where not reached: the median is None when half or
    more did not) and how many runs reached it."""
    times = sorted(_t(r["time_to_target_s"]) for r in runs)
    med = statistics.median(times)
    fin = lambda v: None if math.isinf(v) else round(v, 3)  # noqa: E731
    return {"median_s": fin(med), "min_s": fin(times[0]), "max_s": fin(times[-1]),
            "reached": f"{sum(not math.isinf(t) for t in times)}/{len(times)}"}


def score(runs: list[dict], metric: str) -> tuple[float, float]:
    """(median time to target, -median best ``metric``): lower is better."""
    best = [max((h.get(metric, -math.inf) for h in r["history"]), default=-math.inf) for r in runs]
    return statistics.median(_t(r["time_to_target_s"]) for r in runs), -statistics.median(best)


# -- the protocol ---------------------------------------------------------------------------------


def _floats(text: str, flag: str) -> list:
    try:
        return [json.loads(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise TuneError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--strategies", default="fedavg,fedbuff")
    p.add_argument("--budget", type=int, default=6, help="grid points per strategy (the same for all)")
    p.add_argument("--grid-seed", type=int, default=0)
    p.add_argument("--tune-seeds", default="100,101")
    p.add_argument("--report-seeds", default="1,2,3")
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--target-metric", default="val_accuracy")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--eval-every-s", type=float, default=None,
                   help="the evaluation grid (virtual s); default: the config's server.eval_every_s (its default 2 where unset)")
    p.add_argument("--horizon", type=float, default=None, help="server.max_virtual_time of every run")
    p.add_argument("--tune-test-samples", type=int, default=None,
                   help="data.test_samples of the tuning runs only: they score on validation, so their test "
                        "evaluation (whole test set by default) can be a seeded subset; the report runs use the config's")
    p.add_argument("--knob", action="append", default=[], help="KEY=v1,v2,...: a knob's values (all strategies)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE on the YAML, as simulate's")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--cache", default=str(HERE / ".cache" / "tune"),
                   help="the run cache folder (module docstring); default benchmarks/.cache/tune")
    p.add_argument("--no-cache", action="store_true", help="run everything again, keep nothing")
    p.add_argument("--name", required=True)
    p.add_argument("--out", default=None, help="the result file (default benchmarks/results/<name>.json)")
    a = p.parse_args(argv)
    a.tune_seeds = [int(s) for s in _floats(a.tune_seeds, "--tune-seeds")]
    a.report_seeds = [int(s) for s in _floats(a.report_seeds, "--report-seeds")]
    both = sorted(set(a.tune_seeds) & set(a.report_seeds))
    if both:
        raise TuneError(f"--report-seeds: {both} are tuning seeds too (report on seeds never tuned on)")
    if not a.tune_seeds or not a.report_seeds:
        raise TuneError("--tune-seeds/--report-seeds: give at least one seed each")
    if a.tune_test_samples is not None and a.tune_test_samples < 1:
        raise TuneError("--tune-test-samples: must be at least 1")
    if a.budget < 1 or a.jobs < 1:
        raise TuneError("--budget/--jobs: must be at least 1")
    if not 0 < a.val_fraction < 1 and a.target_metric.startswith("val_"):
        raise TuneError(f"--val-fraction: {a.val_fraction} must be in (0, 1) to tune on {a.target_metric}")
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    a.cache = None if a.no_cache else Path(a.cache)
    knobs = {}
    for k in a.knob:
        key, _, values = k.partition("=")
        if not values:
            raise TuneError(f"--knob: {k!r} is not KEY=v1,v2,...")
        knobs[key.strip()] = _floats(values, "--knob")
    a.knob = knobs
    return a


def tune(a: argparse.Namespace, argv: list[str], save: Any = None) -> dict:
    """The whole protocol (module docstring) for parsed arguments; the result file's payload.
    ``save(payload)``, when given, gets the tuning phase's payload (``"complete": false``, no report
    yet) before the report runs start, so a long run that is stopped keeps its tuning results."""
    prov = provenance(argv)  # the code the runs start on (a commit made during a long run is not theirs)
    notes: list[str] = []
    bases = strategy_bases(a.config, a.strategies, a.sets)
    points, budget, knobs = grids(bases, a.budget, a.grid_seed, a.knob, notes)
    for n in notes:
        print(f"[tune] {n}", file=sys.stderr)
    print(f"[tune] budget: {budget} grid points per strategy x {len(a.tune_seeds)} tuning seeds "
          f"({', '.join(a.strategies)}); report on seeds {a.report_seeds}" if budget > 1 else
          f"[tune] defaults vs defaults (--budget 1: no tuning runs) on seeds {a.report_seeds}", file=sys.stderr)
    if a.eval_every_s is None:  # the YAML's own grid (every strategy's server section is the YAML's)
        a.eval_every_s = bases[a.strategies[0]]["server"].get("eval_every_s")
    test_metric = a.target_metric[4:] if a.target_metric.startswith("val_") else a.target_metric
    common = dict(val_fraction=a.val_fraction, eval_every_s=a.eval_every_s, horizon=a.horizon)

    tuned = budget > 1  # one point: defaults vs defaults, nothing to tune
    jobs = [{"strategy": s, "point_index": i, "config": run_config(bases[s], pt, seed=seed, metric=a.target_metric,
                                                                  target=a.target, test_samples=a.tune_test_samples,
                                                                  **common)}
            for s in a.strategies for i, pt in enumerate(points[s]) for seed in a.tune_seeds] if tuned else []
    results = run_all(jobs, a.jobs, "tune", a.cache, prov["commit"])
    variants: dict[str, list[dict]] = {s: [] for s in a.strategies}
    for s in a.strategies:
        for i, pt in enumerate(points[s]):
            runs = [r for j, r in zip(jobs, results) if j["strategy"] == s and j["point_index"] == i]
            if not runs:  # --budget 1: not tuned
                variants[s].append({"index": i, "overrides": pt, "default": i == 0, "score": None, "runs": []})
                continue
            sc = score(runs, a.target_metric)
            variants[s].append({"index": i, "overrides": pt, "default": i == 0, "score": {
                "median_time_to_target_s": None if math.isinf(sc[0]) else sc[0],
                "median_best_" + a.target_metric: -sc[1], **stats(runs)}, "runs": runs})
    chosen = {s: min(variants[s], key=lambda v: (score(v["runs"], a.target_metric), v["index"]))["index"]
              if tuned else 0 for s in a.strategies}
    for s in a.strategies:
        print(f"[tune] {s}: {'best point' if budget > 1 else 'defaults'} {chosen[s]} {points[s][chosen[s]]}",
              file=sys.stderr)
    head = {
        "provenance": {**prov, "finished": provenance(argv)["date"]},
        "protocol": {"config": str(a.config), "strategies": a.strategies, "budget": budget, "grid_seed": a.grid_seed,
                     "knobs": knobs, "tune_seeds": a.tune_seeds, "report_seeds": a.report_seeds,
                     "target": a.target, "tune_metric": a.target_metric, "report_metric": test_metric,
                     "val_fraction": a.val_fraction, "eval_every_s": a.eval_every_s, "horizon": a.horizon,
                     "tune_test_samples": a.tune_test_samples,
                     "sets": a.sets, "notes": notes},
        "variants": variants, "chosen": {s: {"index": chosen[s], "overrides": points[s][chosen[s]]}
                                         for s in a.strategies},
    }
    if save is not None:
        save({**head, "complete": False, "report_runs": {}, "report": []})

    wanted = sorted({(s, i) for s in a.strategies for i in (0, chosen[s])})
    rjobs = [{"strategy": s, "point_index": i, "config": run_config(bases[s], points[s][i], seed=seed,
                                                                   metric=test_metric, target=a.target, **common)}
             for s, i in wanted for seed in a.report_seeds]
    rresults = run_all(rjobs, a.jobs, "report", a.cache, prov["commit"])
    report_runs = {f"{s}/{i}": [r for j, r in zip(rjobs, rresults) if (j["strategy"], j["point_index"]) == (s, i)]
                   for s, i in wanted}
    rows = []
    for kind in ("defaults", "tuned") if tuned else ("defaults",):
        idx = {s: 0 if kind == "defaults" else chosen[s] for s in a.strategies}
        st = {s: stats(report_runs[f"{s}/{idx[s]}"]) for s in a.strategies}
        ref = st.get("fedavg", {}).get("median_s")
        for s in a.strategies:
            med = st[s]["median_s"]
            rows.append({"comparison": kind, "strategy": s, "point": idx[s], "overrides": points[s][idx[s]], **st[s],
                         "ratio_vs_fedavg": None if not (ref and med) else round(ref / med, 3)})
    every = [*results, *rresults]
    return {
        **head, "complete": True,
        "cache": {"folder": None if a.cache is None else str(a.cache),
                  "commits": sorted({str(r.get("commit")) for r in every})},
        "report_runs": report_runs, "report": rows,
    }


def table(rows: list[dict]) -> str:
    """The report rows as a markdown table."""
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    out = ["| comparison | strategy | settings | median s (min-max) | reached | fedavg / strategy |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        settings = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["overrides"].items())
        ratio = "-" if r["ratio_vs_fedavg"] is None else f"{r['ratio_vs_fedavg']:.2f}x"
        out.append(f"| {r['comparison']} | {r['strategy']} | {settings} | {fmt(r['median_s'])} "
                   f"({fmt(r['min_s'])}-{fmt(r['max_s'])}) | {r['reached']} | {ratio} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse(argv)
    except TuneError as e:
        print(f"tune: {e}", file=sys.stderr)
        return 2
    target = Path(a.out) if a.out else HERE / "results" / f"{a.name}.json"
    payload = tune(a, [str(Path(__file__).relative_to(HERE.parent)), *argv], save=lambda p: write_result(target, p))
    path = write_result(target, payload)
    print(table(payload["report"]))
    print(f"[tune] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
