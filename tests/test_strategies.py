"""Strategies: exact values on small arrays, and the equivalences they must reduce to."""

import copy
import subprocess
import sys

import numpy as np
import pytest

from fedasync.config import CentralDPConfig, ServerConfig, StalenessConfig
from fedasync.server.staleness import STALENESS, make_staleness_fn
from fedasync.server.strategies import (
    STRATEGIES,
    CentralDP,
    FedAsync,
    FedAvg,
    FedBuff,
    Update,
    make_strategy,
    params_norm,
    params_sha256,
    params_sub,
)

CONST = make_staleness_fn("constant")


def P(**arrays):
    return {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}


def upd(task_id, params, base, base_version=0, staleness=0, n=1, client_id=None):
    return Update(
        task_id=task_id,
        client_id=task_id if client_id is None else client_id,
        params=params,
        base_params=base,
        base_version=base_version,
        staleness=staleness,
        num_examples=n,
    )


def assert_params_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k])


def random_params(rng):
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4).astype(np.float32),
    }


# -- helpers ------------------------------------------------------------------------


def test_params_helpers():
    a, b = P(w=[[1, 2], [3, 4]], b=[3]), P(w=[[0, 2], [1, 1]], b=[-1])
    a0 = copy.deepcopy(a)
    d = params_sub(a, b)
    assert_params_equal(d, P(w=[[1, 0], [2, 3]], b=[4]))
    assert_params_equal(a, a0)
    assert params_norm(P(x=[3.0], y=[[4.0]])) == 5.0
    assert isinstance(params_norm(a), float)
    with pytest.raises(ValueError):
        params_sub(a, P(w=[[1, 2], [3, 4]]))


def test_params_sha256():
    a = P(w=[[1, 2], [3, 4]], b=[5])
    h = params_sha256(a)
    assert len(h) == 64 and h == params_sha256(copy.deepcopy(a))
    assert h != params_sha256(P(w=[1, 2, 3, 4], b=[5]))  # shape
    assert h != params_sha256({"w": a["w"].astype(np.float64), "b": a["b"]})  # dtype
    assert h != params_sha256(P(v=[[1, 2], [3, 4]], b=[5]))  # key name
    assert h != params_sha256({"b": a["b"], "w": a["w"]})  # key order
    assert h != params_sha256(P(w=[[1, 2], [3, 4]], b=[6]))  # values
    assert params_sha256({"w": np.asfortranarray(a["w"]), "b": a["b"]}) == h  # memory layout is not content


# -- exact values -------------------------------------------------------------------


def test_fedasync_exact():
    s = FedAsync(alpha=0.5, staleness_fn=make_staleness_fn("polynomial", a=0.5))
    x = P(w=[[0, 4], [8, 0]])
    u = upd(7, P(w=[[4, 0], [0, 8]]), x, staleness=3)
    assert s.weight(u) == 0.25  # 0.5 * (1+3)^-0.5
    new = s.add(x, u, version=3)
    assert_params_equal(new, P(w=[[1, 3], [6, 2]]))
    assert s.last_aggregated() == [7] and s.pending() == []


def test_fedbuff_uniform_exact():
    s = FedBuff(buffer_size=2, server_lr=1.0, staleness_fn=make_staleness_fn("polynomial", a=1.0))
    x0, x = P(w=[0, 0]), P(w=[1, 1])
    u1 = upd(1, P(w=[2, 4]), x0, staleness=0)
    u2 = upd(2, P(w=[4, 0]), x0, staleness=1)
    assert s.weight(u2) == 0.5
    assert s.add(x, u1, version=1) is None
    assert s.pending() == [1]
    new = s.add(x, u2, version=1)  # ([2,4] + 0.5*[4,0]) / 2 = [2,2]
    assert_params_equal(new, P(w=[3, 3]))
    assert s.pending() == [] and s.last_aggregated() == [1, 2]


