"""One function builds a run's parts from its config and its task; the loop only runs them.

:func:`assemble` is what ``fedasync simulate`` (:mod:`fedasync.runs`), the Python API
(:mod:`fedasync.api`), Flower's ServerApp (``flwr run .``) and the deployment ServerApp
(``fedasync server``) call; :class:`fedasync.server.loop.AsyncServer` takes the :class:`RunParts`
it returns and neither loads data nor builds models. A caller may pass any part ready-made
(``strategy=``, ``scheduler=``, ``evaluator=``, ...) and the rest is built from the config: a test
swaps one part this way.

The task is :func:`fedasync.task.interface.task_from_config`'s: the Python API's object, else
``task:`` of the config, else the built-in task of ``data``/``model``. For the built-in task the
parts come from the federation's arrays (:func:`fedasync.task.data.load_federated`: the same
evaluation, validation gradient and initial model as before there was a task interface, so a
built-in run's model is bit-identical); for a user task, from its functions: client sizes are
``len(load_data(c, n)[0])``, the server evaluates ``evaluate(model, loader)`` on
``load_centralized()`` (else the clients' test sets pooled), and Zeno++'s validation gradient is
the gradient of ``loss`` over a seeded sample of the pooled training sets.

Evaluation returns the task's metric dict; with a validation set (``data.val_fraction > 0`` for the
built-in task, ``load_validation`` for a user task) the same metrics on it too, each prefixed
``val_`` (``val_accuracy``, ``val_loss``), so ``server.target`` may name them: a sweep tunes on
validation while the test metrics stay for reporting. ``data.val_fraction`` with a user task is a
``TaskError`` (the task defines its own ``load_validation``). A target (``server.target`` or
``target_accuracy``) names a metric; one the task does not report is a :class:`TargetError` at the first evaluation,
which :func:`assemble` runs on the initial model (a new run), before the run is written anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fedasync.config import Config

Params = dict[str, np.ndarray]

#: batch size of the server's evaluation and validation-gradient passes
EVAL_BATCH = 1024


class TargetError(ValueError):
    """The target's metric is not one the task reports (one line naming both)."""


class Evaluator:
    """``evaluator(params) -> {metric: value}``: the task's metrics of the model ``params``, on the
    server's evaluation set. ``target`` (a ``TargetConfig`` or None) names a metric that every
    result must hold. The last result is kept, keyed by the params' sha256, so the probe
    :func:`assemble` runs on the initial model is not computed twice."""

    def __init__(self, model: Any, metrics: Callable[[Any], dict], target: Any = None) -> None:
        self.model = model
        self._metrics = metrics
        self.target = target
        self._last: tuple[str, dict] | None = None

    def __call__(self, params: Params) -> dict[str, float]:
        from fedasync.server.strategies import params_sha256
        from fedasync.task.models import set_params

        key = params_sha256(params)
        if self._last is not None and self._last[0] == key:
            return dict(self._last[1])
        set_params(self.model, params)
        was = self.model.training
        self.model.eval()
        try:
            out = {str(k): float(v) for k, v in self._metrics(self.model).items()}
        finally:
            self.model.train(was)
        self.check(out)
        self._last = (key, out)
        return dict(out)

    def check(self, metrics: dict) -> None:
        t = self.target
        if t is not None and t.metric not in metrics:
            raise TargetError(f"server.target: metric {t.metric!r} is not one the task reports "
                              f"(its metrics: {', '.join(sorted(metrics)) or 'none'})")


@dataclass
class RunParts:
    """What a run is made of; :class:`~fedasync.server.loop.AsyncServer` takes it as is."""

    cfg: Config
    mode: str
    task: Any  # fedasync.task.interface.Task (the built-in one too)
    num_examples: list[int]  # each client's training examples (steps per task, DP plans)
    profiles: list  # each client's speed profile (server/clock.py)
    strategy: Any
    policy: Any  # server/policy.Policies (scheduler, delay compensation, filter, attack)
    evaluator: Evaluator
    initial_params: Callable[[], Params]  # the model of version 0 (a new run)
    setup_json: str  # what every task carries for its client to build its data, model and trainer
    make_privacy: Callable[..., Any] | None = None  # (store, run_id, strategy, resumed) -> PrivacyTracker
    extra: dict = field(default_factory=dict)

    @property
    def scheduler(self) -> Any:
        return self.policy.scheduler

    def new_model(self, params: Params | None = None) -> Any:
        """A fresh ``nn.Module`` of the task's architecture, holding ``params`` when given."""
        from fedasync.task.models import set_params

        m = self.task.model()
        if params is not None:
            set_params(m, params)
        return m


