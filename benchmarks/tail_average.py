"""Tail averaging, measured after the fact: the test accuracy of the mean of a run's last N versions.

A DP run's single versions wander on the plateau with the noise of their last step; the server
can evaluate and report the mean of its last ``server.average_last`` versions instead. This
script measures, on a finished run's store, what each N would have given, without running it
again. The run must have kept the versions' parameters (``--set store.save_parameters=true
--set store.checkpoint_every=1``, as ``benchmarks/mnist.py``'s DP tries did).

    python benchmarks/tail_average.py sqlite:////tmp/dp3/row1.db --last 1 10 20 40 \\
        --out benchmarks/results/tail-row1.json

The data and model come from the run's own configuration (stored with the run): every test
example of ``data.path`` (the whole test split, not ``server.eval_samples``), normalized as the
server saw it (``data.normalize``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tail_accuracies(url: str, run_id: int, lasts: list[int]) -> dict:
    import yaml
    from mnist import full_test_set  # the test images as benchmarks/mnist.py's full-test figure sees them

    from fedasync.config import config_from_dict
    from fedasync.server.params import params_mean
    from fedasync.store import Store
    from fedasync.task.models import set_params
    from fedasync.task.train import evaluate

    store = Store(url)
    try:
        cfg = config_from_dict(yaml.safe_load(store.get_run(run_id).config_yaml))
        model, x_test, y_test = full_test_set(cfg)
        if x_test is None:
            raise SystemExit(f"{cfg.data.path} has no test split to evaluate on")
        held = set(store.versions_with_parameters(run_id))
        last, _ = store.load_version(run_id)
        missing = [v for v in range(last - max(lasts) + 1, last + 1) if v not in held]
        if missing:
            raise SystemExit(f"run {run_id} kept no parameters for versions {missing[:5]}...: "
                             "run it with store.save_parameters=true and store.checkpoint_every=1")
        # each version loaded once, for every N (the largest N's versions include the others')
        params = {v: store.load_version(run_id, v)[1] for v in range(last - max(lasts) + 1, last + 1)}
        rows = []
        for n in lasts:
            want = list(range(last - n + 1, last + 1))
            set_params(model, params_mean([params[v] for v in want]))
            acc = float(evaluate(model, x_test, y_test)[1])
            rows.append({"last": n, "versions": [want[0], want[-1]], "accuracy_full_test": round(acc, 4)})
            print(f"[tail] run {run_id}: mean of the last {n} versions ({want[0]}-{want[-1]}): "
                  f"{acc:.4f} on {len(y_test)} test examples", flush=True)
        return {"store": url, "run_id": run_id, "last_version": last, "test_examples": int(len(y_test)),
                "rows": rows}
    finally:
        store.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", help="the run's store URL (sqlite:////path/run.db)")
    ap.add_argument("--run-id", type=int, default=1)
    ap.add_argument("--last", type=int, nargs="+", default=[1, 10, 20, 40])
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.last):
        ap.error("--last takes counts of versions >= 1")
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = tail_accuracies(args.store, args.run_id, args.last)
    out["command"] = "python benchmarks/tail_average.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
