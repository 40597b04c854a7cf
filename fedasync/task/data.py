"""Federated data: load a data set, hold out a server-side test set, partition the rest.

Local data sets (no network):

* ``digits``  - scikit-learn's 8x8 digits (1797 samples), features scaled to [0, 1], shape (64,).
* ``mnist1d`` - MNIST-1D generated locally (``mnist1d.data.make_dataset``, never downloaded),
  ``cfg.mnist1d_samples`` samples, standardized, shape (40,).
* ``files``   - local files at ``cfg.path``: an .npz, a folder of parquet/CSV files or a
  ``save_to_disk`` folder (:mod:`fedasync.task.files`).
* ``hub``     - a Hugging Face data set through ``flwr_datasets.FederatedDataset`` (needs network).

The held-out test set is the data set's own test split, else a stratified split of
``cfg.test_fraction`` (seeded); ``cfg.val_fraction > 0`` then carves a seeded stratified validation
set out of the training pool (never the test set; ``FederatedData.x_val``/``y_val``, which no client
gets); the rest of the training data is split across ``cfg.num_clients`` clients by a
flwr-datasets partitioner (``IidPartitioner``, ``DirichletPartitioner``, ``ShardPartitioner`` or
``NaturalIdPartitioner``) run on an in-memory ``datasets.Dataset``.  Everything is a pure function
of ``(cfg, seed)``: the same inputs give identical arrays in any process.  Results are cached per
process; the cached arrays are read-only (copy them before changing them in place).
``cfg.normalize: [mean, std]`` maps every feature to ``(x - mean) / std`` after loading (for
clients and the server's test set alike; a device's own file too, see :func:`normalize`).
"""

from __future__ import annotations

import functools
import logging
import random
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fedasync.config import DataConfig

log = logging.getLogger(__name__)

# MNIST-1D's own generation seed: the data set itself is fixed; `seed` drives split and partition.
_MNIST1D_SEED = 42


@dataclass
class FederatedData:
    partitions: list[tuple[np.ndarray, np.ndarray]]  # per client id 0..N-1: (x float32, y int64)
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    x_val: np.ndarray | None = None  # data.val_fraction > 0: the server's validation set (no client's)
    y_val: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return len(self.partitions)

    def sizes(self) -> list[int]:
        return [len(y) for _, y in self.partitions]


# -- raw data sets ----------------------------------------------------------------------------


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    return x, y


