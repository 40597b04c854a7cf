"""Validation of every update: the validator's reasons one by one, Ed25519 signing, and a battery
of bad replies driven through the real server loop by a crafted Transport (each rejected with
its own reason, the model untouched), plus timeouts, late replies and failing clients."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fedasync.config import ServerConfig, config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport, Reply, TaskMsg
from fedasync.server.strategies import params_sha256
from fedasync.server.validation import REASONS, UpdateValidator, all_finite
from fedasync.signing import (
    SigningKeyError,
    generate_key,
    load_private_key,
    load_public_key,
    load_public_keys,
    public_pem,
    public_raw,
    save_keypair,
    sign_update,
    update_message,
    verify_update,
)
from fedasync.store import Store

# -- signing -----------------------------------------------------------------------------


def test_sign_verify_round_trip_and_binding():
    key = generate_key()
    pub = key.public_key()
    sha = "ab" * 32
    m = {"num_examples": 40, "loss": 0.5}
    sig = sign_update(key, 3, 17, 5, sha, m, run_key=RK)
    assert verify_update(pub, sig, 3, 17, 5, sha, m, run_key=RK)
    # every signed field is bound: another run, task, base version or parameters fails
    for args in [(4, 17, 5, sha), (3, 18, 5, sha), (3, 17, 6, sha), (3, 17, 5, "cd" * 32)]:
        assert not verify_update(pub, sig, *args, m, run_key=RK)
    assert not verify_update(generate_key().public_key(), sig, 3, 17, 5, sha, m, run_key=RK)  # another key
    assert not verify_update(pub, None, 3, 17, 5, sha, m, run_key=RK)
    assert not verify_update(pub, sig[:-1] + bytes([sig[-1] ^ 1]), 3, 17, 5, sha, m, run_key=RK)
    assert not verify_update(pub, b"short", 3, 17, 5, sha, m, run_key=RK)
    with pytest.raises(ValueError):
        update_message(1, 2, 3, "not-a-sha", 1, "ab" * 32, run_key=RK)
    with pytest.raises(ValueError, match="num_examples"):
        update_message(1, 2, 3, sha, -1, "ab" * 32, run_key=RK)


def test_the_signature_covers_num_examples_and_the_metrics():
    """Review finding: the weight (``num_examples``) and the DP metrics the server records were
    not signed, so a reply changed in transit kept its valid signature."""
    key = generate_key()
    pub = key.public_key()
    sha = "ab" * 32
    m = {"num_examples": 100, "epsilon": 1.5, "delta": 1e-5, "accountant_history": [[1.1, 0.01, 20]],
         "dp_steps": 20, "noise_multiplier": 1.1, "sample_rate": 0.01, "accountant": "rdp"}
    sig = sign_update(key, 3, 17, 5, sha, m, run_key=RK)
    assert verify_update(pub, sig, 3, 17, 5, sha, dict(m), run_key=RK)
    # the same metrics after a trip as JSON (tuples become lists, key order changes): still valid
    import json

    assert verify_update(pub, sig, 3, 17, 5, sha, json.loads(json.dumps(dict(reversed(list(m.items()))))),
                         run_key=RK)
    for k, v in [("num_examples", 10**9), ("epsilon", 0.1), ("delta", 1e-9), ("accountant_history", []),
                 ("dp_steps", 2), ("loss", 0.0)]:
        assert not verify_update(pub, sig, 3, 17, 5, sha, dict(m, **{k: v}), run_key=RK), k
    assert not verify_update(pub, sig, 3, 17, 5, sha, {k: v for k, v in m.items() if k != "epsilon"}, run_key=RK)
    assert not verify_update(pub, sig, 3, 17, 5, sha, None, run_key=RK)
    # the weight is what the server uses: a non-negative int
    from fedasync.signing import num_examples_of

    assert [num_examples_of(x) for x in ({"num_examples": 5}, {"num_examples": -3}, {}, None,
                                          {"num_examples": float("inf")}, {"num_examples": "x"})] == [5, 0, 0, 0, 0, 0]


def test_a_signed_reply_verifies_after_the_wire():
    """The client signs its metrics before they travel as JSON (Flower's ConfigRecord); the server
    verifies the decoded reply: the digest is the same on both sides."""
    from fedasync.wire import content_to_result, reply_content

    key = generate_key()
    params = {"w": np.full((3, 2), 0.1, np.float32), "b": np.zeros(2, np.float32)}
    metrics = {"num_examples": 64, "steps": 3, "train_time_s": 0.123456789, "epsilon": 0.7321, "delta": 1e-5,
               "accountant_history": [(1.1, 0.0625, 3)], "dp_steps": 3, "task_id": 7, "client_id": 0}
    result = {"params": params, "metrics": metrics}
    result["signature"] = sign_update(key, 1, 7, 2, params_sha256(params), result["metrics"], run_key=RK)
    got = content_to_result(reply_content(result))
    reply = Reply(task_id=7, params=got["params"], metrics=got["metrics"], signature=got["signature"])
    v = UpdateValidator(REF, ServerConfig(), public_keys={0: key.public_key()})
    assert v.check(reply, _Live(7, 0, 2), 0, run_id=1, base=REF, run_key=RK) is None


def test_validator_rejects_a_reply_whose_weight_changed_in_transit():
    """t8: two signed replies; changing one's ``num_examples`` after signing is ``bad_signature``."""
    keys = {0: generate_key(), 1: generate_key()}
    v = UpdateValidator(REF, ServerConfig(), public_keys={c: k.public_key() for c, k in keys.items()})
    good = {"w": np.full((3, 2), 0.1, np.float32), "b": np.zeros(2, np.float32)}
    r = _reply(good, keys[1], task=11, base=0, run=7, metrics={"num_examples": 100, "client_id": 1})
    assert v.check(r, _Live(11, 1, 0), 0, run_id=7, base=REF, run_key=RK) is None
    r.metrics["num_examples"] = 10**9
    assert v.check(r, _Live(11, 1, 0), 0, run_id=7, base=REF, run_key=RK) == "bad_signature"
    r = _reply(good, keys[1], task=11, base=0, run=7, metrics={"num_examples": 100, "epsilon": 2.0})
    r.metrics["epsilon"] = 0.5  # a DP client's spend, understated in transit
    assert v.check(r, _Live(11, 1, 0), 0, run_id=7, base=REF, run_key=RK) == "bad_signature"


def test_key_files(tmp_path):
    key = generate_key()
    priv, pub = save_keypair(key, tmp_path, "client-2")
    assert priv.stat().st_mode & 0o777 == 0o600
    assert public_raw(load_private_key(priv)) == public_raw(key)
    assert public_raw(load_public_key(pub)) == public_raw(key)
    assert public_raw(load_public_key(public_raw(key))) == public_raw(key)  # raw 32 bytes
    assert public_raw(load_public_key(public_pem(key))) == public_raw(key)
    assert set(load_public_keys(tmp_path)) == {2}
    with pytest.raises(FileExistsError):
        save_keypair(generate_key(), tmp_path, "client-2")
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(SigningKeyError, match="not an unencrypted PEM private key"):
        load_private_key(tmp_path / "junk.key")
    with pytest.raises(SigningKeyError, match="cannot read"):
        load_private_key(tmp_path / "missing.key")
    with pytest.raises(SigningKeyError, match="no such directory"):
        load_public_keys(tmp_path / "nope")


# -- the validator, one reason at a time -------------------------------------------------


@dataclass
class _Live:
    task_id: int
    client_id: int
    base_version: int


REF = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
RK = "5e" * 16  # a run key (each run's random identifier, which signatures cover)


def _reply(params, key=None, task=7, base=2, run=1, metrics=None):
    metrics = metrics or {}
    sig = sign_update(key, run, task, base, params_sha256(params), metrics, run_key=RK) \
        if key is not None and params is not None else None
    return Reply(task_id=task, params=params, metrics=metrics, signature=sig)


def test_validator_reasons():
    k0 = generate_key()
    cfg = ServerConfig(max_update_norm=1.0, max_staleness=2)
    v = UpdateValidator(REF, cfg, public_keys={0: public_raw(k0)})
    live = _Live(7, 0, 2)
    good = {"w": np.full((3, 2), 0.1, np.float32), "b": np.zeros(2, np.float32)}
    assert v.check(_reply(good, k0), live, 0, run_id=1, base=REF, run_key=RK) is None

    def with_(**kv):
        d = {k: a.copy() for k, a in good.items()}
        d.update(kv)
        return d

    cases = {
        "missing_params": (_reply(None), live, 0),
        "missing_key": (_reply({"w": good["w"]}, k0), live, 0),
        "extra_key": (_reply(with_(z=np.zeros(1, np.float32)), k0), live, 0),
        "bad_shape": (_reply(with_(b=np.zeros(3, np.float32)), k0), live, 0),
        "bad_dtype": (_reply(with_(b=np.zeros(2, np.float64)), k0), live, 0),
        "non_finite": (_reply(with_(b=np.array([0, np.nan], np.float32)), k0), live, 0),
        "norm_exceeded": (_reply(with_(b=np.array([0, 2.0], np.float32)), k0), live, 0),
        "stale": (_reply(good, k0), live, 3),
        "bad_signature": (_reply(good, generate_key()), live, 0),
        "unknown_client": (_reply(good, k0, metrics={"client_id": 5}), live, 0),
    }
    for reason, (reply, lv, s) in cases.items():
        assert v.check(reply, lv, s, run_id=1, base=REF, run_key=RK) == reason, reason
    # a signature for another task, run or base version is a bad signature
    assert v.check(_reply(good, k0, task=8), live, 0, run_id=1, base=REF, run_key=RK) == "bad_signature"
    assert v.check(_reply(good, k0, run=2), live, 0, run_id=1, base=REF, run_key=RK) == "bad_signature"
    assert v.check(_reply(good, k0, base=1), live, 0, run_id=1, base=REF, run_key=RK) == "bad_signature"
    # unsigned, and a client with no registered key
    assert v.check(_reply(good), live, 0, run_id=1, base=REF, run_key=RK) == "bad_signature"
    assert v.check(_reply(good, k0), _Live(7, 1, 2), 0, run_id=1, base=REF, run_key=RK) == "unknown_client"
    # every reason the validator can give is in the documented list
    assert set(cases) <= set(REASONS)


def test_validator_without_signing_ignores_signatures():
    v = UpdateValidator(REF, ServerConfig())
    assert not v.signing
    assert v.check(Reply(task_id=1, params={k: a.copy() for k, a in REF.items()}), _Live(1, 0, 0), 0) is None


# -- the battery, through the server loop ------------------------------------------------


def _cfg(**server):
    return config_from_dict({
        "name": "battery", "seed": 3,
        "data": {"dataset": "digits", "num_clients": 4, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 8},
        "train": {"local_steps": 1, "batch_size": 8},
        "server": {"strategy": "fedasync", "concurrency": 1, "eval_every": 100, **server},
        "clock": {"sigma": 0.0, "jitter": 0.0, "bandwidth_sigma": 0.0},
    })


class CraftedTransport:
    """Replies built by ``make(task, n)`` for the n-th task; extra (stray) replies can be queued.
    After the plan, pushes fail, so the run ends (``no_client_can_train``)."""

    def __init__(self, make, n_tasks: int):
        self.make, self.n_tasks = make, n_tasks
        self.ready: dict[str, Reply] = {}
        self.delivered: dict[str, Reply] = {}
        self.extra: list[tuple[str, Reply]] = []
        self.sent: list[TaskMsg] = []

    def node_ids(self):
        return [0]

    def send(self, tasks):
        ids = []
        for t in tasks:
            if len(self.sent) >= self.n_tasks:
                ids.append(None)
                continue
            self.sent.append(t)
            mid = f"m{t.task_id}"
            self.ready[mid] = self.make(t, len(self.sent) - 1, self)
            ids.append(mid)
        return ids

    def poll(self, ids):
        out = [(m, self.ready.pop(m)) for m in ids if m in self.ready]
        self.delivered.update(out)
        out += self.extra
        self.extra = []
        return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_agrees_with_the_element_check(dtype):
    """The dot-product fast path never passes a NaN or an infinity, anywhere in the array, and
    never rejects finite values whose squares overflow (it falls back to the element check)."""
    big = np.finfo(dtype).max
    rng = np.random.default_rng(0)
    arrays = [np.zeros((0,), dtype), rng.standard_normal((3, 50)).astype(dtype),
              np.full(7, big, dtype), np.array([big, -big, 1.0], dtype)]
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 77, 149):
            a = rng.standard_normal(150).astype(dtype)
            a[at] = bad
            arrays.append(a.reshape(3, 50))
        arrays.append(np.array([big, bad], dtype))
    for a in arrays:
        assert all_finite(a) == bool(np.all(np.isfinite(a))), a
    assert all_finite(np.arange(5)) and all_finite(np.array([1 + 2j]))
    assert not all_finite(np.array([1 + np.nan * 1j]))
    assert not all_finite(np.full((4, 4), np.nan, dtype)[:, ::2])  # not contiguous


