"""The task interface: what is learned, as a user's Python module (issue 33).

A task is a module (or any object: a notebook's namespace, a class instance) with these functions;
``task_args`` (the YAML's ``task_args:``) are passed as keyword arguments:

- ``model(**task_args) -> torch.nn.Module`` (required);
- ``load_data(partition_id, num_partitions, **task_args) -> (train, test)`` (required): each a
  ``torch.utils.data.Dataset`` or ``(x, y)`` arrays (wrapped as a ``TensorDataset``: floating
  arrays as float32, integer arrays as int64); a device's ``--data`` reaches it as ``data_path=``;
- ``load_centralized(**task_args) -> Dataset | (x, y)`` (optional): the server's evaluation set;
- ``load_validation(**task_args) -> Dataset | (x, y)`` (optional): the server's validation set (data
  no client trains on); the server then reports every metric on it too, prefixed ``val_``;
- ``loss(model, batch) -> Tensor`` (optional; default: cross-entropy of ``model(x)`` on ``(x, y)``
  batches). A batch is whatever ``default_collate`` makes of the Dataset's items;
- ``evaluate(model, loader) -> dict[str, float]`` (optional; default ``{"loss", "accuracy"}``);
- ``train(model, loader, optimizer, steps) -> dict`` (optional): a full override of the local loop;
  fedasync still owns the optimizer, the step budget, DP-SGD and the proximal term
  (:func:`fedasync.task.train.local_train`).

``loss``, ``evaluate`` and ``train`` receive those ``task_args`` their signature names (all of them
when it takes ``**kwargs``). Every loading error is a :class:`TaskError`: one line naming the task
and the function or key. :func:`task_from_config` is the one way a run gets its task: the Python
API's object, else ``cfg.task``, else the built-in task of ``cfg.data``/``cfg.model``
(:mod:`fedasync.task.builtin`), which goes through this same interface.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

__all__ = ["TaskError", "Task", "load_task", "task_from_config", "init_params", "as_dataset", "check_nonempty",
           "batch_size_of", "to_device", "default_loss", "default_evaluate", "builtin_task", "remember", "known_task", "model_problems", "FUNCTIONS"]

#: the functions a task may define; the first two are required
FUNCTIONS = ("model", "load_data", "load_centralized", "loss", "evaluate", "train", "load_validation")
_POSITIONAL = {"model": (), "load_data": ("partition_id", "num_partitions"), "load_centralized": (),
               "load_validation": (),
               "loss": ("model", "batch"), "evaluate": ("model", "loader"),
               "train": ("model", "loader", "optimizer", "steps")}


class TaskError(ValueError):
    """A task that cannot be used; the message is one line naming the task and the function or key."""


# -- datasets and batches -------------------------------------------------------------------------


def _tensor(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    arr = np.asarray(a)
    if arr.dtype.kind == "f":
        arr = np.array(arr, dtype=np.float32, copy=True)  # a copy: cached arrays are read-only
    elif arr.dtype.kind in "iub":
        arr = np.array(arr, dtype=np.int64, copy=True)
    else:
        raise TypeError(f"arrays of dtype {arr.dtype} (need numbers)")
    return torch.from_numpy(arr)


def as_dataset(obj: Any, where: str) -> Dataset:
    """A ``Dataset`` as is; ``(x, y)`` arrays or tensors as a ``TensorDataset`` (x float32 when
    floating, integer labels int64). ``where`` names the function in the error."""
    if isinstance(obj, Dataset):
        if not hasattr(obj, "__len__"):
            raise TaskError(f"{where}: the Dataset has no len(); fedasync needs map-style Datasets")
        return obj
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        try:
            x, y = _tensor(obj[0]), _tensor(obj[1])
        except TypeError as e:
            raise TaskError(f"{where}: (x, y) holds {e}") from None
        if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
            raise TaskError(f"{where}: x has {len(x) if x.ndim else 0} rows but y has {len(y) if y.ndim else 0}")
        return TensorDataset(x, y)
    raise TaskError(f"{where}: returned {type(obj).__name__}; expected a torch Dataset or (x, y) arrays")


def check_nonempty(dataset: Dataset, where: str) -> None:
    """A Dataset that yields nothing is an error (one line naming ``where``)."""
    try:
        n = len(dataset)
        if n > 0:
            dataset[0]
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"{where}: the Dataset fails on its first item: {type(e).__name__}: {e}") from None
    if n == 0:
        raise TaskError(f"{where}: the Dataset yields nothing (len 0)")


def _leaves(batch: Any):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _leaves(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _leaves(v)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor (0 if none)."""
    for t in _leaves(batch):
        return int(t.shape[0]) if t.ndim else 1
    return 0


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a (nested tuple/list/dict) batch moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


