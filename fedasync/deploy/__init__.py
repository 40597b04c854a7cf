"""Deployment on Flower's SuperLink and SuperNodes (what ``fedasync server``/``client``/``keys``/
``certs`` do; the CLI in ``fedasync/cli/deploy.py`` only parses, calls and prints).

- ``certs.py``: a CA and the SuperLink's TLS certificate.
- ``keys.py``: client signing keys, SuperNode authentication keys, the server's key registry.
- ``processes.py``: starting and stopping Flower's processes (PIDs, /proc), the SuperNode command.
- ``federation.py``: the Flower side of a run: our SuperLink, the flwr CLI / Control API, the
  generated app, the store's progress.
- ``run.py``: ``fedasync server`` end to end: TLS settings, the run directory, submit, follow.
- ``superlink.py``: our SuperLink (``python -m fedasync.deploy.superlink``): Flower's, its public
  port serving SuperNodes only, its Control and Runtime APIs on a 127.0.0.1 listener.
- ``supernode.py``: one device's SuperNode (``fedasync client``): Flower's ``flower-supernode``
  with a shorter poll and a watchdog that keeps the warm trainer (``fedasync.clients.warm``) running.

The ServerApp itself (what runs inside the SuperLink) is ``fedasync.server.app:deploy_app``.
"""

from __future__ import annotations


class DeployError(Exception):
    """A deployment step that cannot go on: one line for the user; ``code`` 2 is bad input,
    1 a failure of Flower's side."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
