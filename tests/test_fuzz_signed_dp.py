"""Fuzzing malformed client replies with signing on and with local DP on (the two areas
``test_fuzz_updates.py`` leaves out), through the same small in-process loops (virtual clock,
SQLite in tmp, 4-client MLP on digits; task 3's reply is broken in one way).

Signing: a reply whose signature is missing, of the wrong type, or valid for anything other than
exactly this run, task, base version, parameters, ``num_examples`` and metrics is rejected
``bad_signature`` (one claiming another client ``unknown_client``) and the model versions are
those of the run in which task 3 failed instead.

Local DP: the clients are a stand-in for :func:`fedasync.privacy.dp.private_task` (the same
accounting from the history the server sends, the same budget check before a task, no Opacus
training: fast); a malformed DP accounting is rejected ``privacy_accounting`` (charged the planned
task), the run never crashes or hangs, and the server's record of a client's spend never falls
below the truth (so no client trains past its budget). With signing on, a reply that is not its
client's (``bad_signature``, ``unknown_client``) is charged the planned task, whatever it claims.

Bugs these found (fixed): an accountant-history entry with sigma = inf hung the server; a
dp_steps of 10**9 stalled it (one accountant step per step), 10**30 crashed it (the store's
INTEGER column), 2.5 was charged 2 steps; a reported history with more steps at a huge sigma
replaced (lowered) the server's record, and the client trained past its budget; a forged reply's
claims were charged to its client; a history padded with thousands of distinct sigmas stalled the
server; a sigma of 1e-300 or 1e300 ended the run (Opacus divides by zero / overflows).
"""

from __future__ import annotations

import json
import logging
import math
import signal
from contextlib import contextmanager

import numpy as np
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedasync.config import config_from_dict
from fedasync.privacy.budgets import epsilon_of, extend_history, history_json, history_steps
from fedasync.server.loop import AsyncServer
from fedasync.server.strategies import params_sha256
from fedasync.signing import sign_update
from fedasync.store import Store
from tests.test_fuzz_updates import BAD, RawTransport, _cfg, honest

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::PendingDeprecationWarning", "ignore::RuntimeWarning")]

KEYS = {c: Ed25519PrivateKey.from_private_bytes(bytes([c + 1]) * 32) for c in range(4)}
PUBS = {c: k.public_key() for c, k in KEYS.items()}
SIGMA, DELTA = 1.0, 1e-5


def _dp_cfg(epsilon=50.0, **server):
    d = yaml.safe_load(_cfg("fedasync", **server).to_yaml())
    d["privacy"] = {"local_dp": {"enabled": True, "epsilon": epsilon, "delta": DELTA, "noise_multiplier": SIGMA,
                                 "planned_tasks": 10}}
    return config_from_dict(d)


PLAIN, DP = _cfg("fedasync"), _dp_cfg()


def _sign(r, config, key=None, **over):
    """Sign reply ``r`` as the task's client would (``over``: run_id / task_id / base_version lied about)."""
    ids = {k: int(config[k]) for k in ("run_id", "task_id", "base_version")}
    ids.update(over)
    key = KEYS[int(config["client_id"])] if key is None else key
    r["signature"] = sign_update(key, ids["run_id"], ids["task_id"], ids["base_version"],
                                 params_sha256(r["params"]), r["metrics"], run_key=config["run_key"])
    return r


class Client:
    """Honest clients (DP: the accounting of ``private_task`` without the training); ``trained``
    counts the DP-SGD steps each client really ran (the truth the server's record must cover)."""

    def __init__(self, sign: bool, mutate=None, bad=BAD):
        self.sign, self.mutate, self.bad = sign, mutate, bad
        self.trained: dict[int, int] = {}

    def __call__(self, params, config):
        r = honest(params, config)
        p = config.get("privacy")
        if p and p.get("local_dp"):
            hist = p["history"]
            after = extend_history(hist, p["noise_multiplier"], p["sample_rate"], p["steps"], p["accountant"])
            eps = epsilon_of(after, p["delta"], p["accountant"])
            if p["epsilon"] is not None and eps > p["epsilon"]:
                return {"refused": "privacy_budget_exhausted", "metrics": {"epsilon_next": eps}}
            c = int(config["client_id"])
            self.trained[c] = self.trained.get(c, 0) + p["steps"]
            r["metrics"] = {"num_examples": p["num_examples"], "epsilon": eps, "dp_steps": p["steps"],
                            "accountant_history": history_json(after), "noise_multiplier": p["noise_multiplier"],
                            "sample_rate": p["sample_rate"], "delta": p["delta"], "accountant": p["accountant"],
                            "epsilon_budget": p["epsilon"], "max_grad_norm": p["max_grad_norm"]}
        if self.sign:
            _sign(r, config)
        if config["task_id"] == self.bad and self.mutate is not None:
            r = self.mutate(r, config)
        return r


