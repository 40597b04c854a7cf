"""Privacy budget math: per-client budgets, sample rates, noise calibration, accountant histories.

Pure: numbers in, numbers out (Opacus' accountants do the accounting); no Flower, no database,
no torch training.  Used by the server (:mod:`fedasync.privacy.tracker`), the client
(:mod:`fedasync.privacy.dp`) and ``fedasync privacy plan``.

Definitions (written down in docs/privacy.md and pinned in tests):

* A client's **budget** is ``(epsilon, delta)`` for the *whole run*: the default
  ``privacy.local_dp`` values, then every ``privacy.overrides`` entry whose ``clients`` set
  names the client, in order (a later entry wins, field by field).
* **Sample rate** ``q = 1 / ceil(n / b)`` with ``b = min(batch_size, n)``: what Opacus derives
  from a ``DataLoader(batch_size=b)`` over the client's ``n`` records (``1 / len(loader)``);
  each record is in each batch independently with probability ``q`` (Poisson sampling).
* **Steps per task** ``s = steps_for(train, n)`` (``train.local_steps``, or
  ``local_epochs * ceil(n / batch_size)``).
* **Noise multiplier** ``sigma``: a number from YAML, or ``auto``: calibrated **once** for the
  client's whole planned budget with Opacus' ``get_noise_multiplier(target_epsilon=epsilon,
  target_delta=delta, sample_rate=q, steps=s * planned_tasks)``: the noise for which
  ``planned_tasks`` tasks spend between ``epsilon - 0.01`` (Opacus' search tolerance) and
  ``epsilon``.  Whether a further task fits is not part of the plan: the client's own check
  before each task decides (usually it does not fit; it can when one task costs less than the
  slack the tolerance leaves, e.g. many small tasks, and under ``prv``, whose epsilon is a
  numerical bound, the check may also land either side).
* **History**: the Opacus accountant's ``[[sigma, q, steps], ...]``; one accountant per client
  lives for the whole run, and ``epsilon`` is always ``accountant.get_epsilon(delta)`` of a fresh
  Opacus accountant loaded with the history.
* **Central DP** (fedbuff): every aggregation releases one noisy sum of ``K`` clipped client
  deltas; it is accounted as a Poisson-subsampled Gaussian mechanism with client sampling
  rate ``q = min(1, K / num_clients)`` and noise multiplier ``privacy.central_dp.noise_multiplier``
  (the DP-FedAvg assumption; see the docs).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from fedasync.config import Config, LocalDPConfig, PrivacyConfig, parse_client_set

log = logging.getLogger("fedasync")

ACCOUNTANTS = ("rdp", "prv", "gdp")
#: accountants that may enforce a budget, calibrate noise or account a run (gdp: reporting only)
ENFORCING_ACCOUNTANTS = ("rdp", "prv")

History = list[tuple[float, float, int]]


class PrivacyError(ValueError):
    """A privacy setting that cannot work (one line, starting with the key path)."""


# -- accountants ---------------------------------------------------------------------------------


def new_accountant(name: str, history: Iterable[Sequence] | None = None):
    """A fresh Opacus accountant (``rdp``, ``prv`` or ``gdp``), optionally restored from a history."""
    from opacus.accountants import create_accountant

    if name not in ACCOUNTANTS:
        raise PrivacyError(f"privacy accountant: unknown accountant {name!r} (use one of {', '.join(ACCOUNTANTS)})")
    acc = create_accountant(mechanism=name)  # gdp warns that it can underestimate: not hidden
    if history:
        acc.load_state_dict({"history": as_history(history), "mechanism": name})
    return acc


def as_history(history: Iterable[Sequence] | None) -> History:
    """``[[sigma, q, steps], ...]`` (from JSON) as Opacus' list of tuples; validated."""
    out: History = []
    for entry in history or []:
        if len(entry) != 3:
            raise PrivacyError(f"accountant history: bad entry {entry!r} (want [noise_multiplier, sample_rate, steps])")
        sigma, q, steps = float(entry[0]), float(entry[1]), int(entry[2])
        # an infinite sigma is refused: Opacus' RDP of it never returns (the server hung)
        if not (math.isfinite(sigma) and sigma >= 0 and 0 < q <= 1 and steps >= 0):
            raise PrivacyError(f"accountant history: bad entry {entry!r}")
        out.append((sigma, q, steps))
    return out