def test_fedbuff_server_lr_and_examples_exact():
    s = FedBuff(2, server_lr=0.5, staleness_fn=make_staleness_fn("polynomial", a=1.0))
    x0, x = P(w=[0, 0]), P(w=[1, 1])
    s.add(x, upd(1, P(w=[2, 4]), x0), 1)
    assert_params_equal(s.add(x, upd(2, P(w=[4, 0]), x0, staleness=1), 1), P(w=[2, 2]))

    e = FedBuff(2, server_lr=1.0, staleness_fn=make_staleness_fn("polynomial", a=1.0), weighting="examples")
    e.add(x, upd(1, P(w=[2, 4]), x0, n=1), 1)
    # (1*1*[2,4] + 3*0.5*[4,0]) / 4 = [2, 1]
    assert_params_equal(e.add(x, upd(2, P(w=[4, 0]), x0, staleness=1, n=3), 1), P(w=[3, 2]))


def test_fedavg_exact():
    x = P(w=[0, 0])
    ex = FedAvg(clients_per_round=2, weighting="examples")
    assert ex.weight(upd(1, x, x, n=3)) == 3.0
    assert ex.add(x, upd(1, P(w=[1, 2]), x, n=1), 0) is None
    assert_params_equal(ex.add(x, upd(2, P(w=[5, 6]), x, n=3), 0), P(w=[4, 5]))
    un = FedAvg(clients_per_round=2, weighting="uniform")
    assert un.weight(upd(1, x, x, n=3)) == 1.0
    un.add(x, upd(1, P(w=[1, 2]), x, n=1), 0)
    assert_params_equal(un.add(x, upd(2, P(w=[5, 6]), x, n=3), 0), P(w=[3, 4]))


def test_dtype_kept_and_inputs_not_mutated():
    rng = np.random.default_rng(0)
    x, xi = random_params(rng), random_params(rng)
    x["h"] = rng.standard_normal(2).astype(np.float64)
    xi["h"] = rng.standard_normal(2).astype(np.float64)
    snap = copy.deepcopy((x, xi))
    for s in (FedAsync(0.5, CONST), FedBuff(1, 1.0, CONST), FedAvg(1)):
        new = s.add(x, upd(1, xi, x), 0)
        assert_params_equal(x, snap[0])
        assert_params_equal(xi, snap[1])
        assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in x.items()}
        assert list(new) == list(x)
        assert all(not np.shares_memory(new[k], x[k]) and not np.shares_memory(new[k], xi[k]) for k in x)


# -- equivalences -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STALENESS))
@pytest.mark.parametrize("eta", [0.3, 0.6, 1.0])
def test_fedbuff_k1_equals_fedasync(name, eta):
    """FedBuff(K=1, eta) == FedAsync(alpha=eta) when each update starts from the current model."""
    fn = make_staleness_fn(name, a=0.7, b=0.0, concurrency=3)
    fa, fb = FedAsync(alpha=eta, staleness_fn=fn), FedBuff(buffer_size=1, server_lr=eta, staleness_fn=fn)
    rng = np.random.default_rng(1)
    xa = xb = random_params(rng)
    for t in range(25):
        xi = {k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in xa.items()}
        u = upd(t, xi, xa, base_version=t, staleness=0)
        assert fa.weight(u) == eta and fb.weight(u) == 1.0
        xa, xb = fa.add(xa, u, t), fb.add(xb, u, t)
        assert xb is not None
        assert_params_equal(xa, xb)
        assert fa.last_aggregated() == fb.last_aggregated() == [t]


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_fedbuff_kn_equals_fedavg(weighting):
    """FedBuff(K=N, eta=1) on N updates from the same model == FedAvg(m=N)."""
    n = 5
    rng = np.random.default_rng(2)
    x0 = random_params(rng)
    ups = [upd(t, random_params(rng), x0, n=int(rng.integers(1, 50))) for t in range(n)]
    fb = FedBuff(n, 1.0, make_staleness_fn("polynomial"), weighting=weighting)
    fv = FedAvg(n, weighting=weighting)
    outs_b = [fb.add(x0, u, 0) for u in ups]
    outs_v = [fv.add(x0, u, 0) for u in ups]
    assert outs_b[:-1] == [None] * (n - 1) and outs_v[:-1] == [None] * (n - 1)
    for k in x0:
        np.testing.assert_allclose(outs_b[-1][k], outs_v[-1][k], rtol=1e-6, atol=1e-6)
    assert fb.last_aggregated() == fv.last_aggregated() == list(range(n))


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_fedbuff_kn_equals_fedavg_exact_on_dyadic(weighting):
    """On values exact in binary the two reductions agree bit for bit."""
    x0 = P(w=[[0.5, -1.0], [2.0, 0.25]])
    xs = [P(w=[[1.0, 0.0], [2.5, 0.75]]), P(w=[[0.0, -2.0], [1.0, 0.25]]),
          P(w=[[1.5, 1.0], [3.0, -0.75]]), P(w=[[0.5, -1.0], [2.0, 0.25]])]
    ns = [1, 1, 2, 4]
    fb, fv = FedBuff(4, 1.0, CONST, weighting=weighting), FedAvg(4, weighting=weighting)
    for t, (xi, n) in enumerate(zip(xs, ns)):
        rb, rv = fb.add(x0, upd(t, xi, x0, n=n), 0), fv.add(x0, upd(t, xi, x0, n=n), 0)
    assert_params_equal(rb, rv)


