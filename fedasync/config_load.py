"""Loading a config's raw YAML: reading the file, ``--set`` overrides, client sets. No pydantic.

:mod:`fedasync.config` validates what these return and re-exports every name here, so
``from fedasync.config import apply_overrides`` keeps working.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config: the message is one line, starting with the key path."""


def packaged_example(name: str = "quickstart") -> Path:
    """Path of a YAML file shipped inside the package (fedasync/examples/NAME.yaml)."""
    ref = resources.files("fedasync") / "examples" / f"{name}.yaml"
    return Path(str(ref))


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected KEY=VALUE")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item}: bad key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(path[: i + 1])}: is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return raw


def parse_client_set(spec: str, num_clients: int | None = None, key: str = "privacy.overrides.clients") -> set[int]:
    """'0-9', '3,5,7', '0-4,10' -> a set of client ids. Errors name ``key``."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ConfigError(f"{key}: bad client set {spec!r}") from None
    if num_clients is not None and any(c >= num_clients or c < 0 for c in out):
        raise ConfigError(f"{key}: {spec!r} names a client outside 0-{num_clients - 1}")
    return out
