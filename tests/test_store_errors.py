"""A store that cannot be opened (nothing listening, a file that is not a database, a bad URL):
every command that opens one says so in one line naming the key, exits 2 and writes nothing
(issue 12 §3)."""

import socket

import pytest
from typer.testing import CliRunner

from conftest import SMALL
from fedasync.cli import app
from fedasync.config import packaged_example
from fedasync.store.opening import StoreOpenError, open_store, probe_store


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.fixture
def dead_pg():
    return f"postgresql+psycopg://u@127.0.0.1:{_closed_port()}/x"


@pytest.fixture
def not_a_db(tmp_path):
    p = tmp_path / "notes.db"
    p.write_text("these are my notes, not a database\n" * 20)
    return p


def _sets(*extra):
    out = []
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


def _invoke_in(tmp_path, monkeypatch, args):
    """Run the CLI in an empty directory; (result, what the directory holds afterwards)."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    r = CliRunner().invoke(app, args)
    return r, sorted(p.name for p in work.iterdir())


def _assert_one_line(r, key: str, what: str):
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    assert lines[0].startswith(f"error: {key}: ") and what in lines[0], lines[0]
    assert "Traceback" not in r.output


def test_simulate_with_nothing_listening(tmp_path, monkeypatch, dead_pg):
    r, left = _invoke_in(tmp_path, monkeypatch, ["simulate", "--backend", "local",
                                                 *_sets(f"store.url={dead_pg}")])
    _assert_one_line(r, "store.url", "Connection refused")
    assert left == []  # no runs/ directory


def test_simulate_with_an_explicit_out_creates_nothing(tmp_path, monkeypatch, not_a_db):
    out = tmp_path / "out"
    r, left = _invoke_in(tmp_path, monkeypatch, ["simulate", "--backend", "local", "--out", str(out),
                                                 *_sets(f"store.url=sqlite:///{not_a_db}")])
    _assert_one_line(r, "store.url", "is not an SQLite database")
    assert not out.exists() and left == []
    assert not_a_db.read_text().startswith("these are my notes")  # untouched


def test_simulate_compare_checks_the_store_too(tmp_path, monkeypatch, dead_pg):
    r, left = _invoke_in(tmp_path, monkeypatch, ["simulate", "--backend", "local", "--compare", "fedavg,fedbuff",
                                                 *_sets(f"store.url={dead_pg}")])
    _assert_one_line(r, "store.url", "cannot connect")
    assert left == []


def test_simulate_resume_against_a_dead_server(tmp_path, monkeypatch, dead_pg):
    r, left = _invoke_in(tmp_path, monkeypatch, ["simulate", "--backend", "local", "--resume", "1",
                                                 *_sets(f"store.url={dead_pg}")])
    _assert_one_line(r, "store.url", "cannot connect")
    assert left == []


def test_server_checks_the_store_before_starting_anything(tmp_path, monkeypatch, dead_pg):
    out = tmp_path / "run"
    r, left = _invoke_in(tmp_path, monkeypatch, ["server", str(packaged_example("quickstart")), "--insecure",
                                                 "--out", str(out),
                                                 *_sets(f"store.url={dead_pg}")])
    _assert_one_line(r, "store.url", "Connection refused")
    assert not out.exists() and left == []


@pytest.mark.parametrize("cmd", [["runs"], ["privacy", "report"], ["ledger", "verify"], ["ledger", "show"]])
def test_readers_on_a_file_that_is_not_a_database(tmp_path, monkeypatch, not_a_db, cmd):
    r, left = _invoke_in(tmp_path, monkeypatch, [*cmd, "--store", f"sqlite:///{not_a_db}"])
    _assert_one_line(r, "--store", "is not an SQLite database")
    assert left == []
    assert not_a_db.read_text().startswith("these are my notes")


@pytest.mark.parametrize("cmd", [["runs"], ["privacy", "report"], ["ledger", "verify"]])
def test_readers_with_nothing_listening(tmp_path, monkeypatch, dead_pg, cmd):
    r, _ = _invoke_in(tmp_path, monkeypatch, [*cmd, "--store", dead_pg])
    _assert_one_line(r, "--store", "Connection refused")


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
def test_serverless_runs_check_the_store_before_creating_the_out_dir(tmp_path, monkeypatch, dead_pg, kind):
    out = tmp_path / "o"
    r, left = _invoke_in(tmp_path, monkeypatch, [kind, "run", "--peers", "4", "--virtual", "--out", str(out),
                                                 "--store", dead_pg])
    _assert_one_line(r, "--store", "Connection refused")
    assert not out.exists() and left == []


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
def test_serverless_peers_on_a_file_that_is_not_a_database(tmp_path, monkeypatch, not_a_db, kind):
    r, _ = _invoke_in(tmp_path, monkeypatch, [kind, "peer", "--store", f"sqlite:///{not_a_db}", "--peer-id", "0"])
    _assert_one_line(r, "--store", "is not an SQLite database")


def test_privacy_report_on_a_run_directory_holding_a_non_database(tmp_path, monkeypatch):
    d = tmp_path / "rundir"
    d.mkdir()
    (d / "fedasync.db").write_bytes(b"\x00garbage" * 100)
    r, _ = _invoke_in(tmp_path, monkeypatch, ["privacy", "report", "--store", str(d)])
    _assert_one_line(r, "--store", "is not an SQLite database")


@pytest.mark.parametrize("url, what", [
    ("not a url", "is not a database URL"),
    ("nosuchdb://h/x", "unknown database kind"),
    ("mysql://u@h/x", "driver for 'mysql' is not installed"),
    ("sqlite:////no/such/dir/x.db", "directory /no/such/dir does not exist"),
])
def test_probe_names_what_is_wrong(url, what):
    with pytest.raises(StoreOpenError, match="^store.url: ") as e:
        probe_store(url, "store.url")
    assert what in str(e.value) and "\n" not in str(e.value)


def test_probe_writes_nothing_and_hides_passwords(tmp_path):
    target = tmp_path / "new.db"
    probe_store(f"sqlite:///{target}", "--store")  # fine: it can be created ...
    assert not target.exists()  # ... but it was not
    with pytest.raises(StoreOpenError, match="no database at"):
        probe_store(f"sqlite:///{target}", "--store", must_exist=True)
    with pytest.raises(StoreOpenError) as e:
        probe_store(f"postgresql+psycopg://u:hunter2@127.0.0.1:{_closed_port()}/x", "store.url")
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


def test_open_store_opens_a_good_one(tmp_path):
    st = open_store(f"sqlite:///{tmp_path / 'ok.db'}", "--store")
    try:
        assert st.list_runs() == []
    finally:
        st.close()
