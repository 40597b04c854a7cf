"""A device's own DP policy: what a real device (``fedasync client``) accepts from a server.

Under local DP the server proposes and the device disposes. A deployed device never applies the
DP settings a task carries as they are: it holds a :class:`DevicePolicy` (``fedasync client
--privacy-policy FILE`` or the ``--dp-*`` flags) and :func:`check_task` compares every DP task
with it **before any training**. A task that asks for less privacy than the policy allows is
refused with reason ``privacy_policy`` (:data:`POLICY_REFUSED`); :func:`check_task` returns the
rule it broke, in one line.

The policy's ``epsilon`` and ``delta`` are the device's budget for its data across **all** runs
and servers: the device keeps one accountant file for them in its state directory, keyed by its
own identity (:func:`device_id`, a random id created once), never by anything a server sends.
The task's own ``epsilon`` and ``delta`` are the server's wish and decide nothing on a device.

Pure: pydantic, yaml and the budget math (:mod:`fedasync.privacy.budgets`); no Flower, no database.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: the reason a device gives when a task breaks its policy (the reply's ``refused``)
POLICY_REFUSED = "privacy_policy"
#: why a device without a policy refuses every DP task
NO_POLICY = ("this device has no DP policy: start fedasync client with --privacy-policy FILE (or the --dp-* "
             "flags) to accept local-DP tasks")
DEVICE_ID_FILE = "device-id"
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")


class PolicyError(ValueError):
    """A policy that cannot be used (one line naming the key)."""


class DevicePolicy(BaseModel):
    """The device's DP policy (YAML keys = field names; see the README, "Privacy budgets")."""

    model_config = ConfigDict(extra="forbid")

    accountant: Literal["rdp", "prv"] = "rdp"
    epsilon: float = Field(gt=0)  # the device's budget for its data, all runs and servers together
    delta: float = Field(1e-5, gt=0, lt=1)
    min_noise_multiplier: float | None = Field(None, gt=0)
    max_epsilon_per_task: float | None = Field(None, gt=0)
    max_sample_rate: float | None = Field(None, gt=0, le=1)
    max_grad_norm: float | None = Field(None, gt=0)  # the loosest clipping norm accepted
    allow_report_loss: bool = False

    @field_validator("accountant", mode="before")
    @classmethod
    def _no_gdp(cls, v):
        if v == "gdp":
            from fedasync.config import GDP_REFUSED

            raise ValueError(GDP_REFUSED)
        return v

    @field_validator("epsilon", "delta", "min_noise_multiplier", "max_epsilon_per_task", "max_sample_rate",
                     "max_grad_norm")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @model_validator(mode="after")
    def _some_noise_floor(self):
        if self.min_noise_multiplier is None and self.max_epsilon_per_task is None:
            raise ValueError("min_noise_multiplier or max_epsilon_per_task: give at least one (the least noise, "
                             "or the most epsilon, one task may use)")
        return self


#: the ``fedasync client`` flag of each policy key
FLAGS = {"epsilon": "--dp-epsilon", "delta": "--dp-delta", "accountant": "--dp-accountant",
         "min_noise_multiplier": "--dp-min-noise", "max_epsilon_per_task": "--dp-max-task-epsilon",
         "max_sample_rate": "--dp-max-sample-rate", "max_grad_norm": "--dp-max-grad-norm",
         "allow_report_loss": "--dp-allow-loss"}


def _one_line(e: ValidationError, name) -> str:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not key and ":" in msg:  # the model validator names its keys itself
        key, msg = msg.split(":", 1)
        key = " or ".join(name(k.strip()) for k in key.split(" or "))
        return f"{key}: {msg.strip()}"
    return f"{name(key)}: {msg}"


def make_policy(values: Any, name=lambda key: key) -> DevicePolicy:
    """A validated :class:`DevicePolicy`; :class:`PolicyError` (one line, the key as ``name(key)``
    says it) if not."""
    if not isinstance(values, dict):
        raise PolicyError(f"{name('policy')}: the policy must be a mapping of keys to values")
    try:
        return DevicePolicy.model_validate(values)
    except ValidationError as e:
        raise PolicyError(_one_line(e, name)) from None


