"""fedasync from Python: :func:`simulate` and :func:`compare` (``fedasync simulate`` calls them).

.. code-block:: python

    import fedasync

    r = fedasync.simulate("config.yaml", set={"server.max_versions": 50}, task=my_task)
    r.summary["final_metrics"], r.history[-1], r.run_dir
    net = r.model()   # the final global model, an nn.Module

``config`` is a YAML path, a dict (a YAML's content) or a :class:`~fedasync.config.Config`
(``None``: the packaged quickstart); ``set`` maps dotted keys to values, as ``--set`` does;
``task`` is a module or any object with the task's functions (``model``, ``load_data``, ...:
:mod:`fedasync.task.interface`), which wins over ``task:`` of the config. With the ``local``
backend a run needs neither Ray nor a subprocess, and several runs in one process are independent
(each its own store and run directory). Bad input raises one exception with a one-line message
naming the key (:class:`~fedasync.config.ConfigError`, :class:`~fedasync.runs.RunError`,
``TaskError``, :class:`~fedasync.assembly.TargetError`, ``PrivacyError``), before anything is
written.
"""

from __future__ import annotations

import json
import re
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from fedasync.config import Config, ConfigError, apply_overrides, config_from_dict, load_config

__all__ = ["Result", "simulate", "compare", "resolve_config", "compare_configs", "prepare", "execute"]


@dataclass
class Result:
    """One run: ``summary`` (as ``summary.json``; store URL unmasked), ``history`` (one dict per
    evaluation: ``version``, ``virtual_time_s`` and every metric of the task), ``run_dir``,
    ``store_url``, ``params`` (the final global model's arrays; None when the store kept no
    parameters) and :meth:`model`."""

    summary: dict
    history: list[dict]
    run_dir: Path
    store_url: str
    params: dict[str, np.ndarray] | None
    parts: Any = field(default=None, repr=False)

    def model(self) -> Any:
        """The final global model as an ``nn.Module`` (the task's architecture, ``params`` loaded)."""
        if self.params is None:
            raise ValueError("Result.model: the run kept no parameters (store.save_parameters: false)")
        return self.parts.new_model(self.params)


def _sets(set_: Mapping[str, Any] | list[str] | None) -> list[str]:
    """``{"server.max_versions": 30}`` as ``--set`` strings (values written as JSON, which YAML reads)."""
    if not set_:
        return []
    if isinstance(set_, (list, tuple)):
        return [str(s) for s in set_]
    return [f"{k}={json.dumps(v)}" for k, v in set_.items()]


def resolve_config(config: str | Path | Mapping | Config | None, set_: Mapping | list[str] | None = None
                   ) -> tuple[Config, Path | None]:
    """The config and the folder a ``task:`` is imported from (the YAML's; else the working directory)."""
    sets = _sets(set_)
    if isinstance(config, Config):
        return config_from_dict(apply_overrides(config.model_dump(mode="json"), sets)), None
    if isinstance(config, Mapping):
        return config_from_dict(apply_overrides(dict(config), sets)), None
    if config is None:
        return load_config(None, sets), None
    return load_config(str(config), sets), Path(config).resolve().parent