# -- buffering and rounds -----------------------------------------------------------


def test_fedbuff_exactly_k_per_aggregation():
    k = 4
    s = FedBuff(k, 1.0, make_staleness_fn("polynomial"))
    rng = np.random.default_rng(3)
    x, v = random_params(rng), 0
    fired = []
    for t in range(2 * k + 3):
        u = upd(t, random_params(rng), x, base_version=v, staleness=0)
        new = s.add(x, u, v)
        if new is not None:
            fired.append(t)
            assert s.last_aggregated() == list(range(t - k + 1, t + 1))
            assert s.pending() == []
            x, v = new, v + 1
    assert fired == [k - 1, 2 * k - 1]
    assert s.pending() == [2 * k, 2 * k + 1, 2 * k + 2]


def test_fedavg_round_closed_and_backup_workers():
    cfg = ServerConfig(strategy="fedavg", concurrency=4, clients_per_round=2, backup_workers=1)
    s = make_strategy(cfg, "examples")
    assert isinstance(s, FedAvg) and s.synchronous and s.round_size == 3
    x0 = P(w=[0, 0])
    # round at version 0: three dispatched, the first two to arrive count
    u = [upd(0, P(w=[1, 1]), x0, n=1), upd(1, P(w=[4, 4]), x0, n=2), upd(2, P(w=[100, 100]), x0, n=5)]
    assert s.check(u[0], 0) is None and s.add(x0, u[0], 0) is None
    assert s.check(u[1], 0) is None
    x1 = s.add(x0, u[1], 0)
    assert_params_equal(x1, P(w=[3, 3]))
    assert s.last_aggregated() == [0, 1]
    # the backup worker finishes after its round was aggregated
    late = upd(2, u[2].params, x0, base_version=0, staleness=1, n=5)
    assert s.check(late, 1) == "round_closed"
    assert s.check(u[2], 0) == "round_closed"  # even if the caller forgot to bump the version
    with pytest.raises(ValueError, match="round_closed"):
        s.add(x1, late, 1)
    # the next round proceeds normally
    assert s.check(upd(3, P(w=[3, 3]), x1, base_version=1), 1) is None


def test_fedavg_m_defaults_to_concurrency():
    s = make_strategy(ServerConfig(strategy="fedavg", concurrency=7), "uniform")
    assert s.clients_per_round == 7 and s.round_size == 7


# -- central DP ---------------------------------------------------------------------


