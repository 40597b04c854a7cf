"""No secret travels to devices or lies open on disk (issue 32).

The store URL (password included) stays with the server: the run config ``fedasync server``
submits to Flower (which every SuperNode gets, merged into its ClientApp's ``run_config``) and
the messages the server sends carry neither the URL nor the password. What a run writes (run
directory, config, summaries, status file, store) is 0700/0600 whatever the umask, and a URL
with a password is shown masked in summaries, status files and printed lines.

A PostgreSQL URL with a password stands for the store; :func:`_pg_store` opens a SQLite file in
its place (no database server is needed), the URL the run sees being the PostgreSQL one.
"""

from __future__ import annotations

import io
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import SMALL, small_config
from tests.test_deploy import in_a_flower_run  # noqa: F401  (a fixture)

SECRET = "pw-S3cret-never-shipped"
HOST = "db.example.invalid"
PG_URL = f"postgresql+psycopg://fedasync:{SECRET}@{HOST}:5432/fedasync"
MASKED = f"postgresql+psycopg://fedasync:***@{HOST}:5432/fedasync"


@pytest.fixture
def umask_022():
    """The usual umask (files 0644, directories 0755): the modes below must not come from it."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _pg_store(monkeypatch, db: Path) -> None:
    """``Store(PG_URL)`` opens the SQLite file ``db``; its ``url`` stays ``PG_URL``."""
    import fedasync.store as store_pkg

    real = store_pkg.Store

    class PgStandIn(real):
        def __init__(self, url: str, create: bool = True):
            super().__init__(f"sqlite:///{db}" if url == PG_URL else url, create)
            self.url = url

    monkeypatch.setattr(store_pkg, "Store", PgStandIn)


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything below it, by relative path."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def _assert_private(root: Path) -> None:
    modes = _modes(root)
    loose = {p: oct(m) for p, m in modes.items()
             if m != (0o700 if (root / p).is_dir() else 0o600)}
    assert not loose, f"not 0700 (directories) / 0600 (files): {loose}"


def _submitted(tmp_path: Path, monkeypatch, cfg) -> tuple:
    """A ``fedasync server`` run on an external SuperLink, stopped at ``flwr run``: the server run,
    the app directory and the run-config file it submitted."""
    from fedasync.deploy.run import TLS, ServerRun

    monkeypatch.delenv("FLWR_HOME", raising=False)
    r = ServerRun(cfg, tmp_path / "run", resume=None, host="127.0.0.1", port=1, superlink="127.0.0.1:2",
                  tls=TLS(insecure=True), auth_keys={}, public_keys={}, say=lambda m: None, warn=lambda m: None)
    submitted = []
    monkeypatch.setattr(r.fed, "submit", lambda app_dir, rc: submitted.append((Path(app_dir), Path(rc))) or 5)
    r.start()
    assert r.flower_run == 5 and len(submitted) == 1
    return (r, *submitted[0])


def _what_supernodes_get(app_dir: Path, rc: Path) -> tuple[dict, bytes]:
    """What Flower gives every SuperNode for this run: the run config its ClientApp sees
    (the app's defaults fused with the overrides ``flwr run --run-config`` parses from ``rc``,
    as GetRun hands them out) and the app bundle (FAB) it fetches."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import get_fused_config_from_fab, parse_config_args
    from flwr.supercore.run import Run

    fab = build_fab_from_disk(app_dir)
    run = Run.create_empty(5)
    run.override_config = parse_config_args([str(rc)])
    return get_fused_config_from_fab(fab, run), fab


def _deploy_cfg(*more: str):
    return small_config("data.num_clients=2", "server.concurrency=2", "server.buffer_size=1",
                        "server.max_versions=2", "server.eval_every=1", f"store.url={PG_URL}", *more)


def test_the_run_config_every_supernode_gets_holds_no_store_url(tmp_path, monkeypatch, umask_022):
    r, app_dir, rc = _submitted(tmp_path, monkeypatch, _deploy_cfg())
    run_config, fab = _what_supernodes_get(app_dir, rc)
    shipped = json.dumps(run_config)
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        shipped += "".join(z.read(n).decode(errors="replace") for n in z.namelist())
    for secret in (SECRET, HOST, "postgresql", "config_yaml", "store"):
        assert secret not in shipped, secret
    assert set(run_config) == {"job"} and set(json.loads(run_config["job"])) == {"job_file", "sha256"}
    # the ServerApp still gets the whole job, from the server-only file the run config names
    from fedasync.deploy.run import JOB_FILE, read_job

    job = read_job(run_config["job"])
    assert PG_URL in job["config_yaml"] and job["out"] == str(r.out)
    assert json.loads(run_config["job"])["job_file"] == str(r.out / JOB_FILE)
    _assert_private(r.out)  # run directory, job file, run-config.toml, Flower's home


