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

import functools
import json
import time
from typing import Any

import numpy as np
import torch

Params = dict[str, np.ndarray]


@functools.lru_cache(maxsize=8)
def _federated(data_json: str, seed: int):
    from fedasync.config import DataConfig
    from fedasync.task.data import load_federated

    return load_federated(DataConfig.model_validate(json.loads(data_json)), seed)


def _federation(setup_json: str):
    s = json.loads(setup_json)
    return _federated(json.dumps(s["data"], sort_keys=True), s["seed"])


@functools.lru_cache(maxsize=8)
def _setup(setup_json: str):
    from fedasync.config import DataConfig, ModelConfig, TrainConfig
    from fedasync.task.models import build_model
    from fedasync.task.train import pick_device

    s = json.loads(setup_json)
    model_cfg = ModelConfig.model_validate(s["model"])
    train_cfg = TrainConfig.model_validate(s["train"])
    if "input_shape" in s:  # sent by the server: no need for the federation's data here
        shape, num_classes = tuple(s["input_shape"]), int(s["num_classes"])
    else:
        fed = _federation(setup_json)
        shape, num_classes = fed.input_shape, fed.num_classes
    DataConfig.model_validate(s["data"])
    device = pick_device(train_cfg.device)
    model = build_model(model_cfg, shape, num_classes).to(device)
    return s, num_classes, model, train_cfg, device, tuple(int(d) for d in shape)


@functools.lru_cache(maxsize=4)
def _npz(path: str, mtime_ns: int, size: int, normalize: tuple[float, float] | None = None):
    from fedasync.task.data import load_npz
    from fedasync.task.data import normalize as norm

    x, y = load_npz(path)
    return norm(x, normalize), y  # data.normalize, as the server's test set and simulated clients have it


def local_data(setup_json: str, client_id: int, data_path: str | None = None):
    """This client's partition: from a device's own .npz when given (read once while the file is
    unchanged), else generated from the setup."""
    if data_path:
        import os

        st = os.stat(data_path)
        norm = json.loads(setup_json).get("data", {}).get("normalize")
        return _npz(str(data_path), st.st_mtime_ns, st.st_size, None if norm is None else tuple(norm))
    return _federation(setup_json).partitions[client_id]


def check_device_data(path: str, x: np.ndarray, y: np.ndarray, shape: tuple[int, ...], num_classes: int) -> None:
    """A device's own data must fit the federation's model: the same sample size, labels 0-(C-1)
    (else torch fails deep inside training with a shape or ``Target ... is out of bounds`` error)."""
    if int(np.prod(x.shape[1:])) != int(np.prod(shape)):
        raise ValueError(f"data.path: {path}: samples of shape {tuple(x.shape[1:])}, but the federation's model "
                         f"takes samples of shape {tuple(shape)}")
    if len(y) and int(np.max(y)) >= num_classes:
        raise ValueError(f"data.path: {path}: label {int(np.max(y))}, but the federation has {num_classes} "
                         f"classes (labels 0-{num_classes - 1})")


def warm(setup_json: str, client_id: int | None = None, data_path: str | None = None) -> None:
    """Load what a task of this setup needs (data, and the model when it trains on the CPU) into
    this process's caches, for the task processes forked from it (:mod:`fedasync.clients.warm`).
    A GPU is never touched here: CUDA does not survive a fork, so a task on ``cuda``/``mps``/
    ``auto`` builds its model in its own process (the data is still shared)."""
    torch.set_num_threads(1)
    s = json.loads(setup_json)
    fed = _federation(setup_json)
    if str(s.get("train", {}).get("device", "auto")).lower() == "cpu":
        import copy

        from fedasync.task.train import local_train

        _s, _classes, model, train_cfg, device, _shape = _setup(setup_json)
        x, y = fed.partitions[0] if fed.partitions else (None, None)
        if x is not None and len(y):
            # one step on a copy: torch's lazy set-up (optimizer, autograd) happens here, once,
            # instead of in every forked task process (seconds each)
            local_train(copy.deepcopy(model), x[:train_cfg.batch_size], y[:train_cfg.batch_size], train_cfg,
                        seed=0, device=device)
    if data_path:
        local_data(setup_json, client_id or 0, data_path)
    elif client_id is not None and 0 <= client_id < len(fed.partitions):
        fed.partitions[client_id]


def policy_refusal(policy, pconf: Any) -> str | None:
    """Why a real device refuses a task on privacy grounds (one line), or None: without a policy it
    refuses every DP task and trains the rest; with one it takes only DP tasks that pass
    :func:`fedasync.privacy.policy.check_task`."""
    from fedasync.privacy.policy import NO_POLICY, check_task

    if policy is None:
        return NO_POLICY if isinstance(pconf, dict) and pconf.get("local_dp") else None
    return check_task(policy, pconf)


def handle_train(params: Params, config: dict[str, Any], data_path: str | None = None,
                 state_dir: str | None = None, device_node: bool = False, policy=None) -> dict[str, Any]:
    """``state_dir``: where a real device keeps its privacy accountant (node config
    ``privacy-state-dir``).  ``device_node``: this is a real device (see the module docstring);
    ``policy``: its :class:`~fedasync.privacy.policy.DevicePolicy` (node config ``privacy-policy``),
    checked before anything else: a task it refuses is ``{"refused": "privacy_policy"}``, logged."""
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
    _s, num_classes, model, train_cfg, device, shape = _setup(config["setup"])
    x, y = local_data(config["setup"], int(config["client_id"]), data_path)
    if data_path:
        check_device_data(data_path, x, y, shape, num_classes)
    if attack and attack.get("kind") == "label_flip":
        from fedasync.clients.attack import flip_labels

        y = flip_labels(y, num_classes)
    dp_metrics: dict[str, Any] = {}
    if pconf and pconf.get("local_dp"):
        # DP-SGD (Opacus): enforce the budget before training, then train privately
        from fedasync.privacy.dp import private_task

        set_params(model, params)
        if device_node:  # its own policy, budget and accountant file; the task's public plan only
            from fedasync.privacy.dp import device_task

            dp = device_task(model, x, y, train_cfg, seed=int(config["seed"]), device=device, pconf=pconf,
                             policy=policy, state_dir=state_dir)
        else:
            dp = private_task(model, x, y, train_cfg, seed=int(config["seed"]), device=device, pconf=pconf,
                              state_dir=state_dir)
        if dp.refused is not None:
            return {"refused": dp.refused, "metrics": dp.metrics}
        result, dp_metrics = dp.train, dp.metrics
    else:
        set_params(model, params)
        result = local_train(model, x, y, train_cfg, seed=int(config["seed"]), device=device)
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
