"""What crosses between the server loop and the clients: tasks, replies, and the transports.

:class:`TaskMsg` is what is sent, :class:`Live` the loop's record of it while it is open,
:class:`Reply` what comes back.

:class:`Transport` is what the loop needs; Flower's Grid implements it in ``server/app.py``
(``GridTransport``) and :class:`LocalTransport` runs the same client code in this process, for
tests and quick looks. A task carries :func:`client_setup_json` (how a client builds its data,
model and trainer) and a seed from :func:`task_seed`. No Flower here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from fedasync.config import Config

Params = dict[str, np.ndarray]


@dataclass
class TaskMsg:
    task_id: int
    client_id: int
    node_id: int | None
    params: Params
    config: dict[str, Any]


@dataclass
class Live:
    """A task the loop has sent and not closed yet."""

    task_id: int
    client_id: int
    base_version: int
    sent_t: float
    finish_t: float | None  # virtual finish time (None under the wall clock)
    deadline: float | None
    message_id: str | None
    timed_out: bool = False


@dataclass
class Reply:
    task_id: int
    params: Params | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the task failed (transport or client exception)
    refused: str | None = None  # the client declined (e.g. privacy_budget_exhausted)
    signature: bytes | None = None
    arrival_wall: float = field(default_factory=time.time)
    params_sha256: str | None = None  # set by whoever hashed ``params`` first (the signature check)

    def __post_init__(self) -> None:  # what a client says is recorded in columns of bounded length
        if self.refused is not None:
            self.refused = str(self.refused)[:200]


class Transport(Protocol):
    """``poll`` returns replies for (some of) ``message_ids``; anything else it returns is treated
    as a stray reply (rejected ``replay``). Optional: ``refresh()``, called each wall-clock step."""

    def node_ids(self) -> list[int]: ...
    def send(self, tasks: list[TaskMsg]) -> list[str | None]: ...  # message ids (None: not sent)
    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]: ...


class LocalTransport:
    """Runs the client code in this process, at send time. No Flower, no Ray."""

    def __init__(self, handler: Callable[[Params, dict], dict] | None = None):
        if handler is None:
            from fedasync.clients.runner import handle_train

            handler = handle_train
        self.handler = handler
        self._ready: dict[str, Reply] = {}
        self._n = 0

    def node_ids(self) -> list[int]:
        return [0]

    def send(self, tasks: list[TaskMsg]) -> list[str | None]:
        ids = []
        for t in tasks:
            self._n += 1
            mid = f"local-{self._n}"
            try:
                self._ready[mid] = reply_from_content(t.task_id, self.handler(t.params, t.config))
            except Exception as e:  # a client exception comes back as an error reply
                self._ready[mid] = Reply(task_id=t.task_id, error=f"{type(e).__name__}: {e}")
            ids.append(mid)
        return ids

    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]:
        return [(m, self._ready.pop(m)) for m in message_ids if m in self._ready]


def reply_from_content(task_id: int, content: dict) -> Reply:
    """Turn a client handler's result dict into a Reply."""
    return Reply(
        task_id=task_id,
        params=content.get("params"),
        metrics=dict(content.get("metrics", {})),
        refused=content.get("refused"),
        signature=content.get("signature"),
    )


def client_setup_json(cfg: Config, fed: Any = None, task: Any = None) -> str:
    """What a client needs to build its task, data, model and trainer (sent with every task).

    The built-in task (``task`` None or named ``builtin``): the data, model and train sections and
    the seed (``data.val_fraction`` among them when set: the client carves the same validation split
    out of the training pool, so its partition is the server's); with the server's ``FederatedData``
    also the model's ``input_shape`` and ``num_classes``, so a device with its own data builds the
    model without the federation's files.
    A user task (:class:`fedasync.task.interface.Task`): its ``name``, source ``digest`` and
    ``args`` (never code: a device imports the module from its own environment and refuses a task
    whose digest differs, ``task_mismatch``), the folder it was imported from (``base_dir``, for
    simulated clients), the number of partitions, the train section and the seed.
    ``fix_model: true`` only when ``privacy.local_dp`` is on with ``fix_model``. No server-only
    setting: not the store, not the privacy section (central DP, every client's budget); a task's
    own DP settings travel in its ``privacy`` key."""
    dp = cfg.privacy.local_dp
    extra: dict[str, Any] = {"fix_model": True} if dp.enabled and dp.fix_model else {}
    if task is not None and getattr(task, "name", "builtin") != "builtin":
        return json.dumps({
            **extra,
            "task": {"name": task.name, "digest": task.digest, "args": task.args, "base_dir": task.base_dir},
            "num_partitions": cfg.data.num_clients,
            "seed": cfg.seed,
            "train": cfg.train.model_dump(mode="json"),
        }, sort_keys=True)
    shape = {} if fed is None else {"input_shape": list(fed.input_shape), "num_classes": int(fed.num_classes)}
    data = cfg.data.model_dump(mode="json")
    if not data.get("val_fraction"):  # the default: the setup of before the key existed
        data.pop("val_fraction", None)
    return json.dumps({
        **extra,
        **shape,
        "seed": cfg.seed,
        "data": data,
        "model": cfg.model.model_dump(mode="json"),
        "train": cfg.train.model_dump(mode="json"),
    }, sort_keys=True)


def task_seed(seed: int, task_id: int) -> int:
    """The seed of task ``task_id``'s local training (independent of which client runs it)."""
    return int(np.random.SeedSequence([seed, task_id]).generate_state(1)[0])
