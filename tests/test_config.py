"""Config: one pydantic schema, --set overrides, and bad input that stops before anything runs."""

import os

import pytest
from typer.testing import CliRunner

from fedasync.cli import app
from fedasync.config import ConfigError, load_config, packaged_example, parse_client_set


def test_packaged_quickstart_matches_the_issue():
    cfg = load_config()
    assert packaged_example().is_file()
    assert (cfg.data.dataset, cfg.data.num_clients, cfg.data.partitioner, cfg.data.alpha) == ("digits", 100, "dirichlet", 0.5)
    assert (cfg.clock.sigma, cfg.server.concurrency, cfg.model.name) == (1.0, 20, "mlp")
    assert (cfg.train.local_steps, cfg.train.batch_size) == (10, 16)
    assert (cfg.server.strategy, cfg.server.buffer_size) == ("fedbuff", 10)
    assert (cfg.server.staleness.fn, cfg.server.staleness.a) == ("polynomial", 0.5)
    assert cfg.server.target_accuracy == 0.90


def test_set_overrides_any_key_with_typed_values():
    cfg = load_config(None, ["server.concurrency=7", "clock.sigma=0.25", "server.max_staleness=3",
                             "server.staleness.fn=hinge", "name=x y"])
    assert cfg.server.concurrency == 7 and cfg.clock.sigma == 0.25 and cfg.server.max_staleness == 3
    assert cfg.server.staleness.fn == "hinge" and cfg.name == "x y"


