"""The SQL store (SQLAlchemy 2): runs, clients, dispatches, updates, model versions, privacy spend."""

from fedasync.store.store import (
    Store,
    decode_params,
    default_sqlite_url,
    dumps_state,
    encode_params,
    loads_state,
)

__all__ = ["Store", "decode_params", "default_sqlite_url", "dumps_state", "encode_params", "loads_state"]
