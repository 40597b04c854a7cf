"""``fedasync task check CONFIG``: try a config's task on one client before a run.

It builds the model (from the run's seed), loads one client's data, takes one training step the
way a run's client does (one DP-SGD step when ``privacy.local_dp`` is on), evaluates on the
server's evaluation set (the client's test set when the task has none), and prints what it saw:
the first batch's structure and shapes, the parameter count, the step time and the metrics.
A task that cannot be used is one line (the :class:`~fedasync.task.interface.TaskError`, naming
the function), exit 2; so is a ``server.target`` metric that ``evaluate`` does not return.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer

from fedasync.cli.common import console, fail, load_or_exit

task_app = typer.Typer(help="Check a task (your model, data, loss and metrics) before a run.", no_args_is_help=True)


def describe(batch: Any) -> str:
    """A batch's structure with each tensor's shape and dtype: ``(x [16, 64] float32, y [16] int64)``."""
    import torch

    if isinstance(batch, torch.Tensor):
        return f"[{', '.join(str(d) for d in batch.shape)}] {str(batch.dtype).replace('torch.', '')}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in batch) + ")"
    return type(batch).__name__


def _user_code(where: str, fn, *args):
    """Call a task function; its own exception becomes one line naming it (a TaskError stays as it is)."""
    from fedasync.task.interface import TaskError

    try:
        return fn(*args)
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"{where} raised {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                        ) from None


def run_check(cfg, task, client: int) -> dict[str, Any]:
    """The check itself (see the module docstring); returns what it measured. Raises TaskError."""
    import torch
    from torch.utils.data import DataLoader

    from fedasync.task.interface import TaskError, check_nonempty, init_params
    from fedasync.task.models import set_params

    name = task.name
    params = _user_code(f"task {name}: model()", init_params, task, cfg.seed)
    model = task.model()
    set_params(model, params)
    n_params = int(sum(p.numel() for p in model.parameters()))
    train, test = _user_code(f"task {name}: load_data({client}, {cfg.data.num_clients})", task.load_data, client,
                             cfg.data.num_clients)
    check_nonempty(train, f"task {name}: load_data({client}, {cfg.data.num_clients})[0] (train)")
    first = next(iter(DataLoader(train, batch_size=min(cfg.train.batch_size, len(train)))))
    with torch.no_grad():
        loss = _user_code(f"task {name}: loss(model, batch)", task.loss, model, first)
    if not torch.isfinite(loss):
        raise TaskError(f"task {name}: loss(model, batch) is {float(loss)} on the first batch")
    step = train_one_step(cfg, task, model, train, client)
    central = _user_code(f"task {name}: load_centralized()", task.load_centralized)
    eval_set, eval_name = (central, "load_centralized()") if central is not None else (test, "the client's test set")
    check_nonempty(eval_set, f"task {name}: {eval_name}")
    metrics = _user_code(f"task {name}: evaluate(model, loader)", task.evaluate, model,
                         DataLoader(eval_set, batch_size=256))
    goal = cfg.server.goal()
    if goal is not None and goal.metric not in metrics:
        raise TaskError(f"server.target.metric: {goal.metric!r} is not a metric of task {name}'s evaluate "
                        f"(it returns {', '.join(sorted(metrics))})")
    return {"task": name, "digest": task.digest, "params": n_params, "train_size": len(train),
            "test_size": len(test), "eval_set": eval_name, "eval_size": len(eval_set), "batch": describe(first),
            "loss": float(loss), **step, "metrics": metrics}


def train_one_step(cfg, task, model, train, client: int) -> dict[str, Any]:
    """One local step through fedasync's own training loop (:func:`fedasync.task.train.local_train`),
    under DP-SGD with the client's planned noise multiplier (:func:`fedasync.privacy.budgets.plan_client`)
    when ``privacy.local_dp`` is on; the step time in ms. ``model`` ends with the step's parameters."""
    import copy
    import warnings

    from fedasync.task.train import local_train, steps_for

    one = cfg.train.model_copy(update={"local_steps": 1, "local_epochs": None})
    dp = cfg.privacy.local_dp
    hook, kind, sigma = None, "SGD", None
    if dp.enabled:
        from fedasync.privacy.budgets import plan_client, resolve_budgets
        from fedasync.privacy.dp import OpacusHook, check_model

        budget = resolve_budgets(cfg.privacy, cfg.data.num_clients)[client]
        plan = plan_client(client, len(train), steps_for(cfg.train, len(train)), cfg.train.batch_size, budget, dp)
        sigma = plan.noise_multiplier
        check_model(model)  # (task.model() applied privacy.local_dp.fix_model) one line naming the layer
        hook = OpacusHook(noise_multiplier=sigma, max_grad_norm=dp.max_grad_norm, accountant=dp.accountant,
                          grad_sample_mode=dp.grad_sample_mode, seed=cfg.seed, default_loss=not task.has_loss)
        kind = f"DP-SGD (noise multiplier {sigma:.3g}, q {plan.sample_rate:.3g}, clip {dp.max_grad_norm:g})"
    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # its first use imports torch._dynamo (~2 s)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
            result = local_train(copy.deepcopy(model) if hook is None else model, train, one, seed=cfg.seed,
                                 device=None, make_private=hook, task=task)
    finally:
        if hook is not None:
            hook.close()
    ms = (time.perf_counter() - t0) * 1e3
    from fedasync.task.models import set_params

    set_params(model, result.params)  # evaluate the model the step made
    return {"kind": kind, "step_ms": ms, "steps": result.steps, "train_loss": result.loss}


def check(
    config: str = typer.Argument(..., help="The YAML config of the run (its task: and task_args:)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set task_args.hidden=16 (repeatable)."),
    client: int = typer.Option(0, "--client", help="Which client's data to load (0..data.num_clients-1)."),
) -> None:
    """Build the model, load one client's data, take one (DP) training step, evaluate; print what was seen."""
    from fedasync.task.interface import TaskError, task_from_config

    cfg = load_or_exit(config, set_)
    if not 0 <= client < cfg.data.num_clients:
        fail(f"--client: {client} is not in 0-{cfg.data.num_clients - 1} (data.num_clients)")
    try:
        task = task_from_config(cfg, base_dir=Path(config).resolve().parent)
        out = run_check(cfg, task, client)
    except TaskError as e:
        fail(str(e))
    except (ValueError, FileNotFoundError, RuntimeError) as e:  # the built-in task's data, a DP refusal
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    console.print(f"task {out['task']} (sha256 {out['digest'][:12]}): {out['params']:,} parameters", markup=False)
    console.print(f"client {client} of {cfg.data.num_clients}: {out['train_size']} training and {out['test_size']} "
                  f"test samples; first batch {out['batch']}", markup=False, soft_wrap=True)
    console.print(f"loss on the first batch {out['loss']:.4g}; one {out['kind']} step in {out['step_ms']:.1f} ms "
                  "(setup included)", markup=False, soft_wrap=True)
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in out["metrics"].items())
    console.print(f"evaluate on {out['eval_set']} ({out['eval_size']} samples): {metrics}", markup=False, soft_wrap=True)
    console.print("ok", markup=False)


task_app.command("check")(check)


def register(app: typer.Typer) -> None:
    app.add_typer(task_app, name="task")
