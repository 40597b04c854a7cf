"""The loop's policies, wired: scheduling, delay compensation, Byzantine filters, simulated attacks.

:class:`Policies` is what :class:`fedasync.server.loop.AsyncServer` asks at its hooks; the
algorithms themselves are the pure modules ``scheduler.py`` (``server.scheduler``), ``delay.py``
(``server.delay_compensation``), ``robust.py`` (``server.robust``) and, in simulation only,
``fedasync.clients.attack`` (``attack:``). The same object runs in simulation and deployment
(``fedasync server`` builds the same :class:`~fedasync.server.loop.AsyncServer`); only the attack
is refused outside simulation.

The hooks, in the order the loop calls them:

- :meth:`choose`: the idle clients to dispatch to (``scheduler.eligible`` then ``choose``);
  :meth:`on_dispatch` for every task sent (a re-sent task of a resumed simulation is not a new
  dispatch and is not reported). :meth:`task_params` / :meth:`task_config`: what a malicious
  client is sent (``stale``: an old model; ``label_flip``, ``sign_flip``, ``scale``, ``gaussian``:
  the ``attack`` entry its simulated client obeys, :mod:`fedasync.clients.runner`).
- :meth:`on_reply`: every reply (accepted or rejected) gives the scheduler the duration the server
  observed (virtual seconds in simulation, wall seconds in deployment; never the clock's speed
  profile) and its staleness; ``budget_aware`` then sees the client's remaining epsilon
  (:func:`fedasync.privacy.budgets.budget_view`, from the privacy tracker's accountant history).
- :meth:`judge`: an update that passed validation and the strategy's check goes through the
  filter (a rejection's reason, ``zeno``, ``kardam`` or ``norm``, is recorded with the update like
  any other; the client's privacy spend is recorded all the same: it trained), then through delay
  compensation (DC-ASGD, on stale updates only: a fresh one has ``x_now == x_base``).

Resume: the scheduler's state travels in the loop state (``resume.loop_state``); so do the cheap
parts of a filter's state (:meth:`state_dict`: norm's recent norms, kardam's recent coefficients,
the version zeno++'s validation gradient was computed at, which is recomputed from the stored
model) and a ``stale`` attacker's window: the versions of the old models kept and the version
each of its tasks in flight was sent, whose parameters the store keeps
(:meth:`held_versions`, ``server/retention.py``) and a resume reloads. Kardam's previous
pseudo-gradient per client (``O(clients x parameters)``) is not in the loop state: the store
keeps each client's last judged update as judged (``updates.filter_params``, cleared by the
client's next one, :meth:`take_remembered`) and its base version (:meth:`held_versions`), and a
resume recomputes the gradients from them (:meth:`restore_filter`). Every combination resumes
bit-identically.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from fedasync.config import Config, check_no_attack
from fedasync.server import robust
from fedasync.server.delay import make_delay_compensation
from fedasync.server.scheduler import participation, scheduler_from_config
from fedasync.server.strategies import Update
from fedasync.server.validation import all_finite

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer

log = logging.getLogger("fedasync")

Params = dict[str, np.ndarray]


#: consecutive rejections by the filter after which the loop warns that the model cannot move
FILTER_WARN_AFTER = 50


def filter_stuck_message(name: str, n: int) -> str:
    """The warning when the filter has rejected ``n`` updates in a row, with what to change."""
    hint = {
        "zeno++": "its test (gamma <v, g> - rho ||g||^2 >= -gamma epsilon) fails for noisy honest updates, "
                  "e.g. under local DP: raise server.robust.epsilon, lower server.robust.rho or set "
                  "server.robust.normalize: true",
        "kardam": "lower server.robust.byzantine_fraction (the share of coefficients it treats as attacks)",
        "norm": "raise server.robust.norm_multiplier or set server.robust.clip: true",
    }.get(name, "check the server.robust settings")
    return (f"server.robust.filter {name} has rejected the last {n} updates in a row: the model is not "
            f"moving; {hint}")


def kept_model(load_version: Any, v: int, who: str, then: str, detail: str = "") -> Params | None:
    """``load_version(v)`` on resume, or ``None`` with a warning when the store did not keep version
    ``v``'s parameters (``who``: what needed them, ``then``: what the resumed run does instead)."""
    try:
        return load_version(v)
    except KeyError:
        log.warning("%s: the model of version %d%s was not kept; %s", who, v, detail, then)
        return None


