"""Which idle client gets the next task.

A scheduler is chosen by name (``SCHEDULERS``, ``server.scheduler.name`` in YAML). It sees only
client ids and what the server itself observed; every choice is a pure function of the seed and
the sequence of calls (``choose`` and the observation hooks), so a simulated run stays a pure
function of config + seed. ``state_dict``/``load_state_dict`` save the random stream and the
observations; the state is plain JSON (``json.dumps`` works on it) so a resumed run continues
the same sequence.

The calls the server loop makes
-------------------------------
- ``eligible(idle) -> list``: the idle clients this policy may dispatch to now (all of them,
  except for ``budget_aware``, which drops clients that cannot afford another task). Call it
  once per fill, before the ``choose`` calls; an empty list means "dispatch nothing".
- ``choose(idle) -> int``: one client id from ``idle`` (non-empty, sorted by the caller). The
  loop removes the chosen id from ``idle`` before the next call.
- ``on_dispatch(client, now, version)``: right after a task for ``client`` is dispatched (not
  for a task a resumed simulation sends again: that is no new dispatch), with the clock's time
  and the global version the task carries.
- ``on_reply(client, duration, staleness)``: when a task of ``client`` ends with a reply
  (accepted or rejected): ``duration`` is the time the server observed between dispatch and reply
  (virtual seconds in simulation, wall seconds in deployment; never the clock's hidden speed
  profile), ``staleness`` the reply's ``v_now - base_version``.
- ``on_failure(client, duration)``: when a task of ``client`` ends without a reply (an error, a
  timeout) after ``duration``. ``fastest`` and ``staleness_aware`` count it as a reply as slow as
  the slowest client's mean so far (or ``duration`` if longer): a client whose tasks fail is not
  "untried" for ever, and is ranked last (Oort likewise penalises clients that fail).
- ``observe_budget(client, remaining, can_afford)``: the client's remaining privacy budget
  ``remaining`` (epsilon; ``None``: no budget) and whether its next task fits in it (see
  :func:`fedasync.privacy.budgets.budget_view`). Only ``budget_aware`` uses it; call it for every
  client at the start (and on resume) and for a client after each of its replies.

Policies
--------
- ``uniform`` (default): uniformly at random among the idle clients, from one Generator seeded
  once with the run's seed (the stream of every run before policies existed, unchanged).
- ``fair``: the idle client with the fewest dispatches so far; ties broken by the seeded stream.
- ``fastest``: sampling in proportion to speed. An idle client that has never replied is chosen first
  (uniformly among such). Otherwise, with probability ``explore`` a uniform choice among the idle
  clients; else client ``i`` with probability ``p_i = speed_i ** beta / sum_j speed_j ** beta`` over the
  idle clients that have replied, ``speed_i = 1 / mean(observed durations of i)``. This is not Oort's
  system utility (Lai et al., OSDI 2021: ``(T / t_i) ** alpha`` for clients slower than a preferred round
  time ``T``, 1 for the others, times a loss-based statistical utility, top-k exploitation, a pacer on T).
- ``staleness_aware``: see :class:`StalenessAwareScheduler` (the formula, after CSMAAFL).
- ``budget_aware``: among the idle clients that can afford another task, the one with the most
  remaining epsilon, then the fewest dispatches, then the seeded stream; a client that cannot
  afford its next task is never chosen. Without budget information (no DP, or clients without an
  epsilon budget) it is ``fair``.

Cost: what a policy observed per client lives in dicts (the state) and in numpy arrays indexed by
client id (O(1) per event), so a choice among 10,000 idle clients is a few numpy passes. Each float
is the same IEEE operations in the same order as the plain-Python policies (sums over clients stay
Python ``sum``), min/max keep Python's NaN rules, ties idle order, the draws the same calls: the
choices are bit-identical (tests/test_scheduler.py). Negative or huge ids use the dicts.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np


def _pairs(d: dict[int, Any]) -> list[list]:
    """``{client: value}`` as ``[[client, value], ...]`` sorted (JSON keeps int keys this way)."""
    return [[int(k), v] for k, v in sorted(d.items())]


def _unpairs(rows: Sequence[Sequence], cast=float) -> dict[int, Any]:
    return {int(k): cast(v) for k, v in rows}


#: per-client array -> (dtype, value for a client never observed)
_COLUMNS: dict[str, tuple[type, Any]] = {"disp": (np.int64, 0), "sum": (np.float64, 0.0), "n": (np.int64, 0),
                                        "room": (np.float64, math.inf), "ok": (np.bool_, True)}
_MAX_ID = 1 << 20  # larger (or negative) ids: dict look-ups, not arrays


def _py(f: Any, a: np.ndarray) -> Any:
    """``f(list(a))`` for ``f`` min or max, as Python computes it (with a NaN, the first decides)."""
    return f(a.tolist()) if np.isnan(a).any() else (a.min() if f is min else a.max())


class Scheduler(ABC):
    name: str = ""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._cols: dict[str, np.ndarray] = {}
        self._odd = False  # some observed client id is not an array index

    # -- per-client arrays (a copy of the dicts, for vectorised choices) -----------------------
    def _col(self, col: str, size: int) -> np.ndarray:
        """Column ``col``, every column at least ``size`` long (all grow together)."""
        have = max((len(b) for b in self._cols.values()), default=0)
        if col not in self._cols or size > have:
            n = have if size <= have else max(size, 2 * have, 64)
            for name in {col, *self._cols}:
                dtype, fill = _COLUMNS[name]
                old = self._cols.get(name, np.zeros(0, dtype))
                self._cols[name] = np.concatenate([old, np.full(n - len(old), fill, dtype)])
        return self._cols[col]

    def _set(self, col: str, client: int, value: Any) -> None:
        c = int(client)
        if 0 <= c < _MAX_ID:
            self._col(col, c + 1)[c] = value
        else:
            self._odd = True

    def _lookup(self, col: str, c: int) -> Any:
        """The dict value behind column ``col`` (for ids that are not array indices)."""
        attr = {"disp": "dispatches", "sum": "dur_sum", "n": "dur_n", "ok": "affordable", "room": "remaining"}[col]
        v = getattr(self, attr).get(c, _COLUMNS[col][1])
        return math.inf if v is None else v  # room: None is unlimited

    def _ids(self, idle: Sequence[int]) -> np.ndarray:
        """``idle`` as an int64 array of array indices, or an object array of ints (dict look-ups)."""
        if not self._odd and len(idle):
            try:
                idx = np.asarray(idle, dtype=np.int64)
                if idx.ndim == 1 and 0 <= idx.min() and idx.max() < _MAX_ID:
                    return idx
            except (OverflowError, TypeError, ValueError):
                pass
        return np.array([int(c) for c in idle] + [None], dtype=object)[:-1]  # 1-d, whatever the ints

    def _get(self, col: str, ids: np.ndarray) -> np.ndarray:
        """Column ``col`` of the clients ``ids`` (from :meth:`_ids`)."""
        if ids.dtype == object:
            return np.array([self._lookup(col, c) for c in ids], dtype=_COLUMNS[col][0])
        return self._col(col, int(ids.max()) + 1)[ids] if len(ids) else np.zeros(0, _COLUMNS[col][0])

    def _rebuild(self, col: str, d: dict[int, Any]) -> None:
        for k, v in d.items():
            self._set(col, k, v)

    @abstractmethod
    def choose(self, idle: Sequence[int]) -> int:
        """One client id from ``idle`` (non-empty, sorted by the caller)."""

    def eligible(self, idle: Sequence[int]) -> list[int]:
        """The idle clients this policy may dispatch to now."""
        return list(idle)

    def on_dispatch(self, client: int, now: float, version: int) -> None:
        """A task for ``client`` was dispatched at time ``now`` carrying global ``version``."""

    def on_reply(self, client: int, duration: float, staleness: int) -> None:
        """A task of ``client`` ended with a reply after ``duration`` (as the server observed it)."""

    def on_failure(self, client: int, duration: float) -> None:
        """A task of ``client`` ended without a reply (an error, a timeout) after ``duration``."""

    def observe_budget(self, client: int, remaining: float | None, can_afford: bool) -> None:
        """``client``'s remaining epsilon (``None``: unbudgeted) and whether its next task fits."""

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _check(idle: Sequence[int]) -> None:
        if len(idle) == 0:
            raise ValueError("no idle client to choose from")

    def _pick(self, candidates: Sequence[int]) -> int:
        """One of ``candidates`` uniformly from the seeded stream (no draw for a single one)."""
        if len(candidates) == 1:
            return int(candidates[0])
        return int(candidates[int(self.rng.integers(len(candidates)))])

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.name, "bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("scheduler") != self.name:
            raise ValueError(f"state is for scheduler {d.get('scheduler')!r}, not {self.name!r}")
        self.rng.bit_generator.state = d["bit_generator"]
        self._cols, self._odd = {}, False  # the subclasses rebuild theirs from the loaded dicts


