"""Signed updates are bound to one run of one deployment (issue 32).

Before: what a client signed named the run by ``runs.id``, the store's counter (1 in every fresh
store), so a reply signed in one deployment verified in another. Now each run gets a random
identifier (``runs.run_key``, ``secrets.token_hex(16)``, migration 0006) when the store creates
it; every task carries it, every signature covers it, and the server verifies against its own
run's, so a reply replayed into another run is ``bad_signature``. It is kept on resume, and a
store of the previous schema gets one per run on upgrade."""

from __future__ import annotations

import re

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from fedasync.config import config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.strategies import params_sha256
from fedasync.server.transport import LocalTransport
from fedasync.signing import generate_key, public_raw, sign_update, verify_update
from fedasync.store import Store, migrate

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::PendingDeprecationWarning", "ignore::RuntimeWarning")]
F = np.float32
KEYS = {c: generate_key() for c in range(4)}
PUBLIC = {c: public_raw(k) for c, k in KEYS.items()}
HEX32 = re.compile(r"[0-9a-f]{32}")


def _cfg(**server):
    s = {"strategy": "fedasync", "concurrency": 2, "eval_every": 1000, "max_versions": 4,
         "max_virtual_time": 200.0, **server}
    return config_from_dict({"name": "binding", "seed": 3,
                             "data": {"dataset": "digits", "num_clients": 4, "partitioner": "iid"},
                             "model": {"name": "mlp", "hidden": 4}, "train": {"local_steps": 1, "batch_size": 8},
                             "server": s, "clock": {"sigma": 0.0, "jitter": 0.0, "bandwidth_sigma": 0.0}})


def signed(params, config):
    """An honest client that signs as the ClientApp does (the task's run key, run id, task id...)."""
    rng = np.random.default_rng(config["seed"])
    p = {k: (v + rng.standard_normal(v.shape).astype(v.dtype) * F(0.01)).astype(v.dtype) for k, v in params.items()}
    m = {"num_examples": 10}
    sig = sign_update(KEYS[config["client_id"]], config["run_id"], config["task_id"], config["base_version"],
                      params_sha256(p), m, run_key=config.get("run_key", ""))
    return {"params": p, "metrics": m, "signature": sig}


def _server(db, fn, cfg=None, **kw):
    store = Store(f"sqlite:///{db}")
    server = AsyncServer(cfg or _cfg(), LocalTransport(fn), store, public_keys=PUBLIC, **kw)
    server.evals.record = lambda at: None
    return server, store


def test_a_reply_signed_in_one_deployment_is_rejected_by_another(tmp_path):
    """Two fresh stores (two deployments of the same config): both runs are run 1. Every reply of
    deployment A, replayed to B for the same task (same run id, task id, base version, parameters:
    B starts from the same model), is bad_signature in B; A accepted them all."""
    got: dict[int, dict] = {}

    def record(params, config):
        got[config["task_id"]] = r = signed(params, config)
        return r

    a, _ = _server(tmp_path / "a.db", record)
    sa = a.run()
    assert sa["stop_reason"] == "max_versions" and sa["updates_accepted"] == sa["updates_received"] >= 4

    def replay(params, config):
        if config["task_id"] not in got:
            raise RuntimeError("nothing recorded for this task")
        return got[config["task_id"]]

    b, store_b = _server(tmp_path / "b.db", replay)
    sb = b.run()
    ups = store_b.updates(sb["run_id"])
    assert len(ups) >= 2 and [(u.accepted, u.reason) for u in ups] == [(False, "bad_signature")] * len(ups)
    assert sb["versions"] == 0
    assert a.run_id == b.run_id == 1 and a.run_key != b.run_key


def test_each_run_has_its_own_random_key_carried_by_every_task(tmp_path):
    seen = []

    def fn(params, config):
        seen.append(config["run_key"])
        return signed(params, config)

    s1, store = _server(tmp_path / "s.db", fn)
    s1.run()
    s2, _ = _server(tmp_path / "s.db", fn)
    s2.run()
    k1, k2 = store.get_run(s1.run_id).run_key, store.get_run(s2.run_id).run_key
    assert HEX32.fullmatch(k1) and HEX32.fullmatch(k2) and k1 != k2
    assert set(seen) == {k1, k2} and seen.index(k2) == len([k for k in seen if k == k1])


