"""The YAML schema: one place that turns YAML (plus ``--set`` overrides) into typed config.

Every section forbids unknown keys, so a typo stops the command before anything runs.
``load_config`` raises :class:`ConfigError` with a single line naming the key path and the
problem; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedasync.config_effect import no_effect
from fedasync.config_load import (ConfigError, apply_overrides, packaged_example, parse_client_set,  # noqa: F401
                                  parse_override, read_yaml)
from fedasync.tracking.schema import TrackingConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    # files: data.path, local (no network); hub: a Hugging Face data set id in hub_name (needs network)
    dataset: Literal["digits", "mnist1d", "hub", "files"] = "digits"
    hub_name: str | None = None  # a Hugging Face dataset id, for dataset: hub (needs network)
    num_clients: int = Field(100, gt=0)
    # iid, dirichlet (alpha), shard (McMahan et al. 2017: label shards), natural (one client per
    # distinct value of partition_column); all flwr-datasets partitioners
    partitioner: Literal["iid", "dirichlet", "shard", "natural"] = "dirichlet"
    alpha: float = Field(0.5, gt=0)  # Dirichlet concentration
    min_partition_size: int = Field(2, ge=1)
    shards_per_client: int = Field(2, gt=0)  # shard
    partition_column: str | None = None  # natural: e.g. a writer id
    test_fraction: float = Field(0.2, gt=0, lt=1)
    # the server evaluates on a seeded stratified subset of this many test samples (speed); None: all
    test_samples: int | None = Field(None, gt=0)
    # a seeded stratified validation split carved out of the training pool before it is partitioned
    # (clients never see it); the server reports val_accuracy / val_loss beside the test metrics
    val_fraction: float = Field(0.0, ge=0, lt=1)
    mnist1d_samples: int = Field(4000, gt=0)
    # files: an .npz (x_train, y_train, x_test, y_test, or x, y), a folder of parquet or CSV files
    # (train*/test* splits), or a folder written by datasets' save_to_disk
    path: str | None = None
    label_column: str = "label"
    feature_column: str | None = None  # default: the first of image, img, pixel_values, x, features
    shape: list[Annotated[int, Field(gt=0)]] | None = Field(None, min_length=1)  # e.g. [28, 28] for flat images
    num_classes: int | None = Field(None, ge=2)  # default: the largest training label + 1
    # [mean, std]: every feature becomes (x - mean) / std once loaded (pixels already in [0, 1]),
    # on the clients and for the server's test set; MNIST's: [0.1307, 0.3081]. None: as loaded
    normalize: tuple[Annotated[float, Field(allow_inf_nan=False)], Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = None

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.partitioner == "natural" and not self.partition_column:
            raise ValueError("partition_column: needed when data.partitioner is natural")
        if self.dataset == "files" and not self.path:
            raise ValueError("path: needed when data.dataset is files (an .npz, or a folder of parquet/CSV files "
                             "or one written by datasets' save_to_disk)")
        return self


class ModelConfig(_Section):
    # a name in fedasync.task.models.MODELS (the registry; tests check the two agree)
    name: Literal["mlp", "cnn", "fedavg_cnn", "resnet20", "dp_cnn"] = "mlp"
    hidden: int = Field(64, gt=0)


class TrainConfig(_Section):
    local_steps: int = Field(10, gt=0)
    local_epochs: int | None = Field(None, gt=0)  # when set, overrides local_steps
    batch_size: int = Field(16, gt=0)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    # FedAsync's proximal term (Xie et al. 2019): minimise f(x) + prox_rho/2 ||x - x_tau||^2 locally,
    # x_tau = the global model the task started from; 0 = plain local SGD
    prox_rho: float = Field(0.0, ge=0)
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"


class StalenessConfig(_Section):
    # adaptive: min(1, server.concurrency / (s + 1)) (Mishchenko et al. 2022); ignores a and b
    fn: Literal["constant", "polynomial", "hinge", "exponential", "adaptive"] = "polynomial"
    a: float = Field(0.5, ge=0, allow_inf_nan=False)
    b: float = Field(4.0, ge=0)


class SchedulerConfig(_Section):
    """``server.scheduler``: which idle client gets the next task (``fedasync.server.scheduler``)."""

    name: Literal["uniform", "fair", "fastest", "staleness_aware", "budget_aware"] = "uniform"
    explore: float = Field(0.1, ge=0, le=1)  # fastest: share of choices made uniformly at random
    beta: float = Field(1.0, ge=0, allow_inf_nan=False)  # fastest: p proportional to (estimated speed) ** beta
    balance: float = Field(1.0, ge=0, allow_inf_nan=False)  # staleness_aware: cost of one dispatch above the least-used client


class DelayCompensationConfig(_Section):
    """``server.delay_compensation``: DC-ASGD (Zheng et al. 2017) on each update before aggregation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    method: Literal["none", "dc_asgd"] = "none"
    lambda_: float = Field(0.04, ge=0, allow_inf_nan=False, alias="lambda")  # YAML key ``lambda`` (a Python keyword)