def test_central_dp_clips_and_noise_free_is_clipped_mean():
    dp = CentralDP(clip=1.0, noise_multiplier=0.0, seed=0)
    s = FedBuff(2, 1.0, make_staleness_fn("polynomial", a=1.0), central_dp=dp)
    x0 = P(w=[0, 0])
    s.add(x0, upd(0, P(w=[3, 4]), x0, staleness=0), 1)  # norm 5 -> [0.6, 0.8]
    new = s.add(x0, upd(1, P(w=[0.3, 0.4]), x0, staleness=1), 1)  # norm 0.5, kept; S=0.5
    np.testing.assert_allclose(new["w"], np.float32([(0.6 + 0.15) / 2, (0.8 + 0.2) / 2]), rtol=1e-7)
    assert dp.releases == 1


def test_central_dp_noise_scale_secret_by_default_and_reproducible_on_request():
    def run(seed, reproducible):
        s = FedBuff(1, 1.0, CONST, central_dp=CentralDP(clip=2.0, noise_multiplier=1.5, seed=seed,
                                                          reproducible=reproducible))
        x0 = {"w": np.zeros(20000, np.float32)}
        return s.add(x0, upd(0, x0, x0), 0)["w"]

    a, b, c = run(11, True), run(11, True), run(12, True)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert abs(a.mean()) < 0.1 and a.std() == pytest.approx(3.0, rel=0.03)  # std = 1.5 * 2.0
    d, e = run(11, False), run(11, False)  # the default: OS entropy, whatever the seed
    assert not np.array_equal(d, e) and not np.array_equal(d, a)
    assert d.std() == pytest.approx(3.0, rel=0.03)


def test_central_dp_never_stores_its_generator():
    for reproducible in (False, True):
        dp = CentralDP(1.0, 1.0, seed=3, reproducible=reproducible)
        dp.privatize([P(w=[1, 2])])
        assert dp.state_dict() == {"releases": 1, "reproducible": reproducible}
    # reproducible: release r's noise is a function of (seed, r), so a restored count continues exactly
    a, b = CentralDP(1.0, 1.0, seed=3, reproducible=True), CentralDP(1.0, 1.0, seed=3, reproducible=True)
    a.privatize([P(w=[0, 0])])
    b.load_state_dict({"releases": 1, "bit_generator": {"ignored": "a state stored by an older version"}})
    np.testing.assert_array_equal(a.privatize([P(w=[0, 0])])["w"], b.privatize([P(w=[0, 0])])["w"])
    # secret: a restored count continues with fresh entropy
    c, d = CentralDP(1.0, 1.0, seed=3), CentralDP(1.0, 1.0, seed=3)
    d.load_state_dict(c.state_dict())
    assert not np.array_equal(c.privatize([P(w=[0, 0])])["w"], d.privatize([P(w=[0, 0])])["w"])


def test_central_dp_release_holds_one_term_per_client():
    """K = 3. Client 7 finishes three times before the buffer fills: its second update waits for the
    next release, its third is rejected (client_backlog); every release has 3 distinct clients."""
    dp = CentralDP(clip=10.0, noise_multiplier=0.0)
    s = FedBuff(3, 1.0, CONST, central_dp=dp)
    x0 = P(w=[0, 0])
    x = x0

    def send(task, client, w):
        u = upd(task, P(w=w), x0, client_id=client)
        reason = s.check(u, 0)
        return reason if reason else s.add(x, u, 0)

    assert send(0, 7, [1, 0]) is None
    assert send(1, 7, [2, 0]) is None and s.pending() == [0, 1]  # held, still pending
    assert send(2, 7, [4, 0]) == "client_backlog"  # one buffered + one held already
    assert send(3, 8, [0, 1]) is None
    new = send(4, 9, [0, 2])
    np.testing.assert_allclose(new["w"], [1 / 3, 1.0])  # tasks 0, 3, 4: the held task 1 is not in it
    assert s.last_aggregated() == [0, 3, 4] and dp.releases == 1
    assert s.pending() == [1]  # the held update opens the next release
    x = new
    assert send(5, 8, [3, 0]) is None
    assert send(6, 7, [5, 0]) is None and s.pending() == [1, 5, 6]  # 7 is buffered (task 1): held again
    new = send(7, 9, [0, 3])
    assert s.last_aggregated() == [1, 5, 7] and dp.releases == 2
    # without central DP nothing is held (FedBuff's rule and its hashes are unchanged)
    plain = FedBuff(3, 1.0, CONST)
    for t in range(2):
        assert plain.check(upd(t, P(w=[1, 0]), x0, client_id=7), 0) is None
        assert plain.add(x0, upd(t, P(w=[1, 0]), x0, client_id=7), 0) is None
    assert plain.add(x0, upd(2, P(w=[1, 0]), x0, client_id=7), 0) is not None


