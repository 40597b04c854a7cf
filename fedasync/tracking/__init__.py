"""Experiment tracking: what a run reports beyond ``history.csv`` and ``summary.json``.

Every run writes ``metrics.jsonl`` beside ``history.csv``: one JSON object per evaluation (``step``
= the model version, ``virtual_time_s``, ``eval/<metric>`` for every metric of the evaluation, and
the asynchronous, privacy and participation figures of :mod:`fedasync.tracking.records`).
``tracking.backends`` (``--track tensorboard,mlflow``) sends the same records to TensorBoard
(:mod:`.tensorboard`) and MLflow (:mod:`.mlflow`), with the resolved config as parameters and, in
MLflow, the final model as an artifact. A backend is imported only when asked for;
:func:`check_backends` says in one line which extra to install, before a run starts.

A server run's records are logged while it runs (:mod:`.live`: its progress callback reads the
history and the store's new rows), the rest when it ends; otherwise (ledger, gossip, a run without a
live tracker) all of them when it ends, from its history and its store. Tracking never touches the
loop: a run's model and history are the same with or without it.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

if TYPE_CHECKING:
    from fedasync.config import Config
    from fedasync.tracking.records import Record

from fedasync.tracking.backends import _Fanout, _line, flat_params, make_trackers  # noqa: F401 (re-exported)

log = logging.getLogger("fedasync")

#: backend -> (the module it imports, the package and the fedasync extra that install it)
NEEDS = {"tensorboard": ("tensorboardX", "tensorboardX", "tensorboard"),
         "mlflow": ("mlflow", "mlflow-skinny", "mlflow")}


class TrackingError(ValueError):
    """A tracker asked for that cannot be used: one line naming the extra that installs it."""


class Tracker(Protocol):
    """What a backend does with a run: its config, one call per record, the final model, done."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_step(self, step: int, time_s: float, scalars: dict[str, float],
                 histograms: dict[str, list[float]]) -> None: ...

    def log_model(self, path: Path) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def check_backends(backends: Iterable[str], opt: str = "tracking.backends") -> None:
    """Import each backend's package; TrackingError (one line: ``pip install fedasync[<extra>]``)
    for the first that is not installed or does not import."""
    for name in backends:
        module, package, extra = NEEDS[name]
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a broken install
            why = "is not installed" if isinstance(e, ImportError) else f"does not import ({type(e).__name__})"
            raise TrackingError(f"{opt}: {name} needs {package}, which {why}: pip install 'fedasync[{extra}]'") \
                from None


def parse_track(spec: str | None) -> list[str]:
    """``--track tensorboard,mlflow`` as ``--set`` strings (empty when not given); an unknown name is a
    TrackingError naming ``--track``."""
    if spec is None:
        return []
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in NEEDS]
    if bad or not names:
        raise TrackingError(f"--track: {', '.join(bad) or repr(spec)} is not one of {', '.join(NEEDS)}")
    return [f"tracking.backends={json.dumps(names)}"]


def stream(run_dir: Path, cfg: Config, recs: Iterable[Record], make: Callable[[], list[Tracker]],
           last: Callable[[dict], None] | None = None, model: Callable[[], Path | None] | None = None) -> None:
    """Write ``metrics.jsonl`` (0600) and send each record to the trackers ``make()`` builds (none
    when ``tracking.backends`` is empty), one record at a time: a run of 10,000 clients never holds
    every version's per-client histograms at once. ``last(scalars)`` adds to the last record;
    ``model()``: the final model's file, for the trackers that keep artifacts."""
    from fedasync.private import open_private

    fan = _Fanout(make if cfg.tracking.backends else list)
    if fan.live:
        fan("log_params", flat_params(cfg))

    def emit(r: Record, f) -> None:
        f.write(_line(r))
        scalars = {k: v for k, v in r.scalars.items() if k not in ("step", "virtual_time_s") and v is not None}
        fan("log_step", r.step, r.time, scalars, r.histograms)

    with open_private(run_dir / "metrics.jsonl", "w") as f:
        prev = None
        for r in recs:
            if prev is not None:
                emit(prev, f)
            prev = r
        if prev is not None:
            if last is not None:
                last(prev.scalars)
            emit(prev, f)
    if fan.live:
        path = model() if model is not None else None
        if path is not None:
            fan("log_model", path)
        fan("close")


def _summary_figures(summary: dict) -> Callable[[dict], None]:
    """What the last record gets from a server run's summary: the filter's figures (``robust/*``)
    and a central ε (``privacy/epsilon_max`` when the records have none)."""
    import math

    def add(last: dict) -> None:
        for k, v in sorted((summary.get("robust") or {}).items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                last[f"robust/{k}"] = v
        eps = (summary.get("privacy") or {}).get("epsilon_max")
        if "privacy/epsilon_max" not in last and isinstance(eps, (int, float)) and math.isfinite(eps):
            last["privacy/epsilon_max"] = eps
    return add


def track_run(run_dir: Path, cfg: Config, summary: dict, root: Path | None = None, label: str | None = None) -> None:
    """``metrics.jsonl`` of a server run (simulated or deployed) from its summary and store, and
    the same records to ``cfg.tracking.backends`` (the final model as ``model.npz`` for MLflow).
    When the run had a live tracker (:mod:`.live`) that one logs what is left and closes; else
    (or when it stopped on an error) every record is made here."""
    import numpy as np

    from fedasync.private import open_private
    from fedasync.store import Store
    from fedasync.tracking.live import live_for
    from fedasync.tracking.records import records

    st = Store(summary["store_url"])
    try:
        run_id = summary["run_id"]

        def model() -> Path | None:
            if "mlflow" not in cfg.tracking.backends:
                return None
            try:
                params = st.load_version(run_id)[1]
            except KeyError:  # store.save_parameters: false
                return None
            path = run_dir / "model.npz"
            with open_private(path, "wb") as f:
                np.savez(f, **params)
            return path

        live = live_for(run_dir)
        if live is not None and live.finish(summary, _summary_figures(summary), model):
            return
        recs = records(summary["history"], st.updates(run_id), st.dispatches(run_id), cfg.data.num_clients,
                       local_dp=cfg.privacy.local_dp.enabled, per_client=cfg.tracking.per_client)
        stream(run_dir, cfg, recs, lambda: make_trackers(cfg, run_dir, root, label), _summary_figures(summary), model)
    finally:
        st.close()


def track_serverless(run_dir: Path, cfg: Config, summary: dict) -> None:
    """``metrics.jsonl`` of a ledger or gossip run (:func:`fedasync.tracking.records.serverless_records`)
    and the same records to ``cfg.tracking.backends`` (no model artifact: its summary names the
    model by sha256, and the store holds it)."""
    from fedasync.tracking.records import serverless_records

    stream(run_dir, cfg, serverless_records(summary),
           lambda: make_trackers(cfg, run_dir, label=summary.get("strategy")))
