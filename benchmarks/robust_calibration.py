"""Calibrating ``server.robust``'s defaults: what honest and attacked updates look like on the quickstart.

A clean FedBuff run on the quickstart's task (digits, 100 Dirichlet(0.5) clients, MLP, lr 0.05,
10 local steps, K = 10, 20 tasks in flight, log-normal speeds sigma = 1, polynomial staleness)
is replayed with fedasync's own pieces (``local_train``, ``FedBuff``, ``gradient``,
``validation_split``) in a small event loop: no Flower, no store, so it runs anywhere. For every
honest update it records what the filters look at:

- zeno++: ``<v, g>`` and ``||g||``, with ``v`` the validation gradient (128 training samples) at
  the current model; the same for the update the client would have sent had it trained on
  flipped labels (``label_flip``), and ``<v, u>`` for a random unit ``u`` (``gaussian``). The
  scores of ``sign_flip``, ``scale`` (factor 10) and ``gaussian`` follow exactly from these,
  since those attacks only rescale or redirect ``g``;
- kardam: the client's empirical Lipschitz coefficient; norm: ``||Δ||``.

It then reports, per seed and for a grid of parameters, the share of honest updates each filter
would reject (false rejections) and the share of attacked ones it would catch. The trajectory is
the clean one: under attack the model moves differently, so these are calibration figures, not
the robustness benchmark (that runs the real loop).

    python benchmarks/robust_calibration.py                  # seeds 0 1 2, 1500 updates each
    python benchmarks/robust_calibration.py --seeds 0 --updates 300
Writes benchmarks/results/robust_calibration.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ZENO_GRID = [(0.001, 0.0), (0.1, 0.1), (0.3, 0.2), (0.3, 0.3), (0.5, 0.3), (0.5, 0.5), (1.0, 0.5)]
KARDAM_F = [0.02, 0.04, 0.05, 0.1, 0.2]
NORM_M = [2.0, 2.5, 3.0]
FACTOR = 10.0


def replay(seed: int, updates: int) -> dict:
    import torch

    from fedasync.clients.attack import flip_labels
    from fedasync.config import load_config
    from fedasync.server.robust import Kardam, flat, validation_split
    from fedasync.server.staleness import make_staleness
    from fedasync.server.strategies import FedBuff, Update
    from fedasync.task.data import load_federated
    from fedasync.task.models import build_model, init_params, set_params
    from fedasync.task.train import evaluate, gradient, local_train

    torch.set_num_threads(1)
    cfg = load_config()
    fed = load_federated(cfg.data, seed)
    model = build_model(cfg.model, fed.input_shape, fed.num_classes)
    cpu = torch.device("cpu")
    x = init_params(cfg.model, fed.input_shape, fed.num_classes, seed)
    xv, yv = validation_split(fed.partitions, 128, seed)
    rng = np.random.default_rng(seed)
    n, conc = cfg.data.num_clients, cfg.server.concurrency
    speed = np.exp(rng.normal(0.0, cfg.clock.sigma, n))
    fb = FedBuff(cfg.server.buffer_size, cfg.server.server_lr, make_staleness(cfg.server.staleness))
    kardam = Kardam(byzantine_fraction=0.05)  # only its coefficients are used
    version, models = 0, {0: x}
    idle, inflight = list(range(n)), []

    def dispatch(now: float) -> None:
        c = idle.pop(int(rng.integers(len(idle))))
        dur = cfg.train.local_steps * cfg.clock.step_time / speed[c] * float(np.exp(rng.normal(0, cfg.clock.jitter)))
        inflight.append((now + dur, c, version))
        inflight.sort()

    for _ in range(conc):
        dispatch(0.0)
    rows, v_times = [], []
    for t in range(updates):
        now, c, bv = inflight.pop(0)
        base = models[bv]
        xc, yc = fed.partitions[c]
        set_params(model, base)
        honest = local_train(model, xc, yc, cfg.train, seed=t, device=cpu).params
        set_params(model, base)
        flipped = local_train(model, xc, flip_labels(yc, fed.num_classes), cfg.train, seed=t, device=cpu).params
        set_params(model, x)
        t0 = time.perf_counter()
        v = flat(gradient(model, xv, yv))
        v_times.append(time.perf_counter() - t0)
        g = flat(base) - flat(honest)
        g_lf = flat(base) - flat(flipped)
        z = np.random.default_rng([seed, t]).standard_normal(g.size)
        u = Update(t, c, honest, base, bv, version - bv, len(yc))
        k = kardam.check(u).score
        rows.append({
            "version": version, "staleness": version - bv,
            "vg": float(v @ g), "g": float(np.linalg.norm(g)), "v": float(np.linalg.norm(v)),
            "vg_lf": float(v @ g_lf), "g_lf": float(np.linalg.norm(g_lf)),
            "vu": float(v @ z / np.linalg.norm(z)), "lipschitz": k,
        })
        new = fb.add(x, u, version)
        if new is not None:
            x, version = new, version + 1
            models[version] = x
        idle.append(c)
        dispatch(now)
    set_params(model, x)
    acc = evaluate(model, fed.x_test, fed.y_test)[1]
    return {"seed": seed, "updates": updates, "versions": version, "final_accuracy": acc,
            "validation_gradient_ms_median": 1000 * statistics.median(v_times), "rows": rows}


def zeno_rates(rows: list[dict], rho: float, eps: float, gamma: float = 1.0) -> dict:
    vg = np.array([r["vg"] for r in rows])
    g = np.array([r["g"] for r in rows])
    vg_lf = np.array([r["vg_lf"] for r in rows])
    g_lf = np.array([r["g_lf"] for r in rows])
    vu = np.array([r["vu"] for r in rows])
    bound = -gamma * eps
    f = FACTOR
    scores = {
        "honest": gamma * vg - rho * g ** 2,
        "sign_flip": -gamma * f * vg - rho * f * f * g ** 2,
        "scale": gamma * f * vg - rho * f * f * g ** 2,
        "gaussian": -gamma * f * g * vu - rho * f * f * g ** 2,
        "label_flip": gamma * vg_lf - rho * g_lf ** 2,
    }
    return {k: float(np.mean(s < bound)) for k, s in scores.items()}


def kardam_false_rejection(rows: list[dict], f: float, window: int = 100, warmup: int = 10) -> float:
    ks = [r["lipschitz"] for r in rows if r["lipschitz"] is not None]
    rejected = 0
    for i, k in enumerate(ks):
        past = ks[max(0, i - window): i]
        if len(past) >= warmup and k > float(np.quantile(past, 1 - f)):
            rejected += 1
    return rejected / len(rows)


def norm_false_rejection(rows: list[dict], m: float, window: int = 100, warmup: int = 10) -> float:
    accepted: list[float] = []
    rejected = 0
    for r in rows:
        n = r["g"]
        if len(accepted) >= warmup and n > m * float(np.median(accepted[-window:])):
            rejected += 1
            continue
        accepted.append(n)
    return rejected / len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--updates", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    runs = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        run = replay(seed, args.updates)
        rows = run["rows"]
        early = [r for r in rows if 20 <= r["version"] < 60]
        run["zeno"] = [{"gamma": 1.0, "rho": rho, "epsilon": eps, "all": zeno_rates(rows, rho, eps),
                        "versions_20_59": zeno_rates(early, rho, eps) if early else None}
                       for rho, eps in ZENO_GRID]
        cos = np.array([r["vg"] / (r["v"] * r["g"]) for r in rows if r["v"] * r["g"] > 0])
        run["honest_cosine_with_v"] = {"q05": float(np.quantile(cos, 0.05)), "median": float(np.median(cos)),
                                       "share_negative": float(np.mean(cos < 0))}
        run["kardam_false_rejection"] = {str(f): kardam_false_rejection(rows, f) for f in KARDAM_F}
        g = np.array([r["g"] for r in rows])
        run["norm_false_rejection"] = {str(m): norm_false_rejection(rows, m) for m in NORM_M}
        run["norm_max_over_median"] = float(g.max() / np.median(g))
        run["wall_s"] = time.perf_counter() - t0
        print(f"seed {seed}: {run['versions']} versions, accuracy {run['final_accuracy']:.4f}, "
              f"{run['wall_s']:.0f} s", flush=True)
        runs.append(run)

    args.out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "rows"} for r in runs]
    (args.out / "robust_calibration.json").write_text(json.dumps({"factor": FACTOR, "runs": summary}, indent=1))
    lines = ["# robust filter calibration (clean FedBuff trajectory on the quickstart; attacks factor 10)", "",
             "zeno++ (gamma 1): share rejected, median over seeds (honest = false rejections)", "",
             "| rho | epsilon | honest | honest, versions 20-59 | sign_flip | scale | gaussian | label_flip |",
             "|---|---|---|---|---|---|---|---|"]
    for i, (rho, eps) in enumerate(ZENO_GRID):
        med = {k: statistics.median(r["zeno"][i]["all"][k] for r in runs) for k in runs[0]["zeno"][i]["all"]}
        early = statistics.median(r["zeno"][i]["versions_20_59"]["honest"] for r in runs
                                  if r["zeno"][i]["versions_20_59"] is not None) if any(
            r["zeno"][i]["versions_20_59"] for r in runs) else float("nan")
        lines.append(f"| {rho} | {eps} | {med['honest']:.3f} | {early:.3f} | {med['sign_flip']:.3f} | "
                     f"{med['scale']:.3f} | {med['gaussian']:.3f} | {med['label_flip']:.3f} |")
    lines += ["", "honest updates whose cosine with v is negative: "
              + ", ".join(f"seed {r['seed']}: {r['honest_cosine_with_v']['share_negative']:.3f}" for r in runs), "",
              "kardam false rejections by f/N: " + ", ".join(
                  f"{f}: {statistics.median(r['kardam_false_rejection'][str(f)] for r in runs):.3f}" for f in KARDAM_F),
              "", "norm false rejections by multiplier: " + ", ".join(
                  f"{m}: {statistics.median(r['norm_false_rejection'][str(m)] for r in runs):.3f}" for m in NORM_M),
              "", "validation gradient (128 samples), median ms: " + ", ".join(
                  f"{r['validation_gradient_ms_median']:.2f}" for r in runs),
              "", "runs: " + ", ".join(f"seed {r['seed']}: {r['versions']} versions, accuracy "
                                      f"{r['final_accuracy']:.4f}" for r in runs)]
    (args.out / "robust_calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
