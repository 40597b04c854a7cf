"""The Flower ClientApp: one train message in, one reply out.

In simulation the task names the virtual client whose partition to train (``client_id``);
on a real device (``fedasync client``) the SuperNode's node config gives ``partition-id`` and,
optionally, ``data-path`` (the device's own .npz) and ``signing-key``.
"""

from __future__ import annotations

import json

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedasync.clients.runner import handle_train
from fedasync.wire import record_to_params, reply_content

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    params = record_to_params(msg.content["params"])
    config = json.loads(msg.content["task"]["json"])
    node_cfg = context.node_config
    data_path = node_cfg.get("data-path") or None
    result = handle_train(params, config, data_path=str(data_path) if data_path else None)
    return Message(reply_content(result), reply_to=msg)

