"""Local training and evaluation (plain torch), through the task (:mod:`fedasync.task.interface`).

``local_train`` runs SGD for ``steps_for(cfg, n)`` steps over minibatches drawn from seeded,
reshuffled permutations of the client's data.  The result is a pure function of (initial
parameters, data, cfg, seed): the same inputs give bit-identical parameters on the same device.

The data is any map-style ``Dataset`` (``local_train(model, dataset, cfg, ..., task=task)``; the
older ``local_train(model, x, y, cfg, ...)`` wraps the arrays as a ``TensorDataset``); a batch is
whatever ``default_collate`` makes of its items.  Each step's loss is ``task.loss(model, batch)``
when the task defines one (a mean over the batch), else ``nn.CrossEntropyLoss()`` on ``(x, y)``
batches.  fedasync keeps what its guarantees rest on whatever the task: the optimizer (SGD with
``train.lr`` / ``train.momentum``), the step budget, the seeded batch plan, DP-SGD and the proximal
term.  A task's ``train(model, loader, optimizer, steps)`` override replaces only the loop: it gets
the (under DP: Opacus-wrapped) model, optimizer and loader, and must call ``optimizer.step()``
exactly ``steps`` times; any other count is a :class:`~fedasync.task.interface.TaskError` (under DP
the accountant charged exactly the planned steps, so a mismatch is never silent).  Only the
``loss`` key of the dict it returns is used (the reply's training loss).

DP-SGD hook
-----------
``make_private(model, optimizer, data_loader) -> (model, optimizer, data_loader, criterion_or_None)``
is called once before the loop (Opacus' ``PrivacyEngine.make_private`` fits this shape).

* ``data_loader`` is a ``DataLoader`` over a ``TensorDataset(x, y)`` (CPU tensors, float32 and
  int64) with a ``batch_sampler`` that yields exactly ``steps`` batches of ``batch_size``
  samples (so ``len(data_loader) == steps``) and a seeded ``torch.Generator`` as ``generator``.
  It also carries ``planned_steps``, ``planned_batch_size`` (``min(cfg.batch_size, n)``) and
  ``seed`` attributes.  Do not hand it to Opacus' Poisson sampling as is:
  ``DPDataLoader.from_data_loader`` takes the sample rate as ``1 / len(data_loader)``
  = ``1 / steps``, which for ``steps > n`` makes Opacus' expected batch size 0 and the update
  NaN.  :class:`fedasync.privacy.dp.OpacusHook` builds ``DPDataLoader(loader.dataset,
  sample_rate=1 / k, generator=...)`` with ``k = ceil(n / planned_batch_size)``, sets its
  sampler's ``steps`` to ``k`` (Opacus' own ``int(1 / sample_rate)`` is ``k - 1`` for some ``k``,
  and ``make_private`` accounts at ``1 / len(loader)``) and passes ``poisson_sampling=False``.
* The loop takes ``planned_steps`` batches from the returned loader, iterating it again if a pass
  yields fewer.  Each step: ``optimizer.zero_grad(); loss = criterion(model(xb), yb);
  loss.backward(); optimizer.step()``.  A returned criterion (Opacus ghost clipping's
  ``DPLossFastGradientClipping``) replaces ``nn.CrossEntropyLoss()``.
* Parameters are read back from the model passed *in* (a ``GradSampleModule`` shares them), so
  the returned keys never carry a ``_module.`` prefix.

Proximal term (``train.prox_rho``, FedAsync's ``rho``)
--------------------------------------------------------
With ``rho > 0`` each step minimises ``f(x) + rho/2 ||x - x_tau||^2``, ``x_tau`` being the
parameters at the start of the task (the global model the client was sent): a step pre-hook on
the torch SGD optimizer adds ``rho (x - x_tau)`` to every ``p.grad`` right before the SGD update
(momentum included).  Under DP, Opacus' optimizer wraps that SGD: it first replaces ``p.grad``
by the clipped, noised per-sample sum, *then* calls the SGD's ``step``, so the hook adds the
term after clipping and noise, in every ``grad_sample_mode`` (ghost clipping included: the
criterion Opacus wraps never sees the term).  The term does not depend on the data, so it is
post-processing and costs no privacy.  ``rho = 0`` registers no hook: plain SGD, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from fedasync.config import TrainConfig
from fedasync.task.interface import Task, TaskError, batch_size_of, to_device
from fedasync.task.models import Params, get_params

MakePrivate = Callable[..., tuple]


def pick_device(pref: str | torch.device | None = "auto") -> torch.device:
    """``auto``: cuda if available, then mps, else cpu.  An explicit unavailable device raises."""
    if isinstance(pref, torch.device):
        pref = str(pref)
    pref = (pref or "auto").lower()
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    if pref == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_ok:
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(pref)
    except RuntimeError:
        raise ValueError(f"train.device: unknown device {pref!r} (use auto, cpu, cuda or mps)") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"train.device: {pref} was asked for, but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use auto or cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"train.device: {pref} was asked for, but only {torch.cuda.device_count()} GPU(s) exist")
        return dev
    if dev.type == "mps":
        if not mps_ok:
            raise RuntimeError(f"train.device: {pref} was asked for, but MPS is not available; use auto or cpu")
        return dev
    raise ValueError(f"train.device: unsupported device {pref!r} (use auto, cpu, cuda or mps)")


@dataclass
class TrainResult:
    params: Params
    num_examples: int
    loss: float  # mean training loss over the steps (a train override: the "loss" it returned, else NaN)
    steps: int


def steps_for(cfg: TrainConfig, num_examples: int) -> int:
    """``local_steps``, or ``local_epochs * ceil(n / batch_size)`` when ``local_epochs`` is set."""
    if cfg.local_epochs is not None:
        return cfg.local_epochs * max(1, math.ceil(num_examples / cfg.batch_size))
    return cfg.local_steps


def batch_plan(num_examples: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of ``min(batch_size, n)`` indices from a stream of seeded permutations."""
    b = min(batch_size, num_examples)
    rng = np.random.default_rng(seed)
    need = steps * b
    passes = -(-need // num_examples)
    stream = np.concatenate([rng.permutation(num_examples) for _ in range(passes)])[:need]
    return stream.reshape(steps, b).tolist()


class PlannedBatchSampler(Sampler[list[int]]):
    """Yields a fixed, precomputed list of batches (``len`` is the number of steps)."""

    def __init__(self, plan: list[list[int]]) -> None:
        self.plan = plan

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self):
        return iter(self.plan)


