"""``data.dataset: files``: a data set from local files (no network).

``data.path`` is one of

* an ``.npz`` with ``x_train, y_train, x_test, y_test``, or ``x, y`` (the test set is then a
  stratified ``data.test_fraction`` split); for ``natural`` partitioning, the group ids are the
  array ``<partition_column>_train`` (or ``<partition_column>`` next to ``x, y``);
* a folder of parquet or CSV files: a file whose name (or folder) starts with ``train`` is in the
  training split, ``test`` in the test split (Hugging Face's ``data/train-00000-of-00001.parquet``
  layout works); with no such names every file is training data, split by ``data.test_fraction``;
* a folder written by ``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (splits
  ``train`` and optionally ``test``).

Columns: ``data.label_column`` (default ``label``) and ``data.feature_column`` (default: the first
of image/img/pixel_values/x/features; a table with none of them - a CSV of pixel columns - uses every
other numeric column as one flat vector).  Images may be 2-D, 3-D or flat; ``data.shape`` reshapes
flat samples (``[28, 28]``).  Features stored as integers in 0-255 (pixels) are scaled to [0, 1]:
decided once from the training split (integer dtype, values in 0-255, largest above 1) and then
applied alike to the test split (see :func:`pixel_scale`).

Every problem raises :class:`ValueError` with one line starting with the key it concerns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedasync.config import DataConfig

log = logging.getLogger(__name__)

FEATURE_COLUMNS = ("image", "img", "pixel_values", "x", "features")


@dataclass
class RawData:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None = None  # None: split off the training data by data.test_fraction
    y_test: np.ndarray | None = None
    groups: np.ndarray | None = None  # per training sample: data.partition_column (natural partitioning)


# -- columns to arrays -----------------------------------------------------------------------


def _stack(values, key: str, where: str) -> np.ndarray:
    """An (n, ...) array from a column; ragged samples raise naming ``key``."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values
    items = [np.asarray(v) for v in values]
    if not items:
        raise ValueError(f"data.path: {where}: holds no samples")
    shapes = {a.shape for a in items}
    if len(shapes) > 1:
        raise ValueError(f"{key}: {where}: ragged samples, shapes {sorted(shapes)[:3]} differ "
                         "(every sample must have the same shape)")
    try:
        return np.stack(items)
    except (ValueError, TypeError) as err:  # pragma: no cover - shapes agree
        raise ValueError(f"{key}: {where}: cannot stack samples ({err})") from None


def as_labels(y, where: str, key: str = "data.label_column") -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"{key}: {where}: labels must be one integer per sample, got shape {y.shape}")
    if np.issubdtype(y.dtype, np.integer):
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0):
        return y.astype(np.int64)
    raise ValueError(f"{key}: {where}: labels must be integers, got dtype {y.dtype}")


def pixel_scale(*xs: np.ndarray) -> bool:
    """Whether features are pixel integers to divide by 255: an integer dtype, every value in 0-255
    and the largest above 1 (0/1 integers stay as they are).  Decided once, on the training data
    (all of ``xs`` together), and applied to every split (and, for a device, to its own file, which
    is its training data)."""
    xs = tuple(np.asarray(x) for x in xs if np.asarray(x).size)
    if not xs or not all(np.issubdtype(x.dtype, np.integer) for x in xs):
        return False
    lo, hi = min(int(x.min()) for x in xs), max(int(x.max()) for x in xs)
    return lo >= 0 and 1 < hi <= 255


def as_features(x: np.ndarray, cfg: DataConfig, where: str, scale: bool | None = None) -> np.ndarray:
    """float32 samples, reshaped to ``data.shape`` when given, divided by 255 when ``scale`` (None:
    :func:`pixel_scale` of ``x`` itself: pass the training split's decision for the other splits)."""
    return _features(x, cfg, where, scale)[0]


