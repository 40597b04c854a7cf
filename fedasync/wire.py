"""The wire format: how a task and its reply travel in Flower records.

A task is ``{"params": ArrayRecord, "task": ConfigRecord{"json": ...}}``; a reply is
``{"params": ArrayRecord (absent when refused), "result": ConfigRecord{"json": ..., "signature": bytes}}``.
Config and metrics travel as JSON because ConfigRecord cannot hold ``None`` or nested maps.
"""

from __future__ import annotations

import io
import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

Params = dict[str, np.ndarray]


def params_to_record(params: Params) -> ArrayRecord:
    # np.asarray, not np.ascontiguousarray: that one makes a 0-d array 1-d
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in params.items()})


def record_to_params(rec: ArrayRecord) -> Params:
    """The arrays of ``rec``, read-only views of the message's bytes (no copy: a big model's
    reply is decoded in a fraction of ``Array.numpy()``'s time)."""
    return {k: _view(rec[k]) for k in rec.keys()}


def _view(a: Array) -> np.ndarray:
    """``a.numpy()`` without the copy: the .npy header parsed, the data viewed in place."""
    data = a.data
    if a.stype != "numpy.ndarray" or not isinstance(data, bytes):
        return a.numpy()
    # the header (magic, version, length, a dict literal) repeats from reply to reply: parsed
    # once (numpy parses it with ast.literal_eval, ~0.1 ms each)
    head = data[:12]
    if head[6:7] == b"\x01":  # version 1: a 2-byte header length, else 4
        n = int.from_bytes(head[8:10], "little") + 10
    else:
        n = int.from_bytes(head[8:12], "little") + 12
    key = data[:n]
    parsed = _HEADERS.get(key)
    if parsed is None:
        bio = io.BytesIO(data)
        try:
            fmt = np.lib.format
            major, _ = fmt.read_magic(bio)
            read_header = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
            shape, fortran, dtype = read_header(bio)
        except ValueError:
            return a.numpy()  # let numpy say what is wrong
        if dtype.hasobject or bio.tell() != n or any(d < 0 for d in shape):
            return a.numpy()  # refused there (allow_pickle=False), or a header numpy reads otherwise
        parsed = (shape, fortran, dtype, int(np.prod(shape, dtype=np.int64)))
        if len(_HEADERS) < 4096 and n <= 4096:  # replies are untrusted: a bounded cache of short headers
            _HEADERS[key] = parsed
    shape, fortran, dtype, count = parsed
    if len(data) - n < count * dtype.itemsize:
        return a.numpy()  # truncated: numpy's error
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=n)
    return arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)


#: .npy header bytes -> (shape, fortran order, dtype, element count); see _view
_HEADERS: dict[bytes, tuple] = {}


def task_content(params: Params | ArrayRecord, config: dict) -> RecordDict:
    """A task: the model (parameters, or their record already built) and the task's config."""
    rec = params if isinstance(params, ArrayRecord) else params_to_record(params)
    return RecordDict({"params": rec, "task": ConfigRecord({"json": json.dumps(config)})})


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