# -- the default loss and metrics -------------------------------------------------------------------


def _xy(batch: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TaskError(f"{where}: the default loss needs (x, y) batches; this Dataset yields "
                    f"{type(batch).__name__}: define loss(model, batch) in the task")


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)`` against ``y`` on an ``(x, y)`` batch."""
    x, y = _xy(batch, "loss")
    return nn.functional.cross_entropy(model(x), y)


@torch.no_grad()
def default_evaluate(model: nn.Module, loader) -> dict[str, float]:
    """``{"loss": mean cross-entropy, "accuracy": share of argmax hits}`` over ``(x, y)`` batches."""
    p = next(model.parameters(), None)
    device = p.device if p is not None else torch.device("cpu")
    total, correct, n = 0.0, 0, 0
    for batch in loader:
        x, y = _xy(batch, "evaluate")
        x, y = x.to(device), y.to(device)
        out = model(x)
        total += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
        n += len(y)
    if n == 0:
        raise TaskError("evaluate: the evaluation set yields nothing")
    return {"loss": total / n, "accuracy": correct / n}


# -- the task -----------------------------------------------------------------------------------------


def _call_kwargs(fn: Callable, args: dict, positional: tuple[str, ...]) -> dict:
    """The task_args a (loss/evaluate/train) function takes: those it names, all with ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(args)
    return {k: v for k, v in args.items() if k in params and k not in positional}


