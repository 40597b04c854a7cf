"""``fedasync gossip``: decentralized asynchronous (DP-)SGD over the store (AD-PSGD, A(DP)²SGD)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from fedasync.cli.common import (TRACK_HELP, console, fail, load_or_exit, progress_bars, quiet_flower,
                                 track_or_exit)
from fedasync.cli.peers import PEER_STORE_HELP, STORE_HELP, Bar, default_store, prepare, user_errors, write_and_print
from fedasync.serverless.processes import STORE_ENV

TOPOLOGY_HELP = "ring | torus | exponential | complete | random-k"


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="gossip", no_args_is_help=True, add_completion=False,
                        help="Gossip: each peer trains its own model and averages it with a neighbour's, atomically.")
    group.command("run")(run)
    group.command("peer")(peer)
    app.add_typer(group, name="gossip")


def _check_topology(topology: str, degree: int, n: int, seed: int) -> None:
    from fedasync.serverless.topology import TOPOLOGIES, neighbours

    if topology not in TOPOLOGIES:
        fail(f"--topology: {topology!r} is not one of {', '.join(TOPOLOGIES)}")
    try:
        neighbours(topology, n, seed, degree)
    except ValueError as e:
        fail(f"--topology {topology}: {e}")


def run(
    config: Optional[str] = typer.Argument(None, help="YAML config (default: the packaged quickstart)."),
    peers: Optional[int] = typer.Option(None, "--peers", help="Number of peers (default: data.num_clients); "
                                        "peer i holds partition i of data.num_clients = N."),
    topology: str = typer.Option("ring", "--topology", help=TOPOLOGY_HELP),
    degree: int = typer.Option(2, "--degree", help="random-k: neighbours each peer draws."),
    store: Optional[str] = typer.Option(None, "--store", help=STORE_HELP + " Default: <out>/fedasync.db."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default runs/<name>-gossip-<time>/)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set train.local_steps=5 (repeatable)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Averaging steps per peer."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=1, help="Measure every N averaging "
                                             "events instead of on the server.eval_every_s grid."),
    time_budget: Optional[float] = typer.Option(None, "--time-budget", help="Stop after this many seconds "
                                                "(wall clock; virtual with --virtual)."),
    emulate_speeds: bool = typer.Option(False, "--emulate-speeds", help="Peer i sleeps its task duration (speed "
                                        "profile) x clock.time_scale per step."),
    virtual: bool = typer.Option(False, "--virtual", help="Deterministic in-process mode on the virtual clock "
                                 "(the same peer code, driven by the simulator)."),
    spawn: Optional[int] = typer.Option(None, "--spawn", min=0, help="Start only peers 0..M-1 here (default: all); "
                                        "the others join from other machines with `peer --run-id`."),
    track: Optional[str] = typer.Option(None, "--track", help=TRACK_HELP),
) -> None:
    """Start N gossip peers; report the average model's accuracy, min/max peer accuracy and consensus distance.

    The step order is the config's gossip.step_order (paper: AD-PSGD; symmetric)."""
    from fedasync.private import private_umask

    with private_umask():  # the run directory, store, logs and keys: 0700/0600, whatever the umask
        from fedasync.serverless.runs import open_store

        def check(cfg) -> None:
            _check_topology(topology, degree, cfg.data.num_clients, cfg.seed)

        cfg, out = prepare(config, track_or_exit(track, set_), peers, out, time_budget, virtual, "gossip", spawn,
                           store, check)
        url = default_store(store, out)
        quiet_flower(False)
        t0 = time.time()
        with user_errors(), progress_bars() as bars:
            bar = Bar(bars, f"gossip {topology} ({cfg.data.num_clients} peers{', virtual' if virtual else ''})",
                      "events")
            if virtual:
                from fedasync.serverless.sim import simulate_gossip

                summary = simulate_gossip(cfg, open_store(url), topology, degree, max_steps=max_steps,
                                          eval_every=eval_every, progress=bar)
            else:
                from fedasync.serverless.runner import run_gossip

                summary = run_gossip(cfg, url, cfg.data.num_clients, out, topology, degree, max_steps=max_steps,
                                     eval_every=eval_every, emulate=emulate_speeds, progress=bar,
                                     spawn_peers=spawn)
        cd = summary["consensus_distance"]
        rows = [("averaging events", str(summary["averaging_events"])),
                ("min / max peer accuracy", f"{summary['final_min_peer_accuracy']:.4f} / "
                                            f"{summary['final_max_peer_accuracy']:.4f}"),
                ("consensus distance final (max)", f"{cd['final']:.4g} ({cd['max']:.4g})"),
                ("spectral gap", f"{summary['spectral_gap']:.4g}"), ("step order", summary["step_order"])]
        if summary.get("privacy"):
            p = summary["privacy"]
            rows.append(("ε max / budget", f"{p['epsilon_max']:.3f} / {p.get('epsilon_budget')}"))
        write_and_print(out, cfg, summary, ["events", "time_s", "accuracy", "loss", "min_accuracy", "max_accuracy",
                                            "consensus_distance"], "consensus_distance",
                        f"{cfg.name}: gossip {topology} (seed {cfg.seed})", rows)
        console.print(f"done in {time.time() - t0:.1f} s")


def peer(
    config: Optional[str] = typer.Argument(None, help="YAML config; must agree with the run's (default: the run's own)."),
    store: str = typer.Option(..., "--store", envvar=STORE_ENV, show_envvar=False, help=PEER_STORE_HELP),
    peer_id: int = typer.Option(..., "--peer-id", help="This peer's id (0..N-1): its partition, row and profile."),
    run_id: Optional[int] = typer.Option(None, "--run-id", help="The gossip run to join (default: the newest running)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key of CONFIG (repeatable)."),
    emulate_speeds: bool = typer.Option(False, "--emulate-speeds", help="Sleep per this peer's speed profile."),
) -> None:
    """Run one gossip peer against a shared store until the run stops."""
    from fedasync.serverless.runner import gossip_peer_loop
    from fedasync.serverless.runs import find_run, open_store

    if set_ and not config:
        fail("--set: needs CONFIG (a peer takes the run's own config; --set overrides a CONFIG given to check it)")
    given = load_or_exit(config, set_) if config else None
    with user_errors():
        st = open_store(store, must_exist=True)
        rid = find_run(st, "gossip", run_id, running_only=True)
        res = gossip_peer_loop(st, rid, peer_id, given, emulate=emulate_speeds)
    console.print(json.dumps(res))