class UniformScheduler(Scheduler):
    """Uniformly at random among the idle clients, from one Generator seeded once."""

    name = "uniform"

    def choose(self, idle: Sequence[int]) -> int:
        self._check(idle)
        return int(idle[int(self.rng.integers(len(idle)))])


class FairScheduler(Scheduler):
    """The idle client with the fewest dispatches so far; ties broken by the seeded stream."""

    name = "fair"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.dispatches: dict[int, int] = {}

    def on_dispatch(self, client: int, now: float, version: int) -> None:
        self.dispatches[int(client)] = k = self.dispatches.get(int(client), 0) + 1
        self._set("disp", client, k)

    def _fewest(self, ids: np.ndarray) -> np.ndarray:
        """Those of ``ids`` (from :meth:`_ids`) with the fewest dispatches, in their order."""
        k = self._get("disp", ids)
        return ids[k == k.min()]

    def choose(self, idle: Sequence[int]) -> int:
        self._check(idle)
        return self._pick(self._fewest(self._ids(idle)))

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["dispatches"] = _pairs(self.dispatches)
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.dispatches = _unpairs(d["dispatches"], int)
        self._rebuild("disp", self.dispatches)


class _DurationsMixin:
    """Observed durations per client: running sum and count (exact, JSON-friendly)."""

    def _init_durations(self) -> None:
        self.dur_sum: dict[int, float] = {}
        self.dur_n: dict[int, int] = {}

    def _observe_duration(self, client: int, duration: float) -> None:
        d = float(duration)
        if not math.isfinite(d) or d < 0:
            return
        c = int(client)
        self.dur_sum[c] = total = self.dur_sum.get(c, 0.0) + d
        self.dur_n[c] = n = self.dur_n.get(c, 0) + 1
        self._set("sum", c, total)
        self._set("n", c, n)

    def on_failure(self, client: int, duration: float) -> None:
        if self._odd:
            slowest = max((self.mean_duration(c) for c in self.dur_n), default=0.0)
        else:  # the same quotients; max of floats that are never NaN (finite sums >= 0, or inf)
            n = self._col("n", 0)
            tried = n > 0
            slowest = float((self._col("sum", 0)[tried] / n[tried]).max()) if tried.any() else 0.0
        self._observe_duration(client, max(float(duration), slowest))

    def _means(self, ids: np.ndarray, untried: float = math.nan) -> np.ndarray:
        """``dur_sum[c] / dur_n[c]`` for ``ids`` (as Python divides), ``untried`` where none."""
        n = self._get("n", ids)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, self._get("sum", ids) / np.maximum(n, 1), untried)

    def mean_duration(self, client: int) -> float | None:
        n = self.dur_n.get(int(client), 0)
        return self.dur_sum[int(client)] / n if n else None

    def _durations_state(self) -> dict[str, Any]:
        # in insertion order, not sorted: ``expected_staleness`` sums ``dur_sum`` in that order, and
        # a float sum in another order may differ in its last bit (a resumed run must not)
        return {"dur_sum": [[int(k), v] for k, v in self.dur_sum.items()],
                "dur_n": [[int(k), v] for k, v in self.dur_n.items()]}

    def _load_durations(self, d: dict[str, Any]) -> None:
        self.dur_sum = _unpairs(d["dur_sum"], float)
        self.dur_n = _unpairs(d["dur_n"], int)
        self._rebuild("sum", self.dur_sum)
        self._rebuild("n", self.dur_n)