def _as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    # np.array copies: the cached partitions are read-only and torch.from_numpy warns on those
    xt = torch.from_numpy(np.array(x, dtype=np.float32, copy=True))
    yt = torch.from_numpy(np.array(y, dtype=np.int64, copy=True))
    return xt, yt


def train_dataset(data, y=None, where: str = "local_train") -> Dataset:
    """``data`` as the training ``Dataset``: a Dataset as is, or ``(x, y)`` arrays (``y`` given) as a
    float32/int64 ``TensorDataset``; empty or ragged data is a ``ValueError`` naming ``where``."""
    if y is not None:
        n = len(y)
        if n == 0:
            raise ValueError(f"{where}: no training samples")
        if len(data) != n:
            raise ValueError(f"{where}: x has {len(data)} rows but y has {n}")
        return TensorDataset(*_as_tensors(data, y))
    if not isinstance(data, Dataset):
        raise TypeError(f"{where}: expected a torch Dataset or (x, y) arrays, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"{where}: no training samples")
    return data


def make_loader(data, y=None, cfg: TrainConfig | None = None, seed: int = 0) -> DataLoader:
    """The planned-batches loader ``local_train`` uses (see the module docstring):
    ``make_loader(dataset, cfg, seed)`` or ``make_loader(x, y, cfg, seed)``."""
    if isinstance(y, TrainConfig):  # make_loader(dataset, cfg, seed): the arguments sit one slot left
        y, cfg, seed = None, y, (seed if cfg is None else cfg)
    dataset = train_dataset(data, y, "make_loader")
    n = len(dataset)
    steps = steps_for(cfg, n)
    loader = DataLoader(
        dataset,
        batch_sampler=PlannedBatchSampler(batch_plan(n, cfg.batch_size, steps, seed)),
        generator=torch.Generator().manual_seed(seed),
    )
    loader.planned_steps = steps
    loader.planned_batch_size = min(cfg.batch_size, n)
    loader.seed = seed
    return loader


def _seed_torch(seed: int, device: torch.device) -> None:
    if device.type == "cpu":
        # torch.manual_seed also queues lazy CUDA/XPU/MTIA seeding, which costs ~0.3 ms a call
        torch.random.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def local_train(
    model: nn.Module,
    data,
    y: np.ndarray | TrainConfig | None = None,
    cfg: TrainConfig | None = None,
    seed: int = 0,
    device: torch.device | None = None,
    make_private: MakePrivate | None = None,
    *,
    task: Task | None = None,
) -> TrainResult:
    """SGD from the model's current parameters; returns the new ones (numpy float32).

    ``local_train(model, dataset, cfg, seed=..., task=task)``, or ``local_train(model, x, y, cfg, ...)``
    with arrays. ``task`` supplies the loss and the optional ``train`` override (default: cross-entropy,
    fedasync's loop). ``device`` defaults to ``pick_device(cfg.device)``; the model is moved there in place.
    """
    if isinstance(y, TrainConfig):  # local_train(model, dataset, cfg, seed, ...)
        y, cfg, seed = None, y, (seed if cfg is None else cfg)
    if cfg is None:
        raise TypeError("local_train: no TrainConfig given")
    dataset = train_dataset(data, y)
    n = len(dataset)
    device = device if device is not None else pick_device(cfg.device)
    _seed_torch(seed, device)
    model.to(device)
    model.train()

    loader = make_loader(dataset, cfg=cfg, seed=seed)
    steps = loader.planned_steps
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if cfg.prox_rho > 0:
        add_proximal_term(optimizer, cfg.prox_rho)
    criterion: Callable = nn.CrossEntropyLoss()
    train_model: nn.Module = model
    if make_private is not None:
        train_model, optimizer, loader, dp_criterion = make_private(model, optimizer, loader)
        if dp_criterion is not None:
            if task is not None and task.has_loss:
                raise TaskError(f"task {task.name}: loss: Opacus' ghost clipping needs the default loss "
                                "(criterion(outputs, targets)); use grad_sample_mode hooks with a task's own loss")
            criterion = dp_criterion
    user_loss = task.loss if task is not None and task.has_loss else None
    user_train = task.train if task is not None else None
    if user_train is not None:
        done, loss_value = _run_override(task, user_train, train_model, loader, optimizer, steps)
        return TrainResult(params=get_params(model), num_examples=n, loss=loss_value, steps=done)

    on_cpu = device.type == "cpu"
    losses: list[float] = []
    done = 0
    while done < steps:
        progressed = False
        for batch in loader:
            progressed = True
            if not on_cpu:
                batch = to_device(batch, device)
            optimizer.zero_grad(set_to_none=True)
            if user_loss is not None:
                loss = user_loss(train_model, batch)
            else:
                xb, yb = _pair(batch, task)
                loss = criterion(train_model(xb), yb)
            loss.backward()
            optimizer.step()
            if batch_size_of(batch) > 0:
                losses.append(loss.item())
            done += 1
            if done >= steps:
                break
        if not progressed:
            raise RuntimeError("local_train: the data loader yielded no batches")

    return TrainResult(
        params=get_params(model),
        num_examples=n,
        loss=float(np.mean(losses)) if losses else float("nan"),
        steps=done,
    )


def _pair(batch, task: Task | None):
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch
    name = task.name if task is not None else "builtin"
    raise TaskError(f"task {name}: loss: the default loss needs (x, y) batches, this Dataset yields "
                    f"{type(batch).__name__}: define loss(model, batch) in the task")


def _run_override(task: Task, user_train: Callable, model, loader, optimizer, steps: int) -> tuple[int, float]:
    """Run the task's ``train`` override, counting its ``optimizer.step()`` calls (must be ``steps``)."""
    taken = [0]
    inner = optimizer.step

    def counted_step(*args, **kwargs):
        taken[0] += 1
        return inner(*args, **kwargs)

    optimizer.step = counted_step
    try:
        out = user_train(model, loader, optimizer, steps)
    finally:
        del optimizer.step  # the class's own step again
    if taken[0] != steps:
        raise TaskError(f"task {task.name}: train(model, loader, optimizer, steps) called optimizer.step() "
                        f"{taken[0]} times, the step budget is {steps} (the steps taken are the steps "
                        "timed and, under DP, accounted)")
    if out is not None and not isinstance(out, dict):
        raise TaskError(f"task {task.name}: train(model, loader, optimizer, steps) returned "
                        f"{type(out).__name__}; expected a dict (e.g. {{'loss': ...}}) or None")
    loss = (out or {}).get("loss", float("nan"))
    try:
        return taken[0], float(loss)
    except (TypeError, ValueError):
        raise TaskError(f"task {task.name}: train(...) returned loss {loss!r}, not a number") from None


def add_proximal_term(optimizer: torch.optim.Optimizer, rho: float):
    """Before every ``optimizer.step()``: ``p.grad += rho * (p - p_0)``, ``p_0`` = the parameters now.

    The gradient of ``rho/2 ||x - x_tau||^2``; see the module docstring (why it is safe under
    DP).  Returns the hook's handle.
    """
    anchor = {p: p.detach().clone() for group in optimizer.param_groups for p in group["params"]}
    rho = float(rho)

    @torch.no_grad()
    def pre_step(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = rho * (p.detach() - anchor[p])
                else:
                    p.grad.add_(p.detach() - anchor[p], alpha=rho)

    return optimizer.register_step_pre_hook(pre_step)


class SlicedBatches:
    """Ordered batches of a ``TensorDataset`` by slicing its tensors (no per-item fetch); what
    :func:`evaluate` and :func:`gradient` hand a task for such a dataset.  Iterable, with ``len``."""

    def __init__(self, dataset: TensorDataset, batch_size: int) -> None:
        self.tensors, self.batch_size = dataset.tensors, int(batch_size)
        self.dataset = dataset

    def __len__(self) -> int:
        return -(-len(self.tensors[0]) // self.batch_size)

    def __iter__(self):
        n = len(self.tensors[0])
        for i in range(0, n, self.batch_size):
            yield [t[i: i + self.batch_size] for t in self.tensors]


def eval_loader(dataset: Dataset, batch_size: int = 1024):
    """Ordered batches of ``dataset``: :class:`SlicedBatches` for a ``TensorDataset``, else a
    ``DataLoader`` (``default_collate``, no shuffling)."""
    if isinstance(dataset, TensorDataset):
        return SlicedBatches(dataset, batch_size)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _model_device(model: nn.Module, device: torch.device | None) -> torch.device:
    if device is None:
        p = next(model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")
    model.to(device)
    return device


@torch.no_grad()
def evaluate_task(task: Task, model: nn.Module, dataset: Dataset, batch_size: int = 1024,
                  device: torch.device | None = None) -> dict[str, float]:
    """The task's metrics (``task.evaluate``: default ``{"loss", "accuracy"}``) of ``model`` on
    ``dataset``, in eval mode, batches moved to ``device`` (default: the model's)."""
    if len(dataset) == 0:
        raise ValueError("evaluate: no samples")
    device = _model_device(model, device)
    was_training = model.training
    model.eval()
    loader = eval_loader(dataset, batch_size)
    if device.type != "cpu":
        loader = _OnDevice(loader, device)
    try:
        return task.evaluate(model, loader)
    finally:
        model.train(was_training)


class _OnDevice:
    def __init__(self, loader, device) -> None:
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield to_device(batch, self.device)


def evaluate(*args, **kwargs):
    """``evaluate(task, model, dataset)``: the task's metric dict (:func:`evaluate_task`);
    ``evaluate(model, x, y, batch_size=1024, device=None)``: ``(mean cross-entropy, accuracy)`` on arrays."""
    if args and isinstance(args[0], Task):
        return evaluate_task(*args, **kwargs)
    return evaluate_arrays(*args, **kwargs)


@torch.no_grad()
def evaluate_arrays(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 1024,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) on ``x, y``; ``device`` defaults to the model's."""
    n = len(y)
    if n == 0:
        raise ValueError("evaluate: no samples")
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    else:
        model.to(device)
    was_training = model.training
    model.eval()
    xt, yt = _as_tensors(x, y)
    total_loss, correct = 0.0, 0
    try:
        for i in range(0, n, batch_size):
            xb = xt[i : i + batch_size].to(device)
            yb = yt[i : i + batch_size].to(device)
            out = model(xb)
            total_loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(was_training)
    return total_loss / n, correct / n


def gradient(
    model: nn.Module,
    x,
    y: np.ndarray | None = None,
    batch_size: int = 1024,
    device: torch.device | None = None,
    *,
    task: Task | None = None,
) -> Params:
    """The gradient of the mean loss over ``x, y`` (or over the Dataset ``x``, ``y`` None) at the
    model's current parameters: the task's ``loss`` (each batch's mean times its size) when ``task``
    defines one, else cross-entropy.

    Keyed like :func:`fedasync.task.models.get_params` (the ``state_dict``, float32 numpy); a
    buffer that is not a trainable parameter gets zeros. Computed in eval mode in chunks of
    ``batch_size`` (each chunk's summed loss, divided by ``n`` once), so the result does not
    depend on ``batch_size`` beyond float rounding. The model's ``.grad`` fields are left as they
    were. Used by the server for Zeno++'s validation gradient (``fedasync.server.robust``), on a
    validation split of the *training* data.
    """
    if y is not None:
        n = len(y)
        if n == 0:
            raise ValueError("gradient: no samples")
        if len(x) != n:
            raise ValueError(f"gradient: x has {len(x)} rows but y has {n}")
        dataset: Dataset = TensorDataset(*_as_tensors(x, y))
    else:
        dataset, n = x, len(x)
        if n == 0:
            raise ValueError("gradient: no samples")
    device = _model_device(model, device)
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    user_loss = task.loss if task is not None and task.has_loss else None
    total = [torch.zeros_like(p) for p in params]
    try:
        for batch in eval_loader(dataset, batch_size):
            batch = to_device(batch, device)
            if user_loss is not None:
                loss = user_loss(model, batch) * batch_size_of(batch)
            else:
                xb, yb = _pair(batch, task)
                loss = nn.functional.cross_entropy(model(xb), yb, reduction="sum")
            grads = torch.autograd.grad(loss, params)
            for t, g in zip(total, grads):
                t += g
    finally:
        model.train(was_training)
    by_name = {names[id(p)]: (t / n).detach().to("cpu", torch.float32).numpy().copy() for p, t in zip(params, total)}
    out: Params = {}
    for k, v in model.state_dict().items():
        out[k] = by_name[k] if k in by_name else np.zeros(tuple(v.shape), np.float32)
    return out
