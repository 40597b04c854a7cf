"""The store's encodings: parameter blobs and the loop's resumable state.

- :func:`pack_params` / :func:`unpack_params`: ``model_versions.parameters``,
  ``updates.pending_params`` and ``updates.filter_params`` (the hot path: raw arrays behind a
  JSON header, no copy on the way out).
- :func:`encode_params` / :func:`decode_params`: an uncompressed ``.npz`` (the ledger's and
  gossip's payloads, and blobs written before the packed format).
- :func:`dumps_state` / :func:`loads_state`: JSON for nested dicts and lists with numpy arrays
  (``runs.loop_state``, ``runs.scheduler_state``, ``runs.strategy_state``: :class:`LoopState`; no pickle).

Pure: numpy and the standard library only.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np

Params = dict[str, np.ndarray]

_PACK = b"FAP1"


def encode_params(params: Params) -> bytes:
    """Parameters as an uncompressed .npz (keys in order); exact round trip."""
    buf = io.BytesIO()
    np.savez(buf, **params)
    return buf.getvalue()


def decode_params(blob: bytes) -> Params:
    """Parameters from :func:`encode_params` (.npz) or :func:`pack_params` bytes."""
    if blob.startswith(_PACK):
        return unpack_params(blob)
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return {k: z[k].copy() for k in z.files}


def pack_params(params: Params) -> bytes:
    """The store's own format for ``model_versions.parameters`` and ``updates.pending_params``:
    ``FAP1``, a JSON header (names, dtypes, shapes), the raw arrays. Exact round trip, ~10x cheaper
    than ``.npz`` (this is on the loop's hot path); :func:`unpack_params` reads both."""
    return b"".join(pack_parts(params))


def pack_parts(params: Params) -> list:
    """:func:`pack_params` as a list of buffers (the arrays' own memory: no copy), to join or write."""
    arrays = [np.asarray(a, order="C") for a in params.values()]  # (ascontiguousarray makes 0-d arrays 1-d)
    head = json.dumps([[k, a.dtype.str, list(a.shape)] for k, a in zip(params, arrays)]).encode()
    return [_PACK, len(head).to_bytes(4, "little"), head, *(a.reshape(-1).view(np.uint8) for a in arrays)]


def unpack_params(blob: bytes) -> Params:
    if not blob.startswith(_PACK):
        return decode_params(blob)  # .npz, written before this format
    n = int.from_bytes(blob[4:8], "little")
    out, pos = {}, 8 + n
    for k, dt, shape in json.loads(blob[8:pos]):
        dtype = np.dtype(dt)
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        out[k] = np.frombuffer(blob, dtype=dtype, count=size // dtype.itemsize if dtype.itemsize else 0,
                               offset=pos).reshape(shape).copy()
        pos += size
    return out


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__nd__": base64.b64encode(encode_params({"a": obj})).decode()}
    if isinstance(obj, dict):
        return {"__dict__": [[_enc(k), _enc(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_enc(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _dec(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__nd__" in obj:
            return decode_params(base64.b64decode(obj["__nd__"]))["a"]
        if "__dict__" in obj:
            return {_dec(k): _dec(v) for k, v in obj["__dict__"]}
        return {k: _dec(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dec(v) for v in obj]
    return obj


class LoopState(str):
    """``runs.loop_state``'s text; ``scheduler_state``, when set, is a snapshot of the scheduler's
    per-client state that the store writes to ``runs.scheduler_state`` in the same transaction
    (the loop state refers to it); ``strategy_state`` likewise, the strategy's snapshot, for
    ``runs.strategy_state``."""

    scheduler_state: str | None = None
    strategy_state: str | None = None


def dumps_state(obj: Any) -> str:
    """JSON for nested dicts/lists of numbers, strings and numpy arrays (no pickle)."""
    return json.dumps(_enc(obj))


def loads_state(text: str | None) -> Any:
    return None if text is None else _dec(json.loads(text))
