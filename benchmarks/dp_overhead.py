"""DP-SGD overhead: time per local step with and without Opacus, MLP and CNN, every grad_sample_mode.

Each measurement is one client task as fedasync runs it (``local_train`` on the digits data,
one CPU thread, the same seed): plain SGD, then DP-SGD through ``fedasync.privacy.dp.OpacusHook``
(noise multiplier 1, clipping norm 1, Poisson sampling) with ``grad_sample_mode`` hooks,
functorch, ew and ghost. The time of a task (including Opacus' ``make_private`` setup, which
a client pays once per task) is divided by its number of steps. The configurations are
interleaved over ``--repeats`` rounds and the median is reported, so a busy machine slows
all of them alike.

    python benchmarks/dp_overhead.py              # writes benchmarks/results/dp_overhead.{md,json}
    python benchmarks/dp_overhead.py --batch-size 16 --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("hooks", "functorch", "ew", "ghost")


def main(argv: list[str] | None = None) -> int:
    import torch

    from fedasync.config import DataConfig, ModelConfig, TrainConfig
    from fedasync.privacy.dp import OpacusHook
    from fedasync.task.data import load_federated
    from fedasync.task.models import build_model, init_params, num_params, set_params
    from fedasync.task.train import local_train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="local steps per timed task")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    fed = load_federated(DataConfig(dataset="digits", num_clients=1, partitioner="iid"), 0)
    x, y = fed.partitions[0]
    cfg = TrainConfig(local_steps=args.steps, batch_size=args.batch_size, lr=0.05, device="cpu")
    device = torch.device("cpu")
    models = {}
    for name in ("mlp", "cnn"):
        mcfg = ModelConfig(name=name, hidden=args.hidden)
        models[name] = (build_model(mcfg, fed.input_shape, fed.num_classes),
                        init_params(mcfg, fed.input_shape, fed.num_classes, 0))

    def task(name: str, mode: str | None, seed: int) -> float:
        model, p0 = models[name]
        set_params(model, p0)
        hook = None if mode is None else OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0,
                                                    grad_sample_mode=mode, seed=seed)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = local_train(model, x, y, cfg, seed=seed, device=device, make_private=hook)
        finally:
            if hook is not None:
                hook.close()
        dt = time.perf_counter() - t0
        assert r.steps == args.steps
        return dt / r.steps

    configs = [(name, mode) for name in models for mode in (None, *MODES)]
    for c in configs:  # warm-up (first calls build kernels and caches)
        task(*c, seed=0)
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        for c in configs:
            times[c].append(task(*c, seed=rep + 1))
        print(f"round {rep + 1}/{args.repeats} done", flush=True)

    # fixed per-task cost of the accounting: one fresh-accountant epsilon (the budget check before
    # training) for a history of 20 tasks at this batch's sample rate
    from fedasync.privacy.budgets import epsilon_of, sample_rate_for

    q = sample_rate_for(len(y), args.batch_size)
    accounting = {}
    for acc in ("rdp", "prv", "gdp"):
        ts = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            epsilon_of([(1.0, q, 20 * args.steps + rep)], 1e-5, acc)
            ts.append(time.perf_counter() - t0)
        accounting[acc] = statistics.median(ts) * 1e3

    rows = []
    for name in models:
        plain = statistics.median(times[(name, None)])
        row = {"model": name, "params": num_params(models[name][1]), "plain_ms": plain * 1e3}
        for mode in MODES:
            t = statistics.median(times[(name, mode)])
            row[f"{mode}_ms"] = t * 1e3
            row[f"{mode}_ratio"] = t / plain
        rows.append(row)

    lines = [
        f"digits, {len(y)} records, batch {args.batch_size}, {args.steps} steps per task, 1 CPU thread, "
        f"median of {args.repeats} interleaved rounds; ms per local step (ratio to plain SGD)",
        "",
        "| model | params | plain SGD | " + " | ".join(f"DP {m}" for m in MODES) + " |",
        "|---|---|---|" + "---|" * len(MODES),
    ]
    for r in rows:
        cells = [f"{r[f'{m}_ms']:.2f} ({r[f'{m}_ratio']:.1f}×)" for m in MODES]
        lines.append(f"| {r['model']} | {r['params']} | {r['plain_ms']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", f"budget check per task (ε of a fresh Opacus accountant, q={q:.4g}, {20 * args.steps} steps): "
              + ", ".join(f"{a} {ms:.1f} ms" for a, ms in accounting.items())]
    table = "\n".join(lines)
    print()
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dp_overhead.md").write_text(table + "\n")
    from provenance import provenance, write_result  # benchmarks/: on sys.path when run as a script
    write_result(out / "dp_overhead.json", {"provenance": provenance(), "args": vars(args), "rows": rows, "accounting_ms": accounting})
    print(f"\nwrote {out / 'dp_overhead.md'} and {out / 'dp_overhead.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
