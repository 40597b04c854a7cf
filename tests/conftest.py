import pytest

from fedasync.config import apply_overrides, config_from_dict, load_config

SMALL = [
    "name=small",
    "data.num_clients=20",
    "server.concurrency=5",
    "server.buffer_size=3",
    "server.max_versions=12",
    "server.max_virtual_time=null",
    "server.eval_every=2",
    "train.local_steps=5",
]


def small_config(*overrides: str):
    """The quickstart scenario, shrunk to run in about a second in-process."""
    return load_config(None, SMALL + list(overrides))


@pytest.fixture
def small():
    return small_config