def _load_mnist1d(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Generate MNIST-1D locally (``make_dataset``; ``get_dataset`` would try to download)."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise RuntimeError(f"data.dataset mnist1d: the mnist1d package is not importable ({err})") from None
    if num_samples < 10:
        raise ValueError(f"data.mnist1d_samples: {num_samples} is too small (need at least 10, one per class)")
    args = get_dataset_args()
    args.num_samples = int(num_samples)
    args.seed = _MNIST1D_SEED
    # make_dataset reseeds the global `random` and `numpy.random` states: put them back.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x = np.concatenate([d["x"], d["x_test"]]).astype(np.float64)
    y = np.concatenate([d["y"], d["y_test"]]).astype(np.int64)
    x = (x - x.mean()) / x.std()  # make_dataset already does this; kept so the contract is explicit
    return x.astype(np.float32), y


# -- partitioning -----------------------------------------------------------------------------


def _make_partitioner(cfg: DataConfig, seed: int, min_partition_size: int | None = None):
    from flwr_datasets.partitioner import (DirichletPartitioner, IidPartitioner, NaturalIdPartitioner,
                                           ShardPartitioner)

    if cfg.partitioner == "iid":
        return IidPartitioner(num_partitions=cfg.num_clients)
    label = cfg.label_column if cfg.dataset == "hub" else "label"  # hub: the data set's own column
    if cfg.partitioner == "shard":
        return ShardPartitioner(num_partitions=cfg.num_clients, partition_by=label,
                                num_shards_per_partition=cfg.shards_per_client, shuffle=True, seed=seed)
    if cfg.partitioner == "natural":
        return NaturalIdPartitioner(partition_by="group" if cfg.dataset != "hub" else str(cfg.partition_column))
    return DirichletPartitioner(
        num_partitions=cfg.num_clients,
        partition_by=label,
        alpha=cfg.alpha,
        min_partition_size=cfg.min_partition_size if min_partition_size is None else min_partition_size,
        self_balancing=True,
        seed=seed,
    )


def _partition_indices(partitioner, num_clients: int) -> list[np.ndarray]:
    out = []
    for i in range(num_clients):
        part = partitioner.load_partition(i)
        out.append(np.asarray(part[:]["idx"], dtype=np.int64))
    return out


def _repair_min_size(parts: list[np.ndarray], min_size: int) -> list[np.ndarray]:
    """Deterministically move samples from the largest clients to those below ``min_size``."""
    lists = [list(p) for p in parts]
    for i in range(len(lists)):
        while len(lists[i]) < min_size:
            donor = max(range(len(lists)), key=lambda j: (len(lists[j]), -j))
            if len(lists[donor]) <= min_size:  # pragma: no cover - excluded by the size check
                raise ValueError("cannot satisfy min_partition_size")
            lists[i].append(lists[donor].pop())
    return [np.asarray(p, dtype=np.int64) for p in lists]


def _warn_dropped(cfg: DataConfig, n: int, parts: list[np.ndarray]) -> None:
    """``shard``: flwr-datasets' ShardPartitioner cuts ``num_clients * shards_per_client`` shards of
    ``n // (num_clients * shards_per_client)`` samples and leaves the rest out (its
    ``keep_incomplete_shard`` does not change that when the number of shards per client is given):
    say how many, once."""
    used = sum(len(p) for p in parts)
    if used < n:
        shards = cfg.num_clients * cfg.shards_per_client
        log.warning("data.partitioner: shard leaves %d of %d training samples (%.0f%%) unused: %d clients x %d "
                    "shards of %d samples (fewer clients or shards_per_client use more of them)", n - used, n,
                    100 * (n - used) / n, cfg.num_clients, cfg.shards_per_client, n // shards)


def partition_labels(cfg: DataConfig, seed: int, labels: np.ndarray,
                     groups: np.ndarray | None = None) -> list[np.ndarray]:
    """Indices into ``labels`` for each client, from a flwr-datasets partitioner.

    ``natural``: one client per distinct value of ``groups`` (``data.partition_column``), in sorted
    order; fewer groups than clients is an error, more leave the groups after the first
    ``num_clients`` unused.  ``shard``: sorted by label, cut into ``num_clients * shards_per_client``
    shards, each client gets ``shards_per_client`` of them (seeded).

    Dirichlet: flwr-datasets resamples up to 10 times when a client falls below
    ``min_partition_size`` and then raises.  On that failure we sample once more with no
    minimum and move samples from the largest clients to the small ones (logged as a warning),
    so a feasible config always succeeds.
    """
    import datasets

    n = len(labels)
    need = cfg.num_clients * (cfg.min_partition_size if cfg.partitioner == "dirichlet" else 1)
    if need > n:
        raise ValueError(
            f"data.num_clients: {cfg.num_clients} clients need at least {need} training samples "
            f"(min_partition_size {cfg.min_partition_size if cfg.partitioner == 'dirichlet' else 1}), "
            f"but only {n} are left after the test split"
        )
    columns = {"idx": np.arange(n, dtype=np.int64), "label": labels}
    if cfg.partitioner == "natural":
        if groups is None:
            raise ValueError(f"data.partitioner: natural needs data.dataset files with data.partition_column "
                             f"(not {cfg.dataset})")
        distinct = len(np.unique(groups))
        if distinct < cfg.num_clients:
            raise ValueError(f"data.partition_column: {cfg.partition_column!r} has {distinct} distinct values in "
                             f"the training data, fewer than data.num_clients ({cfg.num_clients})")
        if distinct > cfg.num_clients:
            log.info("data.partition_column: %d groups, the first %d (sorted) become clients", distinct,
                     cfg.num_clients)
        columns["group"] = groups
    if cfg.partitioner == "shard" and n // (cfg.num_clients * cfg.shards_per_client) < 1:
        raise ValueError(f"data.shards_per_client: {cfg.num_clients} clients x {cfg.shards_per_client} shards "
                         f"need at least that many training samples, only {n} are left")
    ds = datasets.Dataset.from_dict(columns)
    partitioner = _make_partitioner(cfg, seed)
    partitioner.dataset = ds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parts = _partition_indices(partitioner, cfg.num_clients)
        except ValueError as err:
            if cfg.partitioner != "dirichlet":
                raise
            log.warning(
                "DirichletPartitioner could not give every client >= %d samples (%s); "
                "resampling without a minimum and topping small clients up from the largest ones",
                cfg.min_partition_size,
                err,
            )
            partitioner = _make_partitioner(cfg, seed, min_partition_size=0)
            partitioner.dataset = ds
            parts = _repair_min_size(_partition_indices(partitioner, cfg.num_clients), cfg.min_partition_size)
    if cfg.partitioner == "shard":
        _warn_dropped(cfg, n, parts)
    retries = sum("min_partition_size" in str(w.message) for w in caught)
    if retries:
        log.debug("DirichletPartitioner resampled %d time(s) to satisfy min_partition_size", retries)
    for w in caught:
        if "min_partition_size" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return parts


# -- the public loaders -----------------------------------------------------------------------


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def stratified_split(y: np.ndarray, test_fraction: float, seed: int,
                     key: str = "data.test_fraction") -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified (train_idx, test_idx), both shuffled; ``ceil(test_fraction * n)`` test samples.
    ``key`` names the setting in the error a split that cannot be stratified raises."""
    from sklearn.model_selection import train_test_split

    try:
        train_idx, test_idx = train_test_split(
            np.arange(len(y)), test_size=test_fraction, random_state=seed, stratify=y, shuffle=True
        )
    except ValueError as err:
        raise ValueError(f"{key}: cannot split {len(y)} samples stratified ({err})") from None
    return np.asarray(train_idx, dtype=np.int64), np.asarray(test_idx, dtype=np.int64)


def subsample_test(y: np.ndarray, k: int, num_classes: int, seed: int) -> np.ndarray:
    """``data.test_samples``: indices of exactly ``k`` of the test samples ``y`` (``k < len(y)``),
    seeded: stratified by label when that is possible (sklearn's ``train_test_split`` with the
    count ``k``), else (fewer samples than classes, a class with a single sample, ``k`` close to
    ``len(y)``) a seeded random pick."""
    from sklearn.model_selection import train_test_split

    if k >= num_classes:
        try:
            return np.asarray(train_test_split(np.arange(len(y)), test_size=int(k), random_state=seed,
                                               stratify=y, shuffle=True)[1], dtype=np.int64)
        except ValueError as err:
            log.info("data.test_samples: %d of %d test samples cannot be stratified (%s); picking them at random",
                     k, len(y), err)
    keep = np.random.default_rng(seed).permutation(len(y))[:k]
    if len(keep) != k:  # pragma: no cover - k < len(y)
        raise ValueError(f"data.test_samples: cannot pick {k} of {len(y)} test samples")
    return keep


def _split_and_partition(cfg: DataConfig, seed: int, x: np.ndarray, y: np.ndarray,
                         groups: np.ndarray | None = None, x_test: np.ndarray | None = None,
                         y_test: np.ndarray | None = None) -> FederatedData:
    from fedasync.task.files import num_classes_of

    if x_test is None:
        train_idx, test_idx = stratified_split(y, cfg.test_fraction, seed)
        x, y, groups, x_test, y_test = (x[train_idx], y[train_idx], None if groups is None else groups[train_idx],
                                        x[test_idx], y[test_idx])
    num_classes = num_classes_of(cfg, y, y_test)
    if cfg.test_samples is not None and cfg.test_samples < len(y_test):
        keep = np.sort(subsample_test(y_test, cfg.test_samples, num_classes, seed))
        x_test, y_test = x_test[keep], y_test[keep]
    x_val = y_val = None
    if cfg.val_fraction > 0:  # out of the training pool, before it is partitioned: no client holds these
        train_idx, val_idx = stratified_split(y, cfg.val_fraction, val_seed(seed), key="data.val_fraction")
        x, y, groups, x_val, y_val = (x[train_idx], y[train_idx], None if groups is None else groups[train_idx],
                                      _readonly(x[val_idx]), _readonly(y[val_idx]))
    parts = partition_labels(cfg, seed, y, groups)
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"data.partitioner: {cfg.partitioner} left clients {empty[:10]} without samples")
    partitions = [(_readonly(x[p]), _readonly(y[p])) for p in parts]
    return FederatedData(
        partitions=partitions,
        x_test=_readonly(x_test),
        y_test=_readonly(y_test),
        input_shape=tuple(int(s) for s in x.shape[1:]),
        num_classes=num_classes,
        x_val=x_val,
        y_val=y_val,
    )


def val_seed(seed: int) -> int:
    """The seed of the validation split (``data.val_fraction``), derived from the run's seed so that
    it is not the test split's."""
    return int(np.random.SeedSequence([int(seed), 0x7A1]).generate_state(1)[0])


def _hub_arrays(ds, cfg: DataConfig, feat, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw features, labels) of a Hugging Face split or partition; ``feat`` from the training split."""
    from fedasync.task.files import as_labels, feature_array

    cols = list(ds.column_names)
    for c in [cfg.label_column] + ([feat] if isinstance(feat, str) else list(feat)):
        if c not in cols:
            key = "data.label_column" if c == cfg.label_column else "data.feature_column"
            raise ValueError(f"{key}: {where} has no column {c!r} (has {cols})")
    npds = ds.with_format("numpy")
    return feature_array(npds, feat, where), as_labels(npds[cfg.label_column], where)


def _load_hub(cfg: DataConfig, seed: int) -> FederatedData:
    """A Hugging Face data set with ``train``/``test`` splits (needs network).  ``data.label_column``,
    ``data.feature_column``, ``data.shape``, ``data.num_classes`` and ``data.test_samples`` apply as
    for ``files``; pixel scaling is decided once on the whole training split."""
    from fedasync.task.files import _feature_column, _features, num_classes_of, pixel_scale

    if not cfg.hub_name:
        raise ValueError("data.hub_name: needed when data.dataset is hub")
    if cfg.val_fraction > 0:
        raise ValueError("data.val_fraction: not available with data.dataset hub (flwr-datasets partitions the "
                         "training split itself); save the data set to disk and use data.dataset files")
    try:
        from flwr_datasets import FederatedDataset

        fds = FederatedDataset(
            dataset=cfg.hub_name, partitioners={"train": _make_partitioner(cfg, seed)}, seed=seed
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*min_partition_size.*")
            parts = [fds.load_partition(i, "train") for i in range(cfg.num_clients)]
        test = fds.load_split("test")
    except Exception as err:
        raise RuntimeError(
            f"data.hub_name: could not load Hugging Face data set {cfg.hub_name!r} "
            f"(it needs network access, a {cfg.label_column!r} column and 'train'/'test' splits; a local file or "
            f"folder belongs to data.dataset: files with data.path): "
            f"{type(err).__name__}: {err}"
        ) from err
    empty = [i for i, part in enumerate(parts) if len(part) == 0]
    if empty:
        raise ValueError(f"data.hub_name: clients {empty[:10]} got no samples")
    where = f"{cfg.hub_name} (train)"
    cols = list(parts[0].column_names)
    if cfg.label_column not in cols:
        raise ValueError(f"data.label_column: {where} has no column {cfg.label_column!r} (has {cols})")
    feat = _feature_column(cfg, cols, where)
    raw = [_hub_arrays(part, cfg, feat, where) for part in parts]
    x_test, y_test = _hub_arrays(test, cfg, feat, f"{cfg.hub_name} (test)")
    scale = pixel_scale(*(x for x, _ in raw))  # once, on the training split: the test split gets the same
    partitions = [(_features(x, cfg, where, scale)[0], y) for x, y in raw]
    x_test = _features(x_test, cfg, f"{cfg.hub_name} (test)", scale)[0]
    ys = [y for _, y in partitions]
    num_classes = num_classes_of(cfg, np.concatenate(ys + ([y_test] if cfg.num_classes is None else [])), y_test)
    if cfg.test_samples is not None and cfg.test_samples < len(y_test):
        keep = np.sort(subsample_test(y_test, cfg.test_samples, num_classes, seed))
        x_test, y_test = x_test[keep], y_test[keep]
    return FederatedData(
        partitions=[(_readonly(x), _readonly(y)) for x, y in partitions],
        x_test=_readonly(x_test),
        y_test=_readonly(y_test),
        input_shape=tuple(int(s) for s in x_test.shape[1:]),
        num_classes=num_classes,
    )


def normalize(x: np.ndarray, mean_std: tuple[float, float] | None) -> np.ndarray:
    """``(x - mean) / std`` in float32 for ``data.normalize: [mean, std]`` (torchvision's
    ``Normalize`` with one value for every feature); ``x`` itself when it is not set."""
    if mean_std is None:
        return x
    mean, std = mean_std
    return ((np.asarray(x, np.float32) - np.float32(mean)) / np.float32(std)).astype(np.float32, copy=False)


@functools.lru_cache(maxsize=8)
def _load_cached(cfg_json: str, seed: int) -> FederatedData:
    cfg = DataConfig.model_validate_json(cfg_json)
    fd = _load_source(cfg, seed)
    if cfg.normalize is None:
        return fd
    return replace(fd, partitions=[(_readonly(normalize(x, cfg.normalize)), y) for x, y in fd.partitions],
                   x_test=_readonly(normalize(fd.x_test, cfg.normalize)),
                   x_val=None if fd.x_val is None else _readonly(normalize(fd.x_val, cfg.normalize)))


def _load_source(cfg: DataConfig, seed: int) -> FederatedData:
    if cfg.dataset == "hub":
        return _load_hub(cfg, seed)
    if cfg.dataset == "digits":
        x, y = _load_digits()
    elif cfg.dataset == "mnist1d":
        x, y = _load_mnist1d(cfg.mnist1d_samples)
    elif cfg.dataset == "files":
        from fedasync.task.files import load_files

        raw = load_files(cfg)
        return _split_and_partition(cfg, seed, raw.x_train, raw.y_train, raw.groups, raw.x_test, raw.y_test)
    else:  # pragma: no cover - the config's Literal excludes it
        raise ValueError(f"data.dataset: unknown data set {cfg.dataset!r}")
    return _split_and_partition(cfg, seed, x, y)


def _key(cfg: DataConfig) -> str:
    # `path` means nothing for the generated data sets
    return (cfg if cfg.dataset == "files" else cfg.model_copy(update={"path": None})).model_dump_json()


def load_federated(cfg: DataConfig, seed: int) -> FederatedData:
    """The whole federation for ``(cfg, seed)``; cached per process, arrays read-only."""
    return _load_cached(_key(cfg), int(seed))


def load_partition(cfg: DataConfig, seed: int, client_id: int) -> tuple[np.ndarray, np.ndarray]:
    fd = load_federated(cfg, seed)
    if not 0 <= client_id < len(fd.partitions):
        raise IndexError(f"client id {client_id} is outside 0-{len(fd.partitions) - 1}")
    return fd.partitions[client_id]


def load_test(cfg: DataConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    fd = load_federated(cfg, seed)
    return fd.x_test, fd.y_test


def load_validation(cfg: DataConfig, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The server's validation set (``data.val_fraction > 0``), else None."""
    fd = load_federated(cfg, seed)
    return None if fd.x_val is None else (fd.x_val, fd.y_val)


# -- deployment: a device's own file ---------------------------------------------------------


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A device's data: an ``.npz`` with ``x`` (features) and ``y`` (integer labels).

    ``x`` gets the pixel scaling of ``data.dataset: files`` (:func:`fedasync.task.files.pixel_scale`:
    integers in 0-255 are divided by 255), decided on this file, the device's training data, so a
    raw uint8 image file trains like the same images in a simulation.  Files written by
    :func:`save_partitions_npz` hold float32 features and are read unchanged."""
    from fedasync.task.files import pixel_scale

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.path: {p}: no such file")
    try:
        with np.load(p, allow_pickle=False) as f:
            files = list(getattr(f, "files", []))
            arrays = {k: f[k] for k in ("x", "y") if k in files}
    except Exception as err:
        raise ValueError(f"data.path: {p}: not a readable .npz file ({type(err).__name__}: {err})") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ValueError(f"data.path: {p}: missing array(s) {', '.join(missing)} (has {files})")
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"data.path: {p}: expected x of shape (n, ...) and y of shape (n,), got {x.shape} and {y.shape}")
    if len(y) == 0:
        raise ValueError(f"data.path: {p}: holds no samples")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
            y = y.astype(np.int64)
        else:
            raise ValueError(f"data.path: {p}: y must hold integer labels, got dtype {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"data.path: {p}: y holds negative labels")
    xf = np.ascontiguousarray(x, dtype=np.float32)
    if pixel_scale(x):
        xf = xf / np.float32(255.0)
    return xf, np.ascontiguousarray(y, dtype=np.int64)


def save_partitions_npz(cfg: DataConfig, seed: int, out_dir: str | Path) -> list[Path]:
    """Write ``client-<i>.npz`` (x, y) for every client, to hand devices their data."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd = load_federated(cfg, seed)
    paths = []
    for i, (x, y) in enumerate(fd.partitions):
        path = out / f"client-{i}.npz"
        np.savez(path, x=x, y=y)
        paths.append(path)
    return paths