class RobustConfig(_Section):
    """``server.robust``: a Byzantine filter on every update and, for fedbuff, a robust buffer aggregator.

    The defaults and the reasons for them are in :mod:`fedasync.server.robust`.
    """

    filter: Literal["none", "zeno++", "kardam", "norm"] = "none"
    aggregator: Literal["mean", "median", "trimmed_mean", "centered_clip"] = "mean"
    # zeno++: accept iff gamma <v, g> - rho ||g||^2 >= -gamma epsilon
    refresh: int = Field(1, gt=0)  # versions between refreshes of the validation gradient v
    validation_size: int = Field(128, gt=0)  # samples drawn from the training data for v
    gamma: float = Field(1.0, gt=0)
    rho: float = Field(1.0, ge=0)
    epsilon: float = Field(0.5, ge=0)
    normalize: bool = False  # rescale g to ||v|| first: a direction-only test
    # kardam: accept iff the empirical Lipschitz coefficient is within the (N-f)/N quantile
    byzantine_fraction: float = Field(0.03, ge=0, lt=1)  # f/N
    dampening: float = Field(0.0, ge=0)  # update scaled by exp(-dampening * staleness)
    # norm: reject (or clip) ||delta|| > norm_multiplier * median of recently accepted norms
    norm_multiplier: float = Field(3.0, gt=1)
    clip: bool = False
    # kardam and norm: how many recent values the statistics use, and when they start to judge
    window: int = Field(100, ge=1)
    warmup: int = Field(10, ge=1)
    # fedbuff aggregators
    trim: float = Field(0.2, ge=0, lt=0.5)  # trimmed_mean: share cut from each end, per coordinate
    cc_radius: float | None = Field(None, gt=0)  # centered_clip: tau; default: median distance to the start
    cc_iters: int = Field(3, ge=1)  # centered_clip: clipping iterations

    @model_validator(mode="after")
    def _check(self) -> "RobustConfig":
        if self.warmup > self.window:
            raise ValueError(f"warmup: {self.warmup} is larger than window ({self.window})")
        return self


class TargetConfig(_Section):  # server.target: reached when metric (a key of the task's evaluate) >= / <= value
    metric: str = Field(min_length=1)
    value: float = Field(allow_inf_nan=False)
    mode: Literal["max", "min"] = "max"