def resolve_policy(path: str | os.PathLike | None, flags: dict[str, Any]) -> DevicePolicy | None:
    """The policy of ``fedasync client``: YAML file ``path`` (``--privacy-policy``) and/or the
    ``--dp-*`` flags (``flags``: policy key -> value, the unset ones left out; a flag wins over the
    file's key). None when neither is given. Errors name the flag or the file and key."""
    import yaml

    flags = {k: v for k, v in flags.items() if v is not None}
    if path is None and not flags:
        return None
    values: Any = {}
    if path is not None:
        try:
            values = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise PolicyError(f"--privacy-policy: {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise PolicyError(f"--privacy-policy: {path}: not YAML ({' '.join(str(e).split())})") from None
        values = {} if values is None else values
        if not isinstance(values, dict):
            raise PolicyError(f"--privacy-policy: {path}: the policy must be a mapping of keys to values")

    def name(key: str) -> str:
        if key in flags or path is None:
            return FLAGS.get(key, key)
        return f"--privacy-policy {path}: {key}"

    return make_policy({**values, **flags}, name)


def policy_json(policy: DevicePolicy) -> str:
    return json.dumps(policy.model_dump(), sort_keys=True)


def policy_file(policy: DevicePolicy, state_dir: str | os.PathLike) -> Path:
    """Where :func:`write_policy` puts ``policy``: ``<state_dir>/policy-<sha256 of its JSON>.json``
    (two clients sharing a state dir with different policies never overwrite each other's)."""
    return Path(state_dir) / f"policy-{hashlib.sha256(policy_json(policy).encode()).hexdigest()[:16]}.json"


def write_policy(policy: DevicePolicy, state_dir: str | os.PathLike) -> Path:
    """Write the resolved policy as JSON in ``state_dir`` (mode 0600, the directory 0700 when made
    here), at :func:`policy_file`; that path is what the SuperNode's node config carries."""
    text = policy_json(policy)
    Path(state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
    path = policy_file(policy, state_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def read_policy(path: str | os.PathLike) -> DevicePolicy:
    """The policy a ``fedasync client`` wrote (:func:`write_policy`)."""
    try:
        return make_policy(json.loads(Path(path).read_text()), lambda key: f"privacy-policy {path}: {key}")
    except (OSError, json.JSONDecodeError) as e:
        raise PolicyError(f"privacy-policy {path}: unreadable ({e})") from None


def device_id(state_dir: str | os.PathLike) -> str:
    """This device's own id: 128 random bits created once in ``<state_dir>/device-id`` (0600).

    It names the device's accountant file: nothing a server sends can change which file is used."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / DEVICE_ID_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
            raise PolicyError(f"privacy state {path}: not a device id ({text[:40]!r}); refusing to guess "
                              "which accountant is this device's") from None
        return text
    new = secrets.token_hex(16)
    with os.fdopen(fd, "w") as f:
        f.write(new + "\n")
    return new


def _num(pconf: dict, key: str) -> float | None:
    v = pconf.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def check_task(policy: DevicePolicy, pconf: Any) -> str | None:
    """The rule a task's privacy settings ``pconf`` break (one line), or None when the policy accepts them.

    Checked, in order: the task is local DP; it carries no ``history`` (a simulation field: a
    missing or reset history is never trusted) and no ``state_key`` (the device keys its own
    record); the accountant is the policy's; no ``reproducible_noise``; ``secure_mode`` only where
    torchcsprng is installed; a known ``grad_sample_mode``; a noise multiplier > 0 and at least
    ``min_noise_multiplier``; a sampling rate ``1/k`` for a whole ``k``, at most ``max_sample_rate``;
    whole ``steps`` >= 1; a clipping norm > 0 and at most ``max_grad_norm``; ``report_loss`` only
    with ``allow_report_loss``; a whole ``num_examples`` >= 1; the task's own epsilon (its steps
    alone, at the policy's delta) at most ``max_epsilon_per_task``."""
    if not isinstance(pconf, dict) or not pconf.get("local_dp"):
        return "the task is not local DP (privacy.local_dp is off): this device trains only with DP-SGD"
    if "history" in pconf:
        return "the task carries an accountant history (a simulation field): this device keeps its own record"
    if "state_key" in pconf:
        return "the task carries a state_key: this device keys its accountant by its own id"
    if pconf.get("accountant") != policy.accountant:
        return f"accountant {pconf.get('accountant')!r}: the policy's is {policy.accountant!r}"
    if pconf.get("reproducible_noise"):
        return "reproducible_noise: the noise would be derived from the seed the server sends"
    if pconf.get("secure_mode") and importlib.util.find_spec("torchcsprng") is None:
        return "secure_mode: true needs torchcsprng, which this device does not have"
    if pconf.get("grad_sample_mode", "ghost") not in GRAD_SAMPLE_MODES:
        return f"grad_sample_mode {pconf.get('grad_sample_mode')!r} is not one of {', '.join(GRAD_SAMPLE_MODES)}"
    sigma = _num(pconf, "noise_multiplier")
    if sigma is None or sigma <= 0:
        return f"noise_multiplier {pconf.get('noise_multiplier')!r}: DP-SGD needs noise > 0"
    if policy.min_noise_multiplier is not None and sigma < policy.min_noise_multiplier:
        return f"noise_multiplier {sigma:g} is below the policy's min_noise_multiplier {policy.min_noise_multiplier:g}"
    q = _num(pconf, "sample_rate")
    if q is None or not 0 < q <= 1 or 1.0 / round(1.0 / q) != q:
        return f"sample_rate {pconf.get('sample_rate')!r} is not 1/k for a whole number k"
    if policy.max_sample_rate is not None and q > policy.max_sample_rate:
        return f"sample_rate {q:g} is above the policy's max_sample_rate {policy.max_sample_rate:g}"
    steps = pconf.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        return f"steps {steps!r} is not a whole number >= 1"
    clip = _num(pconf, "max_grad_norm")
    if clip is None or clip <= 0:
        return f"max_grad_norm {pconf.get('max_grad_norm')!r} is not a number > 0"
    if policy.max_grad_norm is not None and clip > policy.max_grad_norm:
        return f"max_grad_norm {clip:g} is above the policy's max_grad_norm {policy.max_grad_norm:g}"
    if pconf.get("report_loss") and not policy.allow_report_loss:
        return "report_loss: the policy does not allow reporting the training loss (allow_report_loss: false)"
    n = pconf.get("num_examples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"num_examples {n!r} is not a whole number >= 1 (the server's planned record count)"
    if policy.max_epsilon_per_task is not None:
        from fedasync.privacy.budgets import epsilon_of

        eps = epsilon_of([(sigma, q, steps)], policy.delta, policy.accountant)
        if eps > policy.max_epsilon_per_task:
            return (f"one task costs epsilon {eps:.4g} (sigma {sigma:g}, q {q:g}, {steps} steps), above the "
                    f"policy's max_epsilon_per_task {policy.max_epsilon_per_task:g}")
    return None
