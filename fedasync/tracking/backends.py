"""What :mod:`fedasync.tracking` and its live tracker (:mod:`.live`) share: the trackers a config asks
for (:func:`make_trackers`), the resolved config as parameters, a record as a line of
``metrics.jsonl``, and the fan-out to the trackers that drops one that fails."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from fedasync.config import Config
    from fedasync.tracking.records import Record

log = logging.getLogger("fedasync")


def flat_params(cfg: Config) -> dict[str, Any]:
    """The resolved config as ``{dotted.key: value}`` (lists as JSON, None as ``null``); the store
    URL and ``tracking.mlflow_uri`` with their passwords masked."""
    from fedasync.private import mask_url

    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (bool, int, float, str)):
            out[prefix] = mask_url(v) if prefix in ("store.url", "tracking.mlflow_uri") else v
        else:
            out[prefix] = json.dumps(v)
    walk("", cfg.model_dump(mode="json", by_alias=True))
    return out


def make_trackers(cfg: Config, run_dir: Path, root: Path | None = None, label: str | None = None,
                  resume: bool = False) -> list[Any]:
    """One tracker per ``cfg.tracking.backends`` for the run in ``run_dir``; ``root``: the folder of
    the MLflow store shared by ``--compare``'s runs (default ``run_dir``); ``label``: the run's name;
    ``resume``: MLflow continues the latest run of that name. A backend that cannot be made is
    logged as one warning line and left out."""
    tr = cfg.tracking
    out: list[Any] = []
    for name in tr.backends:
        try:  # one that cannot be made (an MLflow store that cannot be reached): a warning, the others go on
            if name == "tensorboard":
                from fedasync.tracking.tensorboard import TensorBoardTracker

                out.append(TensorBoardTracker(run_dir / "tensorboard"))
            elif name == "mlflow":
                from fedasync.tracking.mlflow import MLflowTracker

                base = Path(root or run_dir)
                uri = tr.mlflow_uri or f"sqlite:///{(base / 'mlflow.db').resolve()}"
                # a SQLite store keeps its artifacts beside it (MLflow's default: ./mlruns where the
                # command runs); a tracking server keeps its own
                local = uri.startswith("sqlite:///") and uri != "sqlite:///:memory:"
                out.append(MLflowTracker(uri, tr.experiment or cfg.name, label or cfg.server.strategy,
                                         Path(uri[len("sqlite:///"):]).parent / "mlartifacts" if local else None,
                                         resume=resume))
        except Exception as e:  # noqa: BLE001
            _Fanout._warn(name, e)
    return out


def _line(r: Record) -> str:
    """A record's scalars as one strict JSON line (a non-finite value: null)."""
    import math

    row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.scalars.items()}
    return json.dumps(row, allow_nan=False) + "\n"


class _Fanout:
    """Calls a method on every tracker still working; one that raises is logged as one warning line
    and dropped (the run's own files are written already: a tracker down must not lose the run)."""

    def __init__(self, make: Callable[[], list[Any]]):
        self.live: list[Any] = []
        try:
            self.live = list(make())
        except Exception as e:  # noqa: BLE001 - e.g. an MLflow server that cannot be reached
            self._warn("tracking", e)

    @staticmethod
    def _warn(who: str, e: BaseException) -> None:
        log.warning("tracking: %s failed: %s: %s", who, type(e).__name__, (str(e).splitlines() or [""])[0])

    def __call__(self, method: str, *args: Any) -> None:
        for t in list(self.live):
            try:
                getattr(t, method)(*args)
            except Exception as e:  # noqa: BLE001
                self._warn(type(t).__name__, e)
                self.live.remove(t)