def history_json(history: Iterable[Sequence] | None) -> list[list]:
    """The history as JSON-able lists ``[[sigma, q, steps], ...]``."""
    return [[float(s), float(q), int(n)] for s, q, n in as_history(history)]


def history_steps(history: Iterable[Sequence] | None) -> int:
    return sum(int(e[2]) for e in history or [])


def epsilon_of(history: Iterable[Sequence] | None, delta: float, accountant: str) -> float:
    """``get_epsilon(delta)`` of a fresh Opacus accountant loaded with ``history`` (0 if empty).

    A zero noise multiplier gives ``inf``, and so does a history whose epsilon Opacus cannot compute
    (it divides by zero or overflows at a sigma like 1e-300 or 1e300). Under ``rdp`` the same float comes from
    :func:`_rdp_epsilon`, which caches each ``(sigma, q)``'s one-step RDP.
    """
    hist = as_history(history)
    if not hist:
        return 0.0
    if any(s == 0 for s, _, n in hist if n > 0):
        return math.inf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Optimal order is the (largest|smallest) alpha.*")
        try:
            if accountant == "rdp":
                return _rdp_epsilon(hist, float(delta))
            return float(new_accountant(accountant, hist).get_epsilon(delta))
        except (OverflowError, ZeroDivisionError):  # Opacus at sigma = 1e300 / 1e-300: no bound, so none
            return math.inf


@functools.lru_cache(maxsize=65536)
def _rdp_per_step(noise_multiplier: float, sample_rate: float):
    """Opacus' RDP of one step at ``(sigma, q)`` at its default orders (read-only; cached).

    ``compute_rdp(steps=n)`` is this vector times ``n``, so a history's RDP costs one multiply
    per entry once each ``(sigma, q)`` is known; without the cache every check of a client's
    budget recomputed the 150 orders (the fractional ones by series), ~0.2 s each.
    """
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS)
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(history: History, delta: float) -> float:
    """``RDPAccountant.get_epsilon(delta)`` for ``history``, the same arithmetic in the same order."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = sum([_rdp_per_step(sigma, q) * steps for sigma, q, steps in history])
    eps, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


def covers(reported: Iterable[Sequence], composed: Iterable[Sequence]) -> bool:
    """Whether ``reported`` holds every step of ``composed`` at the same ``(sigma, q)``. Then its RDP
    is at least the composition's at every order, so its epsilon is too, now and after any further
    steps; more steps alone are not enough (steps at a huge sigma spend nothing: a history that swapped
    the record for them would lower the client's epsilon)."""
    have: dict[tuple[float, float], int] = {}
    for sigma, q, n in as_history(reported):
        have[(sigma, q)] = have.get((sigma, q), 0) + n
    need: dict[tuple[float, float], int] = {}
    for sigma, q, n in as_history(composed):
        need[(sigma, q)] = need.get((sigma, q), 0) + n
    return all(have.get(k, 0) >= n for k, n in need.items())


def extend_history(history: Iterable[Sequence] | None, noise_multiplier: float, sample_rate: float,
                   steps: int, accountant: str) -> History:
    """The history after ``steps`` more steps at ``(noise_multiplier, sample_rate)``.

    Computed by stepping an Opacus accountant exactly as ``DPOptimizer``'s hook does, so the
    result equals the history of the accountant that trained (consecutive equal entries merge).
    """
    acc = new_accountant(accountant, history)
    steps = int(steps)
    try:
        if steps > 0:  # one step as the hook does; the rest only count (a reply's dp_steps=10**9 looped for minutes)
            acc.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))
    except ValueError as e:  # gdp: sigma and q must stay constant
        raise PrivacyError(f"privacy.local_dp.accountant {accountant}: {e}") from None
    out = as_history(acc.history)
    if steps > 1:  # every accountant merges a step equal to the last entry into it
        sigma, q, n = out[-1]
        out[-1] = (sigma, q, n + steps - 1)
    return out


