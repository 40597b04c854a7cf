"""What a ledger or gossip run reports: ``summary.json``, ``history.csv`` and plots, the
ledger's evaluations of model blocks (``ledger_evals``: observations of the runner, not part of
the chain) and the overview ``fedasync ledger show`` prints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from sqlalchemy import select

from fedasync.config import Config
from fedasync.private import mask_url, open_private, private_dir, write_private
from fedasync.server.strategies import params_sha256
from fedasync.serverless.flchain import KINDS, ChainView
from fedasync.serverless.gossip import snapshot
from fedasync.serverless.runs import started_at
from fedasync.serverless.topology import neighbours, spectral_gap
from fedasync.store import Store
from fedasync.store import serverless_schema as SS


# -- outputs --------------------------------------------------------------------------------------


def stats(xs: list[float]) -> dict:
    return {
        "mean": float(np.mean(xs)) if xs else None,
        "p50": float(np.percentile(xs, 50)) if xs else None,
        "p95": float(np.percentile(xs, 95)) if xs else None,
        "max": float(max(xs)) if xs else None,
    }


def write_outputs(out: Path, cfg: Config, summary: dict, columns: list[str], extra_plot: str | None = None) -> dict:
    """summary.json, history.csv (``columns``), metrics.jsonl, accuracy.png (and ``extra_plot`` vs time), config.yaml,
    in ``out`` made 0700; the files fedasync writes itself are 0600 (the plots follow the umask,
    which the commands hold at 077: :func:`fedasync.private.private_umask`)."""
    import csv

    from fedasync.outputs import _plot

    private_dir(out)
    paths = {"summary": out / "summary.json", "history": out / "history.csv", "plot": out / "accuracy.png",
             "config": out / "config.yaml"}
    write_private(paths["summary"], json.dumps(summary, indent=2) + "\n")
    with open_private(paths["history"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in summary["history"]:
            w.writerow(row)
    clock = "virtual" if summary.get("clock") == "virtual" else "wall-clock"
    x = "time_s"
    hist = [dict(h, virtual_time_s=h[x]) for h in summary["history"]]  # _plot's x axis
    _plot({summary["strategy"]: hist}, paths["plot"], cfg.server.target_accuracy,
          f"{cfg.name}: {summary['strategy']} ({clock} time)")
    if extra_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        ax.plot([h[x] for h in summary["history"]], [h[extra_plot] for h in summary["history"]], lw=1.6)
        ax.set_xlabel(f"{clock} time (s)")
        ax.set_ylabel(extra_plot.replace("_", " "))
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)
        ax.set_title(f"{cfg.name}: {summary['strategy']}")
        fig.tight_layout()
        paths["extra"] = out / f"{extra_plot}.png"
        fig.savefig(paths["extra"])
        plt.close(fig)
    write_private(paths["config"], cfg.to_yaml())
    from fedasync.tracking import track_serverless

    track_serverless(out, cfg, summary)  # metrics.jsonl, and tracking.backends
    paths["metrics"] = out / "metrics.jsonl"
    return paths


# -- the ledger -----------------------------------------------------------------------------------


def record_eval(store: Store, run_id: int, height: int, model_index: int, loss: float, acc: float) -> None:
    with store.session() as s:
        if s.get(SS.LedgerEval, (run_id, height)) is None:
            s.add(SS.LedgerEval(run_id=run_id, height=height, model_index=model_index, accuracy=acc, loss=loss,
                                evaluated_wall=time.time()))


def chain_overview(store: Store, run_id: int) -> dict:
    """Head, counts per kind, members, per-peer contributions, rejected blocks and the evaluated
    model blocks (as a peer's :class:`ChainView` sees the chain)."""
    view = ChainView(store, run_id)
    view.refresh()
    per_peer: dict[str, dict] = {}
    members = view.members.by_peer if view.members is not None else {}
    for p, k in members.items():
        per_peer[str(p)] = {"update": 0, "aggregate": 0, "key": k[:16]}
    for b in view.accepted():
        if b.kind in ("update", "aggregate"):
            p = per_peer.setdefault(str(b.meta.get("peer")), {"update": 0, "aggregate": 0, "key": b.public_key[:16]})
            p[b.kind] += 1
    with store.session() as s:
        evals = {e.height: e for e in s.scalars(select(SS.LedgerEval).where(SS.LedgerEval.run_id == run_id))}
    models = []
    for i, h in enumerate(view.models):
        e = evals.get(h)
        b = view.blocks[h]
        models.append({"model_index": i, "height": h, "created": b.created,
                       "updates": len(b.meta.get("updates", [])),
                       "accuracy": None if e is None else e.accuracy, "loss": None if e is None else e.loss})
    kinds = {k: len(view.accepted(k)) for k in KINDS}
    head = view.head if view.blocks else None
    return {
        "run_id": run_id, "height": view.height, "head_hash": head.hash if head else None,
        "head_kind": head.kind if head else None, "counts": kinds, "pending": len(view.pending),
        "rule": view.rule.to_dict() if view.rule else None, "peers": per_peer, "models": models,
        "pinned": view.members is not None, "members": sorted(members),
        "rejected": [{"height": h, "kind": view.blocks[h].kind, "why": view.blocks[h].rejected} for h in view.rejected],
        "started": started_at(store, run_id) if view.blocks and view.blocks[0].created > 1e8 else 0.0,
    }


def ledger_summary(cfg: Config, store: Store, run_id: int, view, history: list[dict], time_to_target: float | None,
                   stop_reason: str | None, clock: str, time_s: float, wall_s: float, conflicts: int = 0,
                   privacy=None, extra: dict | None = None) -> dict:
    view.refresh()
    accs = [h["accuracy"] for h in history]
    stal = [view.staleness(h) for h in view.arrival]
    per_peer: dict[int, int] = {}
    for b in view.accepted("update"):
        per_peer[int(b.meta["peer"])] = per_peer.get(int(b.meta["peer"]), 0) + 1
    head_params = view.params(view.models[-1])
    out = {
        "run_id": run_id, "name": cfg.name, "strategy": "ledger-fedbuff", "mode": "ledger", "clock": clock,
        "seed": cfg.seed, "num_clients": cfg.data.num_clients, "num_peers": cfg.data.num_clients,
        "buffer_size": view.rule.buffer_size, "versions": view.num_aggregates, "blocks": len(view.blocks),
        "update_blocks": len(view.arrival), "aggregate_blocks": view.num_aggregates, "pending": len(view.pending),
        "rejected_blocks": len(view.rejected), "updates_per_peer": {str(k): v for k, v in sorted(per_peer.items())}, "height_conflicts": conflicts,
        "virtual_time_s": round(time_s, 6) if clock == "virtual" else None, "wall_time_s": round(wall_s, 3),
        "final_accuracy": accs[-1] if accs else None, "best_accuracy": max(accs) if accs else None,
        "target_accuracy": cfg.server.target_accuracy,
        "time_to_target_s": None if time_to_target is None else round(time_to_target, 6),
        "staleness": {k: v for k, v in stats(stal).items()},
        "model_sha256": params_sha256(head_params), "head_hash": view.head.hash, "height": view.height,
        "store_url": mask_url(store.url),
        "stop_reason": stop_reason, "history": history,
    }
    if privacy is not None:
        out["privacy"] = privacy.summary()
    if extra:
        out.update(extra)
    return out


# -- gossip -----------------------------------------------------------------------------------------


def record_gossip_metric(store: Store, run_id: int, m, time_s: float) -> None:
    """A ``gossip_metrics`` row for measurement ``m`` (:class:`fedasync.serverless.gossip.Metrics`)
    recorded again at ``time_s``: a grid time at which no averaging event changed the models."""
    with store.session() as s:
        s.add(SS.GossipMetric(run_id=run_id, events=m.events, time_s=time_s, accuracy=m.accuracy, loss=m.loss,
                              min_accuracy=m.min_accuracy, max_accuracy=m.max_accuracy,
                              consensus_distance=m.consensus_distance, recorded_wall=time.time()))


def gossip_summary(cfg: Config, store: Store, run_id: int, topology: str, degree: int, history: list[dict],
                   time_to_target: float | None, stop_reason: str | None, clock: str, time_s: float, wall_s: float,
                   last, privacy=None, extra: dict | None = None) -> dict:
    _, info = snapshot(store, run_id)
    accs = [h["accuracy"] for h in history]
    cd = [h["consensus_distance"] for h in history]
    steps = [r["steps"] for r in info]
    out = {
        "run_id": run_id, "name": cfg.name, "strategy": f"gossip-{topology}", "mode": "gossip", "clock": clock,
        "topology": topology, "degree": degree if topology == "random-k" else None,
        "step_order": cfg.gossip.step_order,
        "spectral_gap": spectral_gap(neighbours(topology, cfg.data.num_clients, cfg.seed, degree)),
        "seed": cfg.seed, "num_clients": cfg.data.num_clients, "num_peers": cfg.data.num_clients,
        "versions": history[-1]["events"] if history else 0, "averaging_events": history[-1]["events"] if history else 0,
        "steps_per_peer": {"min": min(steps), "max": max(steps), "mean": float(np.mean(steps))},
        "virtual_time_s": round(time_s, 6) if clock == "virtual" else None, "wall_time_s": round(wall_s, 3),
        "final_accuracy": accs[-1] if accs else None, "best_accuracy": max(accs) if accs else None,
        "final_min_peer_accuracy": history[-1]["min_accuracy"] if history else None,
        "final_max_peer_accuracy": history[-1]["max_accuracy"] if history else None,
        "consensus_distance": {"final": cd[-1] if cd else None, "max": max(cd) if cd else None},
        "target_accuracy": cfg.server.target_accuracy,
        "time_to_target_s": None if time_to_target is None else round(time_to_target, 6),
        "model_sha256": params_sha256(last.average) if last is not None else None,
        "peers_exhausted": sum(1 for r in info if r["exhausted"]), "store_url": mask_url(store.url),
        "stop_reason": stop_reason, "history": history,
    }
    if privacy is not None:
        out["privacy"] = privacy.summary()
        out["privacy"]["epsilon_per_peer"] = {str(r["peer"]): r["epsilon"] for r in info}
    if extra:
        out.update(extra)
    return out