def _builtin_sources(cfg: Config):
    """The built-in task's arrays: (task, fed, sizes, eval model, metrics fn, validation gradient fn,
    init). With ``privacy.local_dp.fix_model`` every model is the task's fixed one."""
    from fedasync.task.data import load_federated, load_test, load_validation
    from fedasync.task.models import build_model, init_params
    from fedasync.task.train import evaluate, gradient

    from fedasync.task import interface

    fed = load_federated(cfg.data, cfg.seed)
    x_test, y_test = load_test(cfg.data, cfg.seed)
    val = load_validation(cfg.data, cfg.seed)
    task = interface.builtin_task(cfg.data, cfg.model, cfg.seed, tuple(fed.input_shape), int(fed.num_classes))
    dp = cfg.privacy.local_dp
    task.fix_model = bool(dp.enabled and getattr(dp, "fix_model", False))  # task.model() then applies the fix

    def new_model():
        return task.model() if task.fix_model else build_model(cfg.model, fed.input_shape, fed.num_classes)

    def metrics(model) -> dict:
        loss, acc = evaluate(model, x_test, y_test)
        if val is None:
            return {"accuracy": acc, "loss": loss}
        val_loss, val_acc = evaluate(model, *val)
        return {"accuracy": acc, "loss": loss, "val_accuracy": val_acc, "val_loss": val_loss}

    def validation(size: int):
        from fedasync.server.robust import validation_split

        x, y = validation_split(fed.partitions, size, cfg.seed)  # training data only, never the test set
        model = new_model()

        def grad(params: Params) -> Params:
            from fedasync.task.models import set_params

            set_params(model, params)
            return gradient(model, x, y)
        return grad

    if task.fix_model:
        init = lambda: interface.init_params(task, cfg.seed)  # noqa: E731
    else:
        init = lambda: init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)  # noqa: E731
    model = new_model()
    return task, fed, [len(p[1]) for p in fed.partitions], model, metrics, validation, init


def task_sources(cfg: Config, task: Any):
    """A user task's parts: (sizes, eval model, metrics fn, validation gradient fn, init)."""
    import torch
    from torch.utils.data import ConcatDataset, DataLoader, Subset

    from fedasync.task.interface import TaskError, check_nonempty, init_params

    if cfg.data.val_fraction > 0:
        raise TaskError(f"data.val_fraction: task {task.name} brings its own data; define load_validation in the "
                        "task (same shape as load_centralized) instead")
    n = cfg.data.num_clients
    parts = [task.load_data(c, n) for c in range(n)]
    sizes = [len(tr) for tr, _ in parts]
    evalset = task.load_centralized()
    where = f"task {task.name}: load_centralized"
    if evalset is None:  # no server set: the clients' test sets pooled
        evalset, where = ConcatDataset([te for _, te in parts if len(te)]) if any(len(te) for _, te in parts) \
            else [], f"task {task.name}: load_data(...)[1] (every client's test set)"
    check_nonempty(evalset, where)
    valset = task.load_validation()
    model = task.model()

    def metrics(m) -> dict:
        with torch.no_grad():
            out = task.evaluate(m, DataLoader(evalset, batch_size=EVAL_BATCH))
            if valset is not None:
                val = task.evaluate(m, DataLoader(valset, batch_size=EVAL_BATCH))
                out.update({f"val_{k}": v for k, v in val.items()})
            return out

    def validation(size: int):
        from fedasync.task.models import get_params, set_params

        pool = ConcatDataset([tr for tr, _ in parts])
        rng = np.random.default_rng(np.random.SeedSequence([int(cfg.seed), 0x7A3E]))
        idx = np.sort(rng.choice(len(pool), size=min(int(size), len(pool)), replace=False))
        data = Subset(pool, [int(i) for i in idx])
        vmodel = task.model()

        def grad(params: Params) -> Params:
            set_params(vmodel, params)
            vmodel.eval()
            vmodel.zero_grad(set_to_none=True)
            total = len(data)
            for batch in DataLoader(data, batch_size=EVAL_BATCH):
                from fedasync.task.interface import batch_size_of

                (task.loss(vmodel, batch) * (batch_size_of(batch) / total)).backward()
            named = dict(vmodel.named_parameters())
            out = {k: (named[k].grad.detach().numpy().astype(np.float32) if k in named and named[k].grad is not None
                       else np.zeros_like(v)) for k, v in get_params(vmodel).items()}
            vmodel.zero_grad(set_to_none=True)
            return out
        return grad

    return sizes, model, metrics, validation, lambda: init_params(task, cfg.seed)


