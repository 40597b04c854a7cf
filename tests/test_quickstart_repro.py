"""The quickstart comparison at a reduced horizon reproduces its pinned result file.

``benchmarks/quickstart.py --repro`` wrote ``benchmarks/results/quickstart_repro.json``; this test
reruns the same function with the same configuration (in-process, local backend) and compares
every figure: counts and model sha256s exactly, floats to 1e-9. A change that moves a published
figure must regenerate the file (``python benchmarks/quickstart.py --repro``) in the same commit.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _quickstart():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_quickstart_repro", BENCH / "quickstart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(got, pinned, where: str) -> list[str]:
    """Every difference between ``got`` and ``pinned`` (dicts/lists walked; floats to 1e-9)."""
    if isinstance(pinned, dict):
        if not isinstance(got, dict) or set(got) != set(pinned):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(pinned)}"]
        return [d for k in pinned for d in _same(got[k], pinned[k], f"{where}.{k}")]
    if isinstance(pinned, list):
        if not isinstance(got, list) or len(got) != len(pinned):
            return [f"{where}: {got!r} != {pinned!r}"]
        return [d for i, (g, p) in enumerate(zip(got, pinned)) for d in _same(g, p, f"{where}[{i}]")]
    if isinstance(pinned, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return [] if math.isclose(got, pinned, rel_tol=0, abs_tol=1e-9) else [f"{where}: {got!r} != {pinned!r}"]
    return [] if (type(got) is type(pinned) and got == pinned) else [f"{where}: {got!r} != {pinned!r}"]


def test_quickstart_repro_matches_pinned_file():
    q = _quickstart()
    pinned = json.loads((BENCH / "results" / "quickstart_repro.json").read_text())
    assert pinned["seeds"] == q.REPRO["seeds"] and pinned["horizon_s"] == q.REPRO["horizon"]
    got = json.loads(json.dumps(q.run(q.REPRO["seeds"], q.REPRO["horizon"])))
    pinned.pop("provenance")
    diffs = _same(got, pinned, "quickstart_repro")
    assert not diffs, "regenerate with `python benchmarks/quickstart.py --repro`:\n" + "\n".join(diffs)
    # the comparison is not vacuous: four different models, FedBuff's well past FedAvg's in 40 s
    seed = pinned["per_seed"]["1"]
    assert len({f["model_sha256"] for f in seed.values()}) == 4
    assert seed["fedbuff"]["best_accuracy"] > seed["fedavg"]["best_accuracy"] + 0.3


def test_same_flags_a_moved_figure():
    assert _same({"a": 1, "b": 0.5}, {"a": 1, "b": 0.5}, "x") == []
    assert _same({"a": 2, "b": 0.5}, {"a": 1, "b": 0.5}, "x") == ["x.a: 2 != 1"]
    assert _same({"a": 1, "b": 0.5 + 1e-8}, {"a": 1, "b": 0.5}, "x") != []
    assert _same({"s": "ab"}, {"s": "ac"}, "x") != []