class ServerConfig(_Section):
    strategy: Literal["fedasync", "fedbuff", "fedavg"] = "fedbuff"
    concurrency: int = Field(20, gt=0)
    # fedasync
    alpha: float = Field(0.6, gt=0, le=1)
    # fedbuff
    buffer_size: int = Field(10, gt=0)
    # fedbuff and fedavg: the server optimizer on each aggregated step d (FedAvgM, Hsu et al. 2019):
    # v <- server_momentum * v + d; x <- x + server_lr * v
    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.0, ge=0, lt=1)  # beta of the server optimizer above; 0: none (plain FedAvg/FedBuff)
    # fedavg
    clients_per_round: int | None = Field(None, gt=0)  # m; default: concurrency
    backup_workers: int = Field(0, ge=0)  # b
    weighting: Literal["auto", "examples", "uniform"] = "auto"  # auto: fedavg examples, fedbuff uniform
    staleness: StalenessConfig = StalenessConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    delay_compensation: DelayCompensationConfig = DelayCompensationConfig()
    robust: RobustConfig = RobustConfig()
    max_staleness: int | None = Field(None, ge=0)
    eval_every_s: float | None = Field(2.0, gt=0, allow_inf_nan=False)  # the evaluation grid, virtual s (null: eval_every)
    eval_every: int = Field(5, gt=0)  # versions, when eval_every_s is null (given alone, it makes eval_every_s null)
    target_hold: int = Field(3, ge=1)  # time to target: the first of target_hold evaluations in a row at the target
    # the model the server evaluates and reports: the mean of its last average_last versions
    # (Polyak-Ruppert tail averaging: smooths the noise of local DP and of asynchrony at no cost in
    # epsilon, it is post-processing); clients always train from the latest version. 1: the latest
    average_last: int = Field(1, ge=1)
    max_versions: int | None = Field(None, gt=0)
    max_virtual_time: float | None = Field(None, gt=0)
    max_wall_time: float | None = Field(None, gt=0)
    target_accuracy: float | None = Field(None, gt=0, le=1)  # alias of target {accuracy, v, max}
    target: TargetConfig | None = None
    stop_at_target: bool = False
    # validation / failures
    max_update_norm: float | None = Field(None, gt=0)
    task_timeout: float | None = Field(None, gt=0)  # seconds (virtual in simulation, wall in deployment)
    late_policy: Literal["reject", "accept"] = "reject"
    poll_interval: float = Field(0.02, gt=0)
    # stop (stop_reason no_progress) after this many taken replies in a row with none accepted; 0/null: never
    max_rejected_in_a_row: int | None = Field(1000, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _eval_cadence(cls, d: Any) -> Any:  # eval_every alone: every eval_every versions (eval_every_s null)
        return {**d, "eval_every_s": d.get("eval_every_s")} if isinstance(d, dict) and "eval_every" in d else d

    @model_validator(mode="after")
    def _one_target(self) -> "ServerConfig":
        if self.eval_every_s is not None and self.eval_every != 5:
            raise ValueError("eval_every_s: eval_every is given too: give one (null: every eval_every versions)")
        if self.target is not None and self.target_accuracy is not None:
            raise ValueError("target and target_accuracy both given: give one (target_accuracy: v means "
                             "target: {metric: accuracy, value: v, mode: max})")
        return self

    def goal(self) -> TargetConfig | None:  # target, or target_accuracy as {accuracy, v, max}
        a = self.target_accuracy
        return self.target if a is None else TargetConfig(metric="accuracy", value=a, mode="max")


class ClockConfig(_Section):
    sigma: float = Field(1.0, ge=0, allow_inf_nan=False)  # log-normal spread of relative compute speed
    jitter: float = Field(0.1, ge=0, allow_inf_nan=False)  # log-normal per-task jitter
    step_time: float = Field(0.05, gt=0, allow_inf_nan=False)  # virtual seconds per local step at speed 1
    bandwidth_mbps: float = Field(20.0, gt=0)  # median, both ways
    bandwidth_sigma: float = Field(0.5, ge=0, allow_inf_nan=False)
    latency_s: float = Field(0.05, ge=0, allow_inf_nan=False)
    emulate: bool = False  # clients really sleep duration * time_scale
    time_scale: float = Field(0.01, gt=0, allow_inf_nan=False)


class StoreConfig(_Section):
    url: str | None = None  # default: sqlite:///<run dir>/fedasync.db
    save_parameters: bool = True
    retry_for_s: float = Field(120.0, ge=0)  # database away (restart): retry each transaction this long; 0: never
    # parameters kept: the latest version, every checkpoint_every-th version (0: none), and any
    # version a live task or the strategy's buffer still refers to (see server/retention.py)
    checkpoint_every: int = Field(100, ge=0)


GDP_REFUSED = ("gdp is Opacus' Gaussian-DP accountant, a central-limit approximation that can underestimate "
               "epsilon; fedasync does not enforce budgets, calibrate noise or account a run with it: use rdp or prv")


class LocalDPConfig(_Section):
    enabled: bool = False
    epsilon: float | None = Field(None, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    noise_multiplier: float | Literal["auto"] = "auto"
    planned_tasks: int = Field(20, gt=0)
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"
    grad_sample_mode: Literal["hooks", "functorch", "ew", "ghost"] = "ghost"
    secure_mode: bool = False
    # opt-in: replies carry each task's mean training loss, computed on private data WITHOUT noise
    # or accounting (not covered by the (epsilon, delta) guarantee)
    report_loss: bool = False
    # a model Opacus cannot train (BatchNorm, ...): replace those layers with Opacus' ModuleValidator.fix
    # (BatchNorm -> GroupNorm) on the server's and every client's model alike, instead of refusing the run
    fix_model: bool = False

    @model_validator(mode="after")
    def _check(self) -> "LocalDPConfig":
        if self.enabled and self.accountant == "gdp":
            raise ValueError(f"accountant: {GDP_REFUSED}")
        if self.enabled and self.noise_multiplier == "auto" and self.epsilon is None:
            raise ValueError("epsilon: needed when noise_multiplier is auto")
        if isinstance(self.noise_multiplier, float) and self.noise_multiplier <= 0:
            raise ValueError("noise_multiplier: must be > 0")
        return self


class BudgetOverride(_Section):
    clients: str  # "0-9", "3,5,7" or "0-4,10"
    epsilon: float | None = Field(None, gt=0)
    delta: float | None = Field(None, gt=0, lt=1)
    noise_multiplier: float | None = Field(None, gt=0)
    planned_tasks: int | None = Field(None, gt=0)


class CentralDPConfig(_Section):
    enabled: bool = False
    clip: float = Field(1.0, gt=0)
    noise_multiplier: float = Field(1.0, ge=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"

    @model_validator(mode="after")
    def _check(self) -> "CentralDPConfig":
        if self.enabled and self.accountant == "gdp":
            raise ValueError(f"accountant: {GDP_REFUSED}")
        return self


class PrivacyConfig(_Section):
    local_dp: LocalDPConfig = LocalDPConfig()
    overrides: list[BudgetOverride] = []
    central_dp: CentralDPConfig = CentralDPConfig()
    # false (default): every DP noise draw and Poisson sample comes from OS entropy, unknown to the
    # server; true: derived from the run seed (bit-reproducible research runs; simulation only)
    reproducible_noise: bool = False

    @model_validator(mode="after")
    def _check(self) -> "PrivacyConfig":
        if self.reproducible_noise and self.local_dp.enabled and self.local_dp.secure_mode:
            raise ValueError("reproducible_noise: true cannot hold with privacy.local_dp.secure_mode: true "
                             "(Opacus' torchcsprng generator cannot be seeded)")
        return self


class SimulationConfig(_Section):
    backend: Literal["flower", "local"] = "flower"  # local: in-process, no Ray (tests, quick looks)
    num_supernodes: int | None = Field(None, gt=0)  # default: num_clients
    num_actors: int = Field(2, gt=0)  # Ray actors (cores)


class DeployConfig(_Section):
    signing: bool = False
    public_keys: str | None = None  # a directory of client-<id>.pub files
    node_discovery_timeout: float = Field(60.0, gt=0)


class GossipConfig(_Section):
    # paper: AD-PSGD (x_j <- (x_i+x_j)/2, x_i <- (x_i+x_j)/2 + Δ_i); symmetric: both ((x_i+Δ_i)+x_j)/2
    step_order: Literal["paper", "symmetric"] = "paper"


class AttackConfig(_Section):
    """``attack``: simulated Byzantine clients (simulation only; ``fedasync server`` refuses it).

    Which clients: ``clients`` ("0-19", "3,5,7") or a ``fraction`` of them drawn from the seed
    (:func:`fedasync.clients.attack.attackers`). What they do: ``fedasync.clients.attack``.
    """

    kind: Literal["sign_flip", "scale", "gaussian", "label_flip", "stale"]
    fraction: float | None = Field(None, gt=0, le=1)
    clients: str | None = None
    factor: float = Field(10.0, gt=0)  # sign_flip, scale, gaussian
    lag: int = Field(20, gt=0)  # stale: how many versions old the attacker's model is

    @model_validator(mode="after")
    def _check(self) -> "AttackConfig":
        if (self.fraction is None) == (self.clients is None):
            raise ValueError("fraction: give exactly one of attack.fraction and attack.clients")
        return self


class Config(_Section):
    name: str = "fedasync"
    seed: int = Field(0, ge=0, lt=2**32)  # numpy's and sklearn's seeds: 0 .. 2**32 - 1
    # a user task: a module importable from the YAML's folder or the environment, or a path ./my_task.py
    # (fedasync.task.interface); unset: the built-in task of `data` and `model`
    task: str | None = Field(None, min_length=1)
    task_args: dict[str, Any] = {}  # keyword arguments passed to every function of the task
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    server: ServerConfig = ServerConfig()
    clock: ClockConfig = ClockConfig()
    store: StoreConfig = StoreConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    simulation: SimulationConfig = SimulationConfig()
    deploy: DeployConfig = DeployConfig()
    gossip: GossipConfig = GossipConfig()  # fedasync gossip only
    attack: AttackConfig | None = None  # simulation only
    tracking: TrackingConfig = TrackingConfig()  # metrics to TensorBoard / MLflow (fedasync/tracking)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        n = self.data.num_clients
        s = self.server
        if s.concurrency > n:
            raise ValueError(f"server.concurrency: {s.concurrency} is larger than data.num_clients ({n})")
        if s.strategy == "fedbuff" and s.buffer_size > n:
            raise ValueError(f"server.buffer_size: {s.buffer_size} is larger than data.num_clients ({n})")
        if s.strategy == "fedavg":
            m = s.clients_per_round or s.concurrency
            if m + s.backup_workers > n:
                raise ValueError(
                    f"server.backup_workers: clients_per_round ({m}) + backup_workers "
                    f"({s.backup_workers}) is larger than data.num_clients ({n})"
                )
        if self.data.dataset == "hub" and not self.data.hub_name:
            raise ValueError("data.hub_name: needed when data.dataset is hub")
        if s.robust.aggregator != "mean":
            if s.strategy != "fedbuff":
                raise ValueError(f"server.robust.aggregator: {s.robust.aggregator} needs server.strategy fedbuff "
                                 f"(got {s.strategy})")
            if self.privacy.central_dp.enabled:
                raise ValueError(f"server.robust.aggregator: {s.robust.aggregator} cannot be combined with "
                                 "privacy.central_dp (its sensitivity is that of the mean)")
        if s.delay_compensation.method != "none" and s.strategy == "fedavg":
            raise ValueError("server.delay_compensation.method: applies to fedasync and fedbuff, not fedavg")
        problem = no_effect(s)  # a key set away from its default that the strategy ignores
        if problem:
            raise ValueError(problem)
        if self.attack is not None and self.attack.clients is not None:
            parse_client_set(self.attack.clients, n, key="attack.clients")
        speed, bw = profile_draws(n, self.clock, self.seed)
        for key, v in (("sigma", speed), ("bandwidth_sigma", bw)):  # a task's duration divides by both
            if not (v > 0).all():
                c = int((v <= 0).argmax())
                raise ValueError(f"clock.{key}: {getattr(self.clock, key):g} draws a {key[:-6] or 'speed'} of 0 for "
                                 f"client {c} (exp(spread * z) below float range): its tasks cannot be timed; use a "
                                 "smaller spread")
        return self

    # -- helpers -----------------------------------------------------------------
    @property
    def clients_per_round(self) -> int:
        return self.server.clients_per_round or self.server.concurrency

    @property
    def weighting(self) -> str:
        w = self.server.weighting
        if w == "auto":
            return "examples" if self.server.strategy == "fedavg" else "uniform"
        return w

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


_PROFILE_STREAM = 0x70726F66  # "prof": keeps profile draws apart from other uses of the seed


def profile_draws(num_clients: int, clock: ClockConfig, seed: int) -> tuple[Any, Any]:
    """Each client's compute speed ``exp(sigma * z)`` and bandwidth in bit/s, as numpy arrays: the
    draws of :func:`fedasync.server.clock.make_profiles`, here so the config can refuse a spread
    that draws 0 or inf (clock.py imports this module, not the other way round)."""
    import numpy as np

    if num_clients < 0:
        raise ValueError(f"num_clients must be >= 0, got {num_clients}")
    rng = np.random.default_rng([seed, _PROFILE_STREAM])
    z = rng.standard_normal((num_clients, 2))  # drawn whatever sigma is, so streams line up
    with np.errstate(over="ignore", under="ignore"):
        speed = np.exp(clock.sigma * z[:, 0])
        bw = clock.bandwidth_mbps * 1e6 * np.exp(clock.bandwidth_sigma * z[:, 1])
    return speed, bw


# -- loading ------------------------------------------------------------------------


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "<root>"


def _known_keys(section: tuple[Any, ...]) -> list[str]:
    """The keys of the config section at ``section`` (a pydantic error location), or []."""
    model: Any = Config
    for part in section:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return []
        ann = field.annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return [f.alias or k for k, f in model.model_fields.items()]


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = _loc(e["loc"])
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        known = _known_keys(e["loc"][:-1])
        return f"{loc}: unknown key" + (f"; known: {', '.join(known)}" if known else "")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        # cross-field errors carry their own key path ("server.x: ...")
        if ":" in msg.split(" ")[0]:
            return msg if loc == "<root>" else f"{loc}.{msg}"
    return f"{loc}: {msg}"


def config_from_dict(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load YAML (default: the packaged quickstart), apply ``--set`` overrides, validate."""
    raw = read_yaml(path if path is not None else packaged_example("quickstart"))
    return config_from_dict(apply_overrides(raw, overrides or []))


def check_no_attack(cfg: Config) -> None:
    """Raise :class:`ConfigError` if ``cfg`` has an ``attack`` section: attacks are simulated only,
    and a deployed server (``fedasync server``) must refuse them (the CLI exits 2)."""
    if cfg.attack is not None:
        raise ConfigError("attack: simulation only; a deployed server refuses a config with an attack section")