def test_the_job_file_must_be_the_one_submitted(tmp_path, monkeypatch):
    from fedasync.deploy.run import read_job

    r, app_dir, rc = _submitted(tmp_path, monkeypatch, _deploy_cfg())
    ref = _what_supernodes_get(app_dir, rc)[0]["job"]
    job_file = Path(json.loads(ref)["job_file"])
    job_file.write_text(job_file.read_text().replace("fedasync", "other", 1))
    with pytest.raises(RuntimeError, match="not the job that was submitted"):
        read_job(ref)
    with pytest.raises(RuntimeError, match="names no job file"):
        read_job(json.dumps({"config_yaml": "store: {url: x}"}))  # an inline job is not run


class DevicesGrid:
    """Flower's Grid as the deployment ServerApp sees it, with ``n`` devices: each answers the
    hello as a SuperNode with ``partition-id`` i does, and trains (the real client handler) what
    it is sent. ``sent`` keeps every message the server pushed."""

    def __init__(self, n: int):
        self.n, self.sent, self.replies, self.count = n, [], {}, 0

    def get_node_ids(self):
        return [100 + i for i in range(self.n)]

    def push_messages(self, msgs):
        from types import SimpleNamespace as NS

        from flwr.app import ConfigRecord, RecordDict

        from fedasync.clients.runner import handle_train
        from fedasync.wire import record_to_params, reply_content

        ids = []
        for m in msgs:
            self.sent.append(m)
            self.count += 1
            mid = f"m{self.count}"
            c = m.metadata.dst_node_id - 100
            if m.metadata.message_type == "query":
                info = {"partition_id": c, "num_partitions": self.n, "public_key": "", "device": "cpu"}
                content = RecordDict({"hello": ConfigRecord({"json": json.dumps(info)})})
            else:
                config = json.loads(m.content["task"]["json"])
                config.pop("deployment")  # trained on the federation's partition c, not a device's own files
                content = reply_content(handle_train(record_to_params(m.content["params"]), config))
            self.replies[mid] = NS(metadata=NS(reply_to_message_id=mid), has_error=lambda: False, content=content)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in ids if i in self.replies]


def _text(content) -> str:
    """Every config value of a message's content, as text (the arrays are model parameters)."""
    from flwr.app import ConfigRecord

    return " ".join(str(v) for rec in content.values() if isinstance(rec, ConfigRecord) for v in rec.values())


def test_a_deployment_ships_no_secret_and_keeps_its_files_private(tmp_path, monkeypatch, umask_022,
                                                                  in_a_flower_run):  # noqa: F811
    from flwr.app import Context, RecordDict

    from fedasync.server.app import deploy_main

    r, app_dir, rc = _submitted(tmp_path, monkeypatch, _deploy_cfg())
    run_config, _ = _what_supernodes_get(app_dir, rc)
    _pg_store(monkeypatch, r.out / "pg-stand-in.db")
    grid = DevicesGrid(2)
    # the ServerApp as Flower starts it: the run config the SuperLink holds, nothing else
    deploy_main(grid, Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))

    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count("query") == 2 and kinds.count("train") >= 2
    for m in grid.sent:  # what reaches each device's ClientApp
        text = _text(m.content)
        assert SECRET not in text and HOST not in text and "postgresql" not in text, m.metadata.message_type
        assert "central_dp" not in text and "overrides" not in text  # no server-only setting either
    status = json.loads((r.out / "server-status.json").read_text())
    summary = json.loads((r.out / "summary.json").read_text())
    assert status["state"] == "done" and status["store_url"] == MASKED
    assert summary["store_url"] == MASKED
    for f in ("server-status.json", "summary.json", "server.log", "history.csv"):
        assert SECRET not in (r.out / f).read_text(), f
    assert PG_URL in (r.out / "config.yaml").read_text()  # the record of the run: whole, and 0600
    _assert_private(r.out)  # the store (and its -wal/-shm), config.yaml, status, plots, logs
    # `fedasync server` follows the run through the store it opens itself, not the masked URL
    followed = r.follow(lambda ev: None, lambda: 0)
    assert followed is not None and followed["store_url"] == MASKED