@pytest.mark.parametrize("override, message", [
    ("server.bogus=1", "server.bogus: unknown key"),
    ("bogus.key=1", "bogus: unknown key"),
    ("server.concurrency=abc", "server.concurrency: Input should be a valid integer"),
    ("server.concurrency=-3", "server.concurrency: Input should be greater than 0"),
    ("server.buffer_size=101", "server.buffer_size: 101 is larger than data.num_clients (100)"),
    ("server.strategy=fedprox", "server.strategy: Input should be"),
    ("data.alpha=0", "data.alpha: Input should be greater than 0"),
    ("train.prox_rho=-0.1", "train.prox_rho: Input should be greater than or equal to 0"),
    ("server.scheduler.name=round_robin", "server.scheduler.name: Input should be 'uniform', 'fair', 'fastest', "
                                          "'staleness_aware' or 'budget_aware'"),
    ("server.scheduler.explore=1.5", "server.scheduler.explore: Input should be less than or equal to 1"),
    ("server.scheduler.bogus=1", "server.scheduler.bogus: unknown key"),
    ("server.delay_compensation.method=dc", "server.delay_compensation.method: Input should be 'none' or 'dc_asgd'"),
    ("server.delay_compensation.lambda=-1", "server.delay_compensation.lambda: Input should be greater than or equal to 0"),
    ("server.staleness.fn=linear", "server.staleness.fn: Input should be 'constant', 'polynomial', 'hinge', "
                                   "'exponential' or 'adaptive'"),
    ("server.robust.filter=zeno", "server.robust.filter: Input should be 'none', 'zeno++', 'kardam' or 'norm'"),
    ("server.robust.aggregator=krum", "server.robust.aggregator: Input should be 'mean', 'median', 'trimmed_mean' "
                                      "or 'centered_clip'"),
    ("server.robust.trim=0.5", "server.robust.trim: Input should be less than 0.5"),
    ("server.robust.warmup=200", "server.robust.warmup: 200 is larger than window (100)"),
    ("server.robust.norm_multiplier=1", "server.robust.norm_multiplier: Input should be greater than 1"),
    ("attack.kind=sign_flip", "attack.fraction: give exactly one of attack.fraction and attack.clients"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_bad_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("server: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_client_sets():
    assert parse_client_set("0-3,7") == {0, 1, 2, 3, 7}
    with pytest.raises(ConfigError):
        parse_client_set("5-2")
    with pytest.raises(ConfigError):
        parse_client_set("0-10", num_clients=5)


GDP_LOCAL = ["--set", "privacy.local_dp.enabled=true", "--set", "privacy.local_dp.epsilon=3",
             "--set", "privacy.local_dp.accountant=gdp"]
GDP_CENTRAL = ["--set", "privacy.central_dp.enabled=true", "--set", "privacy.central_dp.accountant=gdp"]


@pytest.mark.parametrize("args, key", [
    (GDP_LOCAL, "privacy.local_dp.accountant: gdp"),
    (GDP_CENTRAL, "privacy.central_dp.accountant: gdp"),
    (["--set", "server.bogus=1"], "server.bogus"),
    (["--set", "server.concurrency=abc"], "server.concurrency"),
    (["--set", "server.concurrency=-1"], "server.concurrency"),
    (["--set", "server.buffer_size=500"], "server.buffer_size"),
    (["--compare", "fedavg,nope"], "server.strategy"),
    (["--set", "server.scheduler.name=rr"], "server.scheduler.name"),
    (["--compare", "fedbuff,fedbuff:scheduler.name=rr"], "server.scheduler.name"),
    (["--compare", "fedbuff:delay_compensation.method=x"], "server.delay_compensation.method"),
    (["--set", "server.robust.filter=krum"], "server.robust.filter"),
    (["--set", "attack.kind=poison", "--set", "attack.fraction=0.2"], "attack.kind"),
])
def test_cli_bad_config_exits_2_and_writes_nothing(tmp_path, monkeypatch, args, key):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and key in lines[0], result.output
    assert os.listdir(tmp_path) == []  # no out dir, no runs/, no database


@pytest.mark.parametrize("name", ["quickstart", "privacy", "edge", "postgres"])
def test_every_packaged_example_is_valid(name):
    assert packaged_example(name).is_file()
    load_config(packaged_example(name))


def test_gdp_is_refused_wherever_it_would_enforce_calibrate_or_account():
    msg = ("gdp is Opacus' Gaussian-DP accountant, a central-limit approximation that can underestimate epsilon; "
           "fedasync does not enforce budgets, calibrate noise or account a run with it: use rdp or prv")
    for sets, key in ((GDP_LOCAL, "privacy.local_dp.accountant"), (GDP_CENTRAL, "privacy.central_dp.accountant")):
        with pytest.raises(ConfigError) as e:
            load_config(None, sets[1::2])
        assert str(e.value) == f"{key}: {msg}"
    # off, gdp names nothing that runs: accepted
    load_config(None, ["privacy.local_dp.accountant=gdp", "privacy.central_dp.accountant=gdp"])
    r = CliRunner().invoke(app, ["privacy", "plan", str(packaged_example("privacy")),
                                 "--set", "privacy.local_dp.accountant=gdp"])
    assert r.exit_code == 2 and "privacy.local_dp.accountant: gdp" in r.output


def test_reproducible_noise_defaults_off_and_cannot_hold_with_secure_mode():
    cfg = load_config(packaged_example("privacy"))
    assert cfg.privacy.reproducible_noise is False and cfg.privacy.local_dp.report_loss is False
    assert cfg.train.prox_rho == 0.0
    with pytest.raises(ConfigError, match=r"^privacy.reproducible_noise: true cannot hold with "
                                          r"privacy.local_dp.secure_mode: true"):
        load_config(packaged_example("privacy"), ["privacy.reproducible_noise=true",
                                                  "privacy.local_dp.secure_mode=true"])


def test_scheduler_delay_robust_and_attack_sections():
    cfg = load_config()
    assert cfg.server.scheduler.name == "uniform" and cfg.server.scheduler.explore == 0.1
    assert cfg.server.delay_compensation.method == "none" and cfg.server.delay_compensation.lambda_ == 0.04
    assert cfg.server.robust.filter == "none" and cfg.server.robust.aggregator == "mean"
    assert cfg.attack is None
    cfg = load_config(None, ["server.scheduler.name=fastest", "server.scheduler.beta=2",
                             "server.delay_compensation.method=dc_asgd", "server.delay_compensation.lambda=0.1",
                             "server.staleness.fn=hinge", "server.robust.filter=zeno++",
                             "server.robust.aggregator=median", "attack.kind=label_flip", "attack.clients=0-9"])
    assert (cfg.server.scheduler.name, cfg.server.scheduler.beta) == ("fastest", 2.0)
    assert cfg.server.delay_compensation.lambda_ == 0.1
    assert cfg.server.robust.filter == "zeno++" and cfg.attack.clients == "0-9"
    # the YAML a run writes uses the key ``lambda`` and loads back to the same config
    raw = cfg.model_dump(mode="json")
    assert raw["server"]["delay_compensation"] == {"method": "dc_asgd", "lambda": 0.1}
    from fedasync.config import config_from_dict

    assert config_from_dict(raw) == cfg
    assert "lambda: 0.1" in cfg.to_yaml()


@pytest.mark.parametrize("sets, message", [
    (["server.strategy=fedasync", "server.robust.aggregator=median"],
     "server.robust.aggregator: median needs server.strategy fedbuff (got fedasync)"),
    (["server.robust.aggregator=trimmed_mean", "privacy.central_dp.enabled=true"],
     "server.robust.aggregator: trimmed_mean cannot be combined with privacy.central_dp"),
    (["server.strategy=fedavg", "server.delay_compensation.method=dc_asgd"],
     "server.delay_compensation.method: applies to fedasync and fedbuff, not fedavg"),
    (["attack.kind=scale", "attack.clients=0-100"], "attack.clients: '0-100' names a client outside 0-99"),
])
def test_cross_checks_name_the_key(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