# -- sample rates, steps, calibration --------------------------------------------------------------


def sample_rate_for(num_examples: int, batch_size: int) -> float:
    """``1 / ceil(n / min(batch_size, n))``: Opacus' ``1 / len(DataLoader(batch_size))``."""
    if num_examples <= 0:
        raise PrivacyError("privacy: a client with no training records cannot be accounted")
    b = min(int(batch_size), int(num_examples))
    return 1.0 / math.ceil(num_examples / b)


def check_enforcing(accountant: str, key: str = "privacy.local_dp.accountant") -> None:
    """Refuse ``gdp`` where epsilon is enforced, noise calibrated or a run accounted."""
    from fedasync.config import GDP_REFUSED

    if accountant not in ENFORCING_ACCOUNTANTS:
        raise PrivacyError(f"{key}: {GDP_REFUSED}" if accountant == "gdp" else
                           f"{key}: unknown accountant {accountant!r} (use rdp or prv)")


@functools.lru_cache(maxsize=4096)
def calibrate(epsilon: float, delta: float, sample_rate: float, total_steps: int, accountant: str,
              key: str = "privacy.local_dp") -> float:
    """Opacus ``get_noise_multiplier`` for ``total_steps`` steps at ``sample_rate`` (cached; ``key``:
    where the budget was set, for the error)."""
    from opacus.accountants.utils import get_noise_multiplier

    check_enforcing(accountant)
    if total_steps <= 0:
        raise PrivacyError(f"{key}.planned_tasks: the planned budget has no steps")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Optimal order is the (largest|smallest) alpha.*")
            return float(get_noise_multiplier(target_epsilon=float(epsilon), target_delta=float(delta),
                                              sample_rate=float(sample_rate), steps=int(total_steps),
                                              accountant=accountant))
    except ValueError as e:
        raise PrivacyError(f"{key}.epsilon: cannot calibrate noise for epsilon={epsilon}, "
                           f"delta={delta}, q={sample_rate:.4g}, {total_steps} steps ({e})") from None


# -- budgets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """One client's budget for the whole run (``epsilon`` None: accounted, never enforced)."""

    epsilon: float | None
    delta: float
    planned_tasks: int
    noise_multiplier: float | None  # a fixed sigma; None: auto (calibrated from epsilon)
    source: str = field(default="privacy.local_dp", compare=False)  # the config entry that set epsilon


def resolve_budgets(privacy: PrivacyConfig, num_clients: int) -> list[Budget]:
    """The budget of every client 0..num_clients-1: default, then matching overrides in order."""
    dp: LocalDPConfig = privacy.local_dp
    base = {
        "epsilon": dp.epsilon,
        "delta": dp.delta,
        "planned_tasks": dp.planned_tasks,
        "noise_multiplier": None if dp.noise_multiplier == "auto" else float(dp.noise_multiplier),
        "source": "privacy.local_dp",
    }
    per = [dict(base) for _ in range(num_clients)]
    for i, ov in enumerate(privacy.overrides):
        try:
            ids = parse_client_set(ov.clients, num_clients)
        except ValueError as e:
            raise PrivacyError(str(e).replace("privacy.overrides.", f"privacy.overrides.{i}.")) from None
        for c in ids:
            for key in ("epsilon", "delta", "planned_tasks", "noise_multiplier"):
                val = getattr(ov, key)
                if val is not None:
                    per[c][key] = val
                    if key in ("epsilon", "planned_tasks"):
                        per[c]["source"] = f"privacy.overrides.{i}"
    out = []
    for c, b in enumerate(per):
        if b["noise_multiplier"] is None and b["epsilon"] is None:  # pragma: no cover - config forbids it
            raise PrivacyError(f"privacy: client {c} has neither epsilon nor a noise_multiplier")
        out.append(Budget(epsilon=None if b["epsilon"] is None else float(b["epsilon"]), delta=float(b["delta"]),
                          planned_tasks=int(b["planned_tasks"]),
                          noise_multiplier=None if b["noise_multiplier"] is None else float(b["noise_multiplier"]),
                          source=b["source"]))
    return out


