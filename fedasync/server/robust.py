"""Byzantine-robust aggregation: filters on each update, robust aggregators for FedBuff's buffer.

An asynchronous server applies each update as it comes, so one client sending a well-formed but
malicious update (it passes :mod:`fedasync.server.validation`) moves the model at once. This
module holds the defences of ``server.robust`` in YAML. Everything is pure array math on the
parameter dicts (``{name: ndarray}``), float64 inside.

Notation: an update from client ``i`` trained from the global model ``x_base`` (version
``base_version``) and returned ``x_client``; its *pseudo-gradient* is ``g = x_base - x_client``
(a descent step: the server moves the model by ``-g``, scaled by the strategy) and its delta is
``Δ = x_client - x_base = -g``. ``staleness = v_now - base_version``.

Filters (``server.robust.filter``)
----------------------------------
A filter is called once per update that passed validation and the strategy's own check, just
before the strategy takes it: :meth:`Filter.check` returns a :class:`Verdict`; ``reason`` is
``None`` to accept, else the rejection reason recorded with the update. A filter's statistics
change only through ``check`` (so the sequence of calls, not the clock, defines them) and are
saved by ``state_dict`` as plain JSON (arrays as base64 of their bytes).

- ``zeno++`` (reason ``zeno``) — Zeno++: C. Xie, S. Koyejo, I. Gupta, "Zeno++: Robust fully
  asynchronous SGD", ICML 2020. The server keeps ``v``, the gradient of the loss on a small
  validation set drawn from the *training* data (:func:`validation_split`; never the test set),
  refreshed lazily every ``refresh`` versions (:meth:`ZenoPlusPlus.needs_refresh`,
  :meth:`ZenoPlusPlus.set_validation_gradient`). An update is accepted iff

      gamma <v, g> - rho ||g||^2  >=  -gamma * epsilon,

  a first-order estimate of the validation loss' descent ``f(x) - f(x - gamma g)`` with a
  penalty on the step's size, allowed a slack ``epsilon``. With ``normalize: true`` ``g`` is first
  rescaled to ``||v||``, which turns the test into ``cos(v, g) >= rho / gamma - epsilon / ||v||^2``
  (direction only). The accepted update itself is applied unchanged.

  Defaults, from ``benchmarks/robust_calibration.py`` (a clean FedBuff replay of the quickstart,
  seeds 0-2, 1,500 updates each; ``benchmarks/results/robust_calibration.md``): ``gamma = 1``
  (FedBuff applies the pseudo-gradient at server step 1), ``rho = 1``, ``epsilon = 0.5``. There,
  honest updates are rejected 1.7 % of the time (median over seeds; 3.7 % in versions 20-59,
  where the validation gradient is largest), and of the same updates turned into attacks with
  factor 10, ``sign_flip`` 99.9 %, ``scale`` 100 %, ``gaussian`` 99.9 % and ``label_flip`` 75 %
  would be rejected. A direction-only test cannot work on this non-IID task: 33-36 % of honest
  updates have a negative cosine with ``v`` (``rho = 0.001, epsilon = 0``: 34.5 % false
  rejections); the magnitude term is what catches attacks that rescale ``g``. ``refresh = 1``:
  a new ``v`` for each version costs one forward/backward pass over ``validation_size = 128``
  samples, 1.5 ms for the quickstart's MLP on one CPU thread (against about 5 ms of training per
  update). 128 samples are about 9 % of the quickstart's 1,437 training digits: the "small
  validation set" the paper assumes.
- ``kardam`` (reason ``kardam``) — Kardam: G. Damaskinos, E. M. El Mhamdi, R. Guerraoui,
  R. Patra, M. Taziki, "Asynchronous Byzantine machine learning (the case of SGD)", ICML 2018
  (PMLR 80). The Lipschitz filter: for client ``i``'s update, with ``(g_prev, x_prev)`` the
  pseudo-gradient and base model of ``i``'s previous update, the empirical Lipschitz coefficient
  ``k = ||g - g_prev|| / ||x_base - x_prev||``; the update is accepted iff ``k`` is at most the
  ``(N - f) / N`` quantile (``1 - byzantine_fraction``) of the last ``window`` coefficients
  computed (from every update received, accepted or not: the quantile is what bounds the
  attackers' share). A client's first update, one trained from the same model as its previous
  one (``x_base == x_prev``, no coefficient), and every update while fewer than ``warmup``
  coefficients exist are accepted. Its dampening ``Λ(τ) = exp(-beta τ)`` scales an accepted
  update by ``exp(-dampening * staleness)`` (default ``dampening = 0``: the staleness weighting of
  ``server.staleness`` already dampens; ``fn: exponential`` with ``a = beta`` *is* Kardam's Λ).
  By construction Kardam rejects about ``f / N`` of honest updates (the paper's slowdown bound);
  ``byzantine_fraction = 0.03`` by default keeps a clean run under 5 % (the quickstart, 150
  virtual s, seeds 0-2: 3.8-4.3 %; 0.04 gave 5.1 % with FedBuff, 0.05 5.6 % in calibration).
  Against a known attacker share set it to that share: with 20 % the calibration run rejects
  18.5 % of honest updates. State: the previous pseudo-gradient of every client and
  the base models they refer to, ``O(clients x parameters)``.
- ``norm`` (reason ``norm``) — reject (or, with ``clip: true``, clip to the threshold) an update
  whose ``||Δ||`` exceeds ``norm_multiplier`` × the median of the last ``window`` accepted norms
  (a clipped update records the threshold). Default multiplier 3: in the calibration runs the
  largest honest norm was 2.4-3.0 × the median over the whole run, and no honest update exceeded
  3 × the running median (multiplier 2: 0.5 %); a scaled attack (factor 10) does. The first
  ``warmup`` updates are accepted (there is no median yet).

``window = 100`` (about the number of clients: one "round" of history) and ``warmup = 10``
(one FedBuff buffer) are shared by kardam and norm.

Aggregators (``server.robust.aggregator``, FedBuff only)
-------------------------------------------------------
FedBuff's buffer of ``K`` updates gives ``u_i = c_i Δ_i`` with ``c_i = K w_i / D`` (``w_i`` and
``D`` as in :mod:`fedasync.server.strategies`: with uniform weighting ``c_i = S(s_i)``), so
that ``mean(u_i)`` is FedBuff's step. :func:`aggregate` replaces that mean by a robust estimate:

- ``mean``: the mean (FedBuff keeps its own arithmetic for it, bit-identical to before);
- ``median``: the coordinate-wise median;
- ``trimmed_mean``: per coordinate, drop the ``floor(trim * K)`` smallest and largest values and
  average the rest (at least one value is kept); default ``trim = 0.2`` (two of a buffer of
  10 at each end: a 20 % attacker share if they fall evenly);
- ``centered_clip``: centered clipping of S. P. Karimireddy, L. He, M. Jaggi, "Learning from
  history for Byzantine robust optimization", ICML 2021:
  ``v <- v + (1/K) sum_i (u_i - v) min(1, tau / ||u_i - v||)``, ``cc_iters`` times (default 3).
  The paper starts from the previous step's momentum; this stateless version starts from the
  coordinate-wise median, and ``tau`` (``cc_radius``) defaults to the median of
  ``||u_i - v_0||`` (scale-free).

Pure: numpy only; imports neither Flower nor the database.
"""

