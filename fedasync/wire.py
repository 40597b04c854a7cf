"""The wire format: how a task and its reply travel in Flower records.

A task is ``{"params": ArrayRecord, "task": ConfigRecord{"json": ...}}``; a reply is
``{"params": ArrayRecord (absent when refused), "result": ConfigRecord{"json": ..., "signature": bytes}}``.
Config and metrics travel as JSON because ConfigRecord cannot hold ``None`` or nested maps.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

Params = dict[str, np.ndarray]


def params_to_record(params: Params) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in params.items()})


def record_to_params(rec: ArrayRecord) -> Params:
    return {k: rec[k].numpy() for k in rec.keys()}


def task_content(params: Params, config: dict) -> RecordDict:
    return RecordDict({"params": params_to_record(params), "task": ConfigRecord({"json": json.dumps(config)})})


def reply_content(result: dict) -> RecordDict:
    """A client's result dict as a RecordDict (params, metrics/refusal as JSON, signature bytes)."""
    meta = {"metrics": result.get("metrics", {}), "refused": result.get("refused")}
    cfg: dict = {"json": json.dumps(meta)}
    if result.get("signature") is not None:
        cfg["signature"] = bytes(result["signature"])
    rd = RecordDict({"result": ConfigRecord(cfg)})
    if result.get("params") is not None:
        rd["params"] = params_to_record(result["params"])
    return rd


def content_to_result(content: RecordDict) -> dict:
    cfg = content["result"]
    meta = json.loads(cfg["json"])
    out = {"metrics": meta.get("metrics", {}), "refused": meta.get("refused")}
    if "signature" in cfg:
        out["signature"] = bytes(cfg["signature"])
    if "params" in content:
        out["params"] = record_to_params(content["params"])
    return out
