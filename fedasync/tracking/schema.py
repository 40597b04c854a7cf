"""The ``tracking:`` section of the YAML (:class:`fedasync.config.Config` takes it from here; pydantic
only, so the schema imports nothing of the trackers)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: the trackers ``tracking.backends`` may name, and the extra that installs each
BACKENDS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


class TrackingConfig(BaseModel):
    """Where a run's metrics go besides ``metrics.jsonl`` (always written beside ``history.csv``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # tensorboard (tensorboardX: pip install fedasync[tensorboard]), mlflow (mlflow-skinny: fedasync[mlflow])
    backends: list[Literal["tensorboard", "mlflow"]] = []
    # MLflow's tracking URI; default: sqlite:///<run dir>/mlflow.db (--compare: the --out folder's)
    mlflow_uri: str | None = Field(None, min_length=1)
    experiment: str | None = Field(None, min_length=1)  # the MLflow experiment; default: the config's name
    # per-client figures (each client's epsilon, staleness, dispatches) as one histogram per version;
    # off by default: runs reach 10,000 clients
    per_client: bool = False

    @field_validator("backends")
    @classmethod
    def _once(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))  # tensorboard,tensorboard: once