class FastestScheduler(_DurationsMixin, Scheduler):
    """Speed-proportional sampling (not Oort's utility): untried first, then ``p_i ∝ speed_i ** beta``, ``explore`` uniform.

    ``speed_i = 1 / mean(observed durations of i)``; a client whose mean duration is 0 counts
    as the fastest seen (its speed is capped at ``1e12``).
    """

    name = "fastest"

    def __init__(self, seed: int = 0, explore: float = 0.1, beta: float = 1.0) -> None:
        super().__init__(seed)
        if not 0.0 <= explore <= 1.0:  # NaN fails it too
            raise ValueError(f"fastest: explore must be in [0, 1], got {explore}")
        if not 0 <= beta < math.inf:
            raise ValueError(f"fastest: beta must be finite and >= 0, got {beta}")
        self.explore = float(explore)
        self.beta = float(beta)
        self._init_durations()

    def on_reply(self, client: int, duration: float, staleness: int) -> None:
        self._observe_duration(client, duration)

    def probabilities(self, tried: Sequence[int]) -> np.ndarray:
        """``p_i ∝ speed_i ** beta`` over ``tried`` (clients with at least one observed duration)."""
        means = self._means(self._ids(tried))
        speed = 1.0 / np.maximum(means, 1e-12)
        # in log space: speeds may span decades and beta may be large
        logw = self.beta * np.log(speed)
        w = np.exp(logw - logw.max())
        return w / w.sum()

    def choose(self, idle: Sequence[int]) -> int:
        self._check(idle)
        ids = self._ids(idle)
        n = self._get("n", ids)
        if not n.all():  # the untried, in idle order
            return self._pick(ids[n == 0])
        if self.explore > 0 and float(self.rng.random()) < self.explore:
            return self._pick(idle)
        p = self.probabilities(ids)
        return int(ids[int(self.rng.choice(len(ids), p=p))])

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d.update(self._durations_state())
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self._load_durations(d)