def compare_configs(spec: str | list, base: Config) -> list[tuple[str, Config]]:
    """``"fedavg,fedbuff,fedasync"`` (an entry may add server keys: ``fedavg:backup_workers=4``) or
    a list of such entries: one config each, differing from ``base`` only in ``server``. Each entry
    resets the keys of ``base`` that apply to another compared strategy but not to its own
    (:func:`fedasync.config_effect.reset_inapplicable`), so none is refused for having no effect."""
    from fedasync.config_effect import reset_inapplicable

    entries = [str(e).strip() for e in (spec.split(",") if isinstance(spec, str) else list(spec)) if str(e).strip()]
    out: list[tuple[str, Config]] = []
    compared = [e.split(":")[0] for e in entries]
    for entry in entries:
        name, *kvs = entry.split(":")
        raw = base.model_dump(mode="json")
        reset_inapplicable(raw["server"], name, compared)
        sets = [f"server.strategy={name}"] + [f"server.{kv}" for kv in kvs]
        try:
            cfg = config_from_dict(apply_overrides(raw, sets))
        except ConfigError as e:
            raise ConfigError(f"--compare {entry}: {e}") from None
        label = re.sub(r"[^A-Za-z0-9_.=+-]+", "-", entry.replace(":", "-"))
        if label in [lbl for lbl, _ in out]:
            raise ConfigError(f"--compare: {entry} is listed twice")
        out.append((label, cfg))
    if not out:
        raise ConfigError("--compare: no strategy given")
    if len(out) > 1 and base.server.eval_every_s is None:
        warnings.warn(f"--compare: evaluated every {base.server.eval_every} versions, not on a common grid of "
                      "virtual times (a FedAvg version is a round, a FedBuff version K updates), so the times "
                      "to a target are not comparable; set server.eval_every_s", UserWarning, stacklevel=2)
    return out


def prepare(configs: list[tuple[str, Config]], *, task: Any = None, backend: str = "local",
            out: str | Path | None = None, resume: int | None = None, compared: bool = False,
            calibration: Callable[[int, int], None] | None = None) -> Path:
    """Check everything that can be checked before a run (DP settings, backend, the built-in data,
    ``out``, the stores, Ray's address, the trackers of ``tracking.backends``) and create the run
    directory; one exception with one line (RunError, ConfigError, PrivacyError) if anything is
    wrong, and then nothing is written. ``calibration(done, total)``: the progress of the built-in
    task's DP noise calibration (a minute or two for 100 clients)."""
    from fedasync.outputs import make_run_dir, out_dir_problem
    from fedasync.runs import RunError, ray_address_problem
    from fedasync.store.opening import StoreOpenError, probe_store

    cfg = configs[0][1]
    user_task = task is not None or bool(getattr(cfg, "task", None))
    if task is not None and backend == "flower" and not (isinstance(task, types.ModuleType) and
                                                        getattr(task, "__file__", None)):
        raise RunError("task=: an object that is not an importable module runs with backend='local' only "
                       "(Flower's engine runs the clients in other processes, which import the task by name)")
    if not user_task and (cfg.privacy.local_dp.enabled or cfg.privacy.central_dp.enabled):
        from fedasync.privacy.tracker import check_runnable

        for label, c in configs:
            try:
                check_runnable(c, progress=calibration)
            except ValueError as e:
                raise RunError(f"{label}: {e}" if compared else str(e)) from None
    if backend not in ("flower", "local"):
        raise RunError(f"--backend: {backend!r} is not one of flower, local")
    if not user_task:  # the built-in task: data and model (the --compare entries differ only in server)
        from fedasync.task.check import check_data

        check_data(cfg)
    out = Path(out) if out is not None else None
    problem = out_dir_problem(out, resume)
    if problem:
        raise RunError(problem)
    from fedasync.tracking import TrackingError, check_backends

    try:  # a tracker that is not installed: one line naming its extra
        check_backends(cfg.tracking.backends)
    except TrackingError as e:
        raise RunError(str(e)) from None
    for _, c in configs:  # a store that cannot be opened: one line, before anything is written
        if c.store.url is not None:
            try:
                probe_store(c.store.url, "store.url")
            except StoreOpenError as e:
                raise RunError(str(e)) from None
    problem = ray_address_problem() if backend == "flower" else None
    if problem:  # Ray would retry an address where nothing listens for minutes
        raise RunError(problem)
    try:
        return make_run_dir(out, cfg.name)
    except ValueError as e:  # a file on the way, no permission
        raise RunError(str(e)) from None