def test_bad_update_battery(tmp_path):
    keys = {c: generate_key() for c in range(4)}
    intruder = generate_key()
    plan = ["good", "nan", "inf", "shape", "dtype", "missing_key", "extra_key", "norm", "forged",
            "unknown_client", "replay", "never_dispatched"]
    expected = {"nan": "non_finite", "inf": "non_finite", "shape": "bad_shape", "dtype": "bad_dtype",
                "missing_key": "missing_key", "extra_key": "extra_key", "norm": "norm_exceeded",
                "forged": "bad_signature", "unknown_client": "unknown_client"}
    shas = []

    def make(t: TaskMsg, i: int, tr: CraftedTransport) -> Reply:
        c = t.config
        kind = plan[i]
        p = {k: (v + np.float32(0.01)).astype(v.dtype) for k, v in t.params.items()}
        first = next(iter(p))
        metrics = {"num_examples": 10, "task_id": t.task_id, "client_id": t.client_id}
        shas.append(server.summary()["model_sha256"])  # the model as this task's reply is built
        if kind == "nan":
            p[first] = p[first].copy()
            p[first].flat[0] = np.nan
        elif kind == "inf":
            p[first] = p[first].copy()
            p[first].flat[-1] = np.inf
        elif kind == "shape":
            p[first] = p[first][:-1]
        elif kind == "dtype":
            p[first] = p[first].astype(np.float64)
        elif kind == "missing_key":
            del p[first]
        elif kind == "extra_key":
            p["intruder.weight"] = np.zeros(3, np.float32)
        elif kind == "norm":
            p[first] = (p[first] + np.float32(100.0)).astype(p[first].dtype)
        elif kind == "unknown_client":
            metrics["client_id"] = 77  # a reply from someone the task was not sent to
        elif kind == "replay":  # the accepted reply of task 0 delivered again (its message id)
            tr.extra.append(("m0", tr.delivered["m0"]))
        elif kind == "never_dispatched":
            tr.extra.append(("forged-mid", Reply(task_id=-1, params=p, metrics={"task_id": 999})))
        signer = intruder if kind == "forged" else keys[t.client_id]
        sig = sign_update(signer, c["run_id"], c["task_id"], c["base_version"], params_sha256(p), metrics,
                          run_key=c["run_key"])
        return Reply(task_id=t.task_id, params=p, metrics=metrics, signature=sig)

    cfg = _cfg(max_update_norm=5.0)
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    tr = CraftedTransport(make, len(plan))
    server = AsyncServer(cfg, tr, store, public_keys={c: public_raw(k) for c, k in keys.items()})
    summary = server.run()

    run_id = summary["run_id"]
    ups = store.updates(run_id)
    assert [u.task_id for u in ups] == list(range(len(plan)))
    assert ups[0].accepted and ups[0].applied_in_version == 1
    for u, kind in zip(ups[1:], plan[1:]):
        if kind in expected:
            assert (u.accepted, u.reason) == (False, expected[kind]), kind
        else:  # the tasks that carried the replays were themselves fine
            assert u.accepted, kind
    # model untouched by every rejected reply: the version after each rejected one is unchanged
    versions = store.versions(run_id)
    v_by_task = {tid: v.version for v in versions for tid in
                 [u.task_id for u in ups if u.applied_in_version == v.version]}
    rejected_tasks = [u.task_id for u in ups if not u.accepted]
    assert len(rejected_tasks) == len(expected)
    assert not any(t in v_by_task for t in rejected_tasks)
    # the model as tasks 1..10 were built (each after the previous reply was handled): one model
    assert len(set(shas[1:11])) == 1 and shas[1] == versions[1].sha256
    # the strongest form: replaying the accepted updates alone gives the same final model
    accepted = [u.task_id for u in ups if u.accepted]
    assert summary["versions"] == len(accepted) == len(versions) - 1
    assert summary["model_sha256"] == versions[-1].sha256
    # replays recorded apart, with their reason, and counted
    replays = store.replays(run_id)
    assert [(r.task_id, r.reason, r.message_id) for r in replays] == [(0, "replay", "m0"), (999, "replay", "forged-mid")]
    assert replays[0].params_sha256 == ups[0].params_sha256
    want = {r: 1 for r in expected.values()}
    want["non_finite"] = 2
    want["replay"] = 2
    assert summary["rejections"] == dict(sorted(want.items()))
    assert summary["updates_rejected"] == len(expected) and summary["replays_rejected"] == 2