class StalenessAwareScheduler(_DurationsMixin, Scheduler):
    r"""Keep the staleness of in-flight work low, balanced against participation.

    In the spirit of CSMAAFL (X. Ma, Q. Wang, H. Sun, R. Q. Hu, Y. Qian, "CSMAAFL: Client
    scheduling and model aggregation in asynchronous federated learning", arXiv:2306.01207,
    2023), which schedules heterogeneous clients so that slow ones do not keep feeding stale
    models while every client still takes part. The formula is this module's, not the paper's:

    - ``r`` = versions per unit time the server has produced so far, measured from the
      ``(now, version)`` pairs of ``on_dispatch``: ``r = (v_last - v_first) / (t_last - t_first)``
      (0 until time has passed);
    - ``d_i`` = the mean duration observed for client ``i``; for a client that has not replied
      yet, the mean over all observed durations (0 before any reply);
    - the expected staleness of a task given to ``i`` now: ``E[s_i] = r * d_i`` (versions
      produced while it trains);
    - ``n_i`` = dispatches of ``i`` so far.

    The choice among the idle clients ``I``::

        i* = argmin_{i in I}  r * d_i  +  balance * (n_i - min_{j in I} n_j)

    ties broken by the seeded stream. ``balance`` (``server.scheduler.balance``, default 1) is the
    expected staleness, in versions, that one extra dispatch above the least-used idle client is
    worth: ``balance = 0`` always sends the task whose reply is expected freshest; a large
    ``balance`` approaches ``fair``. Before any reply (``r * d_i = 0`` for all) it is ``fair``
    (at ``balance = 0``, uniform: every cost is 0 and the seeded stream breaks the tie).

    What a scheduler can and cannot change: with ``C`` tasks always in flight and a version every
    ``K`` replies, each reply is overtaken on average by ``C - 1`` others while in flight, so the
    *mean* staleness of the replies is about ``(C - 1) / K`` versions whatever the policy (a
    closed system: every completion adds one to the staleness of the ``C - 1`` tasks still in
    flight). A policy changes how that staleness is spread over the replies and how many versions
    a unit of time yields. This one makes each dispatched task individually fresh (fast clients)
    as far as participation allows: in the tests' simulated loop (30 clients, ``sigma = 1.5``)
    ``balance = 1`` keeps Jain's index of participation above 0.95 and yields replies faster than
    ``fair``; ``balance = 0.2`` yields them faster than ``uniform``.
    """

    name = "staleness_aware"

    def __init__(self, seed: int = 0, balance: float = 1.0) -> None:
        super().__init__(seed)
        if not 0 <= balance < math.inf:
            raise ValueError(f"staleness_aware: balance must be finite and >= 0, got {balance}")
        self.balance = float(balance)
        self._init_durations()
        self.dispatches: dict[int, int] = {}
        self.first: list[float] | None = None  # [t, version] of the first dispatch
        self.last: list[float] | None = None

    def on_dispatch(self, client: int, now: float, version: int) -> None:
        self.dispatches[int(client)] = k = self.dispatches.get(int(client), 0) + 1
        self._set("disp", client, k)
        point = [float(now), float(version)]
        if self.first is None:
            self.first = point
        self.last = point

    def on_reply(self, client: int, duration: float, staleness: int) -> None:
        self._observe_duration(client, duration)

    @property
    def version_rate(self) -> float:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return 0.0
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])

    def _mean_over_all(self) -> float:
        total_n = sum(self.dur_n.values())
        return sum(self.dur_sum.values()) / total_n if total_n else 0.0

    def expected_staleness(self, client: int, mean_over_all: float | None = None) -> float:
        d = self.mean_duration(client)
        if d is None:
            d = self._mean_over_all() if mean_over_all is None else mean_over_all
        return self.version_rate * d

    def _costs(self, ids: np.ndarray) -> np.ndarray:
        """Per client, as ``expected_staleness(c) + balance * (n_c - least)`` computes it."""
        k = self._get("disp", ids)
        everyone = self._mean_over_all()  # once per choice, not once per untried client
        with np.errstate(all="ignore"):  # inf * 0 = NaN, silently, as with Python floats
            return self.version_rate * self._means(ids, everyone) + self.balance * (k - k.min())

    def costs(self, idle: Sequence[int]) -> list[float]:
        return self._costs(self._ids(idle)).tolist() if len(idle) else []

    def choose(self, idle: Sequence[int]) -> int:
        self._check(idle)
        ids = self._ids(idle)
        cost = self._costs(ids)
        return self._pick(ids[cost == _py(min, cost)])

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d.update(self._durations_state())
        d.update(dispatches=_pairs(self.dispatches), first=self.first, last=self.last)
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self._load_durations(d)
        self.dispatches = _unpairs(d["dispatches"], int)
        self._rebuild("disp", self.dispatches)
        self.first = None if d["first"] is None else [float(x) for x in d["first"]]
        self.last = None if d["last"] is None else [float(x) for x in d["last"]]


