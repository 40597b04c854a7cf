"""Which ``server`` keys act on which strategy, and the check that refuses a key with no effect.

A key listed in :data:`APPLIES` whose value differs from its default under a strategy it does not
apply to is refused with one line naming it (``server.alpha: has no effect under fedbuff (it
applies to fedasync)``): a value that would be silently ignored is a mistake in the config or in
the reader's understanding of it. A key at its default is accepted whatever the strategy, so a
resolved ``config.yaml`` (every key written out at its default) loads again. The table follows the
code: :func:`fedasync.server.strategies.make_strategy`'s builders, the validator's ``stale``
check, the policy's delay compensation (a fedavg update is never stale, so DC-ASGD's correction
is 0) and the robust aggregators (fedbuff's buffer only). Pure: imports nothing of fedasync.
"""

from __future__ import annotations

from typing import Any, Iterator

#: ``server`` key (dotted below ``server``; a section: each of its keys) -> the strategies it acts on
APPLIES: dict[str, tuple[str, ...]] = {
    "alpha": ("fedasync",),
    "buffer_size": ("fedbuff",),
    "server_lr": ("fedbuff", "fedavg"),
    "server_momentum": ("fedbuff", "fedavg"),
    "weighting": ("fedbuff", "fedavg"),
    "clients_per_round": ("fedavg",),
    "backup_workers": ("fedavg",),
    "staleness": ("fedasync", "fedbuff"),
    "max_staleness": ("fedasync", "fedbuff"),
    "delay_compensation": ("fedasync", "fedbuff"),
    "robust.aggregator": ("fedbuff",),
}

ADAPTIVE_UNDER_FEDBUFF = (
    "server.staleness.fn: adaptive is refused under fedbuff: its weight min(1, concurrency / (s + 1)) "
    "assumes staleness counted in updates, fedbuff counts it in versions of buffer_size updates, so it "
    "stays 1 (as constant) unless an update is concurrency versions old; use constant, polynomial, hinge "
    "or exponential")


def applies_to(key: str) -> tuple[str, ...] | None:
    """The strategies a ``server`` key (``alpha``, ``staleness.fn``, ...) acts on; None: all of them."""
    for k, strategies in APPLIES.items():
        if key == k or key.startswith(k + "."):
            return strategies
    return None


def _walk(node: Any, path: str) -> Any:
    for part in path.split("."):
        node = getattr(node, part)
    return node


def _default(server: Any, path: str) -> Any:
    """The default of ``server.<path>`` (a section's default instance for a section)."""
    head, *rest = path.split(".")
    node = type(server).model_fields[head].default
    for part in rest:
        node = getattr(node, part)
    return node


def _leaves(server: Any, key: str) -> Iterator[tuple[str, Any, Any]]:
    """``(dotted name as in YAML, value, default)`` for ``key``, or for each key of a section."""
    value, default = _walk(server, key), _default(server, key)
    fields = getattr(type(value), "model_fields", None)
    if fields is None:
        yield key, value, default
        return
    for name, f in fields.items():
        yield f"{key}.{f.alias or name}", getattr(value, name), getattr(default, name)


def no_effect(server: Any) -> str | None:
    """The line refusing the first key of ``server`` (a ``ServerConfig``) set away from its default
    that has no effect under ``server.strategy``, else None; also ``adaptive`` under fedbuff."""
    strategy = server.strategy
    for key, strategies in APPLIES.items():
        if strategy in strategies:
            continue
        for name, value, default in _leaves(server, key):
            if value != default:
                return (f"server.{name}: has no effect under {strategy} "
                        f"(it applies to {' and '.join(strategies)})")
    if strategy == "fedbuff" and server.staleness.fn == "adaptive":
        return ADAPTIVE_UNDER_FEDBUFF
    return None


def reset_inapplicable(server: dict[str, Any], strategy: str, compared: list[str]) -> None:
    """In a raw ``server`` section (a dict, changed in place): remove the keys that do not apply to
    ``strategy`` but do to another of ``compared`` (``--compare``: each entry keeps only its own
    strategy's keys, at their defaults otherwise). A key that applies to none of ``compared`` stays
    (and is refused when it is away from its default)."""
    for key, strategies in APPLIES.items():
        if strategy in strategies or not any(s in strategies for s in compared):
            continue
        *parents, last = key.split(".")
        node: Any = server
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
