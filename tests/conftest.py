import os

import pytest

from fedasync.config import load_config

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
    """The quickstart scenario, shrunk to run in about a second in-process (``buffer_size`` only
    under fedbuff: a key with no effect on the strategy is refused)."""
    strategy = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("server.strategy=")), "fedbuff")
    small = SMALL if strategy == "fedbuff" else [s for s in SMALL if not s.startswith("server.buffer_size=")]
    return load_config(None, small + list(overrides))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: extra intra-op threads only add contention (the CI box is shared). A module
    takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small():
    return small_config


def pytest_sessionstart(session):
    # in CI the PostgreSQL cases must run, not skip
    if os.environ.get("CI") and not os.environ.get("FEDASYNC_TEST_POSTGRES_URL"):
        raise pytest.UsageError("CI: FEDASYNC_TEST_POSTGRES_URL is not set (.ci/postgres.sh failed?)")