class BudgetAwareScheduler(FairScheduler):
    """Most remaining epsilon among the clients that can afford another task; else ``fair``.

    ``observe_budget(c, remaining, can_afford)`` feeds it. Order of preference among the eligible
    idle clients: more remaining epsilon (a client with ``remaining=None``, no budget, counts as
    unlimited), then fewer dispatches, then the seeded stream. A client last observed with
    ``can_afford=False`` is not eligible (:meth:`eligible` drops it, :meth:`choose` refuses to
    pick it), so no task is ever sent whose planned spend would exceed the budget. Clients never
    observed are eligible with unlimited budget: without DP this is exactly ``fair``.
    """

    name = "budget_aware"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.remaining: dict[int, float | None] = {}
        self.affordable: dict[int, bool] = {}

    def observe_budget(self, client: int, remaining: float | None, can_afford: bool) -> None:
        c = int(client)
        self.remaining[c] = None if remaining is None else float(remaining)
        self.affordable[c] = bool(can_afford)
        self._set("room", c, self._room(c))
        self._set("ok", c, self.affordable[c])

    def _eligible(self, ids: np.ndarray) -> np.ndarray:
        return ids[self._get("ok", ids)]

    def eligible(self, idle: Sequence[int]) -> list[int]:
        return self._eligible(self._ids(idle)).tolist()

    def _room(self, c: int) -> float:
        r = self.remaining.get(int(c))
        return math.inf if r is None else r

    def choose(self, idle: Sequence[int]) -> int:
        self._check(idle)
        ok = self._eligible(self._ids(idle))
        if not len(ok):
            raise ValueError("budget_aware: no idle client can afford another task")
        room = self._get("room", ok)
        # a NaN max (the first one's budget) leaves none: _fewest raises ValueError, as it did
        return self._pick(self._fewest(ok[room == _py(max, room)]))

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["remaining"] = _pairs(self.remaining)
        d["affordable"] = _pairs(self.affordable)
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.remaining = _unpairs(d["remaining"], lambda v: None if v is None else float(v))
        self.affordable = _unpairs(d["affordable"], bool)
        self._rebuild("room", {c: self._room(c) for c in self.remaining})
        self._rebuild("ok", self.affordable)