@dataclass
class Task:
    """A task as fedasync uses it: the user's functions bound to their ``task_args``.

    ``name``: ``"builtin"`` or the module's name; ``digest``: sha256 of the module's source (of the
    built-in spec for ``builtin``); ``args``: ``task_args``. ``num_classes`` is known for the built-in
    task (the label-flip attack needs it) and ``None`` otherwise. With ``fix_model`` (set from
    ``privacy.local_dp.fix_model`` by :func:`task_from_config` and by a client from its setup),
    :meth:`model` replaces the layers Opacus cannot train (BatchNorm -> GroupNorm, Opacus'
    ``ModuleValidator.fix``, as :func:`fedasync.privacy.dp.make_compatible` does).
    """

    name: str
    digest: str
    args: dict
    fns: dict[str, Callable] = field(default_factory=dict, repr=False)
    num_classes: int | None = None
    fix_model: bool = False  # privacy.local_dp.fix_model: model() applies Opacus' ModuleValidator.fix
    base_dir: str | None = None  # the folder a module name was imported from (simulated clients import it there)

    @property
    def train(self) -> Callable | None:
        """The user's ``train(model, loader, optimizer, steps) -> dict`` override, or None."""
        fn = self.fns.get("train")
        if fn is None:
            return None
        kw = _call_kwargs(fn, self.args, _POSITIONAL["train"])
        return (lambda model, loader, optimizer, steps: fn(model, loader, optimizer, steps, **kw)) if kw else fn

    @property
    def has_loss(self) -> bool:
        """Whether the task defines its own ``loss`` (Opacus' ghost clipping needs the default one)."""
        return "loss" in self.fns

    def _where(self, fn: str) -> str:
        return f"task {self.name}: {fn}"

    def model(self) -> nn.Module:
        m = self.fns["model"](**self.args)
        if not isinstance(m, nn.Module):
            raise TaskError(f"{self._where('model')}(...) returned {type(m).__name__}, not a torch.nn.Module")
        if self.fix_model:
            from opacus.validators import ModuleValidator

            if ModuleValidator.validate(m, strict=False):
                m = ModuleValidator.fix(m)
                left = ModuleValidator.validate(m, strict=False)
                if left:
                    raise TaskError(f"{self._where('model')}: privacy.local_dp.fix_model: ModuleValidator.fix "
                                    f"left layers Opacus cannot train: {str(left[0]).split('. ')[0]}")
        return m

    def load_data(self, partition_id: int, num_partitions: int, data_path: str | None = None) -> tuple[Dataset, Dataset]:
        fn = self.fns["load_data"]
        kw = dict(self.args)
        if data_path is not None:
            if not _accepts(fn, "data_path"):
                raise TaskError(f"{self._where('load_data')} does not accept data_path= (the device's --data): "
                                "add a data_path=None parameter")
            kw["data_path"] = str(data_path)
        out = fn(int(partition_id), int(num_partitions), **kw)
        if not (isinstance(out, (tuple, list)) and len(out) == 2) or isinstance(out[0], (np.ndarray, torch.Tensor)):
            got = "(x, y) arrays" if isinstance(out, (tuple, list)) and out else type(out).__name__
            raise TaskError(f"{self._where('load_data')}(...) returned {got}; expected (train, test), each a "
                            "Dataset or (x, y) arrays")
        where = self._where("load_data")
        return as_dataset(out[0], f"{where}(...)[0] (train)"), as_dataset(out[1], f"{where}(...)[1] (test)")

    def load_centralized(self) -> Dataset | None:
        return self._server_set("load_centralized")

    def load_validation(self) -> Dataset | None:
        """The task's validation set (``load_validation``), None when it defines none."""
        return self._server_set("load_validation")

    def _server_set(self, name: str) -> Dataset | None:
        fn = self.fns.get(name)
        if fn is None:
            return None
        ds = as_dataset(fn(**self.args), f"{self._where(name)}(...)")
        check_nonempty(ds, f"{self._where(name)}(...)")
        return ds

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        fn = self.fns.get("loss")
        if fn is None:
            return default_loss(model, batch)
        out = fn(model, batch, **_call_kwargs(fn, self.args, _POSITIONAL["loss"]))
        if not isinstance(out, torch.Tensor) or out.ndim != 0:
            raise TaskError(f"{self._where('loss')}(model, batch) returned "
                            f"{type(out).__name__ if not isinstance(out, torch.Tensor) else f'a tensor of shape {tuple(out.shape)}'}"
                            "; expected a scalar tensor")
        return out

    def evaluate(self, model: nn.Module, loader) -> dict[str, float]:
        fn = self.fns.get("evaluate")
        if fn is None:
            return default_evaluate(model, loader)
        out = fn(model, loader, **_call_kwargs(fn, self.args, _POSITIONAL["evaluate"]))
        if not isinstance(out, dict) or not out:
            raise TaskError(f"{self._where('evaluate')}(model, loader) returned {type(out).__name__}; "
                            "expected a non-empty dict of metric name -> number")
        try:
            return {str(k): float(v) for k, v in out.items()}
        except (TypeError, ValueError):
            raise TaskError(f"{self._where('evaluate')}(model, loader): every metric must be a number, got "
                            f"{ {k: type(v).__name__ for k, v in out.items()} }") from None


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _check_signature(name: str, fn_name: str, fn: Any, args: dict) -> None:
    if not callable(fn):
        raise TaskError(f"task {name}: {fn_name} is {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check
    pos = _POSITIONAL[fn_name]
    dummy = [None] * len(pos)
    kw = dict(args) if fn_name in ("model", "load_data", "load_centralized", "load_validation") else {}
    try:
        sig.bind(*dummy, **kw)
    except TypeError as e:
        want = ", ".join([*pos, *(f"{k}=" for k in kw)]) or "no arguments"
        raise TaskError(f"task {name}: {fn_name}{sig} cannot be called as {fn_name}({want}) ({e})") from None


def _digest_of(obj: Any, fns: dict[str, Callable]) -> str:
    h = hashlib.sha256()
    path = getattr(obj, "__file__", None) if isinstance(obj, types.ModuleType) else None
    if path and Path(path).is_file():
        h.update(Path(path).read_bytes())
        return h.hexdigest()
    for k in FUNCTIONS:
        if k in fns:
            try:
                src = inspect.getsource(fns[k])
            except (OSError, TypeError):
                src = getattr(fns[k], "__qualname__", repr(fns[k]))
            h.update(f"{k}\0{src}\0".encode())
    return h.hexdigest()


def _import(spec: str, base_dir: str | Path | None) -> types.ModuleType:
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = Path(spec) if Path(spec).is_absolute() else base / spec
        if not path.is_file():
            raise TaskError(f"task {spec}: no such file {path}")
        mod_name = f"fedasync_task_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}_{path.stem}"
        ispec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(ispec)
        sys.modules[mod_name] = module
        try:
            ispec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise TaskError(f"task {spec}: the module does not import: {type(e).__name__}: {e}") from None
        return module
    added = str(base.resolve())
    sys.path.insert(0, added)
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise TaskError(f"task {spec}: no module named {e.name!r} in {added} or the environment") from None
        raise TaskError(f"task {spec}: the module does not import: ModuleNotFoundError: {e}") from None
    except Exception as e:
        raise TaskError(f"task {spec}: the module does not import: {type(e).__name__}: {e}") from None
    finally:
        try:
            sys.path.remove(added)
        except ValueError:
            pass


def load_task(spec: Any, task_args: dict | None = None, base_dir: str | Path | None = None) -> Task:
    """A :class:`Task` from a module name (importable from ``base_dir``, the YAML's folder, or the
    environment), a path ``./my_task.py`` (relative to ``base_dir``), a module, or any object with
    the functions. Checks that ``model`` and ``load_data`` exist and that every function's signature
    takes the documented arguments (and ``task_args``); else :class:`TaskError`."""
    if isinstance(spec, Task):
        return spec
    args = dict(task_args or {})
    if isinstance(spec, str):
        if not spec.strip():
            raise TaskError("task: an empty name")
        obj: Any = _import(spec.strip(), base_dir)
        name = spec.strip()
    else:
        obj = spec
        name = getattr(spec, "__name__", None) or type(spec).__name__
    if isinstance(obj, dict):
        fns = {k: obj[k] for k in FUNCTIONS if obj.get(k) is not None}
    else:
        fns = {k: getattr(obj, k) for k in FUNCTIONS if getattr(obj, k, None) is not None}
    for required in ("model", "load_data"):
        if required not in fns:
            raise TaskError(f"task {name}: no {required} function (a task needs model(**task_args) and "
                            "load_data(partition_id, num_partitions, **task_args))")
    for k, fn in fns.items():
        _check_signature(name, k, fn, args)
    return Task(name=name, digest=_digest_of(obj, fns), args=args, fns=fns)


_KNOWN: dict[tuple[str, str], Task] = {}


def remember(task: Task) -> Task:
    """Keep ``task`` in this process under its name and digest: a client in the same process (the
    local backend) then uses this very object (a notebook's functions need no import)."""
    _KNOWN[(task.name, task.digest)] = task
    return task


def known_task(name: str, digest: str) -> Task | None:
    """The task this process holds under ``name`` and ``digest`` (see :func:`remember`), or None."""
    return _KNOWN.get((name, digest))


def model_problems(model: nn.Module) -> list[str]:
    """Why Opacus cannot train ``model`` under DP-SGD (empty: it can), one short line per problem."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return []
    out = []
    bn = [name or "<root>" for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bn:
        out.append(f"BatchNorm at {', '.join(bn)} (each sample's output depends on the rest of its batch)")
    for e in errors:
        text = str(e).split(". ")[0]
        if "BatchNorm" in text and bn:
            continue
        out.append(f"{type(e).__name__}: {text}")
    return out


def task_from_config(cfg: Any, task: Any = None, base_dir: str | Path | None = None) -> Task:
    """The run's task: ``task`` (a module/object from the Python API) wins; else ``cfg.task`` with
    ``cfg.task_args``; else the built-in task of ``cfg.data``, ``cfg.model`` and ``cfg.seed``.
    ``fix_model`` follows ``privacy.local_dp`` (enabled and ``fix_model``); a user task is
    :func:`remember`-ed for the clients of this process."""
    args = dict(getattr(cfg, "task_args", None) or {})
    dp = getattr(getattr(cfg, "privacy", None), "local_dp", None)
    fix = bool(dp is not None and dp.enabled and dp.fix_model)
    spec = task if task is not None else getattr(cfg, "task", None)
    if spec is None or (isinstance(spec, str) and not spec):
        t = builtin_task(cfg.data, cfg.model, cfg.seed)
        t.fix_model = fix
        return t
    t = load_task(spec, args, base_dir)
    t.fix_model = fix
    if isinstance(spec, str) and base_dir is not None:
        t.base_dir = str(Path(base_dir).resolve())
    if dp is not None and dp.enabled and not fix:
        problems = model_problems(t.model())
        if problems:
            raise TaskError(f"task {t.name}: model: Opacus cannot train it under DP-SGD: {'; '.join(problems)}. "
                            "Set privacy.local_dp.fix_model: true (Opacus' ModuleValidator.fix: BatchNorm -> "
                            "GroupNorm) or replace those layers")
    return remember(t)


def builtin_task(data_cfg: Any, model_cfg: Any, seed: int, input_shape: tuple[int, ...] | None = None,
                 num_classes: int | None = None) -> Task:
    """The built-in data sets and models as a :class:`Task` named ``builtin``
    (:mod:`fedasync.task.builtin`); ``input_shape``/``num_classes``: build the model without the data."""
    from fedasync.task.builtin import builtin_functions

    parts = builtin_functions(data_cfg, model_cfg, seed, input_shape, num_classes)
    return Task(name="builtin", digest=parts["digest"], args={}, fns=parts["fns"], num_classes=parts["num_classes"])


def init_params(task: Task, seed: int):
    """The initial global model of a run: ``task.model()`` built right after ``torch.manual_seed(seed)``
    (torch's global RNG state is put back afterwards), as float32 numpy arrays keyed like the
    ``state_dict``. For the built-in task this equals :func:`fedasync.task.models.init_params`."""
    from fedasync.task.models import get_params

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = task.model()
    return get_params(model)