from __future__ import annotations

import base64
import math
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fedasync.server.params import _BLOCK, _cast_like

Params = dict[str, np.ndarray]

REASONS = ("zeno", "kardam", "norm")
FILTERS = ("none", "zeno++", "kardam", "norm")
AGGREGATORS = ("mean", "median", "trimmed_mean", "centered_clip")


# -- flat vectors and JSON-safe arrays ------------------------------------------------------


def flat(p: Params, dtype: Any = np.float64, out: np.ndarray | None = None) -> np.ndarray:
    """All arrays of ``p`` in key order, raveled into one vector of ``dtype`` (float64; ``None``:
    the arrays' common dtype), each cast straight into its slice: one allocation (none when
    written into ``out``), not one per array plus the concatenation."""
    arrays = [np.asarray(v) for v in p.values()]
    dtype = np.result_type(*{a.dtype for a in arrays}) if dtype is None else dtype
    out = np.empty(sum(a.size for a in arrays), dtype) if out is None else out
    i = 0
    for a in arrays:
        out[i: i + a.size] = a.reshape(-1)
        i += a.size
    return out


def unflat(vec: np.ndarray, like: Params) -> Params:
    """``vec`` cut back into ``like``'s keys and shapes (float64)."""
    out: Params = {}
    i = 0
    for k, ref in like.items():
        n = int(np.size(ref))
        out[k] = np.asarray(vec[i: i + n], np.float64).reshape(np.shape(ref)).copy()
        i += n
    if i != len(vec):
        raise ValueError(f"unflat: vector has {len(vec)} values, the parameters {i}")
    return out