#: name (``server.scheduler.name``) -> class taking ``seed`` and its own keyword parameters
SCHEDULERS: dict[str, type[Scheduler]] = {
    "uniform": UniformScheduler,
    "fair": FairScheduler,
    "fastest": FastestScheduler,
    "staleness_aware": StalenessAwareScheduler,
    "budget_aware": BudgetAwareScheduler,
}

#: the ``server.scheduler`` keys each policy takes
PARAMS: dict[str, tuple[str, ...]] = {
    "uniform": (),
    "fair": (),
    "fastest": ("explore", "beta"),
    "staleness_aware": ("balance",),
    "budget_aware": (),
}


def make_scheduler(name: str = "uniform", seed: int = 0, **params: float) -> Scheduler:
    """The policy ``name`` seeded with ``seed``; ``params`` are its keyword parameters
    (``explore``, ``beta`` for fastest; ``balance`` for staleness_aware)."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    unknown = set(params) - set(PARAMS[name])
    if unknown:
        raise ValueError(f"scheduler {name} takes no parameter {', '.join(sorted(unknown))}")
    return SCHEDULERS[name](seed, **params)


def scheduler_from_config(cfg: Any, seed: int = 0) -> Scheduler:
    """From a :class:`fedasync.config.SchedulerConfig` (``cfg.server.scheduler``): only the
    parameters the chosen policy takes are passed."""
    return make_scheduler(cfg.name, seed, **{k: getattr(cfg, k) for k in PARAMS[cfg.name]})


def participation(counts: dict[int, int] | Sequence[int], num_clients: int | None = None) -> dict[str, Any]:
    """Participation figures from dispatch counts per client (a dict, or a list indexed by id).

    ``jain``: Jain's fairness index ``(sum x)^2 / (n * sum x^2)`` over all ``n`` clients (1: all
    equal; ``1/n``: one client got everything; 1.0 when nobody was dispatched); ``never``: the
    share of clients never dispatched; ``counts``: the list of counts by client id.
    """
    if isinstance(counts, dict):
        n = num_clients if num_clients is not None else (max(counts) + 1 if counts else 0)
        xs = [int(counts.get(c, 0)) for c in range(n)]
    else:
        xs = [int(x) for x in counts]
        if num_clients is not None:
            xs = (xs + [0] * num_clients)[:num_clients]
    n = len(xs)
    total = sum(xs)
    sq = sum(x * x for x in xs)
    jain = 1.0 if sq == 0 else total * total / (n * sq)
    return {"counts": xs, "jain": jain, "never": (sum(1 for x in xs if x == 0) / n) if n else 0.0}
