"""A server key that has no effect on the chosen strategy is refused (issue 34), one line naming it;
every key at its default is accepted under every strategy (a resolved config.yaml reloads), and
``--compare`` gives each entry only its own strategy's keys."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel

from fedasync.config import ConfigError, ServerConfig, config_from_dict, load_config
from fedasync.config_effect import APPLIES, applies_to

STRATEGIES = ("fedasync", "fedbuff", "fedavg")

#: a non-default value for every key of the table (each section: every one of its keys)
VALUES = {
    "alpha": 0.5, "buffer_size": 5, "server_lr": 1.5, "server_momentum": 0.9, "weighting": "uniform",
    "clients_per_round": 5, "backup_workers": 1, "staleness.fn": "constant", "staleness.a": 1.0,
    "staleness.b": 2.0, "max_staleness": 3, "delay_compensation.method": "dc_asgd",
    "delay_compensation.lambda": 0.1, "robust.aggregator": "median",
}

CASES = [(key, value, s) for key, value in VALUES.items() for s in STRATEGIES if s not in applies_to(key)]


def test_the_table_covers_every_value_and_section_key():
    sections = {k for k in APPLIES if "." not in k and isinstance(ServerConfig.model_fields[k].default, BaseModel)}
    for key in APPLIES:
        if key in sections:
            fields = type(ServerConfig.model_fields[key].default).model_fields  # the section's class
            assert {f"{key}.{f.alias or n}" for n, f in fields.items()} <= set(VALUES), key
        else:
            assert key in VALUES, key


@pytest.mark.parametrize("key,value,strategy", CASES, ids=[f"{k}-{s}" for k, _, s in CASES])
def test_a_key_with_no_effect_on_the_strategy_is_refused_naming_it(key, value, strategy):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"server.strategy={strategy}", f"server.{key}={value}"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"server.{key}: ") and strategy in msg
    if key not in ("robust.aggregator", "delay_compensation.method"):  # older checks word those two
        assert msg == (f"server.{key}: has no effect under {strategy} "
                       f"(it applies to {' and '.join(applies_to(key))})")


@pytest.mark.parametrize("key,value", list(VALUES.items()))
def test_the_same_key_is_accepted_where_it_applies(key, value):
    for strategy in applies_to(key):
        if (key, strategy) == ("staleness.fn", "fedbuff"):
            continue
        cfg = load_config(None, [f"server.strategy={strategy}", f"server.{key}={value}"])
        node = cfg.server
        for part in key.replace("lambda", "lambda_").split("."):
            node = getattr(node, part)
        assert node == value


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_key_written_out_at_its_default_loads_under_every_strategy(strategy):
    raw = load_config().model_dump(mode="json")
    raw["server"] = ServerConfig(strategy=strategy).model_dump(mode="json")  # every key, at its default
    assert config_from_dict(raw).server.strategy == strategy


def test_adaptive_staleness_is_refused_under_fedbuff_only():
    with pytest.raises(ConfigError, match=r"^server\.staleness\.fn: adaptive is refused under fedbuff: .*versions"):
        load_config(None, ["server.staleness.fn=adaptive"])
    assert load_config(None, ["server.strategy=fedasync", "server.staleness.fn=adaptive"]).server.staleness.fn \
        == "adaptive"


def test_a_resolved_config_yaml_of_a_fedavg_run_reloads(tmp_path):
    import fedasync

    r = fedasync.simulate(None, set={"data.num_clients": 8, "server.strategy": "fedavg", "server.concurrency": 4,
                                     "server.clients_per_round": 3, "server.backup_workers": 1,
                                     "server.max_versions": 2, "server.max_virtual_time": None,
                                     "train.local_steps": 1, "model.hidden": 8}, out=tmp_path / "run")
    written = r.run_dir / "config.yaml"
    cfg = load_config(written)
    assert cfg.server.strategy == "fedavg" and cfg.server.backup_workers == 1
    assert cfg == config_from_dict(yaml.safe_load(written.read_text()))


def test_compare_resets_the_keys_of_the_other_strategies():
    from fedasync.api import compare_configs

    base = load_config(None, ["server.buffer_size=5", "server.server_lr=1.5", "server.max_staleness=3"])
    cfgs = dict(compare_configs("fedavg,fedbuff,fedasync:alpha=0.5", base))
    assert (cfgs["fedbuff"].server.buffer_size, cfgs["fedbuff"].server.server_lr) == (5, 1.5)
    assert (cfgs["fedavg"].server.buffer_size, cfgs["fedavg"].server.server_lr) == (10, 1.5)
    assert cfgs["fedavg"].server.max_staleness is None and cfgs["fedbuff"].server.max_staleness == 3
    assert cfgs["fedasync-alpha=0.5"].server.server_lr == 1.0 and cfgs["fedasync-alpha=0.5"].server.alpha == 0.5
    assert all(c.data == base.data and c.clock == base.clock for c in cfgs.values())


def test_compare_still_refuses_a_key_that_applies_to_none_of_its_entries():
    from fedasync.api import compare_configs

    base = load_config(None, ["server.buffer_size=5"])
    with pytest.raises(ConfigError) as e:
        compare_configs("fedavg,fedasync", base)
    assert str(e.value) == ("--compare fedavg: server.buffer_size: has no effect under fedavg "
                            "(it applies to fedbuff)")
    with pytest.raises(ConfigError, match=r"^--compare fedavg:alpha=0\.5: server\.alpha: has no effect under fedavg"):
        compare_configs("fedbuff,fedavg:alpha=0.5", load_config())


def test_compare_on_the_quickstart_runs_every_strategy(tmp_path):
    import fedasync

    out = fedasync.compare(None, "fedavg,fedbuff,fedasync",
                           set={"data.num_clients": 10, "server.concurrency": 4, "server.buffer_size": 3,
                                "server.max_versions": 3, "server.max_virtual_time": None, "train.local_steps": 1,
                                "model.hidden": 8},
                           out=tmp_path / "cmp")
    assert set(out["results"]) == {"fedavg", "fedbuff", "fedasync"}
    for label, r in out["results"].items():
        assert r.summary["strategy"] == label and r.summary["versions"] == 3
    assert (out["run_dir"] / "comparison.json").is_file()
