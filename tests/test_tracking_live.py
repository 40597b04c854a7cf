"""Live tracking (issue 35): a server run's records reach metrics.jsonl and TensorBoard while it runs,
and the files at its end are the end-of-run writer's (metrics.jsonl byte for byte, TensorBoard's and
MLflow's tags, steps and values); a resumed run appends without repeating a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")

BOTH = 'tracking.backends=["tensorboard","mlflow"]'


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: sorted((e.step, e.value, e.wall_time) for e in acc.Scalars(t)) for t in acc.Tags()["scalars"]}


def _mlflow(db: Path) -> dict[str, list[tuple[int, float, int]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {k: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, k))
            for k in run.data.metrics}


@pytest.mark.parametrize("extra", [[], ['server.strategy="fedavg"', "server.backup_workers=2"],
                                   ['server.strategy="fedavg"', "server.eval_every_s=0.3"]],
                         ids=["fedbuff", "fedavg-backups", "fedavg-grid"])
def test_records_are_logged_while_the_run_goes_and_end_as_the_end_of_run_writer(tmp_path, extra):
    import fedasync
    from fedasync.api import resolve_config
    from fedasync.tracking import track_run

    grid = any(e.startswith("server.eval_every_s") for e in extra)
    base = [s for s in SMALL if not (extra and s.startswith("server.buffer_size"))
            and not (grid and s.startswith("server.eval_every="))]
    sets = [*base, *extra, BOTH]
    live = tmp_path / "live"
    seen: list[tuple[int, int, int]] = []  # (evaluations, metrics.jsonl lines, TensorBoard eval steps) per event

    def watch(ev: dict) -> None:
        p = live / "metrics.jsonl"
        lines = len(p.read_text().splitlines()) if p.exists() else 0
        steps = len(_scalars(live / "tensorboard").get("eval/accuracy", [])) if (live / "tensorboard").exists() else 0
        seen.append((ev["evaluations"], lines, steps))

    r = fedasync.simulate(None, set=sets, backend="local", out=live, progress=watch)
    n = len(r.history)
    # while it ran: the file and TensorBoard's events grew, a few evaluations behind the loop
    grew = [lines for _, lines, _ in seen]
    assert grew == sorted(grew) and len(set(grew)) > 3 and max(grew) > n // 2
    assert max(steps for *_, steps in seen) > n // 2
    assert all(lines <= evals and steps <= evals for evals, lines, steps in seen)
    # at the end: what the end-of-run writer makes from the same summary and store
    cfg, _ = resolve_config(None, sets)
    end = tmp_path / "end"
    end.mkdir()
    track_run(end, cfg, r.summary, label=cfg.server.strategy)
    assert (live / "metrics.jsonl").read_bytes() == (end / "metrics.jsonl").read_bytes()
    assert _scalars(live / "tensorboard") == _scalars(end / "tensorboard")
    assert _mlflow(live / "mlflow.db") == _mlflow(end / "mlflow.db")
    lines = [json.loads(x) for x in (live / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(n))  # the evaluation's index, always increasing
    assert [x["async/version"] for x in lines] == [h["version"] for h in r.history]
    if grid:  # the grid evaluates a version at several grid times: the version repeats, the step does not
        assert len({h["version"] for h in r.history}) < n


def test_a_resumed_run_appends_after_what_the_first_part_logged(tmp_path):
    import fedasync

    out = tmp_path / "run"
    first = fedasync.simulate(None, set=[*SMALL, BOTH, "server.max_versions=6"], backend="local", out=out)
    n1 = len((out / "metrics.jsonl").read_text().splitlines())
    assert n1 == len(first.history)
    r = fedasync.simulate(None, set=[*SMALL, BOTH], backend="local", out=out, resume=first.summary["run_id"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(len(r.history)))  # no step twice
    assert lines[-1]["async/version"] == r.summary["versions"] == 12
    tb = _scalars(out / "tensorboard")["eval/accuracy"]
    assert [s for s, *_ in tb] == list(range(len(r.history)))
    ml = _mlflow(out / "mlflow.db")["eval/accuracy"]  # one MLflow run, continued
    assert [s for s, *_ in ml] == list(range(len(r.history)))