def test_the_signature_covers_the_run_key():
    key = generate_key()
    sha, m = "ab" * 32, {"num_examples": 3}
    ka, kb = "0a" * 16, "0b" * 16
    sig = sign_update(key, 1, 2, 0, sha, m, run_key=ka)
    assert verify_update(key.public_key(), sig, 1, 2, 0, sha, m, run_key=ka)
    assert not verify_update(key.public_key(), sig, 1, 2, 0, sha, m, run_key=kb)
    for bad in (None, "", "0A" * 16, "0a" * 15, 5):  # a verifier without its run's key accepts nothing
        assert not verify_update(key.public_key(), sig, 1, 2, 0, sha, m, run_key=bad)
    with pytest.raises(ValueError, match="run_key"):
        sign_update(key, 1, 2, 0, sha, m, run_key="")


class Crash(BaseException):
    pass


def test_resume_keeps_the_run_key(tmp_path):
    seen = []

    def fn(params, config):
        seen.append((config["task_id"], config["run_key"]))
        return signed(params, config)

    db = tmp_path / "s.db"
    server, store = _server(db, fn, _cfg(max_versions=8))
    orig, calls = store.record_reply, [0]

    def crash(*a, **k):
        calls[0] += 1
        out = orig(*a, **k)
        if calls[0] == 3:
            raise Crash()
        return out

    store.record_reply = crash
    with pytest.raises(Crash):
        server.run()
    key = Store(f"sqlite:///{db}").get_run(server.run_id).run_key
    n = len(seen)
    resumed, store2 = _server(db, fn, _cfg(max_versions=8), resume_run_id=server.run_id)
    summary = resumed.run()
    assert resumed.run_key == key == store2.get_run(server.run_id).run_key
    assert len(seen) > n and {k for _, k in seen} == {key}
    assert summary["stop_reason"] == "max_versions" and summary["rejections"] == {}  # every signature verified


def test_a_store_of_the_previous_schema_gets_a_key_per_run_and_resumes(tmp_path):
    """A run made at head, the store taken back to revision 0005 (no ``run_key``), then opened:
    the upgrade gives each run its own key, and the run resumes, signed and verified under it."""
    db = tmp_path / "s.db"
    first, store = _server(db, signed, _cfg(max_versions=3))
    s1 = first.run()
    other = store.create_run("other", "fedbuff", 0, "x: 1\n", "simulation")
    store.close()
    engine = create_engine(f"sqlite:///{db}")  # (no foreign keys: as the store tests downgrade)
    migrate.downgrade(engine, "0005")
    with engine.connect() as conn:
        assert "run_key" not in {r[1] for r in conn.execute(text("PRAGMA table_info(runs)"))}
    engine.dispose()

    store = Store(f"sqlite:///{db}")  # upgraded on open
    keys = {r.id: r.run_key for r in store.list_runs()}
    assert set(keys) == {s1["run_id"], other} and all(HEX32.fullmatch(k) for k in keys.values())
    assert len(set(keys.values())) == 2
    seen = []

    def fn(params, config):
        seen.append(config["run_key"])
        return signed(params, config)

    resumed, store2 = _server(db, fn, _cfg(max_versions=6), resume_run_id=s1["run_id"])
    summary = resumed.run()
    assert summary["versions"] == 6 and summary["rejections"] == {}
    assert set(seen) == {keys[s1["run_id"]]} == {store2.get_run(s1["run_id"]).run_key}


def test_the_clientapp_signs_with_the_tasks_run_key(tmp_path, monkeypatch):
    """The real ClientApp ``train`` (as a SuperNode runs it, with a ``signing-key`` node config) on the
    tasks the loop sends: every reply verifies under the run's key; a reply it signed for this run,
    shown to another run, does not."""
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedasync.clients import app as clientapp
    from fedasync.signing import save_keypair
    from fedasync.wire import content_to_result, task_content

    for attr in ("_run_id", "_task_id", "_node_id"):  # Message() needs a running task's identity
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
    for c, k in KEYS.items():
        save_keypair(k, tmp_path / "keys", f"client-{c}")
    replies = []

    def via_clientapp(params, config):
        msg = Message(task_content(params, config), dst_node_id=1, message_type="train")
        node = {"signing-key": str(tmp_path / "keys" / f"client-{config['client_id']}.key")}
        out = content_to_result(clientapp.train(msg, Context(run_id=1, node_id=1, node_config=node,
                                                             state=RecordDict(), run_config={})).content)
        replies.append((config, out))
        return out

    server, _ = _server(tmp_path / "s.db", via_clientapp)
    summary = server.run()
    assert summary["stop_reason"] == "max_versions" and summary["rejections"] == {}
    config, out = replies[0]
    sha = params_sha256(out["params"])
    args = (out["signature"], config["run_id"], config["task_id"], config["base_version"], sha, out["metrics"])
    assert verify_update(KEYS[config["client_id"]].public_key(), *args, run_key=server.run_key)
    assert not verify_update(KEYS[config["client_id"]].public_key(), *args, run_key="00" * 16)
