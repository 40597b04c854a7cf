"""The server side of privacy: budgets sent with each task, spend recorded with each reply.

The server loop (``server/loop.py``) builds one :class:`PrivacyTracker` per run when
``privacy.local_dp`` or ``privacy.central_dp`` is enabled and

* adds :meth:`PrivacyTracker.client_config` to every task (under ``"privacy"``): the client's
  budget, noise multiplier, clipping norm, accountant, ``grad_sample_mode``, ``secure_mode``,
  ``reproducible_noise``, ``report_loss``, the number of records the server planned it with
  (echoed back as ``num_examples``) and, in simulation or a server-less run, its accountant history (the
  store keeps it; a real device keeps its own in a local file and gets the server's record only
  as a floor);
* records :meth:`PrivacyTracker.on_reply` (a ``privacy_spend`` row and the client's new
  ``accountant_state`` / ``epsilon`` / ``tasks_done``) in the same transaction as the update;
* puts :meth:`PrivacyTracker.summary` into ``summary.json`` as ``privacy``, including which
  noise ran (``noise``: from OS entropy, or from the seed with ``privacy.reproducible_noise``);
* at the start of a run says, once and in one line each: that the noise comes from a seeded
  PRNG rather than a CSPRNG (Opacus' "Secure RNG turned off"), and every group of clients whose
  ``delta >= 1/n`` for its ``n`` records.  A deployment refuses ``reproducible_noise``.

Enforcement is the client's (``fedasync.privacy.dp.private_task``): a client whose next task
would exceed its budget refuses; the loop marks it exhausted and never picks it again.

Central DP (fedbuff, ``privacy.central_dp``): ``strategies.CentralDP`` clips and noises every
buffer, which holds ``K`` updates of ``K`` distinct clients (a client's second update waits for
the next release), so the sensitivity of a release is ``clip`` per client; each aggregation is
one release of a Poisson-subsampled Gaussian mechanism with client sampling rate
``q = min(1, K / num_clients)`` (an assumption: asynchronous arrival is not Poisson sampling),
accounted with an Opacus accountant (row ``client_id = -1``).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fedasync.config import Config
from fedasync.privacy.budgets import (
    ClientPlan,
    PrivacyError,
    as_history,
    central_delta_warning,
    central_epsilon,
    central_sample_rate,
    covers,
    delta_warnings,
    epsilon_of,
    extend_history,
    history_json,
    history_steps,
    plan_clients,
)

log = logging.getLogger("fedasync.privacy")

#: the most DP-SGD steps one reply may report (``privacy_spend.steps``, an INTEGER column)
MAX_STEPS = 2**31 - 1
#: the most entries a reply's accountant history may hold beyond the server's record (a task adds at
#: most one; each distinct (sigma, q) costs ~15 ms of RDP: thousands stalled the server)
MAX_NEW_ENTRIES = 64

CENTRAL_ASSUMPTION = ("each fedbuff aggregation is one release of the Gaussian mechanism on the clipped deltas "
                      "of K distinct clients (one term per client), accounted as if its K clients were "
                      "Poisson-sampled from all clients with q = K / num_clients (asynchronous arrival is not "
                      "random sampling: this is an assumption)")

INSECURE_RNG = ("Opacus' \"Secure RNG turned off\" (privacy.local_dp.secure_mode: false, torchcsprng absent): "
                "DP noise and Poisson batches come from torch's seeded PRNG (Mersenne Twister on CPU, Philox on "
                "CUDA), not a cryptographically secure generator; ")


def noise_summary(cfg: Config) -> dict[str, Any]:
    """Which noise a run uses (``summary.json``: ``privacy.noise``)."""
    p = cfg.privacy
    rep = bool(p.reproducible_noise)
    local = None
    if p.local_dp.enabled:
        local = "torchcsprng" if p.local_dp.secure_mode else ("task_seed" if rep else "os_entropy")
    central = ("run_seed" if rep else "os_entropy") if p.central_dp.enabled else None
    return {"reproducible": rep, "local_dp": local, "central_dp": central}


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


class ProgressLines:
    """A start-up step's ``progress(done, total)`` as a line on stderr (``write``) every
    ``every_s`` seconds: the first once ``first_s`` have passed (a calibration found in the cache
    says nothing), the last when it is done, if a line was written. What :func:`check_runnable`
    reports to when its caller gives no progress (the Python API, a user task's assembly)."""

    def __init__(self, what: str = "calibrating DP noise", every_s: float = 3.0, first_s: float = 2.0,
                 write: Any = None, clock: Any = None):
        import sys
        import time

        self.what, self.every_s, self.first_s = what, every_s, first_s
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock or time.monotonic
        self.t0 = self.clock()
        self.last: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        due = now - self.t0 >= self.first_s if self.last is None else now - self.last >= self.every_s
        if due or (done >= total and self.last is not None):
            self.last = now
            self.write(f"{self.what}: {done}/{total} (epsilon, delta, sample rate, steps), {now - self.t0:.0f} s")


class CalibrationBar:
    """``progress(done, total)`` of the noise calibration as a task of a rich ``Progress``
    (``bars``; added on the first call, so nothing shows when there is nothing to calibrate): the
    bar of ``fedasync simulate``, ``fedasync server`` and ``fedasync privacy plan``."""

    def __init__(self, bars):
        self.bars, self.task = bars, None

    def __call__(self, done: int, total: int) -> None:
        if self.task is None:
            self.task = self.bars.add_task("calibrating DP noise", total=total, info="")
        self.bars.update(self.task, completed=done, info=f"{done}/{total} (epsilon, delta, q, steps)")


#: () -> the progress(done, total) that check_runnable reports to when its caller gives none
_default_progress: Any = ProgressLines


def set_calibration_progress(make: Any) -> Any:
    """Make ``make()`` the progress :func:`check_runnable` reports to when its caller gives none
    (the deployment ServerApp: its status file, which ``fedasync server`` shows as a bar); the
    previous one."""
    global _default_progress
    prev, _default_progress = _default_progress, make
    return prev


def check_runnable(cfg: Config, sizes: list[int] | None = None, model: Any = None,
                   progress: Any = None) -> None:
    """Everything that can be checked before a DP run starts (raises :class:`PrivacyError`).
    ``sizes`` (each client's examples) and ``model()`` (the task's model): a run's parts
    (:func:`fedasync.assembly.assemble`); without them, the built-in task's. ``progress(done,
    total)``: the noise calibration's (:func:`fedasync.privacy.budgets.plan_clients`); None:
    :func:`set_calibration_progress`'s (lines on stderr every few seconds, :class:`ProgressLines`)."""
    from fedasync.privacy.dp import check_model, check_secure_mode

    p = cfg.privacy
    if p.central_dp.enabled and cfg.server.strategy != "fedbuff":
        raise PrivacyError(f"privacy.central_dp: needs server.strategy fedbuff (got {cfg.server.strategy})")
    if p.central_dp.enabled and cfg.weighting != "uniform":
        raise PrivacyError("privacy.central_dp: needs server.weighting uniform (the sensitivity is per client)")
    if p.local_dp.enabled:
        check_secure_mode(p.local_dp.secure_mode)
        if sizes is None or model is None:
            from fedasync.task.data import load_federated
            from fedasync.task.models import build_model

            fed = load_federated(cfg.data, cfg.seed)
            sizes = fed.sizes()
            model = lambda: build_model(cfg.model, fed.input_shape, fed.num_classes)  # noqa: E731
        check_model(model())
        # resolves every budget and calibrates sigma (cached)
        plan_clients(cfg, list(sizes), progress if progress is not None else _default_progress())


class PrivacyTracker:
    """Per-client accountants (their histories) and central DP accounting for one run."""

    def __init__(self, cfg: Config, store, run_id: int, strategy, resumed: bool = False,
                 sizes: list[int] | None = None, model: Any = None) -> None:
        """``sizes``/``model``: the run's client sizes and ``task.model`` (its parts); without them
        the built-in task's are loaded (:func:`check_runnable`)."""
        self.cfg = cfg
        self.store = store
        self.run_id = run_id
        self.local = cfg.privacy.local_dp.enabled
        self.central = cfg.privacy.central_dp if cfg.privacy.central_dp.enabled else None
        if sizes is None and self.local:
            from fedasync.task.data import load_federated

            sizes = load_federated(cfg.data, cfg.seed).sizes()
        check_runnable(cfg, sizes, model)
        try:
            run = store.get_run(run_id)
            self.mode = run.mode
        except Exception:  # pragma: no cover - a store without the run row
            self.mode = "simulation"
        if self.mode == "deployment" and cfg.privacy.reproducible_noise:
            from fedasync.privacy import REPRODUCIBLE_REFUSED

            raise PrivacyError(REPRODUCIBLE_REFUSED)
        n = cfg.data.num_clients
        self.plans: list[ClientPlan] = []
        self.history: dict[int, list] = {c: [] for c in range(n)}
        self.eps: dict[int, float] = {c: 0.0 for c in range(n)}
        self.tasks_done: dict[int, int] = {c: 0 for c in range(n)}
        if self.local:
            self.plans = plan_clients(cfg, list(sizes))
        if resumed:
            for row in store.clients(run_id):
                if row.accountant_state:
                    st = json.loads(row.accountant_state)
                    self.history[row.client_id] = as_history(st.get("history"))
                self.eps[row.client_id] = float(row.epsilon or 0.0)
                self.tasks_done[row.client_id] = int(row.tasks_done or 0)
        self.central_dp = None
        self._central_seen = 0
        self._memo: tuple = (None, None)  # _spend's last (key, result)
        self._central_eps = 0.0
        if self.central is not None:
            self.central_dp = getattr(strategy, "central_dp", None)
            if self.central_dp is None:
                raise PrivacyError("privacy.central_dp: the strategy has no central DP mechanism (use fedbuff)")
            self.central_q = central_sample_rate(cfg.server.buffer_size, n)
            if resumed:
                # the strategy's snapshot can predate the last releases (it is taken with an empty
                # buffer); the store records every release with its version
                stored = sum(int(r.steps) for r in store.privacy_spend(run_id) if r.client_id == -1)
                self.central_dp.releases = max(int(self.central_dp.releases), stored)
            self._central_seen = int(self.central_dp.releases)
            self._central_eps = self._central_epsilon(self._central_seen)
        if not resumed:
            self._announce()

    def _announce(self) -> None:
        """Once per run, one line each: where the noise comes from, and delta >= 1/n."""
        p = self.cfg.privacy
        if self.local and not p.local_dp.secure_mode:
            how = ("each task seeds its generators from the task seed (privacy.reproducible_noise: true): anyone "
                   "with the run's seed can regenerate the noise" if p.reproducible_noise else
                   "each task seeds its generators with fresh OS entropy, unknown to the server")
            log.warning("%s%s", INSECURE_RNG, how)
        if self.central is not None:
            how = ("derived from the run seed (privacy.reproducible_noise: true): anyone with the seed can "
                   "regenerate it" if p.reproducible_noise else "seeded with 128 bits of OS entropy when the server "
                   "starts, never stored")
            log.warning("central DP noise: numpy's PCG64 (not a cryptographically secure generator), %s", how)
            w = central_delta_warning(self.central.delta, self.cfg.data.num_clients)
            if w:
                log.warning("%s", w)
        for w in delta_warnings(self.plans):
            log.warning("%s", w)

    # -- what travels with a task ------------------------------------------------------------
    def client_config(self, client_id: int) -> dict[str, Any]:
        if not self.local:
            return {"local_dp": False}
        p = self.plans[client_id]
        dp = self.cfg.privacy.local_dp
        conf: dict[str, Any] = {
            "local_dp": True,
            "epsilon": p.budget.epsilon,
            "delta": p.budget.delta,
            "planned_tasks": p.budget.planned_tasks,
            "noise_multiplier": p.noise_multiplier,
            "noise_auto": p.noise_auto,
            "sample_rate": p.sample_rate,
            "steps": p.steps,
            "max_grad_norm": dp.max_grad_norm,
            "accountant": dp.accountant,
            "grad_sample_mode": dp.grad_sample_mode,
            "secure_mode": dp.secure_mode,
            "reproducible_noise": self.cfg.privacy.reproducible_noise,
            "report_loss": dp.report_loss,
            "num_examples": p.num_examples,  # the server's plan: what the reply reports back
        }
        hist = history_json(self.history[client_id])
        if self.mode != "deployment":  # simulation, ledger, gossip: the store is the client's own record
            conf["history"] = hist
        else:  # a real device keeps its own accountant (keyed by its own id); the server's record may only raise it
            conf["server_history"] = hist
        return conf

    # -- what a reply records ----------------------------------------------------------------
    def _spend(self, client_id: int, metrics: Any) -> dict:
        """What a local-DP reply spent, parsed and checked before anything changes (memoized for
        the reply at hand: the loop asks :meth:`check_reply` first, then :meth:`on_reply`).

        The server's record of a client only grows: it is the record before this task composed
        with this task's ``(noise_multiplier, sample_rate, dp_steps)``, or the device's own history
        when that holds all of the composition's steps (:func:`~fedasync.privacy.budgets.covers`; a device with a state file
        knows of tasks the server lost). A device that started from an older record (a task that overlapped another
        one of the same client, a record lost in a crash) reports a history that misses steps: the
        composition keeps them. A reply whose accounting is missing or malformed (a dp_steps that
        is not a whole number up to MAX_STEPS, a history of more than MAX_NEW_ENTRIES entries beyond
        the record) is charged the task the server planned and rejected (``privacy_accounting``);
        one whose epsilon is over the client's budget is rejected (``over_budget``): its spend is
        recorded all the same."""
        key = (client_id, id(metrics))
        if self._memo[0] == key:
            return self._memo[1]
        plan, dp = self.plans[client_id], self.cfg.privacy.local_dp
        prior = self.history[client_id]
        reason, reported, eps = None, None, None
        try:
            m = metrics if isinstance(metrics, dict) else {}
            sigma, q, steps = float(m["noise_multiplier"]), float(m["sample_rate"]), int(m["dp_steps"])
            reported, eps = as_history(m["accountant_history"]), float(m["epsilon"])
            if len(reported) > len(prior) + MAX_NEW_ENTRIES:
                raise ValueError(f"accountant history: {len(reported)} entries, the record {len(prior)}")
            # dp_steps: a whole number the store's integer column holds (2.5 was charged 2; 10**30 crashed the run)
            whole = not isinstance(m["dp_steps"], bool) and steps == m["dp_steps"] and steps <= MAX_STEPS
            if not (whole and math.isfinite(sigma) and sigma >= 0 and 0 < q <= 1 and steps >= 0 and eps >= 0):
                raise ValueError("out of range")
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # PrivacyError is a ValueError
            log.error("client %d replied without valid privacy accounting in a DP run (%s: %s): charged the "
                      "task the server planned, update rejected", client_id, type(e).__name__, e)
            reason, reported = "privacy_accounting", None
            sigma, q, steps = plan.noise_multiplier, plan.sample_rate, plan.steps
        composed = extend_history(prior, sigma, q, steps, dp.accountant)
        if reported is not None and covers(reported, composed):
            hist = reported  # the device's own record: this task and at least all the server knows
            own = epsilon_of(hist, plan.budget.delta, dp.accountant)
            # rdp: the server's own figure. prv: a numerical bound; a claim may raise it, never lower it
            eps = own if dp.accountant == "rdp" else max(eps, own)
        else:
            if reported is not None:
                log.warning("client %d's accountant history (%d steps) does not hold the server's record plus this "
                            "task (%d steps): recorded the composition", client_id, history_steps(reported),
                            history_steps(composed))
            hist, eps = composed, epsilon_of(composed, plan.budget.delta, dp.accountant)
        budget = plan.budget.epsilon
        if reason is None and budget is not None and eps > budget:
            log.error("client %d reports epsilon %.6g over its budget %.6g: update rejected", client_id, eps, budget)
            reason = "over_budget"
        spend = {"history": hist, "epsilon": eps, "reason": reason, "row": {
            "client_id": client_id, "accountant": dp.accountant, "noise_multiplier": sigma, "sample_rate": q,
            "steps": steps, "epsilon": eps, "delta": plan.budget.delta}}
        self._memo = (key, spend)
        return spend

    def check_reply(self, client_id: int, metrics: Any) -> str | None:
        """Why a reply's update must be rejected on privacy grounds (``privacy_accounting``,
        ``over_budget``), or None; changes nothing (see :meth:`_spend`)."""
        return self._spend(client_id, metrics)["reason"] if self.local else None

    def on_reply(self, client_id: int, task_id: int, metrics: dict) -> tuple[dict | list[dict] | None, dict | None]:
        """Record a reply's spend (accepted or rejected): the ``privacy_spend`` row(s) and the
        client's new ``clients`` state, for the reply's transaction."""
        rows: list[dict] = []
        state = None
        if self.local:
            spend = self._spend(client_id, metrics)
            self._memo = (None, None)
            self.history[client_id] = spend["history"]
            self.eps[client_id] = spend["epsilon"]
            self.tasks_done[client_id] += 1
            rows.append(spend["row"])
            state = {
                "accountant_state": json.dumps({"accountant": self.cfg.privacy.local_dp.accountant,
                                                "history": history_json(spend["history"])}),
                "epsilon": spend["epsilon"],
                "tasks_done": self.tasks_done[client_id],
            }
        if self.central_dp is not None and self.central_dp.releases > self._central_seen:
            new = int(self.central_dp.releases) - self._central_seen
            self._central_seen = int(self.central_dp.releases)
            self._central_eps = self._central_epsilon(self._central_seen)
            c = self.central
            rows.append({
                "client_id": -1, "accountant": c.accountant, "noise_multiplier": c.noise_multiplier,
                "sample_rate": self.central_q, "steps": new,
                "epsilon": self._central_eps if math.isfinite(self._central_eps) else float("inf"),
                "delta": c.delta,
            })
        if not rows:
            return None, state
        return (rows[0] if len(rows) == 1 else rows), state

    def _central_epsilon(self, releases: int) -> float:
        c = self.central
        return central_epsilon(c.noise_multiplier, self.central_q, releases, c.delta, c.accountant)

    # -- progress and summary ----------------------------------------------------------------
    @property
    def epsilon_max(self) -> float | None:
        if self.local:
            return max(self.eps.values()) if self.eps else 0.0
        return _finite(self._central_eps)

    def central_summary(self) -> dict[str, Any] | None:
        if self.central is None:
            return None
        c = self.central
        return {
            "accountant": c.accountant, "delta": c.delta, "clip": c.clip, "noise_multiplier": c.noise_multiplier,
            "sample_rate": self.central_q, "releases": self._central_seen, "epsilon": _finite(self._central_eps),
            "sampling_assumption": CENTRAL_ASSUMPTION,
        }

    def summary(self) -> dict[str, Any]:
        exhausted = sum(1 for r in self.store.clients(self.run_id) if r.exhausted)
        central = self.central_summary()
        if self.local:
            dp = self.cfg.privacy.local_dp
            eps = list(self.eps.values())
            out: dict[str, Any] = {
                "accountant": dp.accountant,
                "delta": dp.delta,
                "epsilon_budget": dp.epsilon,
                "epsilon_max": max(eps) if eps else 0.0,
                "epsilon_mean": sum(eps) / len(eps) if eps else 0.0,
                "clients_exhausted": exhausted,
                "clients_trained": sum(1 for t in self.tasks_done.values() if t > 0),
                "tasks_private": sum(self.tasks_done.values()),
                "overrides": len(self.cfg.privacy.overrides),
            }
        else:
            out = {
                "accountant": central["accountant"], "delta": central["delta"], "epsilon_budget": None,
                "epsilon_max": central["epsilon"], "epsilon_mean": central["epsilon"],
                "clients_exhausted": exhausted,
            }
        if central is not None:
            out["central_dp"] = central
        out["noise"] = noise_summary(self.cfg)
        return out