def test_a_simulated_run_directory_is_private(tmp_path, umask_022):
    from fedasync.cli import app

    out = tmp_path / "sim"
    sets = [a for s in SMALL for a in ("--set", s)]
    # a hidden layer of 1100: the model's parameters (> 256 KiB) go to files beside the store
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *sets,
                                 "--set", "server.max_versions=2", "--set", "model.hidden=1100"])
    assert r.exit_code == 0, r.output
    modes = _modes(out)
    assert "fedasync.db" in modes and "summary.json" in modes and "config.yaml" in modes
    assert any(p.startswith("fedasync.db-params/") for p in modes), sorted(modes)
    _assert_private(out)


def test_a_simulated_run_masks_the_store_password(tmp_path, monkeypatch, umask_022):
    from fedasync.cli import app

    _pg_store(monkeypatch, tmp_path / "pg-stand-in.db")
    import fedasync.store.opening as opening

    monkeypatch.setattr(opening, "probe_store", lambda url, key, must_exist=False: None)  # no server here
    out = tmp_path / "cmp"
    sets = [a for s in SMALL for a in ("--set", s)]
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *sets,
                                 "--set", "server.max_versions=2", "--set", f"store.url={PG_URL}",
                                 "--compare", "fedasync,fedbuff"])
    assert r.exit_code == 0, r.output
    assert SECRET not in r.output and MASKED in r.output.replace("\n", "")
    for label in ("fedasync", "fedbuff"):
        assert json.loads((out / label / "summary.json").read_text())["store_url"] == MASKED
        assert SECRET not in (out / label / "summary.json").read_text()
    comparison = (out / "comparison.json").read_text()
    assert SECRET not in comparison and MASKED in comparison
    _assert_private(out)


def test_a_new_sqlite_store_is_private(tmp_path, umask_022):
    from fedasync.store.opening import open_store

    st = open_store(f"sqlite:///{tmp_path / 's.db'}", "--store")
    st.close()
    assert stat.S_IMODE((tmp_path / "s.db").stat().st_mode) == 0o600


def test_masked_urls_hide_only_the_password():
    from fedasync.private import mask_url
    from fedasync.store.opening import shown

    assert mask_url(PG_URL) == MASKED == shown(PG_URL)
    assert mask_url("sqlite:////tmp/x/fedasync.db") == "sqlite:////tmp/x/fedasync.db"
    assert mask_url("postgresql://u@h/db") == "postgresql://u@h/db" and mask_url(None) is None


# -- server-less runs (ledger, gossip) ------------------------------------------------------------

LEDGER_SMALL = ["data.num_clients=3", "server.concurrency=3", "server.buffer_size=2", "train.local_steps=2",
                "server.eval_every=1"]


def _pg_stand_in(monkeypatch, db: Path):
    """``serverless.runs.open_store(PG_URL)`` opens the SQLite file ``db``; the store's ``url`` stays
    ``PG_URL`` (what every summary, line and error would show)."""
    import fedasync.serverless.runs as runs
    from fedasync.store import Store

    def open_store(url, must_exist=False):
        st = Store(f"sqlite:///{db}" if url == PG_URL else url)
        st.url = url
        return st

    monkeypatch.setattr(runs, "open_store", open_store)
    import fedasync.cli.common as common

    monkeypatch.setattr(common, "check_store_or_exit", lambda url, key, must_exist=False: None)  # no server here


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
def test_a_serverless_run_masks_the_store_password_and_keeps_its_directory_private(kind, tmp_path, monkeypatch,
                                                                                   umask_022):
    from fedasync.cli import app

    _pg_stand_in(monkeypatch, tmp_path / "pg-stand-in.db")
    out = tmp_path / "run"
    sets = [a for s in SMALL + LEDGER_SMALL for a in ("--set", s)]
    r = CliRunner().invoke(app, [kind, "run", "--virtual", "--peers", "3", "--max-steps", "2", "--out", str(out),
                                 "--store", PG_URL, *sets])
    assert r.exit_code == 0, r.output
    printed = r.output.replace("\n", "")
    assert SECRET not in printed and MASKED in printed  # `; store ...` (and the ledger's `verify with: --store ...`)
    if kind == "ledger":
        assert f"verify with: fedasync ledger verify --store {MASKED}" in printed
    summary = (out / "summary.json").read_text()
    assert SECRET not in summary and json.loads(summary)["store_url"] == MASKED
    _assert_private(out)  # run directory 0700; summary, history, plots, config 0600