def enc_array(a: np.ndarray) -> dict[str, Any]:
    """A JSON-safe, exact encoding of an array (dtype, shape, base64 of the C-order bytes)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def dec_array(d: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(d["b64"])
    return np.frombuffer(raw, dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def pseudo_gradient(update: Any, x_base: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``g = x_base - x_client`` of an update (with ``params`` and ``base_params``), flat in the base
    model's key order (``x_base``: ``flat(update.base_params)`` when at hand; ``out``: where to write ``g``)."""
    if update.base_params is None:
        raise ValueError("robust filters need the update's base_params")
    if update.params.keys() != update.base_params.keys():
        raise ValueError("robust filters: update and base model have different keys")
    x = flat(update.base_params) if x_base is None else x_base
    g = np.empty_like(x) if out is None else out
    i = 0
    for k, b in update.base_params.items():  # each array cast to float64 inside the subtraction
        a, n = np.asarray(update.params[k]).reshape(-1), np.asarray(b).size
        if a.size != n:
            raise ValueError(f"robust filters: {k!r} has {a.size} values in the update, {n} in the base model")
        np.subtract(x[i: i + n], a, out=g[i: i + n])
        i += n
    return g


# -- verdicts -----------------------------------------------------------------------------------


@dataclass
class Verdict:
    """A filter's decision on one update.

    ``reason``: ``None`` to accept, else the rejection reason. ``delta``: a replacement for the
    update's ``Δ = x_client - x_base`` (flat float64 in the base model's key order; the ``norm``
    filter's clipping), or ``None``.
    ``scale``: a factor on ``Δ`` (Kardam's dampening). ``score``: the statistic the decision
    was made on (zeno++'s score, kardam's coefficient, the norm), for logs; ``threshold``: what
    it was compared with (``None`` while warming up).
    """

    reason: str | None
    delta: np.ndarray | None = None
    scale: float = 1.0
    score: float | None = None
    threshold: float | None = None

    @property
    def accepted(self) -> bool:
        return self.reason is None

    def changes_update(self) -> bool:
        return self.delta is not None or self.scale != 1.0

    def apply(self, update: Any) -> Params:
        """The client parameters to hand to the strategy: ``x_base + scale * Δ'`` in the update's
        dtypes, or the update's own ``params`` object when the verdict changes nothing."""
        if not self.changes_update():
            return update.params
        delta = self.delta if self.delta is not None else -pseudo_gradient(update)
        new = flat(update.base_params) + self.scale * delta
        return _cast_like(unflat(new, update.base_params), update.params)


# -- filters --------------------------------------------------------------------------------------


