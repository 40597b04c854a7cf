"""Local training and evaluation (plain torch).

``local_train`` runs SGD for ``steps_for(cfg, n)`` steps over minibatches drawn from seeded,
reshuffled permutations of the client's data.  The result is a pure function of (initial
parameters, data, cfg, seed): the same inputs give bit-identical parameters on the same device.

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
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fedasync.config import TrainConfig
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
    loss: float  # mean training loss over the steps
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


def make_loader(x: np.ndarray, y: np.ndarray, cfg: TrainConfig, seed: int) -> DataLoader:
    """The planned-batches loader ``local_train`` uses (see the module docstring)."""
    n = len(y)
    steps = steps_for(cfg, n)
    xt, yt = _as_tensors(x, y)
    loader = DataLoader(
        TensorDataset(xt, yt),
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
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    seed: int,
    device: torch.device | None = None,
    make_private: MakePrivate | None = None,
) -> TrainResult:
    """SGD from the model's current parameters; returns the new ones (numpy float32).

    ``device`` defaults to ``pick_device(cfg.device)``; the model is moved there in place.
    """
    n = len(y)
    if n == 0:
        raise ValueError("local_train: no training samples")
    if len(x) != n:
        raise ValueError(f"local_train: x has {len(x)} rows but y has {n}")
    device = device if device is not None else pick_device(cfg.device)
    _seed_torch(seed, device)
    model.to(device)
    model.train()

    loader = make_loader(x, y, cfg, seed)
    steps = loader.planned_steps
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if cfg.prox_rho > 0:
        add_proximal_term(optimizer, cfg.prox_rho)
    criterion: Callable = nn.CrossEntropyLoss()
    train_model: nn.Module = model
    if make_private is not None:
        train_model, optimizer, loader, dp_criterion = make_private(model, optimizer, loader)
        if dp_criterion is not None:
            criterion = dp_criterion

    on_cpu = device.type == "cpu"
    losses: list[float] = []
    done = 0
    while done < steps:
        progressed = False
        for xb, yb in loader:
            progressed = True
            if not on_cpu:
                xb = xb.to(device, non_blocking=True)
                yb = yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(train_model(xb), yb)
            loss.backward()
            optimizer.step()
            if len(yb) > 0:
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


@torch.no_grad()
def evaluate(
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
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 1024,
    device: torch.device | None = None,
) -> Params:
    """The gradient of the mean cross-entropy loss over ``x, y`` at the model's current parameters.

    Keyed like :func:`fedasync.task.models.get_params` (the ``state_dict``, float32 numpy); a
    buffer that is not a trainable parameter gets zeros. Computed in eval mode in chunks of
    ``batch_size`` (each chunk's summed loss, divided by ``n`` once), so the result does not
    depend on ``batch_size`` beyond float rounding. The model's ``.grad`` fields are left as they
    were. Used by the server for Zeno++'s validation gradient (``fedasync.server.robust``), on a
    validation split of the *training* data.
    """
    n = len(y)
    if n == 0:
        raise ValueError("gradient: no samples")
    if len(x) != n:
        raise ValueError(f"gradient: x has {len(x)} rows but y has {n}")
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    else:
        model.to(device)
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    xt, yt = _as_tensors(x, y)
    total = [torch.zeros_like(p) for p in params]
    try:
        for i in range(0, n, batch_size):
            xb = xt[i: i + batch_size].to(device)
            yb = yt[i: i + batch_size].to(device)
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
