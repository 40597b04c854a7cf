"""The wire format: a reply's arrays are read as views of the message bytes (``wire._view``),
exactly what ``Array.numpy()`` gives, and bytes that numpy would refuse are refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array

from fedasync.wire import _HEADERS, params_to_record, record_to_params

ARRAYS = {
    "f32": np.arange(6, dtype=np.float32).reshape(2, 3), "scalar": np.array(3.5), "empty": np.zeros((0, 4), np.int64),
    "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "big_endian": np.arange(5, dtype=">i4"),
    "bool": np.ones((2, 2), bool), "f16": np.linspace(0, 1, 7, dtype=np.float16),
}


def _raw(data: bytes, shape: tuple, dtype: str = "float32") -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def test_views_equal_what_array_numpy_gives_twice_over():
    rec = params_to_record(ARRAYS)
    for _ in range(2):  # the second time from the header cache
        got = record_to_params(rec)
        assert list(got) == list(ARRAYS)
        for k, a in ARRAYS.items():
            want = rec[k].numpy()
            assert got[k].shape == want.shape == a.shape and got[k].dtype == want.dtype, k
            assert np.array_equal(got[k], want) and not got[k].flags.writeable, k
    b = io.BytesIO()
    np.lib.format.write_array(b, np.arange(4.0), version=(2, 0))  # a version-2 header
    assert np.array_equal(record_to_params({"v2": _raw(b.getvalue(), (4,), "float64")})["v2"], np.arange(4.0))


def test_bytes_numpy_refuses_are_refused():
    good = Array(np.arange(6, dtype=np.float32)).data
    with pytest.raises(ValueError):  # truncated
        record_to_params({"t": _raw(good[:-4], (6,))})
    with pytest.raises(ValueError):  # not .npy at all
        record_to_params({"x": _raw(b"not an npy header at all", (6,))})
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }"
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    negative = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + good[-24:]
    with pytest.raises(ValueError):  # a negative dimension (frombuffer would read it as "all")
        record_to_params({"n": _raw(negative, (6,))})
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):  # object arrays need pickle: refused, as np.load refuses them
        record_to_params({"o": _raw(pickled.getvalue(), (1,), "object")})
    assert all(len(k) <= 4096 for k in _HEADERS)