def assemble(cfg: Config, *, task: Any = None, base_dir: Any = None, mode: str = "simulation",
             resume: bool = False, strategy: Any = None, scheduler: Any = None, policy: Any = None,
             evaluator: Evaluator | None = None, profiles: list | None = None) -> RunParts:
    """The parts of a run of ``cfg`` (``task``: the Python API's module or object; ``base_dir``:
    where ``task:`` is imported from, the YAML's folder). Any part given is used as is;
    ``scheduler`` replaces the one ``server.scheduler`` names. A new run (not ``resume``) evaluates
    the initial model here, so a target metric the task does not report fails before anything is
    written (:class:`TargetError`); a task that cannot be loaded is a ``TaskError``."""
    from fedasync.server.clock import make_profiles
    from fedasync.server.policy import Policies
    from fedasync.server.strategies import make_strategy
    from fedasync.server.transport import client_setup_json

    user = task is not None or bool(getattr(cfg, "task", None))
    fed = None
    if user:
        from fedasync.task.interface import task_from_config

        the_task = task_from_config(cfg, task, base_dir)
        sizes, model, metrics, validation, init = task_sources(cfg, the_task)
    else:
        the_task, fed, sizes, model, metrics, validation, init = _builtin_sources(cfg)
    if strategy is None:
        central = cfg.privacy.central_dp if cfg.privacy.central_dp.enabled else None
        strategy = make_strategy(cfg.server, cfg.weighting, cfg.seed, central_dp=central,
                                 reproducible_noise=cfg.privacy.reproducible_noise)
    if policy is None:
        policy = Policies(cfg, validation, mode, scheduler=scheduler)
    if evaluator is None:
        evaluator = Evaluator(model, metrics, cfg.server.goal())
    setup = client_setup_json(cfg, fed) if fed is not None else _user_setup(cfg, the_task, base_dir)
    make_privacy = None
    if cfg.privacy.local_dp.enabled or cfg.privacy.central_dp.enabled:
        if user and not resume:  # a DP setting this task cannot run: one line, before the run exists
            from fedasync.privacy.tracker import check_runnable

            check_runnable(cfg, sizes, the_task.model)
        def make_privacy(store, run_id, strat, resumed):
            from fedasync.privacy.tracker import PrivacyTracker

            return PrivacyTracker(cfg, store, run_id, strat, resumed=resumed, sizes=sizes, model=the_task.model)
    parts = RunParts(cfg=cfg, mode=mode, task=the_task, num_examples=list(sizes),
                     profiles=profiles if profiles is not None else make_profiles(cfg.data.num_clients, cfg.clock,
                                                                                  cfg.seed),
                     strategy=strategy, policy=policy, evaluator=evaluator, initial_params=_once(init),
                     setup_json=setup, make_privacy=make_privacy)
    if not resume and evaluator.target is not None:
        evaluator(parts.initial_params())  # the first evaluation, before the run exists
    return parts


def _user_setup(cfg: Config, task: Any, base_dir: Any) -> str:
    """A user task's setup (:func:`~fedasync.server.transport.client_setup_json`: the task's name,
    digest and args, never code; ``base_dir`` for a simulated client's import). The task object is
    remembered in this process (``fedasync.task.interface.remember``), so that an in-process client
    uses the very object the Python API was given (a notebook's functions have no module to import)."""
    import inspect

    from fedasync.server.transport import client_setup_json
    from fedasync.task import interface

    if hasattr(interface, "remember"):
        interface.remember(task)
    params = inspect.signature(client_setup_json).parameters
    kw = {k: v for k, v in (("task", task), ("base_dir", None if base_dir is None else str(base_dir)))
          if k in params}
    return client_setup_json(cfg, None, **kw)


def _once(fn: Callable[[], Params]) -> Callable[[], Params]:
    """``fn`` computed at the first call and returned after (the initial model is built once)."""
    box: list = []

    def get() -> Params:
        if not box:
            box.append(fn())
        return box[0]
    return get