def test_central_dp_privatize_direct():
    dp = CentralDP(clip=1.0, noise_multiplier=0.0)
    out = dp.privatize([P(w=[3, 4]), P(w=[0, 0.5])], weights=[1.0, 2.0])
    np.testing.assert_allclose(out["w"], [0.6, 1.8])
    assert out["w"].dtype == np.float64


# -- state --------------------------------------------------------------------------


def _drive(strategy, x, v, bases, items):
    """Feed (task_id, params) items; each update starts one version back (fedavg: the current)."""
    out = []
    for t, xi in items:
        base_v = v if strategy.synchronous else max(0, v - 1)
        u = upd(t, xi, bases[base_v], base_version=base_v, staleness=v - base_v, n=t + 1)
        new = strategy.add(x, u, v)
        out.append(new)
        if new is not None:
            x, v = new, v + 1
            bases[v] = x
    return x, v, out


@pytest.mark.parametrize(
    "factory",
    [
        lambda: FedAsync(0.6, make_staleness_fn("hinge", a=0.5, b=1)),
        lambda: FedBuff(3, 0.8, make_staleness_fn("polynomial"),
                        central_dp=CentralDP(1.0, 1.0, seed=5, reproducible=True)),
        lambda: FedBuff(4, 1.0, make_staleness_fn("exponential", a=0.1), weighting="examples"),
        lambda: FedAvg(3, backup_workers=1),
    ],
)
def test_state_dict_round_trip_continues_identically(factory):
    rng = np.random.default_rng(4)
    x0 = random_params(rng)
    first = list(enumerate(random_params(rng) for _ in range(5)))
    rest = list(enumerate((random_params(rng) for _ in range(7)), start=5))

    a = factory()
    bases = {0: x0}
    x, v, _ = _drive(a, x0, 0, bases, first)
    state = a.state_dict()
    pending = a.pending()
    _, _, out_a = _drive(a, x, v, dict(bases), rest)  # a goes on; the saved state must not change

    b = factory()
    b.load_state_dict(state)
    assert b.pending() == pending
    _, _, out_b = _drive(b, x, v, dict(bases), rest)
    assert [r is None for r in out_a] == [r is None for r in out_b]
    assert any(r is not None for r in out_a)
    for ra, rb in zip(out_a, out_b):
        if ra is not None:
            assert_params_equal(ra, rb)
    assert a.last_aggregated() == b.last_aggregated()
    assert a.pending() == b.pending()


def test_load_state_wrong_strategy_raises():
    with pytest.raises(ValueError):
        FedAvg(2).load_state_dict(FedAsync(0.5, CONST).state_dict())


# -- the registry -------------------------------------------------------------------


