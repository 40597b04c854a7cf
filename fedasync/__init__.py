"""fedasync: asynchronous federated learning on Flower.

- ``server/``: the asynchronous server (loop, strategies, staleness, clock, transports, resume).
- ``clients/``: what a client does with a task; the Flower ClientApp.
- ``task/``: the learning task (data, models, local training).
- ``privacy/``: differential privacy (Opacus clients, budgets, the server's tracker).
- ``store/``: the SQL store (SQLAlchemy, Alembic migrations).
- ``serverless/``: server-less variants (FLchain ledger, gossip) over the store.
- ``deploy/``: running on Flower's SuperLink and SuperNodes (processes, certificates, keys).
- ``cli/``: the ``fedasync`` command (parses, calls the above, prints).
- ``config.py`` (the YAML config), ``runs.py`` (running simulations, continuing stored runs),
  ``outputs.py`` (what a run writes), ``signing.py`` (Ed25519 update signatures), ``wire.py``
  (how tasks and replies travel in Flower records).
"""

__version__ = "0.1.0"