def _features(x: np.ndarray, cfg: DataConfig, where: str, scale: bool | None) -> tuple[np.ndarray, bool]:
    key = "data.feature_column"
    if x.dtype == object:
        x = _stack(list(x), key, where)
    if x.ndim < 2 and cfg.shape is None:
        x = x.reshape(len(x), 1)
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
        raise ValueError(f"{key}: {where}: features must be numeric, got dtype {x.dtype}")
    if cfg.shape is not None:
        size = math.prod(x.shape[1:])
        if math.prod(cfg.shape) != size:
            raise ValueError(f"data.shape: {list(cfg.shape)} holds {math.prod(cfg.shape)} values, "
                             f"but the samples of {where} have {size} ({tuple(x.shape[1:])})")
        x = x.reshape(len(x), *cfg.shape)
    if scale is None:
        scale = pixel_scale(x)
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{key}: {where}: features hold NaN or infinite values")
    return (x / np.float32(255.0) if scale else x), scale


def check_groups(groups: np.ndarray, where: str) -> np.ndarray:
    """``data.partition_column``'s values, one per training sample; missing ones (NaN, null) raise."""
    groups = np.asarray(groups)
    if np.issubdtype(groups.dtype, np.floating):
        missing = int(np.isnan(groups).sum())
    elif groups.dtype == object:
        missing = sum(v is None or (isinstance(v, float) and math.isnan(v)) for v in groups.ravel())
    else:
        missing = 0
    if missing:
        raise ValueError(f"data.partition_column: {missing} samples have no value ({where}; every training "
                         "sample needs its group id for natural partitioning)")
    return groups


def _feature_column(cfg: DataConfig, columns: list[str], where: str) -> str | list[str]:
    rest = [c for c in columns if c not in (cfg.label_column, cfg.partition_column)]
    if cfg.feature_column is not None:
        if cfg.feature_column not in columns:
            raise ValueError(f"data.feature_column: {where} has no column {cfg.feature_column!r} (has {columns})")
        return cfg.feature_column
    for c in FEATURE_COLUMNS:
        if c in rest:
            return c
    if not rest:
        raise ValueError(f"data.feature_column: {where} has no feature column besides the label (has {columns})")
    return rest  # a table of scalar columns (a CSV of pixels): all of them, one flat vector


Ref = tuple[str | list[str], bool]  # (feature column or columns, pixel scaling): the training split decided


def feature_array(npds, feat: str | list[str], where: str) -> np.ndarray:
    """The samples of a numpy-formatted ``datasets.Dataset``: one column (stacked when ragged or
    nested), or several scalar columns side by side."""
    if isinstance(feat, list):
        return np.stack([np.asarray(npds[c]) for c in feat], axis=1)
    x = npds[feat]
    if not isinstance(x, np.ndarray) or x.dtype == object:
        x = _stack(list(x), "data.feature_column", where)
    return np.asarray(x)


def _from_dataset(ds, cfg: DataConfig, where: str,
                  ref: Ref | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, Ref]:
    """(x, y, groups, ref) from an in-memory or on-disk ``datasets.Dataset``.  ``ref`` None: this
    is the training split, which decides the feature columns and the pixel scaling (returned as
    ``ref``); a test split is read with the training split's ``ref``: its feature columns are picked
    by name, it gets the same scaling, and it needs no ``data.partition_column``."""
    cols = list(ds.column_names)
    if cfg.label_column not in cols:
        raise ValueError(f"data.label_column: {where} has no column {cfg.label_column!r} (has {cols})")
    if ref is None and cfg.partition_column is not None and cfg.partition_column not in cols:
        raise ValueError(f"data.partition_column: {where} has no column {cfg.partition_column!r} (has {cols})")
    if ref is None:
        feat = _feature_column(cfg, cols, where)
    else:
        feat = ref[0]
        missing = [c for c in ([feat] if isinstance(feat, str) else feat) if c not in cols]
        if missing:
            raise ValueError(f"data.feature_column: {where} has no column {missing[0]!r} (a feature column of "
                             f"the training split; {len(missing)} missing)")
    if len(ds) == 0:
        raise ValueError(f"data.path: {where}: holds no samples")
    npds = ds.with_format("numpy")
    x = feature_array(npds, feat, where)
    y = as_labels(npds[cfg.label_column], where)
    groups = None
    if ref is None and cfg.partition_column is not None:
        groups = np.asarray(npds[cfg.partition_column])
        if cfg.partitioner == "natural":
            groups = check_groups(groups, where)
    x, scaled = _features(np.asarray(x), cfg, where, None if ref is None else ref[1])
    return x, y, groups, (feat, scaled)


