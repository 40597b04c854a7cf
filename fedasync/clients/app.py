"""The Flower ClientApp: one train message in, one reply out; and the deployment hello.

In simulation the task names the virtual client whose partition to train (``client_id``).
On a real device (``fedasync client``) the SuperNode's node config says who the device is:

- ``partition-id``, ``num-partitions``: its client id and the number of clients;
- ``data-path`` (optional): the device's own ``.npz`` (``x``, ``y``); else its partition is
  generated from the task's setup (the same partitioner and seed as the server);
- ``signing-key`` (optional): its Ed25519 private key; every update is signed over
  ``(run key, run id, task id, base version, sha256 of the parameters, its metrics)``
  (:func:`fedasync.signing.update_message`; the run key is the task's random run identifier);
- ``device`` (optional): ``auto``, ``cpu``, ``cuda`` or ``mps``, overriding ``train.device``;
- ``privacy-state-dir`` (optional): where it keeps its DP accountant;
- ``privacy-policy`` (optional): the device's DP policy as JSON (``fedasync client`` writes it
  in the state dir, 0600): which local-DP tasks it accepts and its own budget; a device without
  one refuses every local-DP task (see :mod:`fedasync.privacy.policy`);
- ``task`` (optional; ``fedasync client --task NAME.task``): the device's own task module, imported
  from its environment; a task whose module (name or sha256 of its source) differs from the
  server's is refused ``task_mismatch`` (logged). Without it the device builds the task the setup
  names: the built-in one, or a user task imported by the server's name and checked the same way;
- ``deployed`` (``fedasync client`` sets it): a real device, which never derives its DP noise
  from the seed a server sends (a task asking for ``privacy.reproducible_noise`` is refused,
  even from a server that does not mark its tasks ``deployment``).

A task says it comes from a deployment with ``"deployment": true``; the reply then echoes the
device's ``client_id`` and the ``task_id``, so that the server can tell a misrouted or replayed
reply. The ``query`` handler answers the server's hello (see ``fedasync.server.app``).
"""

from __future__ import annotations

import functools
import json

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedasync.wire import record_to_params, reply_content

app = ClientApp()


@functools.lru_cache(maxsize=4)
def _signing_key(path: str):
    from fedasync.signing import load_private_key

    return load_private_key(path)


@functools.lru_cache(maxsize=4)
def _policy(path: str, mtime_ns: int):
    from fedasync.privacy.policy import read_policy

    return read_policy(path)


def node_policy(node_cfg: dict):
    """The device's :class:`~fedasync.privacy.policy.DevicePolicy` from node config ``privacy-policy``, or None."""
    path = node_cfg.get("privacy-policy") or None
    if not path:
        return None
    import os

    return _policy(str(path), os.stat(str(path)).st_mtime_ns)


def _node(context: Context) -> dict:
    return dict(context.node_config or {})


def _set_device(setup_json: str, device: str) -> str:
    s = json.loads(setup_json)
    s["train"]["device"] = device
    return json.dumps(s, sort_keys=True)


def task_config(msg: Message, node_cfg: dict) -> dict:
    """The task's config as this node trains it: a deployed device trains its own partition
    (``partition-id``) on its own ``device``."""
    config = json.loads(msg.content["task"]["json"])
    if config.get("deployment") and "partition-id" in node_cfg:
        config["client_id"] = int(node_cfg["partition-id"])  # a device trains its own data
    if node_cfg.get("device"):
        config["setup"] = _set_device(config["setup"], str(node_cfg["device"]))
    return config


@app.train()
def train(msg: Message, context: Context) -> Message:
    from fedasync.clients.runner import handle_train

    params = record_to_params(msg.content["params"])
    node_cfg = _node(context)
    config = task_config(msg, node_cfg)
    deployed = bool(config.get("deployment"))
    data_path = node_cfg.get("data-path") or None
    state_dir = node_cfg.get("privacy-state-dir") or None  # a device keeps its DP accountant here
    result = handle_train(params, config, data_path=str(data_path) if data_path else None,
                          state_dir=str(state_dir) if state_dir else None,
                          device_node=deployed or bool(node_cfg.get("deployed")), policy=node_policy(node_cfg),
                          node_task=str(node_cfg["task"]) if node_cfg.get("task") else None)
    if deployed:
        result.setdefault("metrics", {}).update(task_id=int(config["task_id"]), client_id=int(config["client_id"]))
    key_path = node_cfg.get("signing-key")
    if key_path and result.get("params") is not None:
        from fedasync.server.strategies import params_sha256
        from fedasync.signing import sign_update

        # last: the signature covers the metrics as sent (num_examples, loss, epsilon, DP accounting)
        result["signature"] = sign_update(_signing_key(str(key_path)), int(config["run_id"]),
                                          int(config["task_id"]), int(config["base_version"]),
                                          params_sha256(result["params"]), result.setdefault("metrics", {}),
                                          run_key=str(config.get("run_key", "")))  # binds it to this run
    return Message(reply_content(result), reply_to=msg)


@app.query()
def hello(msg: Message, context: Context) -> Message:
    """Who this node is: its client id, the number of clients and its signing public key."""
    node_cfg = _node(context)
    info = {
        "partition_id": int(node_cfg["partition-id"]) if "partition-id" in node_cfg else None,
        "num_partitions": int(node_cfg["num-partitions"]) if "num-partitions" in node_cfg else None,
        "public_key": "",
        "device": str(node_cfg.get("device") or "auto"),
        "has_data": bool(node_cfg.get("data-path")),
    }
    key_path = node_cfg.get("signing-key")
    if key_path:
        from fedasync.signing import public_raw

        info["public_key"] = public_raw(_signing_key(str(key_path))).hex()
    return Message(RecordDict({"hello": ConfigRecord({"json": json.dumps(info)})}), reply_to=msg)