def execute(configs: list[tuple[str, Config]], out: Path, *, compared: bool, task: Any = None,
            base_dir: Path | None = None, backend: str = "local", resume: int | None = None,
            progress: Callable | None = None, verbose: bool = False, existed: bool = True
            ) -> tuple[dict[str, Path], dict[str, Result]]:
    """Run ``configs`` into ``out`` (a folder per label when ``compared``); the run directories and
    a :class:`Result` per run that finished or stopped. The run directory made by :func:`prepare`
    is removed again (unless it ``existed``) when a run fails before writing to it."""
    from fedasync.outputs import remove_if_empty
    from fedasync.runs import run_configs

    out_dirs = {label: (out / label if compared else out) for label, _ in configs}
    parts: dict[str, Any] = {}
    try:
        summaries = run_configs(configs, out_dirs, backend, progress=progress, resume=resume, verbose=verbose,
                                task=task, base_dir=base_dir, on_parts=parts.__setitem__,
                                track_root=out if compared else None)
    except BaseException:
        if not existed:
            remove_if_empty(out)
        raise
    return out_dirs, {label: _result(s, out_dirs[label], parts.get(label)) for label, s in summaries.items()}


def _result(summary: dict, run_dir: Path, parts: Any) -> Result:
    from fedasync.store import Store

    params = None
    st = Store(summary["store_url"])
    try:
        params = st.load_version(summary["run_id"])[1]
    except KeyError:
        pass
    finally:
        st.close()
    return Result(summary=summary, history=[dict(h) for h in summary["history"]], run_dir=run_dir,
                  store_url=summary["store_url"], params=params, parts=parts)


def simulate(config: str | Path | Mapping | Config | None = None, *, set: Mapping | None = None,  # noqa: A002
             task: Any = None, backend: str = "local", out: str | Path | None = None,
             resume: int | None = None, progress: Callable[[dict], None] | None = None,
             verbose: bool = False) -> Result:
    """Run one simulation (see the module docstring); its :class:`Result`. ``resume``: continue
    that run of the store in ``out`` (or ``store.url``); ``progress(event)``: called after each
    reply with the loop's progress event."""
    from fedasync.runs import resume_config

    cfg, base_dir = resolve_config(config, set)
    if resume is not None:
        given = None if config is None else str(config) if isinstance(config, (str, Path)) else "<config>"
        cfg = resume_config(given, _sets(set), Path(out) if out is not None else None, resume, cfg, mode="simulation")
    configs = [(cfg.server.strategy, cfg)]
    existed = out is not None and Path(out).exists()
    run_dir = prepare(configs, task=task, backend=backend, out=out, resume=resume)
    _, results = execute(configs, run_dir, compared=False, task=task, base_dir=base_dir, backend=backend,
                         resume=resume, progress=(lambda label, c: progress) if progress else None,
                         verbose=verbose, existed=existed)
    return next(iter(results.values()))


def compare(config: str | Path | Mapping | Config | None = None, strategies: str | list = "fedavg,fedbuff,fedasync",
            *, set: Mapping | None = None, task: Any = None, backend: str = "local",  # noqa: A002
            out: str | Path | None = None, verbose: bool = False) -> dict[str, Any]:
    """Run the identical scenario under several strategies (as ``--compare``; ``strategies`` e.g.
    ``"fedavg,fedbuff:buffer_size=5"`` or a list of entries). Returns ``{"results": {label:
    Result}, "comparison": comparison.json's content, "run_dir": Path}``; comparison.json and
    comparison.png are written when every run finished."""
    from fedasync.outputs import comparison, write_comparison

    cfg, base_dir = resolve_config(config, set)
    configs = compare_configs(strategies, cfg)
    existed = out is not None and Path(out).exists()
    run_dir = prepare(configs, task=task, backend=backend, out=out, compared=True)
    _, results = execute(configs, run_dir, compared=True, task=task, base_dir=base_dir, backend=backend,
                         verbose=verbose, existed=existed)
    summaries = {label: r.summary for label, r in results.items()}
    if len(results) == len(configs):
        write_comparison(run_dir, summaries)
    return {"results": results, "comparison": comparison(summaries), "run_dir": run_dir}
