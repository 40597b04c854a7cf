"""The CLI end to end, in-process backend: outputs, --compare, `fedasync runs`."""

import json

from typer.testing import CliRunner

from conftest import SMALL
from fedasync.cli import app


def _sets():
    out = []
    for s in SMALL:
        out += ["--set", s]
    return out


def test_simulate_compare_writes_each_summary_and_the_comparison(tmp_path):
    out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *_sets(),
                                 "--set", "server.target_accuracy=0.5", "--set", "server.max_versions=15",
                                 "--compare", "fedavg,fedbuff,fedavg:backup_workers=2"])
    assert r.exit_code == 0, r.output
    labels = ["fedavg", "fedbuff", "fedavg-backup_workers=2"]
    summaries = {lbl: json.loads((out / lbl / "summary.json").read_text()) for lbl in labels}
    for lbl in labels:
        for f in ("history.csv", "accuracy.png", "config.yaml", "fedasync.db"):
            assert (out / lbl / f).is_file()
    assert summaries["fedavg-backup_workers=2"]["backup_workers"] == 2
    # identical scenario: same seed and clients, different strategies
    assert {s["seed"] for s in summaries.values()} == {0}
    assert summaries["fedavg"]["strategy"] == "fedavg" and summaries["fedbuff"]["strategy"] == "fedbuff"
    comp = json.loads((out / "comparison.json").read_text())
    assert list(comp["strategies"]) == labels
    t0 = summaries["fedavg"]["time_to_target_s"]
    for lbl in labels:
        t = summaries[lbl]["time_to_target_s"]
        expected = None if t is None or t0 is None else t0 / t
        assert comp["time_to_target_ratio"][lbl] == expected
    assert (out / "comparison.png").is_file()
    assert "time-to-target ratio" in r.output

    # `fedasync runs` lists a store's runs
    store_url = summaries["fedbuff"]["store_url"]
    r2 = CliRunner().invoke(app, ["runs", "--store", store_url])
    assert r2.exit_code == 0 and "fedbuff" in r2.output and "finished" in r2.output


def test_runs_on_a_missing_store_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(app, ["runs", "--store", f"sqlite:///{tmp_path}/nope.db"])
    assert r.exit_code == 2 and "no database" in r.output


def test_runs_without_store_lists_the_run_directories_here(tmp_path, monkeypatch):
    """`fedasync runs` with no --store reads ./fedasync.db and every runs/*/fedasync.db (where
    simulate and server write by default: the old default, ./fedasync.db alone, found none of
    them); a store it cannot read is skipped with a line, and nothing is created."""
    from fedasync.store import Store

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["runs"])
    assert r.exit_code == 2 and "no store here" in r.output and list(tmp_path.iterdir()) == []
    for d, strategy in (("quickstart-20261206-000001", "fedbuff"), ("mnist-20261206-000002", "fedasync")):
        (tmp_path / "runs" / d).mkdir(parents=True)
        st = Store(f"sqlite:///{tmp_path / 'runs' / d / 'fedasync.db'}")
        st.set_run_status(st.create_run(d.split("-")[0], strategy, 0, "", "simulation"), "finished",
                          summary={"final_accuracy": 0.5})
        st.close()
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "fedasync.db").write_text("junk")
    r = CliRunner().invoke(app, ["runs"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rows = {ln.split()[0]: ln.split() for ln in r.output.splitlines() if "-2026" in ln}
    assert rows["quickstart-20261206-000001"][1:6] == ["1", "fedbuff", "simulation", "finished", "0"]
    assert rows["mnist-20261206-000002"][2] == "fedasync" and rows["mnist-20261206-000002"][6] == "0.5000"
    assert "skipped broken:" in r.output and "not an SQLite database" in r.output
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["broken", "mnist-20261206-000002",
                                                                     "quickstart-20261206-000001"]


def test_server_refuses_reproducible_noise_before_starting_anything(tmp_path, monkeypatch):
    from fedasync.config import packaged_example

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["server", str(packaged_example("privacy")), "--insecure",
                                 "--set", "privacy.reproducible_noise=true"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: privacy.reproducible_noise: true derives the DP noise")
    assert list(tmp_path.iterdir()) == []  # no run directory, no SuperLink