@contextmanager
def _deadline(seconds):
    """A hang becomes a failure (SIGALRM: the main thread, where pytest runs tests)."""
    def boom(*_):
        raise TimeoutError(f"the run did not finish in {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(tmp_path, cfg, client, sign):
    store = Store(f"sqlite:///{tmp_path / 'fuzz.db'}")
    try:
        with _deadline(20):
            server = AsyncServer(cfg, RawTransport(client), store, public_keys=PUBS if sign else None)
            server.evals.record = lambda at: None
            summary = server.run()
        rid = summary["run_id"]
        out = {"summary": summary, "ups": {u.task_id: u for u in store.updates(rid)},
               "shas": [v.sha256 for v in store.versions(rid)],
               "finite": all(bool(np.isfinite(a).all()) for a in server.params.values()),
               "clients": {c.client_id: c for c in store.clients(rid)},
               "spend": {r.task_id: r for r in store.privacy_spend(rid) if r.client_id >= 0}}
    finally:
        store.close()
        (tmp_path / "fuzz.db").unlink(missing_ok=True)
    return out


def _fail(r, config):
    raise RuntimeError("the client fell over")


_BASELINES: dict[tuple, list[str]] = {}


def _baseline(tmp_path, cfg_name, sign):
    key = (cfg_name, sign)
    if key not in _BASELINES:
        out = _run(tmp_path, {"plain": PLAIN, "dp": DP}[cfg_name], Client(sign, _fail), sign)
        assert BAD not in out["ups"] and out["summary"]["tasks_failed"] >= 1 and out["finite"]
        _BASELINES[key] = out["shas"]
    return _BASELINES[key]


def _check_rejected(tmp_path, cfg_name, sign, mutate, reason, same_model=True):
    out = _run(tmp_path, {"plain": PLAIN, "dp": DP}[cfg_name], Client(sign, mutate), sign)
    assert BAD in out["ups"], "the malformed reply is not in updates"
    u = out["ups"][BAD]
    assert (u.accepted, u.reason, u.applied_in_version) == (False, reason, None)
    assert out["summary"]["rejections"].get(reason, 0) >= 1
    assert out["summary"]["stop_reason"] == "max_versions" and out["finite"]
    assert all(v.accepted for t, v in out["ups"].items() if t != BAD)  # nothing else is refused after it
    if same_model:
        assert out["shas"] == _baseline(tmp_path, cfg_name, sign)
    return out


# -- signing -----------------------------------------------------------------------------------------


def _sig(fn):
    def m(r, config):
        r = dict(r)
        r["signature"] = fn(r.get("signature"))
        return r
    return m


def _flip(s):
    b = bytearray(s)
    b[0] ^= 1
    return bytes(b)


def _resigned(change, **over):
    """Change the reply, then sign it with the task's key (``over``: the ids it is signed for)."""
    def m(r, config):
        r = change(dict(r, metrics=dict(r["metrics"])), config)
        return _sign(r, config, **over)
    return m


def _signed_then(change):
    """A correctly signed reply changed after signing (the signature is kept)."""
    def m(r, config):
        return change(dict(r, metrics=dict(r["metrics"])), config)
    return m


def _other_params(r, config):
    p = dict(r["params"])
    k = next(iter(p))
    p[k] = (p[k] + np.float32(1e-3)).astype(p[k].dtype)
    r["params"] = p
    return r


def _ident(r, config):
    return r


def _meta(**kv):
    def m(r, config):
        r["metrics"].update(kv)
        return r
    return m


def _signed_for(**kv):
    """Signed over metrics with ``kv``, sent with the honest ones."""
    def m(r, config):
        honest_metrics = dict(r["metrics"])
        r["metrics"] = dict(r["metrics"], **kv)
        _sign(r, config)
        r["metrics"] = honest_metrics
        return r
    return m


def _other(config):
    """Another client than the task's."""
    return (int(config["client_id"]) + 1) % 4


def _unjsonable(r, config):
    r = dict(r, metrics=dict(r["metrics"], junk=object()))
    r["signature"] = bytes(64)  # the client could not have signed it: sign_update raises TypeError
    return r


SIGNATURE_REJECTED = {
    "missing": (lambda r, c: {k: v for k, v in r.items() if k != "signature"}, "bad_signature"),
    "none": (_sig(lambda s: None), "bad_signature"),
    "int": (_sig(lambda s: int.from_bytes(s, "big")), "bad_signature"),
    "list": (_sig(lambda s: list(s)), "bad_signature"),
    "dict": (_sig(lambda s: {"sig": s.hex()}), "bad_signature"),
    "str_hex": (_sig(lambda s: s.hex()), "bad_signature"),
    "str_hex_upper": (_sig(lambda s: s.hex().upper()), "bad_signature"),
    "str_hex_odd": (_sig(lambda s: s.hex()[:-1]), "bad_signature"),
    "str_huge": (_sig(lambda s: "a" * 10**6), "bad_signature"),
    "bytes_huge": (_sig(lambda s: s * 10**4), "bad_signature"),
    "bytes_empty": (_sig(lambda s: b""), "bad_signature"),
    "bytes_short": (_sig(lambda s: s[:63]), "bad_signature"),
    "bytes_long": (_sig(lambda s: s + b"\0"), "bad_signature"),
    "bytes_hex": (_sig(lambda s: s.hex().encode()), "bad_signature"),
    "bit_flipped": (_sig(_flip), "bad_signature"),
    "memoryview": (_sig(lambda s: memoryview(s)), "bad_signature"),
    "ndarray": (_sig(lambda s: np.frombuffer(s, np.uint8)), "bad_signature"),
    "float": (_sig(lambda s: float("nan")), "bad_signature"),
    "other_params": (_signed_then(_other_params), "bad_signature"),
    "other_task": (_resigned(_ident, task_id=BAD + 1), "bad_signature"),
    "other_run": (_resigned(_ident, run_id=2), "bad_signature"),
    "other_base_version": (_resigned(_ident, base_version=1), "bad_signature"),
    "other_num_examples": (_signed_for(num_examples=11), "bad_signature"),
    "other_loss": (_signed_for(loss=0.25), "bad_signature"),
    "other_metrics_extra_key": (_signed_for(epsilon=0.1), "bad_signature"),
    "loss_changed_after": (_signed_then(_meta(loss=0.1)), "bad_signature"),
    "epsilon_added_after": (_signed_then(_meta(epsilon=0.0)), "bad_signature"),
    "num_examples_changed_after": (_signed_then(_meta(num_examples=1000)), "bad_signature"),
    "metrics_dropped_after": (_signed_then(lambda r, c: dict(r, metrics=None)), "bad_signature"),
    "another_clients_key": (lambda r, c: _sign(r, c, key=KEYS[_other(c)]), "bad_signature"),
    # signed by another client, claiming to be it: the task was sent to this one
    "claims_another_client": (lambda r, c: _sign(dict(r, metrics=dict(r["metrics"], client_id=_other(c))), c,
                                                 key=KEYS[_other(c)]), "unknown_client"),
    "claims_another_client_own_key": (_resigned(lambda r, c: _meta(client_id=_other(c))(r, c)), "unknown_client"),
    "metrics_not_json": (_unjsonable, "bad_signature"),
    "num_examples_float_signed": (_resigned(_meta(num_examples=2.5)), "bad_num_examples"),
    "num_examples_bool_signed": (_resigned(_meta(num_examples=True)), "bad_num_examples"),
}




@pytest.mark.parametrize("case", sorted(SIGNATURE_REJECTED))
def test_a_badly_signed_reply_is_rejected_and_changes_nothing(tmp_path, case):
    logging.disable(logging.WARNING)
    try:
        mutation, reason = SIGNATURE_REJECTED[case]
        _check_rejected(tmp_path, "plain", True, mutation, reason)
    finally:
        logging.disable(logging.NOTSET)


def _tuple_then_list(r, config):
    r = _sign(dict(r, metrics=dict(r["metrics"], extra=(1, 2))), config)  # signed with a tuple,
    r["metrics"]["extra"] = [1, 2]  # arrives as JSON's list
    return r


@pytest.mark.parametrize("case", ["bytearray", "metrics_tuple_signed_as_list", "numpy_metrics"])
def test_a_correctly_signed_reply_in_another_spelling_is_taken(tmp_path, case):
    mutate = {
        "bytearray": _sig(lambda s: bytearray(s)),
        # the digest is of canonical JSON: a tuple and a list, a numpy scalar and a float are the same
        "metrics_tuple_signed_as_list": _tuple_then_list,
        "numpy_metrics": _resigned(_meta(loss=np.float64(0.5))),
    }[case]
    out = _run(tmp_path, PLAIN, Client(True, mutate), True)
    assert out["ups"][BAD].accepted and out["summary"]["stop_reason"] == "max_versions"


def test_every_honest_signed_reply_is_taken(tmp_path):
    out = _run(tmp_path, PLAIN, Client(True), True)
    assert all(u.accepted for u in out["ups"].values()) and out["summary"]["rejections"] == {}


# -- local DP ----------------------------------------------------------------------------------------

def _dp_meta(**kv):
    return lambda r, config: dict(r, metrics=dict(r["metrics"], **kv))


def _dp_drop(key):
    return lambda r, config: dict(r, metrics={k: v for k, v in r["metrics"].items() if k != key})


def _hist(entries):
    """accountant_history from [[sigma, q or None (the planned q), steps], ...]."""
    def m(r, config):
        q = config["privacy"]["sample_rate"]
        h = [[s, q if e is None else e, n] for s, e, n in entries]
        return dict(r, metrics=dict(r["metrics"], accountant_history=h))
    return m


DP_REJECTED = {
    "epsilon_nan": _dp_meta(epsilon=float("nan")),
    "epsilon_negative": _dp_meta(epsilon=-1.0),
    "epsilon_huge_int": _dp_meta(epsilon=10**400),
    "epsilon_dict": _dp_meta(epsilon={"eps": 1.0}),
    "epsilon_list": _dp_meta(epsilon=[1.0]),
    "epsilon_none": _dp_meta(epsilon=None),
    "epsilon_missing": _dp_drop("epsilon"),
    "sigma_nan": _dp_meta(noise_multiplier=float("nan")),
    "sigma_inf": _dp_meta(noise_multiplier=float("inf")),
    "sigma_negative": _dp_meta(noise_multiplier=-1.0),
    "sigma_str": _dp_meta(noise_multiplier="x"),
    "q_zero": _dp_meta(sample_rate=0.0),
    "q_above_one": _dp_meta(sample_rate=2.0),
    "q_nan": _dp_meta(sample_rate=float("nan")),
    "steps_negative": _dp_meta(dp_steps=-1),
    "steps_str": _dp_meta(dp_steps="x"),
    "steps_none": _dp_meta(dp_steps=None),
    "steps_inf": _dp_meta(dp_steps=float("inf")),
    # not whole, or beyond the store's INTEGER column: 2.5 was charged 2 steps, 10**30 crashed the run
    "steps_float": _dp_meta(dp_steps=2.5),
    "steps_bool": _dp_meta(dp_steps=True),
    "steps_str_number": _dp_meta(dp_steps="1"),
    "steps_beyond_int32": _dp_meta(dp_steps=2**31),
    "steps_huge": _dp_meta(dp_steps=10**30),
    "history_missing": _dp_drop("accountant_history"),
    "history_int": _dp_meta(accountant_history=5),
    "history_str": _dp_meta(accountant_history="abc"),
    "history_short_entry": _dp_meta(accountant_history=[[1.0, 0.5]]),
    "history_nan_sigma": _hist([(float("nan"), None, 1)]),
    "history_negative_steps": _hist([(SIGMA, None, -1)]),
    "history_q_zero": _hist([(SIGMA, 0.0, 1)]),
    "history_dict": _dp_meta(accountant_history={"a": 1}),
    "history_inf_sigma": _hist([(float("inf"), None, 100)]),  # made the server hang (compute_rdp)
    "history_nested": _dp_meta(accountant_history=[[[1.0], [0.5], [1]]]),
}


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("case", sorted(DP_REJECTED))
def test_a_malformed_dp_accounting_is_rejected_and_charged_the_plan(tmp_path, case, sign):
    logging.disable(logging.ERROR)
    try:
        mutate = DP_REJECTED[case]
        if sign:  # the client signed its malformed accounting: the signature is fine, the accounting is not
            mutate = _resigned(mutate)
        out = _check_rejected(tmp_path, "dp", sign, mutate, "privacy_accounting")
    finally:
        logging.disable(logging.NOTSET)
    u = out["ups"][BAD]
    row = out["spend"][BAD]  # charged all the same: the planned task
    assert row.steps == 1 and row.noise_multiplier == SIGMA and math.isfinite(row.epsilon)
    _check_records(out)


def _check_records(out, budget=50.0):
    """Every client's record is finite, within budget, and not below what the client trained."""
    for c in out["clients"].values():
        if c.accountant_state is None:
            continue
        hist = json.loads(c.accountant_state)["history"]
        assert c.epsilon is not None and math.isfinite(c.epsilon) and c.epsilon <= budget
        assert math.isclose(c.epsilon, epsilon_of(hist, DELTA, "rdp"), rel_tol=1e-12)


@pytest.mark.parametrize("case,mutate", [
    ("epsilon_inf", _dp_meta(epsilon=float("inf"))),  # under rdp the server recomputes epsilon
    ("epsilon_bool", _dp_meta(epsilon=True)),
    ("epsilon_str", _dp_meta(epsilon="0.5")),
    ("epsilon_zero", _dp_meta(epsilon=0.0)),
    ("loss_nan", _dp_meta(loss=float("nan"))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_wrong_epsilon_with_a_true_history_is_recorded_as_the_truth(tmp_path, case, mutate):
    honest_run = _run(tmp_path, DP, Client(False), False)
    out = _run(tmp_path, DP, Client(False, mutate), False)
    assert out["summary"]["stop_reason"] == "max_versions" and out["finite"]
    assert out["ups"][BAD].accepted
    assert out["spend"][BAD].epsilon == honest_run["spend"][BAD].epsilon
    assert {c: (r.epsilon, r.accountant_state) for c, r in out["clients"].items()} == \
        {c: (r.epsilon, r.accountant_state) for c, r in honest_run["clients"].items()}
    _check_records(out)


def test_a_huge_dp_steps_is_charged_without_hanging_the_server(tmp_path):
    """dp_steps = 10**9: the accountant was stepped once per step (minutes, the run stalled)."""
    logging.disable(logging.ERROR)
    try:
        # (its client is then out of budget: it refuses its next tasks, so the model differs from the baseline)
        out = _check_rejected(tmp_path, "dp", False, _dp_meta(dp_steps=10**9), "over_budget", same_model=False)
    finally:
        logging.disable(logging.NOTSET)
    c = out["ups"][BAD].client_id
    hist = json.loads(out["clients"][c].accountant_state)["history"]
    assert history_steps(hist) >= 10**9  # charged what it claims: over its budget
    assert out["clients"][c].epsilon > 50.0


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("case", ["huge_sigma", "more_steps_lower_epsilon", "drops_the_prior"])
def test_a_reported_history_cannot_lower_the_servers_record(tmp_path, case, sign):
    """A reply whose accountant history holds more steps but spends less (a huge sigma, steps
    moved to a noisier entry) must not replace the server's record: the record only grows."""
    entries = {"huge_sigma": [(1e6, None, 100)],
               "more_steps_lower_epsilon": [(SIGMA * 50, None, 5)],
               "drops_the_prior": [(SIGMA * 10, None, 50)]}[case]
    mutate = _hist(entries)
    if sign:
        mutate = _resigned(mutate)
    honest_run = _run(tmp_path, DP, Client(sign), sign)
    out = _run(tmp_path, DP, Client(sign, mutate), sign)
    assert out["summary"]["stop_reason"] == "max_versions" and out["finite"]
    c = out["ups"][BAD].client_id
    truth = honest_run["spend"][BAD].epsilon
    assert out["spend"][BAD].epsilon >= truth
    assert out["clients"][c].epsilon >= honest_run["clients"][c].epsilon
    _check_records(out)


def test_a_lowered_history_does_not_let_a_client_train_past_its_budget(tmp_path):
    """The clients check their budget against the history the server sends (as in simulation);
    one reply reports a history of many noisy steps: the server must keep the true record, or the
    client trains on past its budget."""
    budget = 1.25
    cfg = _dp_cfg(epsilon=budget, max_versions=40, max_virtual_time=5000.0)
    client = Client(False, _hist([(1e6, None, 100)]))
    out = _run(tmp_path, cfg, client, False)
    assert out["summary"]["stop_reason"] == "no_client_can_train"
    q = next(iter(out["spend"].values())).sample_rate
    for c, steps in client.trained.items():
        true_eps = epsilon_of([[SIGMA, q, steps]], DELTA, "rdp")
        assert true_eps <= budget, f"client {c} trained {steps} steps: epsilon {true_eps} over {budget}"


def test_an_unauthenticated_reply_does_not_rewrite_a_clients_record(tmp_path):
    """With signing on, a reply with a bad signature (anyone could have sent it) still records a
    spend; it must never lower the client's record."""
    logging.disable(logging.ERROR)
    try:
        mutate = _signed_then(_hist([(1e6, None, 100)]))
        honest_run = _run(tmp_path, DP, Client(True), True)
        out = _check_rejected(tmp_path, "dp", True, mutate, "bad_signature")
    finally:
        logging.disable(logging.NOTSET)
    c = out["ups"][BAD].client_id
    assert out["spend"][BAD].epsilon >= honest_run["spend"][BAD].epsilon
    assert out["clients"][c].epsilon >= honest_run["clients"][c].epsilon
    _check_records(out)


def _forged(**kv):
    """A reply that its client did not sign (signed by no one: a bit flipped), claiming ``kv``."""
    def m(r, config):
        r = dict(r, metrics=dict(r["metrics"], **kv))
        r["signature"] = _flip(r["signature"])
        return r
    return m


@pytest.mark.parametrize("case", ["claims_no_spend", "claims_a_huge_spend", "claims_another_client"])
def test_an_unauthenticated_reply_is_charged_the_planned_task_not_its_claims(tmp_path, case):
    """Signing on: what a reply rejected bad_signature / unknown_client reports is nobody's word, so
    its client is charged the task the server planned (as for a malformed accounting): a forger
    must neither erase the task's spend (noise 1e6, 0 steps) nor exhaust the client's budget."""
    mutate = {"claims_no_spend": _forged(noise_multiplier=1e6, dp_steps=0, epsilon=0.0),
              "claims_a_huge_spend": _forged(dp_steps=10**9),
              "claims_another_client": lambda r, c: _sign(dict(r, metrics=dict(
                  r["metrics"], dp_steps=10**9, client_id=_other(c))), c, key=KEYS[_other(c)])}[case]
    reason = "unknown_client" if case == "claims_another_client" else "bad_signature"
    logging.disable(logging.ERROR)
    try:
        honest_run = _run(tmp_path, DP, Client(True), True)
        out = _check_rejected(tmp_path, "dp", True, mutate, reason)
    finally:
        logging.disable(logging.NOTSET)
    row, truth = out["spend"][BAD], honest_run["spend"][BAD]
    assert (row.steps, row.noise_multiplier, row.sample_rate) == (truth.steps, truth.noise_multiplier,
                                                                  truth.sample_rate)
    assert row.epsilon == truth.epsilon
    assert all(r.steps == 1 for r in out["spend"].values())  # every task charged its planned step, no more
    for c, r in out["clients"].items():  # each record: exactly the tasks charged
        steps = sum(x.steps for x in out["spend"].values() if x.client_id == c)
        assert history_steps(json.loads(r.accountant_state)["history"] if r.accountant_state else []) == steps
    _check_records(out)


def test_signed_dp_replies_through_the_wire(tmp_path):
    """The metrics digest survives the wire (JSON; a numpy float becomes a float): an honest signed
    DP reply is taken, one whose epsilon is understated in transit is ``bad_signature`` and its
    client is charged the planned task."""
    from fedasync.wire import content_to_result, reply_content

    def via_wire(change):
        def m(r, config):
            r = content_to_result(reply_content(r))
            return change(r, config)
        return m

    ok = _run(tmp_path, DP, Client(True, via_wire(_ident)), True)
    assert all(u.accepted for u in ok["ups"].values()) and ok["summary"]["rejections"] == {}
    logging.disable(logging.ERROR)
    try:
        out = _check_rejected(tmp_path, "dp", True, via_wire(_meta(epsilon=0.0, dp_steps=0)), "bad_signature")
    finally:
        logging.disable(logging.NOTSET)
    assert out["spend"][BAD].steps == 1 and out["spend"][BAD].epsilon == ok["spend"][BAD].epsilon
    _check_records(out)


def _check_quietly(*args, **kw):
    """:func:`_check_rejected` with the tracker's error logs silenced (they are the expected outcome)."""
    logging.disable(logging.ERROR)
    try:
        return _check_rejected(*args, **kw)
    finally:
        logging.disable(logging.NOTSET)


def _spent_inf(out):
    """The broken reply's spend and its client's record are an epsilon of inf; ``out`` again."""
    c = out["ups"][BAD].client_id
    assert out["spend"][BAD].epsilon == math.inf and out["clients"][c].epsilon == math.inf
    return out


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "signed"])
def test_a_reply_that_claims_no_noise_is_over_budget_and_the_run_goes_on(tmp_path, sign):
    """noise_multiplier 0 is in range and spends epsilon = inf: over_budget, recorded as such; the
    infinity must not crash the store, the summary or the later budget checks."""
    mutate = _dp_meta(noise_multiplier=0.0)
    if sign:
        mutate = _resigned(mutate)
    out = _spent_inf(_check_quietly(tmp_path, "dp", sign, mutate, "over_budget", same_model=False))
    assert out["summary"]["privacy"]["epsilon_max"] == math.inf
    # summary.json is strict JSON (it said Infinity, which jq, JavaScript and PostgreSQL refuse): null
    from fedasync.outputs import write_run_outputs

    paths = write_run_outputs(tmp_path / "outputs", DP, out["summary"])

    def no_constant(name):
        raise AssertionError(f"summary.json holds {name}")

    written = json.loads(paths["summary"].read_text(), parse_constant=no_constant)
    assert written["privacy"]["epsilon_max"] is None and written["privacy"]["epsilon_mean"] is None
    assert all(u.accepted for t, u in out["ups"].items() if t != BAD)  # the others go on being taken


@pytest.mark.parametrize("sign", [False, True], ids=["unsigned", "signed"])
def test_a_history_of_thousands_of_distinct_entries_does_not_stall_the_server(tmp_path, sign):
    """The true history plus 3000 one-step entries at distinct sigmas: it holds every step of the
    server's record, and the epsilon of each distinct (sigma, q) costs ~15 ms (the run stalled for
    most of a minute; a few hundred thousand would stall it for hours). More new entries than a
    reply can honestly add is a malformed accounting."""
    def pad(r, config):
        q = config["privacy"]["sample_rate"]
        extra = [[SIGMA + (i + 1) * 1e-6, q, 1] for i in range(3000)]
        return dict(r, metrics=dict(r["metrics"], accountant_history=r["metrics"]["accountant_history"] + extra))
    mutate = _resigned(pad) if sign else pad
    _check_quietly(tmp_path, "dp", sign, mutate, "privacy_accounting")


def _append_entry(sigma):
    def m(r, config):
        q = config["privacy"]["sample_rate"]
        hist = r["metrics"]["accountant_history"] + [[sigma, q, 1]]
        return dict(r, metrics=dict(r["metrics"], accountant_history=hist))
    return m


@pytest.mark.parametrize("case,mutate", [
    ("sigma_1e-300", _dp_meta(noise_multiplier=1e-300)),
    ("sigma_1e300", _dp_meta(noise_multiplier=1e300)),
    ("history_sigma_1e-300", _append_entry(1e-300)),
    ("history_sigma_1e300", _append_entry(1e300)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_sigma_whose_epsilon_cannot_be_computed_is_an_unbounded_spend(tmp_path, case, mutate):
    """Opacus' RDP divides by zero at sigma = 1e-300 and overflows at 1e300: the error escaped the
    tracker and ended the run. An epsilon that cannot be computed is no bound: inf, over_budget."""
    _spent_inf(_check_quietly(tmp_path, "dp", False, mutate, "over_budget", same_model=False))