def test_a_serverless_run_directory_with_its_store_is_private(tmp_path, umask_022):
    from fedasync.cli import app

    out = tmp_path / "run"
    sets = [a for s in SMALL + LEDGER_SMALL for a in ("--set", s)]
    r = CliRunner().invoke(app, ["ledger", "run", "--virtual", "--peers", "3", "--max-steps", "2", "--out", str(out),
                                 *sets])
    assert r.exit_code == 0, r.output
    assert "fedasync.db" in _modes(out)
    _assert_private(out)  # the store (default <out>/fedasync.db) too


def test_serverless_errors_mask_the_store_password(tmp_path):
    from fedasync.serverless.common import ServerlessError
    from fedasync.serverless.runs import find_run
    from fedasync.store import Store

    st = Store(f"sqlite:///{tmp_path / 's.db'}")
    st.url = PG_URL
    for kind in ("ledger", "gossip"):
        with pytest.raises(ServerlessError) as e:
            find_run(st, kind, 7, running_only=False)
        assert SECRET not in str(e.value) and MASKED in str(e.value)
    with pytest.raises(KeyError) as e:  # the store's own message
        st.get_run(7)
    assert SECRET not in str(e.value) and MASKED in str(e.value)


def test_privacy_report_errors_mask_the_store_password(tmp_path, monkeypatch):
    import fedasync.cli.privacy as privacy
    from fedasync.cli import app
    from fedasync.store import Store

    st = Store(f"sqlite:///{tmp_path / 's.db'}")
    st.url = PG_URL
    monkeypatch.setattr(privacy, "store_or_exit", lambda url, key, must_exist=False: st)
    r = CliRunner().invoke(app, ["privacy", "report", "--store", PG_URL])  # no runs
    assert r.exit_code == 2 and SECRET not in r.output and MASKED in r.output.replace("\n", ""), r.output
    st.create_run("x", "fedbuff", 0, "{}", "simulate")
    r = CliRunner().invoke(app, ["privacy", "report", "--store", PG_URL, "--run", "9"])
    assert r.exit_code == 2 and SECRET not in r.output and MASKED in r.output.replace("\n", ""), r.output


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
def test_peer_processes_get_the_store_url_in_their_environment_not_on_their_command_line(kind, tmp_path,
                                                                                        monkeypatch, umask_022):
    """``ps`` shows every user a process's command line; only its owner reads its environment."""
    import fedasync.serverless.runner as runner
    from fedasync.serverless.processes import STORE_ENV

    started = []

    class Exited:
        pid = 0

        def poll(self):
            return 1

    def spawn(argv, log_path, env=None):
        started.append((list(argv), dict(env or {})))
        return Exited()

    monkeypatch.setattr(runner, "spawn", spawn)
    url = f"sqlite:///{tmp_path / 'peers.db'}"
    cfg = small_config(*LEDGER_SMALL)
    run = runner.run_ledger if kind == "ledger" else runner.run_gossip
    with pytest.raises(runner.ServerlessError, match="exited before the run started"):
        run(cfg, url, 3, tmp_path / "out", peer_grace_s=0.1)
    assert len(started) == 3
    for argv, env in started:
        assert url not in " ".join(argv) and "--store" not in argv, argv
        assert env.get(STORE_ENV) == url
    out = tmp_path / "out"
    loose = {p: oct(m) for p, m in _modes(out).items()
             if not p.endswith(".pub") and m != (0o700 if (out / p).is_dir() else 0o600)}
    assert not loose, loose  # run directory, config.yaml, private keys, logs (a public key may be read)


def test_a_peer_reads_its_store_from_the_environment(tmp_path):
    from fedasync.cli import app
    from fedasync.serverless.processes import STORE_ENV

    missing = f"sqlite:///{tmp_path / 'none.db'}"
    for kind in ("ledger", "gossip"):
        r = CliRunner().invoke(app, [kind, "peer", "--peer-id", "0"], env={STORE_ENV: missing})
        assert r.exit_code == 2 and "--store: no database at" in r.output and "none.db" in r.output, r.output