def test_rejected_updates_leave_model_and_version_unchanged(tmp_path):
    """Only bad replies after the first: the model's sha256 and version never move again."""
    keys = {c: generate_key() for c in range(4)}
    seen = []

    def make(t, i, tr):
        seen.append((server.version, server.summary()["model_sha256"]))
        p = {k: (v + np.float32(0.01)).astype(v.dtype) for k, v in t.params.items()}
        if i > 0:
            k = next(iter(p))
            p[k] = np.full_like(p[k], np.nan) if i % 2 else p[k][:1]
        sig = sign_update(keys[t.client_id], t.config["run_id"], t.task_id, t.config["base_version"],
                          params_sha256(p), {"num_examples": 5}, run_key=t.config["run_key"])
        return Reply(task_id=t.task_id, params=p, metrics={"num_examples": 5}, signature=sig)

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    server = AsyncServer(_cfg(), CraftedTransport(make, 7), store,
                         public_keys={c: public_raw(k) for c, k in keys.items()})
    summary = server.run()
    after_first = seen[1]
    assert after_first[0] == 1
    assert all(s == after_first for s in seen[1:])
    assert summary["versions"] == 1 and summary["model_sha256"] == after_first[1]
    assert summary["rejections"] == {"bad_shape": 3, "non_finite": 3}