# -- the three layouts -----------------------------------------------------------------------


def _load_npz(p: Path, cfg: DataConfig) -> RawData:
    try:
        with np.load(p, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as err:
        raise ValueError(f"data.path: {p}: not a readable .npz file ({type(err).__name__}: {err})") from None
    names = sorted(arrays)
    for key, value, fits in (("label_column", cfg.label_column, ("label", "y")),
                             ("feature_column", cfg.feature_column, (None, "x"))):
        if value not in fits:
            raise ValueError(f"data.{key}: {value!r} does not apply to an .npz ({p.name}): its arrays are "
                             f"x_train, y_train, x_test, y_test (or x, y), has {names}; leave data.{key} unset")
    pc = cfg.partition_column
    if {"x_train", "y_train"} <= arrays.keys():
        has_test = {"x_test", "y_test"} <= arrays.keys()
        parts = [("x_train", "y_train")] + ([("x_test", "y_test")] if has_test else [])
        gkey = f"{pc}_train" if pc is not None else None
    elif {"x", "y"} <= arrays.keys():
        parts, gkey = [("x", "y")], pc
    else:
        raise ValueError(f"data.path: {p}: needs arrays x_train, y_train, x_test, y_test (or x, y); has {names}")
    out, scale = [], None  # the training split (first) decides the pixel scaling for both
    for xk, yk in parts:
        where = f"{p.name}[{xk}]"
        if yk not in arrays:  # pragma: no cover - checked above
            raise ValueError(f"data.label_column: {p}: no array {yk}")
        x, y = arrays[xk], as_labels(arrays[yk], f"{p.name}[{yk}]")
        if len(x) != len(y):
            raise ValueError(f"data.path: {p}: {xk} has {len(x)} samples but {yk} has {len(y)}")
        if len(y) == 0:
            raise ValueError(f"data.path: {where}: holds no samples")
        x, scale = _features(x, cfg, where, scale)
        out.append((x, y))
    groups = None
    if pc is not None:
        if gkey not in arrays:
            raise ValueError(f"data.partition_column: {p} has no array {gkey!r} (has {names})")
        groups = np.asarray(arrays[gkey])
        if cfg.partitioner == "natural":
            groups = check_groups(groups, f"{p.name}[{gkey}]")
        if len(groups) != len(out[0][1]):
            raise ValueError(f"data.partition_column: {p}[{gkey}] has {len(groups)} values for {len(out[0][1])} samples")
    (x_tr, y_tr), test = out[0], (out[1] if len(out) > 1 else (None, None))
    return RawData(x_tr, y_tr, test[0], test[1], groups)


def _split_of(rel: Path) -> str | None:
    for part in rel.parts:
        name = part.lower()
        if name.startswith("train"):
            return "train"
        if name.startswith("test"):
            return "test"
    return None


def _read_table(files: list[Path], kind: str, root: Path):
    import datasets

    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.concat_tables([pq.read_table(f) for f in files])
        except Exception as err:
            raise ValueError(f"data.path: {root}: cannot read the parquet files ({type(err).__name__}: {err})") from None
        return datasets.Dataset(table)  # in memory; Hugging Face feature metadata (Image) is kept
    import pandas as pd

    try:
        df = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    except Exception as err:
        raise ValueError(f"data.path: {root}: cannot read the CSV files ({type(err).__name__}: {err})") from None
    return datasets.Dataset.from_pandas(df, preserve_index=False)


def _load_table_folder(p: Path, cfg: DataConfig) -> RawData:
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".parquet", ".csv"))
    if not files:
        raise ValueError(f"data.path: {p}: a folder with no .parquet or .csv files (and not a save_to_disk folder)")
    kinds = {f.suffix.lower() for f in files}
    if len(kinds) > 1:
        raise ValueError(f"data.path: {p}: mixes parquet and CSV files; keep one kind")
    kind = "parquet" if ".parquet" in kinds else "csv"
    splits: dict[str | None, list[Path]] = {}
    for f in files:
        splits.setdefault(_split_of(f.relative_to(p)), []).append(f)
    if "train" not in splits and "test" not in splits:
        train, test = splits[None], []
    elif "train" not in splits:
        raise ValueError(f"data.path: {p}: has test files but no train files")
    else:
        train, test = splits["train"], splits.get("test", [])
        if splits.get(None):
            log.warning("data.path %s: ignoring %d file(s) in neither a train nor a test split (%s)",
                        p, len(splits[None]), splits[None][0].name)
    x, y, groups, ref = _from_dataset(_read_table(train, kind, p), cfg, f"{p.name} (train)")
    if not test:
        return RawData(x, y, None, None, groups)
    xt, yt, _, _ = _from_dataset(_read_table(test, kind, p), cfg, f"{p.name} (test)", ref)
    return RawData(x, y, xt, yt, groups)


