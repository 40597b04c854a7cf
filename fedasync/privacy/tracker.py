"""The server side of privacy: budgets sent with each task, spend recorded with each reply.

The server loop (``server/loop.py``) builds one :class:`PrivacyTracker` per run when
``privacy.local_dp`` or ``privacy.central_dp`` is enabled and

* adds :meth:`PrivacyTracker.client_config` to every task (under ``"privacy"``): the client's
  budget, noise multiplier, clipping norm, accountant, ``grad_sample_mode``, ``secure_mode``,
  ``reproducible_noise``, ``report_loss``, the number of records the server planned it with
  (echoed back as ``num_examples``) and, in simulation, its accountant history so far (the
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
    delta_warnings,
    history_json,
    history_steps,
    plan_clients,
)

log = logging.getLogger("fedasync.privacy")

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


def check_runnable(cfg: Config) -> None:
    """Everything that can be checked before a DP run starts (raises :class:`PrivacyError`)."""
    from fedasync.privacy.dp import check_model, check_secure_mode
    from fedasync.task.data import load_federated
    from fedasync.task.models import build_model

    p = cfg.privacy
    if p.central_dp.enabled and cfg.server.strategy != "fedbuff":
        raise PrivacyError(f"privacy.central_dp: needs server.strategy fedbuff (got {cfg.server.strategy})")
    if p.central_dp.enabled and cfg.weighting != "uniform":
        raise PrivacyError("privacy.central_dp: needs server.weighting uniform (the sensitivity is per client)")
    if p.local_dp.enabled:
        check_secure_mode(p.local_dp.secure_mode)
        fed = load_federated(cfg.data, cfg.seed)
        check_model(build_model(cfg.model, fed.input_shape, fed.num_classes))
        plan_clients(cfg, fed.sizes())  # resolves every budget and calibrates sigma (cached)


class PrivacyTracker:
    """Per-client accountants (their histories) and central DP accounting for one run."""

    def __init__(self, cfg: Config, store, run_id: int, strategy, resumed: bool = False) -> None:
        from fedasync.task.data import load_federated

        self.cfg = cfg
        self.store = store
        self.run_id = run_id
        self.local = cfg.privacy.local_dp.enabled
        self.central = cfg.privacy.central_dp if cfg.privacy.central_dp.enabled else None
        check_runnable(cfg)
        try:
            self.mode = store.get_run(run_id).mode
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
            sizes = load_federated(cfg.data, cfg.seed).sizes()
            self.plans = plan_clients(cfg, sizes)
        if resumed:
            for row in store.clients(run_id):
                if row.accountant_state:
                    st = json.loads(row.accountant_state)
                    self.history[row.client_id] = as_history(st.get("history"))
                self.eps[row.client_id] = float(row.epsilon or 0.0)
                self.tasks_done[row.client_id] = int(row.tasks_done or 0)
        self.central_dp = None
        self._central_seen = 0
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
        if self.mode == "simulation":
            conf["history"] = hist
        else:  # a real device keeps its own accountant; the server's record is a floor
            conf["server_history"] = hist
            conf["state_key"] = f"{self.cfg.name}-run{self.run_id}-client{client_id}"
        return conf

    # -- what a reply records ----------------------------------------------------------------
    def on_reply(self, client_id: int, task_id: int, metrics: dict) -> tuple[dict | list[dict] | None, dict | None]:
        rows: list[dict] = []
        state = None
        if self.local:
            hist, eps = metrics.get("accountant_history"), metrics.get("epsilon")
            if hist is None or eps is None:
                log.error("task %d: client %d replied without privacy accounting in a DP run", task_id, client_id)
            else:
                hist = as_history(hist)
                eps = float(eps)
                grew = history_steps(hist) - history_steps(self.history[client_id])
                if grew != int(metrics.get("dp_steps", -1)):
                    log.warning("task %d: client %d's accountant grew by %d steps, it reports %s", task_id,
                                client_id, grew, metrics.get("dp_steps"))
                budget = self.plans[client_id].budget.epsilon
                if budget is not None and eps > budget:
                    log.error("task %d: client %d reports epsilon %.6g over its budget %.6g", task_id, client_id,
                              eps, budget)
                self.history[client_id] = hist
                self.eps[client_id] = eps
                self.tasks_done[client_id] += 1
                rows.append({
                    "client_id": client_id, "accountant": str(metrics.get("accountant", self.cfg.privacy.local_dp.accountant)),
                    "noise_multiplier": float(metrics["noise_multiplier"]), "sample_rate": float(metrics["sample_rate"]),
                    "steps": int(metrics["dp_steps"]), "epsilon": eps, "delta": float(metrics["delta"]),
                })
                state = {
                    "accountant_state": json.dumps({"accountant": self.cfg.privacy.local_dp.accountant,
                                                    "history": history_json(hist)}),
                    "epsilon": eps,
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