class Filter(ABC):
    """A filter run on each update before the strategy takes it (see the module docstring)."""

    name: str = ""
    reason: str = ""

    @abstractmethod
    def check(self, update: Any) -> Verdict:
        """Judge ``update`` (``client_id``, ``params``, ``base_params``, ``base_version``,
        ``staleness``: a :class:`fedasync.server.strategies.Update`) and update the statistics."""

    def state_dict(self) -> dict[str, Any]:
        return {"filter": self.name}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("filter") != self.name:
            raise ValueError(f"state is for filter {d.get('filter')!r}, not {self.name!r}")


class ZenoPlusPlus(Filter):
    """Zeno++: accept iff ``gamma <v, g> - rho ||g||^2 >= -gamma epsilon``, ``g`` as sent (``normalize``: ``g ||v||/||g||``)."""

    name = "zeno++"
    reason = "zeno"

    def __init__(self, gamma: float = 1.0, rho: float = 1.0, epsilon: float = 0.5, refresh: int = 1,
                 normalize: bool = False) -> None:
        if gamma <= 0 or rho < 0 or epsilon < 0:
            raise ValueError(f"zeno++ needs gamma > 0, rho >= 0, epsilon >= 0 (got {gamma}, {rho}, {epsilon})")
        if refresh < 1:
            raise ValueError(f"zeno++ refresh must be >= 1, got {refresh}")
        self.gamma, self.rho, self.epsilon = float(gamma), float(rho), float(epsilon)
        self.refresh = int(refresh)
        self.normalize = bool(normalize)
        self.v: np.ndarray | None = None
        self.v_version: int | None = None

    def needs_refresh(self, version: int) -> bool:
        """Whether the validation gradient must be recomputed at ``version`` (none yet, or it was
        computed ``refresh`` or more versions ago)."""
        return self.v is None or self.v_version is None or version - self.v_version >= self.refresh

    def set_validation_gradient(self, v: Params | np.ndarray, version: int) -> None:
        """``v``: the loss gradient on the validation set at the global model of ``version``
        (:func:`fedasync.task.train.gradient`: keyed and ordered like the model's parameters)."""
        self.v = flat(v) if isinstance(v, dict) else np.asarray(v, np.float64).ravel().copy()
        self.v_version = int(version)

    def score(self, g: np.ndarray) -> float:
        """``gamma <v, g> - rho ||g||^2`` for the flat pseudo-gradient ``g`` (rescaled to ``||v||`` if ``normalize``)."""
        if self.v is None:
            raise RuntimeError("zeno++: no validation gradient yet (call set_validation_gradient first)")
        if g.shape != self.v.shape:
            raise ValueError(f"zeno++: the update has {g.size} values, the validation gradient {self.v.size}")
        if self.normalize:
            gn = float(np.linalg.norm(g))
            g = g * (float(np.linalg.norm(self.v)) / gn) if gn > 0 else g
        return self.gamma * float(np.dot(self.v, g)) - self.rho * float(np.dot(g, g))

    def check(self, update: Any) -> Verdict:
        s = self.score(pseudo_gradient(update))
        bound = -self.gamma * self.epsilon
        return Verdict(None if s >= bound else self.reason, score=s, threshold=bound)

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["v"] = None if self.v is None else enc_array(self.v)
        d["v_version"] = self.v_version
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.v = None if d["v"] is None else dec_array(d["v"])
        self.v_version = None if d["v_version"] is None else int(d["v_version"])


def _quantile(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, np.float64), q))


