"""A run's summary (``summary.json``, the CLI's table): counts, times, the task's metrics, staleness;
and its progress events."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from fedasync.server.strategies import params_sha256

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def progress_event(srv: AsyncServer) -> dict:
    """What the loop reports after each reply (the CLI's progress bar, the deployment log)."""
    last = srv.history[-1] if srv.history else {}
    return {
        "version": srv.version, "virtual_time_s": srv.clock.now, "accuracy": last.get("accuracy"),
        "metrics": metrics_of(last),
        "updates": srv.received, "accepted": srv.accepted, "live": len(srv.live),
        "max_versions": srv.cfg.server.max_versions, "max_virtual_time": srv.cfg.server.max_virtual_time,
        "epsilon_max": srv.privacy.epsilon_max if srv.privacy is not None else None,
        "exhausted": len(srv.exhausted), "evaluations": len(srv.history),
    }


def metrics_of(row: dict) -> dict:
    """The metrics of a history row (every key but ``version`` and ``virtual_time_s``)."""
    return {k: v for k, v in row.items() if k not in ("version", "virtual_time_s")}


def build_summary(srv: AsyncServer) -> dict:
    """The summary of ``srv``'s run as it stands. ``final_metrics``: the last evaluation's metrics
    (every one the task reports); ``target``: ``server.target`` (or ``target_accuracy`` as
    ``{accuracy, v, max}``); ``final_accuracy``/``best_accuracy`` when the task reports accuracy."""
    cfg = srv.cfg
    accs = [h["accuracy"] for h in srv.history if h.get("accuracy") is not None]
    goal = cfg.server.goal()
    st = srv.staleness
    return {
        "run_id": srv.run_id,
        "name": cfg.name,
        "strategy": cfg.server.strategy,
        "seed": cfg.seed,
        "num_clients": cfg.data.num_clients,
        "concurrency": cfg.server.concurrency,
        "backup_workers": cfg.server.backup_workers if cfg.server.strategy == "fedavg" else None,
        "versions": srv.version,
        "updates_received": srv.received,
        "updates_accepted": srv.accepted,
        "updates_rejected": srv.received - srv.accepted,
        "rejections": dict(sorted(srv.rejections.items())),
        "tasks_failed": srv.failed,
        "replays_rejected": srv.replays,
        "virtual_time_s": round(srv.clock.now, 6),
        "wall_time_s": round(time.time() - srv.t_wall0, 3),
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "final_metrics": metrics_of(srv.history[-1]) if srv.history else {},
        "target": goal.model_dump() if goal is not None else None,
        "target_accuracy": cfg.server.target_accuracy,
        # the first evaluation from which the target held target_hold evaluations in a row (evaluation.py)
        "time_to_target_s": None if srv.time_to_target is None else round(srv.time_to_target, 6),
        "target_hold": cfg.server.target_hold,
        "eval_every_s": cfg.server.eval_every_s,  # the evaluation grid (None: every eval_every versions)
        "staleness": {
            "mean": float(np.mean(st)) if st else None,
            "p50": percentile(st, 50), "p95": percentile(st, 95),
            "max": int(max(st)) if st else None,
        },
        "model_sha256": params_sha256(srv.params),
        "store_url": srv.store.url,
        "stop_reason": srv.stop_reason,
        "history": srv.history,
        **({"privacy": srv.privacy.summary()} if srv.privacy is not None else {}),
        # participation (dispatches per client, Jain's index) and robust figures, from the store
        **srv.policy.summary([d.client_id for d in srv.store.dispatches(srv.run_id)], srv.store.updates(srv.run_id)),
    }
