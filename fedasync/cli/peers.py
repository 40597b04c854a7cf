"""Pieces shared by the server-less commands (``fedasync ledger``, ``fedasync gossip``): the
config for N peers and a new run directory (0700), one-line errors, the progress bar, the summary
table and outputs. Not a command itself."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from rich.markup import escape
from rich.table import Table

from fedasync.cli.common import console, data_or_exit, fail, tracking_or_exit
from fedasync.private import mask_url

STORE_HELP = "SQLAlchemy URL of the store (SQLite for one machine, postgresql+psycopg://... for many)."
#: ``--store`` of a peer: also read from the environment, so that a password stays out of ``ps``
PEER_STORE_HELP = (STORE_HELP + " Default: the environment variable FEDASYNC_STORE (a URL with a password is "
                   "better given there: other users of the machine see a command line, not the environment).")


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input or state -> one line on stderr, exit 2."""
    from fedasync.config import ConfigError
    from fedasync.privacy.budgets import PrivacyError
    from fedasync.serverless.common import ServerlessError
    from fedasync.serverless.flchain import ChainError
    from fedasync.signing import SigningKeyError

    try:
        yield
    except (ConfigError, ServerlessError, ChainError, PrivacyError, SigningKeyError, FileExistsError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def prepare(config: Optional[str], set_: list[str], peers: Optional[int], out: Optional[Path],
            time_budget: Optional[float], virtual: bool, kind: str, spawn: Optional[int] = None,
            store: Optional[str] = None, check: Optional[Callable] = None):
    """The config for N peers, and the output directory (new, empty), created only once every
    input has been checked (the trackers asked for are installed; ``check(cfg)``: the command's own checks)."""
    from fedasync.config import ConfigError, apply_overrides, config_from_dict, packaged_example, read_yaml
    from fedasync.outputs import new_run_dir
    from fedasync.serverless.common import cap_for_peers

    # server.concurrency means nothing without a server and server.buffer_size cannot exceed the
    # number of peers: cap both before validating (so `--peers 4` works with the quickstart)
    with user_errors():
        raw, capped = cap_for_peers(apply_overrides(read_yaml(config or packaged_example("quickstart")), set_),
                                    peers)
    try:
        cfg = config_from_dict(raw)
    except ConfigError as e:
        fail(str(e))
    if time_budget is not None:
        if not (math.isfinite(time_budget) and time_budget > 0):
            fail(f"--time-budget: must be a finite number > 0, got {time_budget}")
        key = "max_virtual_time" if virtual else "max_wall_time"
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={key: float(time_budget)})})
    n = cfg.data.num_clients
    if spawn is not None:
        if virtual:
            fail("--spawn: starts peer processes, which --virtual does not use")
        if not 0 <= spawn <= n:
            fail(f"--spawn: must be in 0..{n} (the number of peers), got {spawn}")
    tracking_or_exit(cfg)  # a tracker not installed: one line naming its extra
    if check is not None:
        check(cfg)
    data_or_exit(cfg)
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--out: {out} exists and is not an empty directory")
    if store is not None:  # reachable and a database, but nothing created yet
        from fedasync.cli.common import check_store_or_exit

        check_store_or_exit(store, "--store")
    if capped:
        console.print(f"note: {capped} (they cannot exceed the number of peers)", highlight=False, soft_wrap=True,
                      markup=False)
    if out is None:
        out = new_run_dir(Path("runs"), f"{cfg.name}-{kind}")
    from fedasync.private import private_dir

    private_dir(out)  # the store, config (URL), keys and logs go there
    return cfg, out


class Bar:
    """A progress bar over steps (or time) with accuracy."""

    def __init__(self, bars, label: str, what: str):
        self.bars, self.what = bars, what
        self.task = bars.add_task(label, total=None, info="")

    def __call__(self, ev: dict) -> None:
        total = ev.get("max_steps") or ev.get("max_time")
        done = ev["version"] if ev.get("max_steps") else ev["time_s"]
        info = f"{self.what}={ev['version']}  t={ev['time_s']:.1f}s"
        if ev.get("accuracy") is not None:
            info += f"  acc={ev['accuracy']:.3f}"
        if ev.get("consensus_distance") is not None:
            info += f"  consensus={ev['consensus_distance']:.3g}"
        self.bars.update(self.task, total=total, completed=done, info=info)


def summary_table(s: dict, title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=escape(title))  # the config's name: plain text, not markup
    t.add_column("")
    t.add_column("", justify="right")
    ttt = s.get("time_to_target_s")
    clock = "virtual" if s.get("clock") == "virtual" else "wall-clock"
    base = [("run", str(s["run_id"])), ("peers", str(s["num_peers"])), ("stop reason", str(s["stop_reason"])),
            ("final accuracy", fmt4(s["final_accuracy"])), ("best accuracy", fmt4(s["best_accuracy"])),
            (f"time to {s['target_accuracy']} ({clock} s)", "-" if ttt is None else f"{ttt:.2f}"),
            ("wall s", f"{s['wall_time_s']:.1f}")]
    if s.get("virtual_time_s") is not None:
        base.insert(5, ("virtual s", f"{s['virtual_time_s']:.2f}"))
    for k, v in base + rows:
        t.add_row(k, v)
    return t


def fmt4(x) -> str:
    """A number with 4 decimals, or - ."""
    return "-" if x is None else f"{x:.4f}"


def default_store(store: Optional[str], out: Path) -> str:
    from fedasync.store import default_sqlite_url

    return store or default_sqlite_url(out)


def write_and_print(out: Path, cfg, summary: dict, columns: list[str], extra_plot: str | None, title: str,
                    rows: list[tuple[str, str]]) -> None:
    from fedasync.serverless.report import write_outputs

    paths = write_outputs(out, cfg, summary, columns, extra_plot)
    console.print(summary_table(summary, title, rows))
    console.print("wrote " + ", ".join(str(p) for p in paths.values()) + f"; store {mask_url(summary['store_url'])}",
                  markup=False)