@dataclass(frozen=True)
class ClientPlan:
    """What a client's DP training looks like: everything ``privacy plan`` prints for it."""

    client_id: int
    num_examples: int
    sample_rate: float
    steps: int  # DP-SGD steps per task
    budget: Budget
    noise_multiplier: float  # resolved (calibrated when auto)
    accountant: str
    max_grad_norm: float

    @property
    def noise_auto(self) -> bool:
        return self.budget.noise_multiplier is None

    def history_after(self, tasks: int) -> History:
        return extend_history([], self.noise_multiplier, self.sample_rate, self.steps * tasks, self.accountant)

    def epsilon_after(self, tasks: int) -> float:
        if tasks <= 0:
            return 0.0
        return epsilon_of(self.history_after(tasks), self.budget.delta, self.accountant)


def budget_view(plan: ClientPlan, history: Iterable[Sequence] | None) -> tuple[float | None, bool]:
    """``(remaining epsilon, can afford its next task)`` for a client with accountant ``history``.

    The same rule as the client's own check (``fedasync.privacy.dp.private_task``, for a client
    whose data matches its plan): the next task is affordable iff the epsilon after ``plan.steps``
    more steps at ``(plan.noise_multiplier, plan.sample_rate)`` is within the budget. Without an
    epsilon budget: ``(None, True)``. For the ``budget_aware`` scheduler
    (:meth:`fedasync.server.scheduler.Scheduler.observe_budget`).
    """
    budget = plan.budget.epsilon
    if budget is None:
        return None, True
    spent = epsilon_of(history, plan.budget.delta, plan.accountant)
    planned = extend_history(history, plan.noise_multiplier, plan.sample_rate, plan.steps, plan.accountant)
    return float(budget) - spent, epsilon_of(planned, plan.budget.delta, plan.accountant) <= float(budget)


def plan_client(client_id: int, num_examples: int, steps: int, batch_size: int, budget: Budget,
                dp: LocalDPConfig) -> ClientPlan:
    q = sample_rate_for(num_examples, batch_size)
    if budget.noise_multiplier is not None:
        sigma = budget.noise_multiplier
    else:
        sigma = calibrate(budget.epsilon, budget.delta, q, steps * budget.planned_tasks, dp.accountant,
                          key=budget.source)
    return ClientPlan(client_id=client_id, num_examples=num_examples, sample_rate=q, steps=steps, budget=budget,
                      noise_multiplier=sigma, accountant=dp.accountant, max_grad_norm=dp.max_grad_norm)


def plan_clients(cfg: Config, sizes: Sequence[int],
                 progress: Callable[[int, int], None] | None = None) -> list[ClientPlan]:
    """A :class:`ClientPlan` for every client, from its number of training records. ``progress(done,
    total)`` is called before the first and after each distinct noise calibration (one per distinct
    (epsilon, delta, sample rate, steps); about 1 s each in Opacus, so 100 clients with their own
    sizes take a minute or two): a command shows it as a progress bar."""
    from fedasync.task.train import steps_for

    budgets = resolve_budgets(cfg.privacy, cfg.data.num_clients)
    if len(sizes) != len(budgets):
        raise PrivacyError(f"data.num_clients: {len(budgets)} clients but {len(sizes)} partitions")
    dp = cfg.privacy.local_dp
    todo = {(b.epsilon, b.delta, sample_rate_for(int(n), cfg.train.batch_size),
             steps_for(cfg.train, int(n)) * b.planned_tasks) for n, b in zip(sizes, budgets)
            if b.noise_multiplier is None and b.epsilon is not None}
    if len(todo) > 1:  # each is a search over sigma in Opacus (about 1-2 s); cached for the process
        log.info("privacy: calibrating the noise multiplier for %d distinct (epsilon, delta, sample rate, steps)",
                 len(todo))
    if progress is not None and todo:
        keys = sorted({(b.epsilon, b.delta, sample_rate_for(int(n), cfg.train.batch_size),
                        steps_for(cfg.train, int(n)) * b.planned_tasks, b.source) for n, b in zip(sizes, budgets)
                       if b.noise_multiplier is None and b.epsilon is not None})
        progress(0, len(keys))
        for i, (eps, delta, q, steps, source) in enumerate(keys, 1):
            calibrate(eps, delta, q, steps, dp.accountant, key=source)  # cached: plan_client finds it
            progress(i, len(keys))
    return [plan_client(c, int(n), steps_for(cfg.train, int(n)), cfg.train.batch_size, b, dp)
            for c, (n, b) in enumerate(zip(sizes, budgets))]


