"""fedasync: asynchronous federated learning on Flower.

- ``server/``: the asynchronous server (loop, strategies, staleness, clock, transports, resume).
- ``clients/``: what a client does with a task; the Flower ClientApp.
- ``task/``: the learning task (data, models, local training).
- ``privacy/``: differential privacy (Opacus clients, budgets, the server's tracker).
- ``store/``: the SQL store (SQLAlchemy, Alembic migrations).
- ``serverless/``: server-less variants (FLchain ledger, gossip) over the store.
- ``deploy/``: running on Flower's SuperLink and SuperNodes (processes, certificates, keys).
- ``cli/``: the ``fedasync`` command (parses, calls the above, prints).
- ``api.py``: ``fedasync.simulate(...)`` and ``fedasync.compare(...)`` from Python (exported here);
  ``assembly.py``: the one function that builds a run's parts from its config and task.
- ``config.py`` (the YAML config), ``runs.py`` (running simulations, continuing stored runs),
  ``outputs.py`` (what a run writes), ``signing.py`` (Ed25519 update signatures), ``wire.py``
  (how tasks and replies travel in Flower records).
"""

__version__ = "0.1.0"

__all__ = ["simulate", "compare", "Result"]


def __getattr__(name: str):
    """``fedasync.simulate``, ``fedasync.compare``, ``fedasync.Result``: :mod:`fedasync.api`'s,
    imported on first use, so that ``import fedasync`` (and every module that reads
    ``fedasync.__version__``) imports nothing else."""
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("fedasync.api"), name)
    raise AttributeError(f"module 'fedasync' has no attribute {name!r}")
