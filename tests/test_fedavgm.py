"""FedAvgM (Hsu et al. 2019): FedAvg and FedBuff share a server optimizer, ``v <- beta v + d``,
``x <- x + server_lr v``, on each aggregated step ``d``. lr 1, beta 0 is plain FedAvg bit for bit;
a server_lr under fedavg now moves the model (it was silently ignored)."""

from __future__ import annotations

import numpy as np
import pytest

from fedasync.config import config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.staleness import make_staleness_fn
from fedasync.server.strategies import FedAvg, FedBuff, Update, params_sha256
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

#: model sha256 of :func:`run` at its defaults, measured on the code before FedAvgM (ba7d074):
#: fedavg ignored server_lr then (1.0 and 1.5 gave this same digest); fedbuff with beta 0 is unchanged
PIN = {"fedavg": "8f13c5ac5744b95029892d6b39cf060500336af8d2001dd247c5703d0c0235c5",
       "fedbuff": "a2829532fe39b1a55b57282b8f98591753b234c66b1d302ac156d750a8bcd6f1"}


def run(tmp_path, strategy="fedavg", **server):
    s = {"strategy": strategy, "concurrency": 4, "max_versions": 4, "eval_every": 2, **server}
    s.update({"clients_per_round": 3, "backup_workers": 1} if strategy == "fedavg" else {"buffer_size": 3})
    raw = {"name": "fedavgm", "seed": 7,
           "data": {"dataset": "digits", "num_clients": 10, "partitioner": "dirichlet", "alpha": 0.5},
           "model": {"name": "mlp", "hidden": 16}, "train": {"local_steps": 3, "batch_size": 8}, "server": s}
    db = tmp_path / f"{strategy}-{len(list(tmp_path.iterdir()))}.db"
    return AsyncServer(config_from_dict(raw), LocalTransport(), Store(f"sqlite:///{db}")).run()


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_lr_1_and_momentum_0_keep_the_old_model_bit_for_bit(tmp_path, strategy):
    s = run(tmp_path, strategy)
    assert s["versions"] == 4 and s["model_sha256"] == PIN[strategy]
    assert run(tmp_path, strategy, server_lr=1.0, server_momentum=0.0)["model_sha256"] == PIN[strategy]


def test_server_lr_under_fedavg_changes_the_model(tmp_path):
    assert run(tmp_path, server_lr=1.5)["model_sha256"] != PIN["fedavg"]


@pytest.mark.parametrize("strategy", ["fedavg", "fedbuff"])
def test_momentum_changes_the_model(tmp_path, strategy):
    assert run(tmp_path, strategy, server_momentum=0.9)["model_sha256"] != PIN[strategy]


def P(*v):
    return {"w": np.asarray(v, np.float32)}


def U(task, params, base, version=0, n=1, client=None):
    return Update(task_id=task, client_id=task if client is None else client, params=params, base_params=base,
                  base_version=version, staleness=0, num_examples=n)


def test_fedavgm_matches_a_hand_computation():
    lr, beta = 0.5, 0.9
    st = FedAvg(clients_per_round=2, weighting="uniform", server_lr=lr, server_momentum=beta)
    x = P(1.0, -2.0)
    rounds = [(P(3.0, 0.0), P(1.0, -4.0)), (P(0.0, 1.0), P(2.0, 3.0)), (P(-1.0, -1.0), P(5.0, 0.0))]
    xs, v = np.array([1.0, -2.0]), np.zeros(2)
    task = 0
    for version, (a, b) in enumerate(rounds):
        assert st.add(x, U(task, a, x, version), version) is None
        x = st.add(x, U(task + 1, b, x, version), version)
        task += 2
        d = (np.asarray(a["w"], np.float64) + np.asarray(b["w"], np.float64)) / 2 - xs
        v = beta * v + d
        xs = np.asarray(xs + lr * v, np.float32).astype(np.float64)  # the model is float32 between rounds
        np.testing.assert_array_equal(x["w"], xs.astype(np.float32))
    np.testing.assert_allclose(st.state_dict()["velocity"]["w"], v)


def test_fedbuff_momentum_matches_a_hand_computation():
    lr, beta = 1.0, 0.5
    st = FedBuff(buffer_size=2, server_lr=lr, staleness_fn=make_staleness_fn("constant"), server_momentum=beta)
    x, xs, v = P(0.0, 0.0), np.zeros(2), np.zeros(2)
    deltas = [((1.0, 2.0), (3.0, 0.0)), ((-1.0, 0.0), (1.0, 4.0))]
    task = 0
    for d1, d2 in deltas:
        base = x
        assert st.add(x, U(task, P(*(np.asarray(d1) + base["w"])), base), 0) is None
        x = st.add(x, U(task + 1, P(*(np.asarray(d2) + base["w"])), base), 0)
        task += 2
        v = beta * v + (np.asarray(d1) + np.asarray(d2)) / 2
        xs = xs + lr * v
        np.testing.assert_allclose(x["w"], xs, rtol=0, atol=1e-6)
    assert xs.tolist() == [3.0, 3.5]  # v1 = d1 = (2, 1); v2 = 0.5 * (2, 1) + (0, 2) = (1, 2.5); x = v1 + v2


def test_discard_puts_the_velocity_back_and_state_round_trips():
    st = FedAvg(clients_per_round=1, weighting="uniform", server_momentum=0.9)
    x = P(0.0)
    x = st.add(x, U(0, P(1.0), x, 0), 0)
    before = st.undo_state()
    v1 = st.state_dict()["velocity"]["w"].copy()
    st.add(x, U(1, P(3.0), x, 1), 1)
    assert st.state_dict()["velocity"]["w"].tolist() != v1.tolist()
    st.discard(before)
    np.testing.assert_array_equal(st.state_dict()["velocity"]["w"], v1)
    other = FedAvg(clients_per_round=1, weighting="uniform", server_momentum=0.9)
    other.load_state_dict(st.state_dict())
    a, b = st.add(x, U(2, P(2.0), x, 1), 1), other.add(x, U(2, P(2.0), x, 1), 1)
    assert params_sha256(a) == params_sha256(b)


@pytest.mark.parametrize("kw", [{"server_momentum": 1.0}, {"server_momentum": -0.1}, {"server_lr": 0.0}])
def test_bad_optimizer_settings_are_refused(kw):
    with pytest.raises(ValueError, match="fedavg server_"):
        FedAvg(clients_per_round=1, **kw)
