"""The MLflow tracker (mlflow-skinny, ``pip install fedasync[mlflow]``): one MLflow run per fedasync
run (``--compare``: one per strategy, in one experiment; a resumed run continues the MLflow run of
its name). Metrics at ``step`` = the evaluation's index (the model version is ``async/version``),
their timestamp the virtual time in milliseconds; the resolved config as params (dotted keys); the
final model (``model.npz``) as an artifact. The default tracking store is SQLite in the run
directory (``sqlite:///<run dir>/mlflow.db``) with the artifacts beside it (``mlartifacts/``)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

BATCH = 100  # MlflowClient.log_batch takes at most 100 params (and 1000 metrics) per call
MAX_VALUE = 6000  # characters of one param value


class MLflowTracker:
    """Logs one run (``run_name``) into experiment ``experiment`` of the store at ``uri``;
    ``artifacts``: the experiment's artifact folder when this tracker creates it (None: MLflow's default)."""

    def __init__(self, uri: str, experiment: str, run_name: str, artifacts: Path | None = None,
                 resume: bool = False):
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its INFO lines on creating tables
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            exp_id = self.client.create_experiment(experiment, artifact_location=artifacts.resolve().as_uri()
                                                   if artifacts is not None else None)
        self.known: dict[str, str] = {}
        old = self.client.search_runs([exp_id], filter_string=f"attributes.run_name = '{run_name}'",
                                      order_by=["attributes.start_time DESC"], max_results=1) if resume else []
        if old:  # a resumed run: its MLflow run goes on (params logged once: MLflow's cannot change)
            self.run_id, self.known = old[0].info.run_id, dict(old[0].data.params)
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_VALUE]) for k, v in params.items() if k not in self.known]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + BATCH])

    def log_step(self, step: int, time_s: float, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        ms = int(round(time_s * 1000))
        metrics = [Metric(tag, float(v), ms, step) for tag, v in scalars.items() if math.isfinite(float(v))]
        for tag, values in histograms.items():  # MLflow has no histograms: their mean and max
            if values:
                metrics.append(Metric(f"{tag}_mean", sum(values) / len(values), ms, step))
                metrics.append(Metric(f"{tag}_max", max(values), ms, step))
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_model(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def flush(self) -> None:  # each log_batch is stored at once
        pass

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
