"""``fedasync ledger``: FLchain, a ledger of signed updates in the store that anyone can audit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fedasync.cli.common import (TRACK_HELP, console, fail, load_or_exit, progress_bars, quiet_flower,
                                 track_or_exit)
from fedasync.cli.peers import (
    PEER_STORE_HELP,
    STORE_HELP,
    Bar,
    default_store,
    fmt4,
    prepare,
    user_errors,
    write_and_print,
)
from fedasync.private import mask_url
from fedasync.serverless.processes import STORE_ENV


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="ledger", no_args_is_help=True, add_completion=False,
                        help="FLchain: peers append signed update and aggregate blocks to a ledger in the store.")
    group.command("run")(run)
    group.command("peer")(peer)
    group.command("verify")(verify)
    group.command("show")(show)
    group.command("member")(member)
    app.add_typer(group, name="ledger")


# -- commands -----------------------------------------------------------------------------------------


def run(
    config: Optional[str] = typer.Argument(None, help="YAML config (default: the packaged quickstart)."),
    peers: Optional[int] = typer.Option(None, "--peers", help="Number of peers (default: data.num_clients); "
                                        "peer i holds partition i of data.num_clients = N."),
    store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + " Default: <out>/fedasync.db."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default runs/<name>-ledger-<time>/)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set server.buffer_size=4 (repeatable)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1,
                                            help="Stop after this many aggregate blocks (default: server.max_versions)."),
    time_budget: Optional[float] = typer.Option(None, "--time-budget", help="Stop after this many seconds "
                                                "(wall clock; virtual with --virtual)."),
    emulate_speeds: bool = typer.Option(False, "--emulate-speeds", help="Peer i sleeps its task duration (speed "
                                        "profile) x clock.time_scale per task."),
    virtual: bool = typer.Option(False, "--virtual", help="Deterministic in-process mode on the virtual clock "
                                 "(the same peer code, driven by the simulator)."),
    spawn: Optional[int] = typer.Option(None, "--spawn", min=0, help="Start only peers 0..M-1 here (default: all); "
                                        "the others join from other machines with `peer --run-id`."),
    peer_keys: Optional[Path] = typer.Option(None, "--peer-keys", help="Directory of peer-<i>.pub: the public keys "
                                             "of the peers that join from elsewhere, pinned in the genesis block."),
    track: Optional[str] = typer.Option(None, "--track", help=TRACK_HELP),
) -> None:
    """Start N peer processes appending to one ledger; stop at the target, the time budget or --max-steps.

    The genesis block pins the members (peer id, public key); the run's authority key is
    <out>/keys/genesis.key (it alone can admit or remove peers: `fedasync ledger member`)."""
    from fedasync.private import private_umask

    with private_umask():  # the run directory, store, logs and keys: 0700/0600, whatever the umask
        from fedasync.serverless.runs import open_store

        def check(cfg) -> None:
            if peer_keys is not None and (virtual or not peer_keys.is_dir()):
                fail(f"--peer-keys: {peer_keys} is not a directory" if not virtual else
                     "--peer-keys: for peer processes, not --virtual")

        cfg, out = prepare(config, track_or_exit(track, set_), peers, out, time_budget, virtual, "ledger", spawn,
                           store, check)
        url = default_store(store, out)
        quiet_flower(False)
        t0 = time.time()
        with user_errors(), progress_bars() as bars:
            bar = Bar(bars, f"ledger ({cfg.data.num_clients} peers{', virtual' if virtual else ''})",
                      "aggregates")
            if virtual:
                from fedasync.serverless.sim import simulate_ledger

                summary = simulate_ledger(cfg, open_store(url), max_steps=max_steps, progress=bar)
            else:
                from fedasync.serverless.runner import run_ledger

                summary = run_ledger(cfg, url, cfg.data.num_clients, out, max_steps=max_steps,
                                     emulate=emulate_speeds, progress=bar, spawn_peers=spawn, peer_keys=peer_keys)
        rows = [("aggregate blocks", str(summary["aggregate_blocks"])),
                ("update blocks", str(summary["update_blocks"])), ("pending", str(summary["pending"])),
                ("rejected blocks", str(summary["rejected_blocks"])),
                ("height conflicts (retried)", str(summary["height_conflicts"])), ("head", summary["head_hash"][:16])]
        if summary.get("peer_exit_codes") and any(c not in (0, None) for c in summary["peer_exit_codes"]):
            rows.append(("peer exit codes", str(summary["peer_exit_codes"])))
        write_and_print(out, cfg, summary, ["version", "height", "time_s", "accuracy", "loss"], None,
                        f"{cfg.name}: ledger (seed {cfg.seed})", rows)
        console.print(f"verify with: fedasync ledger verify --store {mask_url(url)} --run-id {summary['run_id']} "
                      f"--head {summary['head_hash']}", highlight=False, soft_wrap=True, markup=False)
        console.print(f"done in {time.time() - t0:.1f} s")


def peer(
    config: Optional[str] = typer.Argument(None, help="YAML config; must agree with the run's (default: the run's own)."),
    store: str = typer.Option(..., "--store", envvar=STORE_ENV, show_envvar=False, help=PEER_STORE_HELP),
    peer_id: int = typer.Option(..., "--peer-id", help="This peer's id (0..N-1): its partition and speed profile."),
    run_id: Optional[int] = typer.Option(None, "--run-id", help="The ledger run to join (default: the newest running)."),
    key: Optional[Path] = typer.Option(None, "--key", help="Ed25519 private key (PEM); created if missing "
                                       "(default ./fedasync-keys/peer-<ID>.key)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key of CONFIG (repeatable)."),
    emulate_speeds: bool = typer.Option(False, "--emulate-speeds", help="Sleep per this peer's speed profile."),
) -> None:
    """Run one ledger peer against a shared store until the run stops (its key must be a member's)."""
    from fedasync.serverless.runs import find_run, open_store
    from fedasync.serverless.runner import ledger_peer_loop

    if set_ and not config:
        fail("--set: needs CONFIG (a peer takes the run's own config; --set overrides a CONFIG given to check it)")
    given = load_or_exit(config, set_) if config else None
    with user_errors():
        st = open_store(store, must_exist=True)
        rid = find_run(st, "ledger", run_id, running_only=True)
        res = ledger_peer_loop(st, rid, peer_id, key or Path("fedasync-keys") / f"peer-{peer_id}.key", given,
                               emulate=emulate_speeds)
    console.print(json.dumps(res))


def verify(
    store: str = typer.Option("sqlite:///fedasync.db", "--store", help=STORE_HELP),
    run_id: Optional[int] = typer.Option(None, "--run-id", help="The ledger run (default: the newest)."),
    head: Optional[str] = typer.Option(None, "--head", help="The hash the chain's last block must have (summary.json "
                                       "head_hash; 16 to 64 hex digits): an anchor from outside the store."),
    authority: Optional[str] = typer.Option(None, "--authority", help="The run's authority key that must have signed "
                                            "the genesis block: keys/genesis.pub (or .key), or 64 hex digits."),
) -> None:
    """Re-check every hash link, signature, signer and payload hash, and recompute every aggregate; check the
    genesis block against the run's config and rule, and the last block against the head the run recorded when
    it stopped (and --head / --authority); exit 1 on the first bad block or a chain that is not the run's."""
    from fedasync.serverless.ledger_verify import HEX, verify_chain
    from fedasync.serverless.runs import find_run, open_store

    if head is not None and not HEX.fullmatch(head):
        fail(f"--head: {head!r} is not 16 to 64 lowercase hex digits of a block hash")
    with user_errors():
        key = _authority_hex(authority) if authority is not None else None
        st = open_store(store, must_exist=True)
        rid = find_run(st, "ledger", run_id)
        report = verify_chain(st, rid, head=head, authority=key)
    if report.ok:
        console.print(report.line(), highlight=False, soft_wrap=True, markup=False)  # text from the chain: plain
        return
    console.print(report.line(), highlight=False, style="red", soft_wrap=True, markup=False)
    raise typer.Exit(1)


def _authority_hex(value: str) -> str:
    """--authority: 64 hex digits, or a PEM public key file, or the PEM private key file."""
    import re

    from fedasync.serverless.flchain import key_hex
    from fedasync.signing import SigningKeyError, load_private_key, load_public_key

    if re.fullmatch(r"[0-9a-f]{64}", value):
        return value
    path = Path(value)
    if not path.is_file():
        raise SigningKeyError(f"--authority: {value} is neither 64 lowercase hex digits nor a key file")
    try:
        return key_hex(load_public_key(path))
    except SigningKeyError:
        try:
            return key_hex(load_private_key(path))
        except SigningKeyError:
            raise SigningKeyError(f"--authority: {path} is not an Ed25519 public or private key (PEM)") from None


def show(
    store: str = typer.Option("sqlite:///fedasync.db", "--store", help=STORE_HELP),
    run_id: Optional[int] = typer.Option(None, "--run-id", help="The ledger run (default: the newest)."),
    all_models: bool = typer.Option(False, "--all", help="List every model block, not only the evaluated ones."),
) -> None:
    """The chain's head, counts per kind, members and their contributions, rejected blocks, and the accuracy of each
    evaluated model block."""
    from fedasync.serverless.report import chain_overview
    from fedasync.serverless.runs import find_run, open_store, run_info

    with user_errors():
        st = open_store(store, must_exist=True)
        rid = find_run(st, "ledger", run_id)
        ov = chain_overview(st, rid)
        info = run_info(st, rid)
    c = ov["counts"]
    console.print(f"[bold]ledger of run {rid}[/bold] ({info.status}, {info.clock} clock): height {ov['height']}, "
                  f"head {ov['head_kind']} {ov['head_hash'][:16]}; blocks: genesis {c['genesis']}, member {c['member']}, "
                  f"update {c['update']}, aggregate {c['aggregate']}; {ov['pending']} update(s) pending",
                  highlight=False)
    r = ov["rule"]
    console.print(f"rule: fedbuff K={r['buffer_size']} server_lr={r['server_lr']} staleness={r['staleness']['fn']}"
                  f"(a={r['staleness']['a']}, b={r['staleness']['b']}) weighting={r['weighting']} "
                  f"max_aggregates={r['max_aggregates']}", highlight=False)
    if not ov["pinned"]:
        console.print("[red]the genesis block pins no signers (a chain from an older fedasync)[/red]")
    t = Table(title="per-peer contributions")
    for col in ("peer", "key", "member", "update blocks", "aggregate blocks"):
        t.add_column(col, justify="right" if col != "key" else "left")
    for p, d in sorted(ov["peers"].items(), key=lambda kv: (len(kv[0]), kv[0])):
        t.add_row(escape(p), escape(str(d["key"])), "yes" if p.isdigit() and int(p) in ov["members"] else "no", str(d["update"]),
                  str(d["aggregate"]))
    console.print(t)
    for r in ov["rejected"]:
        console.print(f"[red]rejected[/red] block at height {r['height']} ({escape(str(r['kind']))}): "
                      f"{escape(str(r['why']))}", highlight=False)
    m = Table(title="model blocks" + ("" if all_models else " (evaluated)"))
    for col in ("model", "height", "updates", "created (s after start)", "accuracy", "loss"):
        m.add_column(col, justify="right")
    t0 = ov["started"] if ov["started"] is not None else (ov["models"][0]["created"] if ov["models"] else 0.0)
    for row in ov["models"]:
        if row["accuracy"] is None and not all_models:
            continue
        m.add_row(str(row["model_index"]), str(row["height"]), str(row["updates"]), f"{row['created'] - t0:+.2f}s",
                  fmt4(row["accuracy"]), fmt4(row["loss"]))
    console.print(m)


def member(
    action: str = typer.Argument(..., help="add | remove"),
    store: str = typer.Option(..., "--store", help=STORE_HELP),
    peer_id: int = typer.Option(..., "--peer-id", help="The peer id to admit or remove."),
    authority: Path = typer.Option(..., "--authority", help="The run's authority key (PEM), the key that signed "
                                   "the genesis block: <out>/keys/genesis.key of `ledger run`."),
    public_key: Optional[Path] = typer.Option(None, "--public-key", help="add: the peer's public key file (PEM, "
                                              "e.g. peer-<ID>.pub next to its --key)."),
    run_id: Optional[int] = typer.Option(None, "--run-id", help="The ledger run (default: the newest)."),
) -> None:
    """Admit a peer (its id and public key) or remove one: a member block signed by the run's authority key."""
    from fedasync.serverless.flchain import append_member, key_hex
    from fedasync.serverless.runs import find_run, open_store
    from fedasync.signing import load_private_key, load_public_key

    if action not in ("add", "remove"):
        fail(f"ACTION: {action!r} is not add or remove")
    if (action == "add") != (public_key is not None):
        fail("--public-key: needed to add a peer (and only then)")
    with user_errors():
        key = load_private_key(authority)
        pub = load_public_key(public_key) if public_key is not None else None
        st = open_store(store, must_exist=True)
        rid = find_run(st, "ledger", run_id)
        height = append_member(st, rid, key, action, peer_id, pub)
    what = f"admitted peer {peer_id} (key {key_hex(pub)[:16]})" if pub is not None else f"removed peer {peer_id}"
    console.print(f"{what} in run {rid}: member block at height {height}", highlight=False)