# -- failures, timeouts and late replies -------------------------------------------------


def _local_cfg(**server):
    return config_from_dict({
        "name": "fail", "seed": 1,
        "data": {"dataset": "digits", "num_clients": 6, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 8},
        "train": {"local_steps": 2, "batch_size": 8},
        "server": {"strategy": "fedasync", "concurrency": 3, "eval_every": 100, "max_versions": 8, **server},
        "clock": {"sigma": 0.0, "jitter": 0.0, "bandwidth_sigma": 0.0},
    })


def test_failing_clients_never_stop_the_run(tmp_path):
    from fedasync.clients.runner import handle_train

    def handler(params, config):
        if config["client_id"] in (1, 4):
            raise RuntimeError("device fell over")
        return handle_train(params, config)

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    summary = AsyncServer(_local_cfg(), LocalTransport(handler), store).run()
    assert summary["versions"] >= 8 and summary["stop_reason"] == "max_versions"  # a batch due at one instant is taken whole
    ds = store.dispatches(summary["run_id"])
    failed = [d for d in ds if d.status == "failed"]
    assert failed and {d.client_id for d in failed} <= {1, 4}
    assert all("device fell over" in d.error for d in failed)
    assert summary["tasks_failed"] == len(failed)
    assert all(u.client_id not in (1, 4) for u in store.updates(summary["run_id"]))