class Policies:
    """Scheduler, delay compensation, filter and attack of one run (see the module docstring)."""

    def __init__(self, cfg: Config, validation: Any = None, mode: str = "simulation", scheduler: Any = None) -> None:
        """``validation(size) -> (params -> gradient)``: Zeno++'s validation gradient on ``size``
        training samples (the task's loss; :func:`fedasync.assembly.assemble` builds it);
        ``scheduler``: used instead of the one ``server.scheduler`` names."""
        if mode != "simulation":
            check_no_attack(cfg)  # ConfigError: a deployed server never simulates attackers
        self.cfg = cfg
        self.scheduler = scheduler or scheduler_from_config(cfg.server.scheduler, cfg.seed)
        self.touched: set[int] = set()  # clients whose scheduler state changed (resume.loop_state clears it)
        self.compensate = make_delay_compensation(cfg.server.delay_compensation)
        self.filter = robust.make_filter(cfg.server.robust)
        self.attack = cfg.attack
        self.malicious: frozenset[int] = frozenset()
        if self.attack is not None:
            from fedasync.clients.attack import attackers

            self.malicious = attackers(self.attack, cfg.data.num_clients, cfg.seed)
        self.clipped = 0
        self._rejected_in_a_row = 0  # by the filter, since its last acceptance (for the warning)
        self._old: dict[int, Params] = {}  # stale attack: recent global models by version
        self._sent: dict[int, int] = {}  # stale attack: task id -> the version its attacker was sent
        self._remembered: dict[int, int] = {}  # kardam: client -> task id of the update it remembers
        self._just_remembered: tuple[Params, int | None] | None = None  # see :meth:`take_remembered`
        self._zeno_grad = None
        if isinstance(self.filter, robust.ZenoPlusPlus):
            if validation is None:
                raise ValueError("server.robust.filter zeno++: needs a validation gradient (assembly.assemble)")
            # the validation set comes from the training partitions, never from the test set
            self._zeno_grad = validation(cfg.server.robust.validation_size)

    # -- scheduling ------------------------------------------------------------------------
    def eligible(self, idle: list[int]) -> list[int]:
        return self.scheduler.eligible(idle)

    def choose(self, idle: list[int], n: int) -> list[int]:
        """Up to ``n`` clients from ``idle`` (already eligible), in the scheduler's order."""
        idle = list(idle)
        chosen = []
        for _ in range(min(n, len(idle))):
            c = self.scheduler.choose(idle)
            idle.remove(c)
            chosen.append(c)
        return chosen

    def on_dispatch(self, client: int, now: float, version: int) -> None:
        self.scheduler.on_dispatch(client, now, version)
        self.touched.add(int(client))

    def observe_budgets(self, privacy: Any, clients: Any) -> None:
        """``budget_aware`` only: each client's remaining epsilon and whether its next task fits."""
        if self.scheduler.name != "budget_aware" or privacy is None or not getattr(privacy, "local", False):
            return
        from fedasync.privacy.budgets import budget_view

        for c in clients:
            remaining, ok = budget_view(privacy.plans[c], privacy.history[c])
            self.scheduler.observe_budget(c, remaining, ok)
            self.touched.add(int(c))

    def on_reply(self, client: int, duration: float, staleness: int, privacy: Any = None) -> None:
        self.scheduler.on_reply(client, duration, staleness)
        self.touched.add(int(client))
        self.observe_budgets(privacy, [client])

    def on_failure(self, client: int, duration: float) -> None:
        """A task of ``client`` ended without a reply (an error, a timeout) after ``duration``."""
        self.scheduler.on_failure(client, duration)
        self.touched.add(int(client))

    # -- what an attacker is sent (simulation only) ----------------------------------------------
    def task_params(self, client: int, version: int, params: Params, task_id: int | None = None) -> Params:
        """The model sent to ``client`` at global ``version``: ``params``, or for a ``stale``
        attacker the oldest model kept within ``attack.lag`` versions (its update claims ``version``;
        the version it was sent is remembered for ``task_id``, for a resume)."""
        if self.attack is None or self.attack.kind != "stale":
            return params
        from fedasync.clients.attack import stale_version

        self._old.setdefault(version, params)
        target = stale_version(version, self.attack.lag)
        for v in [v for v in self._old if v < target]:
            del self._old[v]
        if client not in self.malicious:
            return params
        oldest = min(self._old)
        if task_id is not None and oldest != version:
            self._sent[task_id] = oldest
        return self._old[oldest]

    def sent_params(self, task_id: int, base: Params, load_version: Any) -> Params:
        """What task ``task_id`` was sent, to send it again on resume: ``base`` (its base version's
        model), or the old model a ``stale`` attacker was sent (``load_version(v) -> params``)."""
        v = self._sent.get(task_id)
        if v is None:
            return base
        if v in self._old:
            return self._old[v]
        sent = kept_model(load_version, v, "stale attack", "the task is sent its base model (the resumed run is "
                          "valid, not bit-identical)", detail=f" (sent to task {task_id})")
        return base if sent is None else sent

    def forget_closed(self, live: Any) -> None:
        """Drop what is remembered of tasks no longer in ``live`` (task ids)."""
        if self._sent:
            self._sent = {t: v for t, v in self._sent.items() if t in live}

    def held_versions(self) -> set[int]:
        """Versions whose parameters a resume needs (the store keeps them): for the attack,
        kardam's base models of the updates it remembers (at most one per client), and the version
        zeno++'s validation gradient was computed at (a resume recomputes it there)."""
        held = set(self._old) | set(self._sent.values())
        if isinstance(self.filter, robust.Kardam):
            held |= set(self.filter.models)
        elif isinstance(self.filter, robust.ZenoPlusPlus) and self.filter.v_version is not None:
            held.add(int(self.filter.v_version))
        return held

    def task_config(self, client: int) -> dict[str, Any]:
        """The ``attack`` entry of a malicious client's task (kinds its simulated client carries out)."""
        if self.attack is None or client not in self.malicious or self.attack.kind == "stale":
            return {}
        return {"attack": {"kind": self.attack.kind, "factor": float(self.attack.factor)}}

    # -- judging an update -----------------------------------------------------------------------
    def _refresh_zeno(self, params: Params, version: int) -> None:
        self.filter.set_validation_gradient(self._zeno_grad(params), version)

    def judge(self, upd: Update, params: Params, version: int) -> str | None:
        """Filter then compensate ``upd`` (its ``params`` may be replaced) against the global model
        ``params`` at ``version``; the rejection reason, or ``None``."""
        if self.filter is not None:
            if isinstance(self.filter, robust.ZenoPlusPlus) and self.filter.needs_refresh(version):
                self._refresh_zeno(params, version)
            verdict = self.filter.check(upd)
            if isinstance(self.filter, robust.Kardam):  # it now remembers upd, as judged (whatever the verdict)
                self._just_remembered = (upd.params, self._remembered.get(upd.client_id))
                self._remembered[upd.client_id] = upd.task_id
            if not verdict.accepted:
                self._rejected_in_a_row += 1
                if self._rejected_in_a_row == FILTER_WARN_AFTER:
                    log.warning("%s", filter_stuck_message(self.cfg.server.robust.filter, FILTER_WARN_AFTER))
                return verdict.reason
            self._rejected_in_a_row = 0
            if verdict.changes_update():
                if verdict.delta is not None:
                    self.clipped += 1
                upd.params = verdict.apply(upd)
        if self.compensate is not None and upd.base_version != version:
            compensated = self.compensate(params, upd.base_params, upd.params)
            if not all(all_finite(a) for a in compensated.values()):  # a finite update overflowed
                return "non_finite"
            upd.params = compensated
        return None

    def take_remembered(self) -> tuple[Params, int | None] | None:
        """After :meth:`judge`: when the filter now remembers the update it judged (kardam), its
        parameters as judged and the task id of the same client's update it forgot (``None``: the
        first), for the store (``updates.filter_params``); otherwise ``None``. Taken once."""
        out, self._just_remembered = self._just_remembered, None
        return out

    # -- resume --------------------------------------------------------------------------------------
    def restore_filter(self, rows: Any, load_version: Any) -> None:
        """Kardam, on resume: remember again the updates the store kept (``Store.filter_updates``:
        ``(row, params)`` in task order), their base models from ``load_version(v) -> params``."""
        if not isinstance(self.filter, robust.Kardam):
            return
        bases: dict[int, Params] = {}
        for row, params in rows:
            v = int(row.base_version)
            self._remembered[int(row.client_id)] = int(row.task_id)  # forgotten by its client's next update
            if v not in bases:
                base = kept_model(load_version, v, "kardam", f"client {row.client_id}'s next update has no "
                                  "coefficient (the resumed run is valid, not bit-identical)")
                if base is None:
                    continue
                bases[v] = base
            self.filter.remember(Update(task_id=row.task_id, client_id=row.client_id, params=params,
                                        base_params=bases[v], base_version=v, staleness=row.staleness,
                                        num_examples=row.num_examples or 0))

    def state_dict(self) -> dict[str, Any]:
        """The filter's cheap state (see the module docstring); the scheduler's is saved beside it."""
        f = self.filter
        d: dict[str, Any] = {"clipped": self.clipped}
        if isinstance(f, robust.ZenoPlusPlus):
            d["zeno_v_version"] = f.v_version
        elif isinstance(f, robust.Kardam):
            d["kardam_coefficients"] = list(f.coefficients)
        elif isinstance(f, robust.NormFilter):
            d["norm"] = f.state_dict()
        if self.attack is not None and self.attack.kind == "stale":
            d["stale_window"] = sorted(self._old)
            d["stale_sent"] = [[t, v] for t, v in sorted(self._sent.items())]
        return d

    def load_state_dict(self, d: dict[str, Any] | None, load_version: Any = None) -> None:
        """``load_version(v) -> params`` (the store's) recomputes zeno++'s validation gradient and
        reloads a ``stale`` attacker's window."""
        if not d:
            return
        self.clipped = int(d.get("clipped", 0))
        if "stale_window" in d and load_version:
            self._sent = {int(t): int(v) for t, v in d.get("stale_sent", [])}
            self._old = {}
            for v in map(int, d["stale_window"]):  # one not kept (a store written otherwise): left out
                old = kept_model(load_version, v, "stale attack", "the resumed run is valid, not bit-identical")
                if old is not None:
                    self._old[v] = old
        f = self.filter
        if isinstance(f, robust.ZenoPlusPlus) and d.get("zeno_v_version") is not None and load_version:
            v = int(d["zeno_v_version"])
            model = kept_model(load_version, v, "zeno++", "the validation gradient is recomputed at the next update")
            if model is not None:
                self._refresh_zeno(model, v)
        elif isinstance(f, robust.Kardam) and "kardam_coefficients" in d:
            f.coefficients = [float(k) for k in d["kardam_coefficients"]]
        elif isinstance(f, robust.NormFilter) and "norm" in d:
            f.load_state_dict(d["norm"])

    # -- reporting -----------------------------------------------------------------------------------
    def summary(self, dispatch_clients: list[int], updates: list[Any]) -> dict[str, Any]:
        """``participation`` and ``robust`` for summary.json, from the store's rows (so a resumed
        run reports the whole run): ``dispatch_clients`` (one client id per dispatch) and the
        ``updates`` rows (``client_id``, ``staleness``, ``accepted``, ``reason``)."""
        n = self.cfg.data.num_clients
        counts = [0] * n
        for c in dispatch_clients:
            if 0 <= c < n:
                counts[c] += 1
        part = participation(counts)
        st_sum, st_n = [0.0] * n, [0] * n
        for u in updates:
            if 0 <= u.client_id < n and u.staleness is not None:
                st_sum[u.client_id] += u.staleness
                st_n[u.client_id] += 1
        part["mean_staleness"] = [round(s / k, 6) if k else None for s, k in zip(st_sum, st_n)]
        part["scheduler"] = self.scheduler.name
        rob = self.cfg.server.robust
        rejected = {r: 0 for r in robust.REASONS}
        groups = {"honest": [0, 0], "malicious": [0, 0]}
        for u in updates:
            g = groups["malicious" if u.client_id in self.malicious else "honest"]
            g[0] += 1
            if not u.accepted and u.reason in rejected:
                rejected[u.reason] += 1
                g[1] += 1
        out = {
            "filter": rob.filter, "aggregator": rob.aggregator if self.cfg.server.strategy == "fedbuff" else None,
            "delay_compensation": self.cfg.server.delay_compensation.method,
            "rejected": rejected, "clipped": self.clipped,
            "honest_updates": groups["honest"][0], "honest_rejected": groups["honest"][1],
            "false_rejection_rate": groups["honest"][1] / groups["honest"][0] if groups["honest"][0] else None,
        }
        if self.attack is not None:
            m = groups["malicious"]
            out.update(attack=self.attack.kind, attackers=sorted(self.malicious), malicious_updates=m[0],
                       malicious_rejected=m[1], true_rejection_rate=m[1] / m[0] if m[0] else None)
        return {"participation": part, "robust": out}
