"""What a client does with one task, independent of transport (Flower or in-process).

``handle_train(params, config)`` takes the global model and the task's config (as sent by the
server) and returns ``{"params": ..., "metrics": {...}}`` or ``{"refused": reason, ...}``.
Data, model and trainer are built once per process and cached by the setup they came from.

What a reply says under local DP: the parameters (DP-SGD), the accounting (epsilon, the
accountant history, sigma, q, steps) and ``num_examples`` = the number of records the server
planned this client with (``privacy.num_examples``, which the server computed itself), not a
fresh count.  No training ``loss``: it is computed on private data without noise or accounting.
``privacy.local_dp.report_loss: true`` adds it back, outside the (epsilon, delta) guarantee.

A real device (``device_node``: the SuperNode was started by ``fedasync client``) or a task
marked ``deployment`` never derives its noise from the seed the server sends: a task asking for
``privacy.reproducible_noise`` is refused with an error.

A real device decides its own privacy (:mod:`fedasync.privacy.policy`): without a DP policy it
refuses every local-DP task (``privacy_policy``); with one, a task that asks for less privacy
than the policy allows is refused (``privacy_policy``, the rule in the reply's ``policy_rule``
and in a log line) before any data is read, and an accepted one trains with the policy's budget
and the device's own accountant file, at the task's public q, steps and sigma
(:func:`fedasync.privacy.dp.device_task`): nothing in the reply depends on its record count.

Simulated attacks: a simulation task for a malicious client carries ``"attack": {"kind": ...,
"factor": ...}`` (``attack:`` in YAML, see :mod:`fedasync.clients.attack`). ``label_flip`` trains on
flipped labels; ``sign_flip``, ``scale`` and ``gaussian`` transform the trained parameters before the
reply. The attack module is imported only for such a task; a deployment task carrying ``attack``, or
any task carrying it to a real device (``device_node``), is refused (``attack_in_deployment``)
without training.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import numpy as np
import torch

Params = dict[str, np.ndarray]
TASK_MISMATCH = "task_mismatch"


@functools.lru_cache(maxsize=8)
def _federated(data_json: str, seed: int):
    from fedasync.config import DataConfig
    from fedasync.task.data import load_federated

    return load_federated(DataConfig.model_validate(json.loads(data_json)), seed)


def _federation(setup_json: str):
    s = json.loads(setup_json)
    return _federated(json.dumps(s["data"], sort_keys=True), s["seed"])


class TaskMismatch(Exception):
    """This device's task module is not the server's (name or digest): the task is refused."""


def setup_task(setup_json: str, node_task: str | None = None, device_node: bool = False):
    """The :class:`~fedasync.task.interface.Task` a setup names, built on this side.

    The setup carries the task's ``name``, ``digest`` and ``args``, never code. The built-in task
    (no ``task`` key) is built from the setup's data and model sections. A user task is the one this
    process holds (the Python API's object, :func:`fedasync.task.interface.remember`), else imported
    by name: on a device from its own environment (``node_task``, node config ``task``, when given;
    else the server's name), in simulation also from the setup's ``base_dir``. A module whose name
    or source digest differs from the server's raises :class:`TaskMismatch`."""
    return _setup_task(setup_json, node_task or None, bool(device_node))


@functools.lru_cache(maxsize=8)
def _setup_task(setup_json: str, node_task: str | None, device_node: bool):
    from fedasync.config import DataConfig, ModelConfig
    from fedasync.task.interface import TaskError, builtin_task, known_task, load_task

    s = json.loads(setup_json)
    want = s.get("task")
    if want is None:
        if node_task:
            raise TaskMismatch(f"the server runs the built-in task, this device's task is {node_task!r}")
        shape = tuple(s["input_shape"]) if "input_shape" in s else None
        task = builtin_task(DataConfig.model_validate(s["data"]), ModelConfig.model_validate(s["model"]), s["seed"],
                            input_shape=shape, num_classes=s.get("num_classes"))
        if task.num_classes is None:
            task.num_classes = int(_federation(setup_json).num_classes)
    else:
        name, digest, args = str(want["name"]), str(want["digest"]), dict(want.get("args") or {})
        task = None if device_node else known_task(name, digest)
        if task is None:
            spec = node_task or name
            if node_task and node_task != name:
                raise TaskMismatch(f"the server's task is {name!r}, this device's is {node_task!r}")
            try:
                task = load_task(spec, args, base_dir=None if device_node else want.get("base_dir"))
            except TaskError as e:
                if not device_node:
                    raise
                raise TaskMismatch(f"the server's task {name!r} does not load here: {e}") from None
        if task.digest != digest:
            raise TaskMismatch(f"task {name}: this side's module (sha256 {task.digest[:12]}) differs from the "
                               f"server's (sha256 {digest[:12]})")
        task = dataclasses.replace(task, args=args)
    return dataclasses.replace(task, fix_model=bool(s.get("fix_model", False)))


@functools.lru_cache(maxsize=8)
def _setup(setup_json: str, node_task: str | None = None, device_node: bool = False):
    from fedasync.config import TrainConfig
    from fedasync.task.train import pick_device

    s = json.loads(setup_json)
    task = setup_task(setup_json, node_task, device_node)
    train_cfg = TrainConfig.model_validate(s["train"])
    device = pick_device(train_cfg.device)
    model = task.model().to(device)
    return s, task, model, train_cfg, device


@functools.lru_cache(maxsize=4)
def _npz(path: str, mtime_ns: int, size: int, normalize: tuple[float, float] | None = None):
    from fedasync.task.data import load_npz
    from fedasync.task.data import normalize as norm

    x, y = load_npz(path)
    return norm(x, normalize), y  # data.normalize, as the server's test set and simulated clients have it


def local_data(setup_json: str, client_id: int, data_path: str | None = None):
    """The built-in task's partition as arrays: from a device's own .npz when given (read once while
    the file is unchanged), else generated from the setup."""
    if data_path:
        import os

        st = os.stat(data_path)
        norm = json.loads(setup_json).get("data", {}).get("normalize")
        return _npz(str(data_path), st.st_mtime_ns, st.st_size, None if norm is None else tuple(norm))
    return _federation(setup_json).partitions[client_id]


@functools.lru_cache(maxsize=16)
def _train_dataset(setup_json: str, node_task: str | None, device_node: bool, client_id: int,
                   data_path: str | None, _mtime_ns: int | None = None, _size: int | None = None):
    from fedasync.task.interface import check_nonempty

    s = json.loads(setup_json)
    task = setup_task(setup_json, node_task, device_node)
    num_partitions = int(s["data"]["num_clients"]) if "data" in s else int(s["num_partitions"])
    train, _test = task.load_data(client_id, num_partitions, data_path)
    check_nonempty(train, f"task {task.name}: load_data({client_id}, {num_partitions})[0] (train)")
    return train


def train_data(setup_json: str, client_id: int, data_path: str | None = None, node_task: str | None = None,
               device_node: bool = False):
    """This client's training Dataset: the task's ``load_data(client_id, num_partitions,
    data_path=...)[0]`` (a device's own ``--data`` file as ``data_path``), cached per setup, client
    and file (its mtime and size: a changed file is read again). One that yields nothing is a
    TaskError naming ``load_data``."""
    st = None
    if data_path:
        import os

        st = os.stat(data_path)
    return _train_dataset(setup_json, node_task or None, bool(device_node), int(client_id),
                          str(data_path) if data_path else None,
                          st.st_mtime_ns if st else None, st.st_size if st else None)


def warm(setup_json: str, client_id: int | None = None, data_path: str | None = None,
         node_task: str | None = None, device_node: bool = False) -> None:
    """Load what a task of this setup needs (data, and the model when it trains on the CPU) into
    this process's caches, for the task processes forked from it (:mod:`fedasync.clients.warm`);
    ``node_task``/``device_node`` as :func:`handle_train` gets them, so the forks find the same entries.
    A GPU is never touched here: CUDA does not survive a fork, so a task on ``cuda``/``mps``/
    ``auto`` builds its model in its own process (the data is still shared)."""
    torch.set_num_threads(1)
    s = json.loads(setup_json)
    data = train_data(setup_json, client_id or 0, data_path, node_task, device_node)
    if str(s.get("train", {}).get("device", "auto")).lower() == "cpu":
        import copy

        from torch.utils.data import Subset

        from fedasync.task.train import local_train

        _s, task, model, train_cfg, device = _setup(setup_json, node_task or None, bool(device_node))
        # one step on a copy: torch's lazy set-up (optimizer, autograd) happens here, once,
        # instead of in every forked task process (seconds each)
        first = Subset(data, range(min(len(data), train_cfg.batch_size)))
        local_train(copy.deepcopy(model), first, train_cfg, seed=0, device=device, task=task)


def policy_refusal(policy, pconf: Any) -> str | None:
    """Why a real device refuses a task on privacy grounds (one line), or None: without a policy it
    refuses every DP task and trains the rest; with one it takes only DP tasks that pass
    :func:`fedasync.privacy.policy.check_task`."""
    from fedasync.privacy.policy import NO_POLICY, check_task

    if policy is None:
        return NO_POLICY if isinstance(pconf, dict) and pconf.get("local_dp") else None
    return check_task(policy, pconf)


def _flip(data, task):
    """The label-flip attack's data: ``(x, C - 1 - y)`` of an ``(x, y)`` TensorDataset with class labels."""
    from torch.utils.data import TensorDataset

    from fedasync.clients.attack import flip_labels

    if not (isinstance(data, TensorDataset) and len(data.tensors) == 2 and not data.tensors[1].is_floating_point()):
        raise ValueError(f"attack.kind label_flip: task {task.name}'s data is not (x, y) with class labels")
    x, y = data.tensors
    classes = task.num_classes if task.num_classes is not None else int(y.max()) + 1
    return TensorDataset(x, torch.from_numpy(flip_labels(y.numpy(), classes)))


def handle_train(params: Params, config: dict[str, Any], data_path: str | None = None,
                 state_dir: str | None = None, device_node: bool = False, policy=None,
                 node_task: str | None = None) -> dict[str, Any]:
    """``state_dir``: where a real device keeps its privacy accountant (node config
    ``privacy-state-dir``).  ``device_node``: this is a real device (see the module docstring);
    ``policy``: its :class:`~fedasync.privacy.policy.DevicePolicy` (node config ``privacy-policy``),
    checked before anything else: a task it refuses is ``{"refused": "privacy_policy"}``, logged.
    ``node_task``: the device's own task module (node config ``task``); a task whose module differs
    from it (name or source digest, :func:`setup_task`) is refused ``task_mismatch``, logged, before
    any data is read."""
    from fedasync.task.models import set_params
    from fedasync.task.train import local_train

    attack = config.get("attack")
    if attack and (config.get("deployment") or device_node):  # a real device never runs attack code
        return {"refused": "attack_in_deployment", "metrics": {}}
    pconf = config.get("privacy")
    if pconf and pconf.get("local_dp") and pconf.get("reproducible_noise") and (device_node or config.get("deployment")):
        from fedasync.privacy import REPRODUCIBLE_REFUSED
        from fedasync.privacy.budgets import PrivacyError

        raise PrivacyError(REPRODUCIBLE_REFUSED)
    try:
        setup_task(config["setup"], node_task, device_node)
    except TaskMismatch as e:
        import logging

        logging.getLogger("fedasync.task").warning("task mismatch: refused task %s: %s", config.get("task_id", "?"), e)
        return {"refused": TASK_MISMATCH, "metrics": {"task_rule": str(e)}}
    if device_node:
        why = policy_refusal(policy, config.get("privacy"))
        if why is not None:
            import logging

            from fedasync.privacy.policy import POLICY_REFUSED

            logging.getLogger("fedasync.privacy").warning("privacy policy: refused task %s: %s",
                                                          config.get("task_id", "?"), why)
            return {"refused": POLICY_REFUSED, "metrics": {"policy_rule": why}}
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    _s, task, model, train_cfg, device = _setup(config["setup"], node_task or None, bool(device_node))
    data = train_data(config["setup"], int(config["client_id"]), data_path, node_task, device_node)
    if attack and attack.get("kind") == "label_flip":
        data = _flip(data, task)
    dp_metrics: dict[str, Any] = {}
    if pconf and pconf.get("local_dp"):
        # DP-SGD (Opacus): enforce the budget before training, then train privately
        from fedasync.privacy.dp import private_task

        set_params(model, params)
        if device_node:  # its own policy, budget and accountant file; the task's public plan only
            from fedasync.privacy.dp import device_task

            dp = device_task(model, data, None, train_cfg, seed=int(config["seed"]), device=device, pconf=pconf,
                             policy=policy, state_dir=state_dir, task=task)
        else:
            dp = private_task(model, data, None, train_cfg, seed=int(config["seed"]), device=device, pconf=pconf,
                              state_dir=state_dir, task=task)
        if dp.refused is not None:
            return {"refused": dp.refused, "metrics": dp.metrics}
        result, dp_metrics = dp.train, dp.metrics
    else:
        set_params(model, params)
        result = local_train(model, data, train_cfg, seed=int(config["seed"]), device=device, task=task)
    if attack and result.params is not None:
        from fedasync.clients.attack import apply_to_reply

        result.params = apply_to_reply(str(attack["kind"]), params, result.params,
                                       factor=float(attack.get("factor", 10.0)), seed=int(config["seed"]),
                                       task_id=int(config.get("task_id", 0)))
    sleep_s = float(config.get("sleep_s", 0.0))
    if sleep_s > 0:  # emulate this client's speed in wall-clock time
        time.sleep(max(0.0, sleep_s - (time.perf_counter() - t0)))
    metrics: dict[str, Any] = {"num_examples": result.num_examples, "loss": result.loss, "steps": result.steps,
                               "train_time_s": time.perf_counter() - t0, **dp_metrics}
    if pconf and pconf.get("local_dp"):
        # what the server already knows (its plan), not a count of private data; loss only on request
        metrics["num_examples"] = int(pconf.get("num_examples") or int(pconf.get("steps") or 0) * train_cfg.batch_size)
        if not pconf.get("report_loss"):
            del metrics["loss"]
    return {"params": result.params, "metrics": metrics}