def _load_saved(p: Path, cfg: DataConfig) -> RawData:
    import datasets

    try:
        d = datasets.load_from_disk(str(p))
    except Exception as err:
        raise ValueError(f"data.path: {p}: cannot load the save_to_disk folder ({type(err).__name__}: {err})") from None
    if isinstance(d, datasets.DatasetDict):
        if "train" not in d:
            raise ValueError(f"data.path: {p}: the saved DatasetDict has no 'train' split (has {list(d)})")
        x, y, groups, ref = _from_dataset(d["train"], cfg, f"{p.name}[train]")
        if "test" not in d:
            return RawData(x, y, None, None, groups)
        xt, yt, _, _ = _from_dataset(d["test"], cfg, f"{p.name}[test]", ref)
        return RawData(x, y, xt, yt, groups)
    x, y, groups, _ = _from_dataset(d, cfg, p.name)
    return RawData(x, y, None, None, groups)


def load_files(cfg: DataConfig) -> RawData:
    """The arrays of ``data.path`` (see the module docstring), checked; ValueError names the key."""
    if not cfg.path:
        raise ValueError("data.path: needed when data.dataset is files (an .npz, or a folder of parquet/CSV "
                         "files or one written by datasets' save_to_disk)")
    p = Path(cfg.path).expanduser()
    if not p.exists():
        raise ValueError(f"data.path: {p}: no such file or folder")
    if p.is_file():
        if p.suffix.lower() != ".npz":
            raise ValueError(f"data.path: {p}: a single file must be an .npz (for parquet or CSV give their folder)")
        raw = _load_npz(p, cfg)
    elif (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():
        raw = _load_saved(p, cfg)
    else:
        raw = _load_table_folder(p, cfg)
    if raw.x_test is not None and raw.x_test.shape[1:] != raw.x_train.shape[1:]:
        raise ValueError(f"data.feature_column: {p.name}: test samples have shape {raw.x_test.shape[1:]}, "
                         f"training samples {raw.x_train.shape[1:]}")
    return raw


def num_classes_of(cfg: DataConfig, y_train: np.ndarray, y_test: np.ndarray | None) -> int:
    """``data.num_classes`` or the training labels' range; a label outside it raises."""
    n = cfg.num_classes if cfg.num_classes is not None else int(y_train.max()) + 1
    src = "data.num_classes" if cfg.num_classes is not None else "the training labels"
    for name, y in (("training", y_train), ("test", y_test)):
        if y is None or not len(y):
            continue
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"data.label_column: {name} label {bad} is outside the class range 0-{n - 1} "
                             f"(from {src}; labels must be 0..num_classes-1)")
    if n < 2:
        raise ValueError(f"data.label_column: only {n} class(es) (need at least 2)")
    return n