class Kardam(Filter):
    """Kardam's Lipschitz filter and dampening (see the module docstring)."""

    name = "kardam"
    reason = "kardam"

    def __init__(self, byzantine_fraction: float = 0.03, window: int = 100, warmup: int = 10,
                 dampening: float = 0.0) -> None:
        if not 0 <= byzantine_fraction < 1:
            raise ValueError(f"kardam byzantine_fraction must be in [0, 1), got {byzantine_fraction}")
        if window < 1 or warmup < 1 or warmup > window:
            raise ValueError(f"kardam needs 1 <= warmup <= window (got warmup={warmup}, window={window})")
        if dampening < 0:
            raise ValueError(f"kardam dampening must be >= 0, got {dampening}")
        self.quantile = 1.0 - float(byzantine_fraction)
        self.window, self.warmup, self.dampening = int(window), int(warmup), float(dampening)
        self.coefficients: list[float] = []
        # client -> (x_client, base_version), base_version -> x_base: flat, in the model's dtype (float32:
        # half of float64's memory); g_prev = float64(x_prev) - float64(x_client) is made again when needed
        self.prev: dict[int, tuple[np.ndarray, int]] = {}
        self.models: dict[int, np.ndarray] = {}
        self._refs: Counter[int] = Counter()  # base_version -> how many clients' prev refer to it
        self._work: dict[str, np.ndarray] = {}  # float64 scratch: x, g, diff (13 MB each for a CNN), g_prev
        self._x_version: int | None = None  # the base version whose flat model is in _work["x"]

    def threshold(self) -> float | None:
        if len(self.coefficients) < self.warmup:
            return None
        return _quantile(self.coefficients, self.quantile)

    def coefficient(self, client: int, g: np.ndarray, x: np.ndarray) -> float | None:
        """``||g - g_prev|| / ||x - x_prev||`` for ``client``, or ``None`` (none before, or the same base)."""
        if client not in self.prev:
            return None
        g_prev, diff = self._work["g_prev"], self._work["diff"]
        x_client, v_prev = self.prev[client]
        x_prev = self.models[v_prev]  # float32 operands are cast to float64 inside each ufunc (exact)
        dx = float(np.linalg.norm(np.subtract(x, x_prev, out=diff)))
        if dx == 0.0:
            return None
        for lo in range(0, x.size, _BLOCK):  # g - g_prev, g_prev made block by block (it stays in cache)
            hi = min(x.size, lo + _BLOCK)
            np.subtract(x_prev[lo:hi], x_client[lo:hi], out=g_prev[:hi - lo], dtype=np.float64)
            np.subtract(g[lo:hi], g_prev[:hi - lo], out=diff[lo:hi])
        return float(np.linalg.norm(diff)) / dx

    def check(self, update: Any) -> Verdict:
        """Judge ``update``: its pseudo-gradient against the one of its client's previous update."""
        client = int(update.client_id)
        x = self._base(update)
        g = pseudo_gradient(update, x, out=self._work["g"])
        k = self.coefficient(client, g, x)
        thr = self.threshold()
        reason = None if (k is None or thr is None or k <= thr) else self.reason
        if k is not None:
            self.coefficients.append(k)
            del self.coefficients[: max(0, len(self.coefficients) - self.window)]
        self._remember(update)  # the client's previous update, whatever the verdict
        scale = math.exp(-self.dampening * int(update.staleness)) if self.dampening > 0 else 1.0
        return Verdict(reason, scale=scale if reason is None else 1.0, score=k, threshold=thr)

    def _remember(self, update: Any) -> None:
        """``prev[client] = (x_client, version)``; ``models`` keeps the versions ``prev`` refers to (counted)."""
        client, version = int(update.client_id), int(update.base_version)
        old = self.prev.get(client)
        self.prev[client] = (flat({k: update.params[k] for k in update.base_params}, None), version)
        self._refs[version] += 1
        if version not in self.models:
            self.models[version] = flat(update.base_params, None)
        if old is not None:
            self._refs[old[1]] -= 1
            if self._refs[old[1]] == 0:
                del self._refs[old[1]], self.models[old[1]]

    def _base(self, update: Any) -> np.ndarray:
        """The update's base model, flat float64, in a scratch vector (reused: no fresh 13 MB per update)."""
        if update.base_params is None:
            raise ValueError("robust filters need the update's base_params")
        n = sum(np.asarray(a).size for a in update.base_params.values())
        if "x" not in self._work or self._work["x"].size != n:
            self._work, self._x_version = {k: np.empty(n) for k in ("x", "g", "diff")}, None
            self._work["g_prev"] = np.empty(min(n, _BLOCK))
        if self._x_version != int(update.base_version):
            flat(update.base_params, out=self._work["x"])
            self._x_version = int(update.base_version)
        return self._work["x"]

    def remember(self, update: Any) -> None:
        """Take ``update`` (as :meth:`check` saw it) as its client's previous one without judging
        it: a resume rebuilds :attr:`prev` from the updates the store kept (``filter_params``)."""
        pseudo_gradient(update, self._base(update), out=self._work["g"])  # check's checks (keys, base)
        self._remember(update)

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["coefficients"] = list(self.coefficients)
        d["prev"] = [[c, enc_array(x), v] for c, (x, v) in sorted(self.prev.items())]
        d["models"] = [[v, enc_array(x)] for v, x in sorted(self.models.items())]
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.coefficients = [float(k) for k in d["coefficients"]]
        self.prev = {int(c): (dec_array(x), int(v)) for c, x, v in d["prev"]}
        self.models = {int(v): dec_array(x) for v, x in d["models"]}
        self._refs = Counter(v for _, v in self.prev.values())