def delta_warnings(plans: Sequence[ClientPlan]) -> list[str]:
    """One line per group of clients whose ``delta >= 1/n`` for their ``n`` records.

    (epsilon, delta)-DP with ``delta >= 1/n`` is met by a mechanism that publishes one of the
    ``n`` records outright with probability ``delta``: the guarantee says little there.
    """
    groups: dict[float, list[ClientPlan]] = {}
    for p in plans:
        if p.budget.delta * p.num_examples >= 1.0:
            groups.setdefault(p.budget.delta, []).append(p)
    out = []
    for delta, ps in sorted(groups.items()):
        ns = [p.num_examples for p in ps]
        n = str(ns[0]) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"
        out.append(f"privacy: delta {delta:g} >= 1/n for clients {format_clients(p.client_id for p in ps)} "
                   f"(n = {n} records): (epsilon, delta)-DP with delta >= 1/n allows publishing a record "
                   f"outright; choose delta well below 1/n")
    return out


def central_delta_warning(delta: float, num_clients: int) -> str | None:
    """The client-level analogue: ``privacy.central_dp.delta >= 1 / num_clients``."""
    if delta * num_clients >= 1.0:
        return (f"privacy.central_dp: delta {delta:g} >= 1/n for the n = {num_clients} clients (all clients "
                f"0-{num_clients - 1}): client-level (epsilon, delta)-DP with delta >= 1/n allows publishing one "
                f"client's data outright; choose delta well below 1/n")
    return None


@dataclass
class PlanGroup:
    """Clients whose DP training is identical (same q, steps, budget and sigma)."""

    clients: list[int]
    plan: ClientPlan
    sizes: list[int] = field(default_factory=list)


def group_plans(plans: Sequence[ClientPlan]) -> list[PlanGroup]:
    groups: dict[tuple, PlanGroup] = {}
    for p in plans:
        key = (p.sample_rate, p.steps, p.budget, p.noise_multiplier)
        g = groups.get(key)
        if g is None:
            g = groups[key] = PlanGroup(clients=[], plan=p)
        g.clients.append(p.client_id)
        g.sizes.append(p.num_examples)
    return sorted(groups.values(), key=lambda g: g.clients[0])


def format_clients(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"`` (the YAML ``clients`` syntax)."""
    xs = sorted(set(int(i) for i in ids))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def milestones(planned_tasks: int) -> list[int]:
    """1, half and all of the planned tasks (deduplicated, in order)."""
    out: list[int] = []
    for t in (1, math.ceil(planned_tasks / 2), planned_tasks):
        if t >= 1 and t not in out:
            out.append(t)
    return out


# -- central DP ------------------------------------------------------------------------------------


def central_sample_rate(buffer_size: int, num_clients: int) -> float:
    """The client sampling rate assumed for central DP: ``min(1, K / num_clients)``."""
    return min(1.0, float(buffer_size) / float(num_clients))


def central_history(noise_multiplier: float, sample_rate: float, releases: int) -> History:
    return [(float(noise_multiplier), float(sample_rate), int(releases))] if releases > 0 else []


def central_epsilon(noise_multiplier: float, sample_rate: float, releases: int, delta: float,
                    accountant: str) -> float:
    """Client-level epsilon after ``releases`` noisy aggregations (``inf`` without noise)."""
    return epsilon_of(central_history(noise_multiplier, sample_rate, releases), delta, accountant)
