"""Local DP-SGD through Opacus, with one accountant per client that persists across its tasks.

:class:`OpacusHook` is the ``make_private`` hook of :func:`fedasync.task.train.local_train`:
it wraps the model, optimizer and data loader with Opacus' ``PrivacyEngine.make_private``
(per-sample clipping to ``max_grad_norm``, Gaussian noise ``noise_multiplier * max_grad_norm``,
Poisson sampling with rate ``q = 1 / ceil(n / batch_size)``) on a ``PrivacyEngine`` whose
accountant is restored from the client's history first, so epsilon keeps growing across tasks.

:func:`private_task` is what a client does with a DP task (see ``clients/runner.py``):

1. find its accountant history: from the task (simulation: the server's store keeps it), else
   from ``<state_dir>/accountant-<key>.json``, raised to the server's record when that holds every
   local step;
2. **before training**, compute the epsilon it would have after this task (history plus the
   planned steps, a fresh Opacus accountant); if that exceeds its budget, refuse with
   ``privacy_budget_exhausted`` and do not train;
3. train with DP-SGD, save the accountant's new state (state dir), and report epsilon after
   the task with the history in the reply metrics.

A deployed device does not run :func:`private_task` but :func:`device_task`, under its own
policy (:mod:`fedasync.privacy.policy`, checked first by ``clients/runner.py``): the policy's
budget, delta and accountant; one accountant file ``<state_dir>/accountant-device-<id>.json``
named by the device's own id for every run and server (the task's ``server_history`` may only
raise it, never lower it); the task's public ``sample_rate``, ``steps`` and ``noise_multiplier``
and the optimizer's denominator ``num_examples // (1/q)``, never its own record count; and the
planned spend saved before training.

Where the randomness comes from (the server must not know it: it could rerun the task on dummy
data with the same generator and subtract the noise):

* **default** (``privacy.reproducible_noise: false``): the Poisson sampler and the noise use two
  fresh ``torch.Generator`` objects per task, each seeded with 63 bits from the OS
  (:func:`secrets.randbits`), never from the task seed or anything else the server sends;
* ``privacy.reproducible_noise: true``: both generators are seeded from the task seed, so a
  simulated DP run is a pure function of config and seed (research runs; a deployment refuses
  it, and a device's ClientApp refuses such a task, see ``clients/runner.py``);
* ``secure_mode: true``: Opacus' torchcsprng generator (stops with a clear error where
  torchcsprng is not installed, as here).

Without torchcsprng the generator is a PRNG (Mersenne Twister on CPU, Philox on CUDA), not a
cryptographically secure one: its outputs are a deterministic function of its 64-bit seed, and
in principle many of them could reveal its state.  Seeded from OS entropy per task, the noise
is unknown to the server; what it does not have is a CSPRNG's guarantee.  Opacus warns
"Secure RNG turned off" once per :class:`~opacus.PrivacyEngine`; fedasync says it once per run
instead, in one line (:func:`fedasync.privacy.tracker.PrivacyTracker`), and logs Opacus' text at
INFO on the client.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import secrets
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from fedasync.task.interface import model_problems  # noqa: F401  (here since before the task interface)
from fedasync.privacy.budgets import (
    PrivacyError,
    as_history,
    calibrate,
    check_enforcing,
    covers,
    epsilon_of,
    extend_history,
    history_json,
    history_steps,
    sample_rate_for,
)

log = logging.getLogger("fedasync.privacy")

GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")
REFUSED = "privacy_budget_exhausted"


# -- checks ------------------------------------------------------------------------------------------


def check_secure_mode(secure_mode: bool) -> None:
    """``secure_mode: true`` needs torchcsprng (Opacus' cryptographically secure RNG)."""
    if secure_mode and importlib.util.find_spec("torchcsprng") is None:
        raise PrivacyError(
            "privacy.local_dp.secure_mode: true needs the torchcsprng package, which is not installed "
            f"(and has no wheel for torch {torch.__version__} here); install it or set secure_mode: false"
        )


def check_model(model: nn.Module) -> None:
    """Raise :class:`PrivacyError` (one line) when Opacus cannot train ``model``."""
    problems = model_problems(model)
    if problems:
        raise PrivacyError(
            "model: Opacus cannot train this model with DP-SGD: " + "; ".join(problems)
            + ". Set privacy.local_dp.fix_model: true (Opacus' ModuleValidator.fix: BatchNorm -> GroupNorm, on "
            "the server's and every client's model alike) or replace those layers in the model"
        )


def make_compatible(model: nn.Module) -> nn.Module:
    """Opacus' ``ModuleValidator.fix``: BatchNorm -> GroupNorm etc., with a warning saying so.

    The fixed model has different parameters (GroupNorm keeps no running statistics), so use the
    fixed architecture on the server and on every client.
    """
    from opacus.validators import ModuleValidator

    problems = model_problems(model)
    if not problems:
        return model
    fixed = ModuleValidator.fix(model)
    left = model_problems(fixed)
    if left:
        raise PrivacyError("model: ModuleValidator.fix could not make the model trainable with DP: " + "; ".join(left))
    warnings.warn("model: replaced modules Opacus cannot train (" + "; ".join(problems)
                  + ") using opacus ModuleValidator.fix (BatchNorm -> GroupNorm)", UserWarning, stacklevel=2)
    return fixed


# -- the make_private hook -----------------------------------------------------------------------------


def _derive_seed(seed: int, stream: int) -> int:
    return int(np.random.SeedSequence([int(seed) % (2**63), 0x0D9, stream]).generate_state(1)[0])


def noise_seeds(seed: int, reproducible: bool) -> tuple[int, int]:
    """Seeds of the Poisson sampler's and the noise's generators for one task.

    Reproducible: derived from the task seed.  Otherwise 63 fresh bits each from the OS
    (:func:`secrets.randbits`), nothing the server sent or could know.
    """
    if reproducible:
        return _derive_seed(seed, 1), _derive_seed(seed, 2)
    return secrets.randbits(63), secrets.randbits(63)


_said_insecure = False


def _log_secure_rng_once(caught: list) -> None:
    """Opacus' "Secure RNG turned off" warning, as one INFO line per process (the server says it
    once per run at WARNING)."""
    global _said_insecure
    for w in caught:
        text = str(w.message)
        if "Secure RNG turned off" in text:
            if not _said_insecure:
                _said_insecure = True
                log.info("opacus: %s", " ".join(text.split()))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


class _EmptyBatchSafe:
    """The wrapped model for ``grad_sample_mode`` functorch and ew, whose per-sample machinery
    fails on the empty batches Poisson sampling draws (``vmap`` / ExpandedWeights of batch 0).

    On an empty batch: forward through the plain model without it, and give every trainable
    parameter the empty per-sample gradient ``hooks`` mode computes there, so that the
    ``DPOptimizer`` still adds the noise (its clipped sum is zero) and the accountant counts the step.
    """

    def __init__(self, gsm: nn.Module) -> None:
        self.gsm = gsm
        self.switch = hasattr(gsm, "disable_hooks")  # functorch: its hooks also fire in backward
        self.off = False

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        if x.shape[0] > 0:
            if self.off:
                self.gsm.enable_hooks()
                self.off = False
            return self.gsm(x, *args, **kwargs)
        if self.switch and not self.off:
            self.gsm.disable_hooks()  # until the next non-empty batch (this one's backward included)
            self.off = True
        inner = self.gsm._module
        out = inner(x, *args, **kwargs)
        for p in inner.parameters():
            if p.requires_grad:
                p.grad_sample = p.new_zeros((0, *p.shape))
        return out


class OpacusHook:
    """``make_private`` hook for :func:`fedasync.task.train.local_train` (one per task).

    ``history``: the client's accountant history so far; after training, :attr:`history` is the
    accountant's new one.  Call :meth:`close` afterwards (it removes Opacus' hooks from the model,
    which a client reuses for its next task).  ``sample_rate`` and ``expected_batch_size`` (a
    deployed device): sample at that public ``q`` (``1/k``) and divide the noisy sum by that public
    number, instead of ``1/ceil(n/b)`` and ``n // k`` from the client's own ``n`` records.
    ``default_loss=False`` (a task with its own ``loss(model, batch)``): ghost clipping needs a
    ``criterion(outputs, targets)``, so ``ghost`` runs as ``hooks`` (the same clipping and noise).
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        accountant: str = "rdp",
        grad_sample_mode: str = "ghost",
        history: list | None = None,
        seed: int = 0,
        secure_mode: bool = False,
        reproducible_noise: bool = False,
        sample_rate: float | None = None,
        expected_batch_size: int | None = None,
        default_loss: bool = True,
    ) -> None:
        if grad_sample_mode == "ghost" and not default_loss:
            grad_sample_mode = "hooks"
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise PrivacyError(f"privacy.local_dp.grad_sample_mode: {grad_sample_mode!r} is not one of "
                               f"{', '.join(GRAD_SAMPLE_MODES)}")
        check_secure_mode(secure_mode)
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.accountant_name = accountant
        self.grad_sample_mode = grad_sample_mode
        self.initial_history = as_history(history)
        if reproducible_noise and secure_mode:
            raise PrivacyError("privacy.reproducible_noise: true cannot hold with secure_mode: true")
        self.seed = int(seed)
        self.secure_mode = bool(secure_mode)
        self.reproducible_noise = bool(reproducible_noise)
        self.engine = None
        self.module = None
        # a device's public plan (the task's q and sum's denominator), never its own record count
        self.planned_rate = None if sample_rate is None else float(sample_rate)
        self.expected_batch_size = None if expected_batch_size is None else int(expected_batch_size)
        self.sample_rate: float | None = None

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader):
        from opacus import PrivacyEngine

        check_model(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.engine = PrivacyEngine(accountant=self.accountant_name, secure_mode=self.secure_mode)
        _log_secure_rng_once(caught)
        if self.initial_history:
            self.engine.accountant.load_state_dict({"history": list(self.initial_history),
                                                    "mechanism": self.accountant_name})
        batch = int(getattr(data_loader, "planned_batch_size", None) or data_loader.batch_size)
        sample_seed, noise_seed = noise_seeds(self.seed, self.reproducible_noise)
        # Poisson sampling at q = 1 / ceil(n / batch), sampled with its own generator (secure_mode:
        # Opacus swaps in torchcsprng).  Not make_private(poisson_sampling=True): its loader has
        # int(1 / q) steps, which float rounding makes ceil(n / batch) - 1 for some sizes (93, 99,
        # ...), and make_private accounts at 1 / len(loader), so the accountant recorded a larger q
        # than the one sampled with and budgeted for.  Here len(loader) is exactly 1 / q.
        from opacus.data_loader import DPDataLoader

        if self.planned_rate is not None:  # a device: q from the task, whatever its own n
            k = round(1.0 / self.planned_rate)
            if not 0 < self.planned_rate <= 1 or 1.0 / k != self.planned_rate:
                raise PrivacyError(f"privacy: sample_rate {self.planned_rate!r} is not 1/k for a whole number k")
        else:
            k = math.ceil(len(data_loader.dataset) / batch)
        base = DPDataLoader(data_loader.dataset, sample_rate=1.0 / k,
                            generator=torch.Generator().manual_seed(sample_seed))
        base.batch_sampler.steps = k
        device = next(model.parameters()).device
        kwargs: dict[str, Any] = {}
        if not self.secure_mode:
            kwargs["noise_generator"] = torch.Generator(device=device).manual_seed(noise_seed)
        with warnings.catch_warnings():
            # Opacus warns about the ignored full-backward-hook semantics of some layers; not actionable
            warnings.filterwarnings("ignore", category=UserWarning, module=r"opacus\..*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            out = self.engine.make_private(
                module=model, optimizer=optimizer, data_loader=base, criterion=nn.CrossEntropyLoss(),
                noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                grad_sample_mode=self.grad_sample_mode, poisson_sampling=False, **kwargs,
            )
        if self.grad_sample_mode == "ghost":
            module, dp_optimizer, criterion, loader = out  # the wrapped criterion's loss must be used
        else:
            module, dp_optimizer, loader = out
            criterion = None
        # Opacus averages over int(n * q) records, which float rounding makes one less than n // k for
        # some n (784 records, batch 16: 15, a 16/15 larger step; batch 1, 49 records: 0, a NaN model)
        # (a device divides by the public num_examples // k instead: the server's plan, not its own n)
        dp_optimizer.expected_batch_size = (len(data_loader.dataset) // k if self.expected_batch_size is None
                                            else self.expected_batch_size)
        self.module = module
        if self.grad_sample_mode in ("functorch", "ew"):
            module = _EmptyBatchSafe(module)
        self.sample_rate = 1.0 / len(loader)  # what make_private gave the accountant
        if self.sample_rate != loader.batch_sampler.sample_rate:  # pragma: no cover - see above
            raise PrivacyError(f"privacy: Opacus accounts q={self.sample_rate} but samples at "
                               f"q={loader.batch_sampler.sample_rate}")
        return module, dp_optimizer, loader, criterion

    @property
    def history(self) -> list[tuple[float, float, int]]:
        if self.engine is None:
            return list(self.initial_history)
        return as_history(self.engine.accountant.history)

    def close(self) -> None:
        """Remove Opacus' hooks and per-sample attributes from the (reused) model."""
        if self.module is not None:
            close = getattr(self.module, "_close", None) or getattr(self.module, "cleanup", None)
            if close is not None:
                close()
            self.module = None


# -- a client's DP task ----------------------------------------------------------------------------------


def _state_file(state_dir: str | os.PathLike, key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", key) or "client"
    return Path(state_dir) / f"accountant-{safe}.json"


def load_state_file(path: Path, accountant: str) -> list:
    if not path.is_file():
        return []
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PrivacyError(f"privacy state file {path}: unreadable ({e}); refusing to train without it") from None
    if d.get("accountant") != accountant:
        raise PrivacyError(f"privacy state file {path}: accountant {d.get('accountant')!r}, the task asks for {accountant!r}")
    return as_history(d.get("history"))


def save_state_file(path: Path, accountant: str, history: list, delta: float, epsilon: float) -> None:
    """Atomic write (temporary file + rename): a crash never leaves a truncated accountant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"accountant": accountant, "history": history_json(history), "delta": delta,
                          "epsilon": epsilon}, indent=1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class DPTaskResult:
    refused: str | None
    metrics: dict[str, Any]
    train: Any = None  # the TrainResult when trained


def resolve_history(pconf: dict, state_dir: str | None) -> tuple[list, Path | None]:
    """The client's accountant history before this task, and the state file to update (if any)."""
    accountant = pconf["accountant"]
    if pconf.get("history") is not None:  # simulation: the server's store keeps the state
        return as_history(pconf["history"]), None
    server = as_history(pconf.get("server_history"))
    if not state_dir:  # the server's record misses what it never took (a crash, a cancelled backup's reply)
        raise PrivacyError("privacy: this device keeps no DP accountant of its own; start it with "
                           "--privacy-state-dir DIR (node config privacy-state-dir): the server's record "
                           "alone misses the tasks whose replies it never took, and cannot enforce the budget")
    path = _state_file(state_dir, str(pconf.get("state_key", "client")))
    local = load_state_file(path, accountant)
    return _raised_by(server, local, path), path


def _raised_by(server: list, local: list, path: Path) -> list:
    """The server's record may only raise the local one: taken when it holds every local step
    (:func:`~fedasync.privacy.budgets.covers`: its epsilon is at least the local one's), else ignored."""
    if server != local and covers(server, local):
        log.warning("privacy state %s has %d steps but the server recorded %d holding them all: using the "
                    "server's history", path, history_steps(local), history_steps(server))
        return server
    return local


def _hook(pconf: dict, accountant: str, sigma: float, history: list, seed: int, task, **extra) -> OpacusHook:
    """The task's Opacus hook: its clip, ``grad_sample_mode`` and ``secure_mode``; ghost clipping
    only with the default loss (:class:`OpacusHook` ``default_loss``)."""
    return OpacusHook(noise_multiplier=sigma, max_grad_norm=float(pconf["max_grad_norm"]), accountant=accountant,
                      grad_sample_mode=pconf.get("grad_sample_mode", "ghost"), history=history, seed=seed,
                      secure_mode=bool(pconf.get("secure_mode", False)),
                      default_loss=task is None or not task.has_loss, **extra)


def _train_private(hook: OpacusHook, model: nn.Module, x, y, train_cfg, seed: int, device, task):
    """:func:`fedasync.task.train.local_train` through ``hook``, whose Opacus hooks are removed after."""
    from fedasync.task.train import local_train

    try:
        with warnings.catch_warnings():
            # Opacus' hooks make torch warn that a full backward hook fires on module outputs: expected
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
            warnings.filterwarnings("ignore", message=".*Using a non-full backward hook.*")
            return local_train(model, x, y, train_cfg, seed=seed, device=device, make_private=hook, task=task)
    finally:
        hook.close()


def private_task(model: nn.Module, x, y: np.ndarray | None, train_cfg, seed: int, device,
                 pconf: dict, state_dir: str | None = None, *, task=None) -> DPTaskResult:
    """Enforce the budget, then train with DP-SGD (see the module docstring). ``x, y``: arrays, or a
    Dataset and ``None``; ``task``: its loss and ``train`` override (:func:`fedasync.task.train.local_train`)."""
    from fedasync.task.train import steps_for

    accountant = pconf["accountant"]
    delta = float(pconf["delta"])
    budget = pconf.get("epsilon")
    check_enforcing(accountant)  # a client never enforces its budget with gdp, whatever it is sent
    check_secure_mode(bool(pconf.get("secure_mode", False)))
    n = len(y) if y is not None else len(x)
    q = sample_rate_for(n, train_cfg.batch_size)
    steps = steps_for(train_cfg, n)
    sigma = float(pconf["noise_multiplier"])
    if pconf.get("noise_auto") and (q != pconf.get("sample_rate") or steps != pconf.get("steps")):
        # a device whose own data differs from what the server planned for: calibrate for it
        sigma = calibrate(float(budget), delta, q, steps * int(pconf["planned_tasks"]), accountant)
    history, state_path = resolve_history(pconf, state_dir)
    planned = extend_history(history, sigma, q, steps, accountant)
    eps_next = epsilon_of(planned, delta, accountant)
    common = {"delta": delta, "epsilon_budget": budget, "accountant": accountant, "noise_multiplier": sigma,
              "sample_rate": q}
    if budget is not None and eps_next > float(budget):
        return DPTaskResult(refused=REFUSED, metrics={
            "epsilon": epsilon_of(history, delta, accountant), "epsilon_next": eps_next,
            "accountant_history": history_json(history), **common})
    hook = _hook(pconf, accountant, sigma, history, seed, task,
                 reproducible_noise=bool(pconf.get("reproducible_noise", False)))
    result = _train_private(hook, model, x, y, train_cfg, seed, device, task)
    after = hook.history
    if history_steps(after) - history_steps(history) != steps:  # e.g. a task's train override
        raise PrivacyError(f"privacy: the accountant charged {history_steps(after) - history_steps(history)} "
                           f"steps, the task planned {steps}")
    if hook.sample_rate != q:  # pragma: no cover - q is Opacus' own rule, computed the same way
        raise PrivacyError(f"privacy: Opacus sampled at q={hook.sample_rate}, the budget assumed q={q}")
    eps = eps_next if after == planned else epsilon_of(after, delta, accountant)
    if state_path is not None:
        save_state_file(state_path, accountant, after, delta, eps)
    return DPTaskResult(refused=None, train=result, metrics={
        "epsilon": eps, "dp_steps": history_steps(after) - history_steps(history),
        "accountant_history": history_json(after), "max_grad_norm": float(pconf["max_grad_norm"]), **common})


# -- a deployed device's DP task, under its own policy -----------------------------------------------------


@contextlib.contextmanager
def _locked(state_dir: str | os.PathLike):
    """One DP task at a time per state dir (two clients sharing it share one budget)."""
    Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(Path(state_dir) / "accountant.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def device_state_file(state_dir: str | os.PathLike) -> Path:
    """The device's one accountant file, for every run and server: named by its own id
    (:func:`fedasync.privacy.policy.device_id`), never by anything a task carries."""
    from fedasync.privacy.policy import device_id

    return Path(state_dir) / f"accountant-device-{device_id(state_dir)}.json"


def device_task(model: nn.Module, x, y: np.ndarray | None, train_cfg, seed: int, device, pconf: dict,
                policy, state_dir: str | None, *, task=None) -> DPTaskResult:
    """A deployed device's DP task (``pconf`` already passed :func:`~fedasync.privacy.policy.check_task`).

    The budget, delta and accountant are the policy's; the history is the device's own file
    (:func:`device_state_file`; the task's ``server_history`` only raises it). q, steps and sigma
    are the task's public plan (``sample_rate``, ``steps``, ``noise_multiplier``) and the DP
    optimizer divides by ``num_examples // k`` (``k = 1/q``), so no reply field depends on the
    device's own record count. The planned spend is saved **before** training: a crash mid-task
    leaves it charged."""
    if not state_dir:
        raise PrivacyError("privacy: this device keeps no DP accountant of its own; start it with "
                           "--privacy-state-dir DIR (node config privacy-state-dir)")
    accountant, delta, budget = policy.accountant, float(policy.delta), float(policy.epsilon)
    check_enforcing(accountant)
    sigma, q, steps = float(pconf["noise_multiplier"]), float(pconf["sample_rate"]), int(pconf["steps"])
    expected = max(1, int(pconf["num_examples"]) // round(1.0 / q))
    common = {"delta": delta, "epsilon_budget": budget, "accountant": accountant, "noise_multiplier": sigma,
              "sample_rate": q}
    with _locked(state_dir):
        path = device_state_file(state_dir)
        history = _raised_by(as_history(pconf.get("server_history")), load_state_file(path, accountant), path)
        planned = extend_history(history, sigma, q, steps, accountant)
        eps_next = epsilon_of(planned, delta, accountant)
        if eps_next > budget:
            log.warning("privacy: refused a task: epsilon would reach %.4g, over this device's budget %.4g",
                        eps_next, budget)
            return DPTaskResult(refused=REFUSED, metrics={
                "epsilon": epsilon_of(history, delta, accountant), "epsilon_next": eps_next,
                "accountant_history": history_json(history), **common})
        save_state_file(path, accountant, planned, delta, eps_next)  # charged before anything is released
        hook = _hook(pconf, accountant, sigma, history, seed, task, sample_rate=q, expected_batch_size=expected)
        cfg = train_cfg.model_copy(update={"local_steps": steps, "local_epochs": None})  # the plan's steps
        result = _train_private(hook, model, x, y, cfg, seed, device, task)
        if hook.history != planned:  # pragma: no cover - the accountant steps exactly as planned
            raise PrivacyError(f"privacy: the accountant recorded {hook.history}, the plan was {planned}")
    return DPTaskResult(refused=None, train=result, metrics={
        "epsilon": eps_next, "dp_steps": steps, "accountant_history": history_json(planned),
        "max_grad_norm": float(pconf["max_grad_norm"]), **common})