class NormFilter(Filter):
    """Reject (or clip) ``||Δ|| > norm_multiplier * median(recent accepted norms)``."""

    name = "norm"
    reason = "norm"

    def __init__(self, norm_multiplier: float = 3.0, clip: bool = False, window: int = 100,
                 warmup: int = 10) -> None:
        if norm_multiplier <= 1:
            raise ValueError(f"norm filter multiplier must be > 1, got {norm_multiplier}")
        if window < 1 or warmup < 1 or warmup > window:
            raise ValueError(f"norm filter needs 1 <= warmup <= window (got warmup={warmup}, window={window})")
        self.multiplier, self.clip = float(norm_multiplier), bool(clip)
        self.window, self.warmup = int(window), int(warmup)
        self.norms: list[float] = []

    def threshold(self) -> float | None:
        if len(self.norms) < self.warmup:
            return None
        return self.multiplier * float(np.median(np.asarray(self.norms, np.float64)))

    def _remember(self, n: float) -> None:
        self.norms.append(float(n))
        del self.norms[: max(0, len(self.norms) - self.window)]

    def check(self, update: Any) -> Verdict:
        delta = -pseudo_gradient(update)
        n = float(np.linalg.norm(delta))
        thr = self.threshold()
        if thr is None or n <= thr:
            self._remember(n)
            return Verdict(None, score=n, threshold=thr)
        if not self.clip:
            return Verdict(self.reason, score=n, threshold=thr)
        self._remember(thr)
        return Verdict(None, delta=delta * (thr / n), score=n, threshold=thr)

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["norms"] = list(self.norms)
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.norms = [float(n) for n in d["norms"]]


def make_filter(cfg: Any) -> Filter | None:
    """From ``server.robust`` (a :class:`fedasync.config.RobustConfig`); ``None`` for ``none``."""
    name = cfg.filter
    if name == "none":
        return None
    if name == "zeno++":
        return ZenoPlusPlus(gamma=cfg.gamma, rho=cfg.rho, epsilon=cfg.epsilon, refresh=cfg.refresh,
                            normalize=cfg.normalize)
    if name == "kardam":
        return Kardam(byzantine_fraction=cfg.byzantine_fraction, window=cfg.window, warmup=cfg.warmup,
                      dampening=cfg.dampening)
    if name == "norm":
        return NormFilter(norm_multiplier=cfg.norm_multiplier, clip=cfg.clip, window=cfg.window, warmup=cfg.warmup)
    raise ValueError(f"unknown robust filter {name!r}; known: {', '.join(FILTERS)}")


# -- the validation set for zeno++ -------------------------------------------------------------------

_VALIDATION_SALT = 0x7A3E0  # keeps this draw independent of every other use of the run's seed