def test_make_strategy():
    assert set(STRATEGIES) == {"fedasync", "fedbuff", "fedavg"}
    fa = make_strategy(ServerConfig(strategy="fedasync", alpha=0.4, staleness=StalenessConfig(fn="constant")), "uniform")
    assert isinstance(fa, FedAsync) and fa.alpha == 0.4 and not fa.synchronous
    fb = make_strategy(ServerConfig(strategy="fedbuff", buffer_size=3, server_lr=0.5), "examples")
    assert isinstance(fb, FedBuff) and (fb.buffer_size, fb.server_lr, fb.weighting) == (3, 0.5, "examples")
    assert fb.central_dp is None
    dp = make_strategy(ServerConfig(), "uniform", seed=3, central_dp=CentralDPConfig(enabled=True, clip=0.5))
    assert dp.central_dp is not None and dp.central_dp.clip == 0.5 and not dp.central_dp.reproducible
    rep = make_strategy(ServerConfig(), "uniform", seed=3, central_dp=CentralDPConfig(enabled=True),
                        reproducible_noise=True)
    assert rep.central_dp.reproducible and rep.central_dp.seed == 3
    assert make_strategy(ServerConfig(), "uniform", central_dp=CentralDPConfig(enabled=False)).central_dp is None
    with pytest.raises(ValueError):
        make_strategy(ServerConfig(), "auto")
    with pytest.raises(ValueError):
        make_strategy(ServerConfig(strategy="fedavg"), "examples", central_dp=CentralDP(1.0, 1.0))


def test_pure_modules_import_neither_flower_nor_sqlalchemy():
    code = (
        "import sys\n"
        "import fedasync.server.staleness, fedasync.server.strategies, fedasync.server.scheduler, fedasync.server.clock\n"
        "import fedasync.server.robust, fedasync.server.delay, fedasync.clients.attack\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('flwr', 'sqlalchemy')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fedbuff_blockwise_mean_is_bit_identical_to_the_plain_expression():
    """The blocked, in-place aggregation (``mean_step``) gives the same bits as
    ``x + lr * (sum_i c_i * (float64(p_i) - float64(b_i))) / d`` cast back, for arrays larger than a
    block, odd sizes, 0-d and integer arrays, and entries restored with a float64 delta."""
    from fedasync.server.params import _BLOCK, _cast_like, _f64, mean_step

    rng = np.random.default_rng(3)
    shapes = {"w": (3 * _BLOCK + 17,), "m": (7, 300), "s": (), "n": (5,), "e": (0, 2)}
    model = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    model["n"] = np.arange(5, dtype=np.int64) * 3
    bases = [{k: (v + rng.standard_normal(v.shape) * 0.1).astype(v.dtype) for k, v in model.items()} for _ in range(2)]
    buf, deltas = [], []
    for i in range(5):
        b = bases[i % 2]
        p = {k: (v + rng.standard_normal(v.shape) * 0.3).astype(v.dtype) for k, v in b.items()}
        d = {k: p[k].astype(np.float64) - b[k].astype(np.float64) for k in p}
        buf.append(d if i == 3 else (p, b))
        deltas.append(d)
    x = _f64(model)
    # weights of exactly 1 (skipped multiplications) on a pair and on a float64 delta, and none
    for coef in ([0.5, 1.0, 0.25, 2.0 / 3.0, 1e-3], [1.0, 0.3, 1.0, 1.0, 0.7]):
        total = {k: np.zeros_like(v) for k, v in x.items()}
        for c, d in zip(coef, deltas):
            for k in total:
                total[k] += c * d[k]
        want = _cast_like({k: x[k] + 0.7 * (total[k] / 4.5) for k in x}, model)
        got = mean_step(model, buf, coef, 4.5, 0.7)
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert got[k].tobytes() == want[k].tobytes(), (coef, k)


def test_params_mean_is_the_mean_per_array_in_the_first_dtypes():
    from fedasync.server.params import params_mean

    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(3, np.int64)}
    b = {"w": np.array([2.0, 4.0], np.float32), "n": np.array(4, np.int64)}
    c = {"w": np.array([6.0, 0.0], np.float32), "n": np.array(4, np.int64)}
    m = params_mean([a, b, c])
    assert list(m) == ["w", "n"] and m["w"].dtype == np.float32 and m["n"].dtype == np.int64
    np.testing.assert_array_equal(m["w"], np.array([3.0, 2.0], np.float32))
    assert int(m["n"]) == 4  # 11/3 rounded
    assert all(np.array_equal(params_mean([a])[k], a[k]) for k in a)
    with pytest.raises(ValueError, match="keys differ"):
        params_mean([a, {"w": a["w"]}])
    with pytest.raises(ValueError, match="no parameters"):
        params_mean([])