@pytest.mark.parametrize("policy", ["reject", "accept"])
def test_timeout_and_late_policy(tmp_path, policy):
    """Every task outlives server.task_timeout (virtual seconds): its slot is given away at the
    deadline, and its reply, when it comes, follows late_policy."""
    cfg = _local_cfg(task_timeout=0.05, late_policy=policy, max_versions=4, max_virtual_time=2.0)
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    summary = AsyncServer(cfg, LocalTransport(), store).run()
    ups = store.updates(summary["run_id"])
    ds = {d.task_id: d for d in store.dispatches(summary["run_id"])}
    assert ups and all(ds[u.task_id].status == "late" for u in ups)
    # slots were handed on: more tasks were dispatched than the concurrency
    assert len(ds) > cfg.server.concurrency
    if policy == "reject":
        assert all(not u.accepted and u.reason == "late" for u in ups)
        assert summary["versions"] == 0 and summary["rejections"] == {"late": len(ups)}
    else:
        assert all(u.accepted for u in ups) and summary["versions"] >= 4
        assert max(u.staleness for u in ups) > 0
    assert summary["tasks_failed"] == sum(d.status in ("timeout", "late") for d in ds.values())


def test_reply_digests_inline_threaded_and_from_the_signature_check():
    """The row's sha256 of a reply: a small model's inline, a big one's in a thread (same value),
    the signature check's own when it hashed first, None for a reply without params."""
    from fedasync.server.records import Digests
    from fedasync.server.strategies import params_sha256
    from fedasync.server.transport import Reply

    d = Digests()
    small = {"w": np.ones(10, np.float32)}
    big = {"w": np.arange(Digests.BIG // 4 + 1, dtype=np.float32)}
    try:
        assert d.of(Reply(task_id=0, params=small), signing=False)() == params_sha256(small)
        assert d._pool is None  # small: no thread
        assert d.of(Reply(task_id=1, params=big), signing=False)() == params_sha256(big)
        assert d._pool is not None
        signed = Reply(task_id=2, params=big)
        digest = d.of(signed, signing=True)
        signed.params_sha256 = "f" * 64  # what the signature check computed and kept
        assert digest() == "f" * 64
        assert d.of(Reply(task_id=3, params=None), signing=False)() is None
    finally:
        d.close()
    assert d._pool is None


@pytest.mark.parametrize("n,bad", [(5, False), (0, False), (2**31 - 1, False), (3.0, False), (None, False),
                                   (2**31, True), (-1, True), (2.5, True), ("7", True), (True, True),
                                   (float("inf"), True), (float("nan"), True)])
def test_a_num_examples_out_of_range_is_rejected_with_its_reason(n, bad):
    # the store's column is a 32-bit integer: PostgreSQL would refuse the row and stop the run
    v = UpdateValidator(REF, ServerConfig())
    metrics = {} if n is None else {"num_examples": n}
    reply = Reply(task_id=1, params={k: a.copy() for k, a in REF.items()}, metrics=metrics)
    assert v.check(reply, _Live(1, 0, 0), 0) == ("bad_num_examples" if bad else None)


def test_a_refusal_reason_is_cut_to_its_column():
    assert len(Reply(task_id=1, refused="x" * 500).refused) == 200
    assert Reply(task_id=1, refused="privacy_budget_exhausted").refused == "privacy_budget_exhausted"