def validation_split(partitions: Sequence[tuple[np.ndarray, np.ndarray]], size: int,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` training samples for the server's validation gradient, drawn without replacement
    from the pooled client partitions (training data only; the test set is never passed here)
    by a Generator seeded with ``(seed, salt)``. Returns ``(x, y)`` in the partitions' dtypes, in
    pool order of the drawn indices (sorted), so the draw is a pure function of the seed."""
    if size < 1:
        raise ValueError(f"validation_split: size must be >= 1, got {size}")
    sizes = [len(y) for _, y in partitions]
    total = int(sum(sizes))
    if total == 0:
        raise ValueError("validation_split: the partitions hold no samples")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), _VALIDATION_SALT]))
    idx = np.sort(rng.choice(total, size=min(int(size), total), replace=False))
    x = np.concatenate([np.asarray(px) for px, _ in partitions])
    y = np.concatenate([np.asarray(py) for _, py in partitions])
    return x[idx].copy(), y[idx].copy()


# -- robust aggregators -------------------------------------------------------------------------------


def _stack(updates: Sequence[Params | np.ndarray]) -> np.ndarray:
    rows = [u if isinstance(u, np.ndarray) else flat(u) for u in updates]
    if not rows:
        raise ValueError("aggregate: no updates")
    if any(r.shape != rows[0].shape for r in rows):
        raise ValueError("aggregate: updates of different sizes")
    return np.stack([np.asarray(r, np.float64) for r in rows])


def trimmed_mean(u: np.ndarray, trim: float) -> np.ndarray:
    """Per coordinate: drop the ``floor(trim K)`` smallest and largest values, average the rest."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean: trim must be in [0, 0.5), got {trim}")
    k_total = u.shape[0]
    k = min(int(math.floor(trim * k_total)), (k_total - 1) // 2)
    s = np.sort(u, axis=0)
    return s[k: k_total - k].mean(axis=0)


def centered_clip(u: np.ndarray, radius: float | None = None, iters: int = 3,
                  start: np.ndarray | None = None) -> np.ndarray:
    """Karimireddy et al. 2021: ``v <- v + mean_i (u_i - v) min(1, tau / ||u_i - v||)``, ``iters`` times,
    from ``start`` (default the coordinate-wise median); ``tau`` default the median ``||u_i - v_0||``."""
    if iters < 1:
        raise ValueError(f"centered_clip: iters must be >= 1, got {iters}")
    v = np.median(u, axis=0) if start is None else np.asarray(start, np.float64).copy()
    if radius is None:
        radius = float(np.median(np.linalg.norm(u - v, axis=1)))
    if radius < 0:
        raise ValueError(f"centered_clip: radius must be >= 0, got {radius}")
    for _ in range(int(iters)):
        diff = u - v
        dist = np.linalg.norm(diff, axis=1)
        factor = np.where(dist > radius, radius / np.where(dist > 0, dist, 1.0), 1.0)
        v = v + (diff * factor[:, None]).mean(axis=0)
    return v


def aggregate(updates: Sequence[Params | np.ndarray], method: str = "mean", *, trim: float = 0.2,
              cc_radius: float | None = None, cc_iters: int = 3) -> np.ndarray:
    """A robust estimate of the mean of ``updates`` (parameter dicts or flat vectors), flat float64."""
    u = _stack(updates)
    if method == "mean":
        return u.mean(axis=0)
    if method == "median":
        return np.median(u, axis=0)
    if method == "trimmed_mean":
        return trimmed_mean(u, trim)
    if method == "centered_clip":
        return centered_clip(u, radius=cc_radius, iters=cc_iters)
    raise ValueError(f"unknown aggregator {method!r}; known: {', '.join(AGGREGATORS)}")


def aggregator_params(cfg: Any) -> dict[str, Any]:
    """The keyword parameters :func:`aggregate` takes, from ``server.robust``."""
    return {"trim": cfg.trim, "cc_radius": cfg.cc_radius, "cc_iters": cfg.cc_iters}
