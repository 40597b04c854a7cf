"""The SQL store (SQLAlchemy 2): runs, clients, dispatches, updates, model versions, privacy spend."""

from fedasync.store.codec import LoopState, decode_params, dumps_state, encode_params, loads_state
from fedasync.store.store import Store, default_sqlite_url

__all__ = ["LoopState", "Store", "decode_params", "default_sqlite_url", "dumps_state", "encode_params", "loads_state"]
