"""Deployment commands: ``fedasync server``, ``fedasync client``, ``fedasync keys gen``,
``fedasync certs gen``. They parse, call :mod:`fedasync.deploy` and print.

``fedasync server CONFIG`` starts a Flower SuperLink (or, with ``--superlink``, uses a running
one), registers the SuperNodes' authentication keys, and submits the deployment ServerApp
(``fedasync.server.app:deploy_app``) with ``flwr run``; the SuperLink runs it in a
``flwr-serverapp`` process. This command then follows the run in the store (progress bar) and
writes nothing itself: the ServerApp writes the run directory (``summary.json``, ``history.csv``,
``accuracy.png``, ``config.yaml``, the store, ``server.log``). Ctrl-C asks the ServerApp to stop
(the run is marked ``stopped``; ``--resume`` continues it); a second Ctrl-C stops the Flower run.

Secure by default: ``fedasync server`` needs the SuperNodes' keys (``--supernode-auth DIR``) and
the clients' signing keys (``deploy.public_keys``), and ``fedasync client`` its ``--auth-key`` and
``--signing-key``, unless ``--no-supernode-auth`` / ``--no-signing`` turns one off (a warning).

``fedasync client`` replaces itself with the device's SuperNode (:mod:`fedasync.deploy.supernode`:
Flower's ``flower-supernode`` with a shorter poll, and a warm trainer, :mod:`fedasync.clients.warm`)
on its own local port (``--port``, else a free one, checked before it starts); the node config
carries ``partition-id``, ``num-partitions``, ``data-path``, ``signing-key``,
``device``, ``privacy-state-dir``, ``privacy-policy`` (the device's DP policy from
``--privacy-policy``/``--dp-*``, written as JSON in the state dir; see ``fedasync.clients.app``)
and ``task`` (``--task``: the device's own task module, checked here: it imports and loads this
device's data, else one line and exit 2).

Everything Flower keeps (its CLI config, the SuperLink's apps) lives in ``<out>/flwr/`` unless
``FLWR_HOME`` is set; the Flower app submitted is a generated ``pyproject.toml`` only (the
SuperLink and SuperNodes run the installed ``fedasync``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from fedasync.cli.common import console, err_console, fail
from fedasync.config import ConfigError, check_no_attack
from fedasync.deploy import DeployError


keys_app = typer.Typer(help="Signing keys (Ed25519) and SuperNode authentication keys.", no_args_is_help=True)
certs_app = typer.Typer(help="TLS certificates for the SuperLink.", no_args_is_help=True)


@keys_app.command("gen")
def keys_gen(
    out: Path = typer.Option(..., "--out", help="Directory to write the keys to."),
    clients: int = typer.Option(..., "--clients", help="Number of clients (ids 0..N-1)."),
    first: int = typer.Option(0, "--first", help="First client id."),
    supernode_auth: bool = typer.Option(True, "--supernode-auth/--no-supernode-auth",
                                        help="Also make the SuperNodes' authentication keys (ECDSA P-384)."),
) -> None:
    """Make client-<i>.key/.pub (Ed25519, signs updates) and supernode-<i>.key/.pub (Flower SuperNode auth).

    The server needs the .pub files (deploy.public_keys: DIR, and --supernode-auth DIR); device i
    needs client-<i>.key (--signing-key) and supernode-<i>.key (--auth-key)."""
    from fedasync.deploy.keys import generate_keys

    if clients <= 0 or first < 0:
        fail("--clients must be > 0 and --first >= 0")
    try:
        names = generate_keys(out, range(first, first + clients), supernode_auth)
    except DeployError as e:
        fail(str(e), e.code)
    except OSError as e:
        fail(f"--out: {out}: {e.strerror or e}")
    console.print(f"wrote {len(names)} key files for clients {first}-{first + clients - 1} to {out} "
                  "(*.key are private: give device i only its own)", markup=False)


@certs_app.command("gen")
def certs_gen(
    out: Path = typer.Option(..., "--out", help="Directory to write ca.crt, ca.key, server.pem, server.key to."),
    host: list[str] = typer.Option(..., "--host", help="Name or IP the devices use to reach the SuperLink "
                                   "(repeatable); 127.0.0.1 and localhost are always added."),
    days: int = typer.Option(365, "--days", help="Validity in days (1-36500)."),
) -> None:
    """Make a CA and a SuperLink certificate signed by it (TLS)."""
    from fedasync.deploy.certs import make_certs, tls_hosts

    hosts = tls_hosts(host)
    try:  # make_certs checks --out, --days and every --host before it writes anything
        paths = make_certs(out, hosts, days)
    except DeployError as e:
        fail(str(e), e.code)
    except ValueError as e:
        fail(str(e))
    except FileExistsError as e:
        fail(f"--out: {e}")
    except OSError as e:
        fail(f"--out: {out}: {e.strerror or e}")
    console.print(f"wrote {paths['ca']} (give it to every device: --root-certificates), {paths['cert']} and "
                  f"{paths['key']} (the SuperLink's); hosts: {', '.join(hosts)}", markup=False)


# -- fedasync client --------------------------------------------------------------------


def default_privacy_state_dir() -> Path:
    """Where ``fedasync client`` keeps a device's DP accountants unless told otherwise."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fedasync" / "privacy"


def _device_task_or_exit(spec: str, partition_id: int, num_partitions: int, data: Optional[Path]) -> str:
    """``--task``: the spec the ClientApp imports, as given (the server compares its name with its own);
    exit 2 with the TaskError line when the module does not import, lacks a function, or cannot load
    this device's data."""
    from fedasync.task.interface import TaskError, check_nonempty, load_task

    if data is not None and not data.exists():
        fail(f"--data: {data}: no such file or directory")
    try:
        t = load_task(spec)
        train, _ = t.load_data(partition_id, num_partitions, data_path=None if data is None else str(data.resolve()))
        check_nonempty(train, f"task {t.name}: load_data(...)[0] (train)")
    except TaskError as e:
        fail(f"--task: {e}")
    except Exception as e:  # the user's own code failed on this device's data
        fail(f"--task: task {spec}: load_data({partition_id}, {num_partitions}"
             f"{'' if data is None else ', data_path=...'}) raised {type(e).__name__}: {e}")
    return spec


def client(
    superlink: str = typer.Option(..., "--superlink", help="The SuperLink's HOST:PORT."),
    partition_id: int = typer.Option(..., "--partition-id", help="This device's client id (0..N-1)."),
    num_partitions: int = typer.Option(..., "--num-partitions", help="Number of clients N (data.num_clients)."),
    data: Optional[Path] = typer.Option(None, "--data", help="This device's .npz (x, y); default: its partition "
                                        "generated from the server's setup. With --task: any file or folder, "
                                        "passed to the task's load_data as data_path."),
    task: Optional[str] = typer.Option(None, "--task", help="The task module this device trains (e.g. "
                                       "my_project.task, or ./my_task.py), imported from this environment (and "
                                       "this directory); it "
                                       "must be the server's task (same name and source), else the device "
                                       "refuses its tasks."),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates",
                                                     help="CA certificate (ca.crt) to verify the SuperLink."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP, no TLS (tests on one machine only)."),
    auth_key: Optional[Path] = typer.Option(None, "--auth-key", help="SuperNode authentication key "
                                            "(supernode-<i>.key, registered by the server); needed unless "
                                            "--no-supernode-auth."),
    signing_key: Optional[Path] = typer.Option(None, "--signing-key", help="Ed25519 key to sign updates "
                                               "(client-<i>.key); needed unless --no-signing."),
    no_signing: bool = typer.Option(False, "--no-signing", help="Send unsigned updates (a server started with "
                                    "--no-signing only); prints a warning."),
    no_supernode_auth: bool = typer.Option(False, "--no-supernode-auth", help="Connect without a SuperNode "
                                           "authentication key (a server started with --no-supernode-auth "
                                           "only); prints a warning."),
    port: Optional[int] = typer.Option(None, "--port", help="The SuperNode's local port on 127.0.0.1 (default: a "
                                       "free one, so that several SuperNodes on one machine never share it)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda or mps (overrides train.device)."),
    privacy_state_dir: Optional[Path] = typer.Option(None, "--privacy-state-dir",
                                                     help="Where this device keeps its DP accountant (default: "
                                                     "$XDG_STATE_HOME/fedasync/privacy, else "
                                                     "~/.local/state/fedasync/privacy)."),
    max_wait_time: Optional[float] = typer.Option(None, "--max-wait-time",
                                                  help="Give up after this many seconds without the SuperLink."),
    poll_interval: float = typer.Option(1.0, "--poll-interval", help="Seconds between the SuperNode's requests "
                                        "for a message when it has none (Flower's own: 3)."),
    warm: bool = typer.Option(True, "--warm/--no-warm", help="Keep a warm trainer (torch, data, model loaded "
                              "once; a forked process per task) instead of a new flwr-clientapp per message."),
    privacy_policy: Optional[Path] = typer.Option(None, "--privacy-policy", help="This device's DP policy (YAML: "
                                                  "accountant, epsilon, delta, min_noise_multiplier, "
                                                  "max_epsilon_per_task, max_sample_rate, max_grad_norm, "
                                                  "allow_report_loss); without a policy the device refuses every "
                                                  "local-DP task. The --dp-* flags set or override its keys."),
    dp_epsilon: Optional[float] = typer.Option(None, "--dp-epsilon", help="Policy: this device's epsilon budget "
                                               "for its data, all runs and servers together."),
    dp_delta: Optional[float] = typer.Option(None, "--dp-delta", help="Policy: its delta (default 1e-5)."),
    dp_accountant: Optional[str] = typer.Option(None, "--dp-accountant", help="Policy: rdp (default) or prv."),
    dp_min_noise: Optional[float] = typer.Option(None, "--dp-min-noise", help="Policy: the least noise "
                                                 "multiplier a task may use."),
    dp_max_task_epsilon: Optional[float] = typer.Option(None, "--dp-max-task-epsilon", help="Policy: the most "
                                                        "epsilon one task may cost."),
    dp_max_sample_rate: Optional[float] = typer.Option(None, "--dp-max-sample-rate", help="Policy: the largest "
                                                       "sampling rate q a task may use."),
    dp_max_grad_norm: Optional[float] = typer.Option(None, "--dp-max-grad-norm", help="Policy: the loosest "
                                                     "clipping norm a task may use."),
    dp_allow_loss: bool = typer.Option(False, "--dp-allow-loss", help="Policy: tasks may ask for the training "
                                       "loss (report_loss; outside the DP guarantee)."),
) -> None:
    """Run this device's SuperNode (flower-supernode with the fedasync ClientApp and a warm trainer)."""
    from fedasync.deploy.processes import (SUPERNODE_HOST, check_port_free, child_env, free_local_port,
                                           parse_address, supernode_command)

    try:
        parse_address(superlink)
    except DeployError as e:
        fail(str(e), e.code)
    if num_partitions <= 0:
        fail("--num-partitions must be > 0")
    if not 0 <= partition_id < num_partitions:
        fail(f"--partition-id: {partition_id} is not in 0-{num_partitions - 1}")
    if insecure and root_certificates is not None:
        fail("--insecure and --root-certificates exclude each other")
    if not insecure and root_certificates is None:
        fail("--root-certificates: needed for TLS (or --insecure for a test on one machine)")
    if insecure and auth_key is not None:
        fail("--auth-key: SuperNode authentication needs TLS (drop --insecure, give --root-certificates)")
    if no_signing and signing_key is not None:
        fail("--no-signing and --signing-key exclude each other")
    if no_supernode_auth and auth_key is not None:
        fail("--no-supernode-auth and --auth-key exclude each other")
    if auth_key is None and not no_supernode_auth:  # secure by default
        fail("--auth-key: SuperNode authentication is on by default: pass --auth-key supernode-<i>.key "
             "(from `fedasync keys gen`; needs TLS), or --no-supernode-auth")
    if signing_key is None and not no_signing:
        fail("--signing-key: updates are signed by default: pass --signing-key client-<i>.key "
             "(from `fedasync keys gen`), or --no-signing")
    for opt, p in (("--data", data if task is None else None), ("--root-certificates", root_certificates),
                   ("--auth-key", auth_key), ("--signing-key", signing_key)):
        if p is not None and not p.is_file():
            fail(f"{opt}: {p}: no such file")
    if task is not None:  # the device's own task: it must import and load this device's data now
        task = _device_task_or_exit(task, partition_id, num_partitions, data)
    elif data is not None:
        from fedasync.task.data import load_npz

        try:
            load_npz(data)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
    if signing_key is not None:
        from fedasync.signing import SigningKeyError, load_private_key

        try:
            load_private_key(signing_key)
        except SigningKeyError as e:
            fail(f"--signing-key: {e}")
    if privacy_state_dir is None:  # a DP device must keep its own accountant (fedasync.privacy.dp)
        privacy_state_dir = default_privacy_state_dir()
    if privacy_state_dir.exists() and not privacy_state_dir.is_dir():
        fail(f"--privacy-state-dir: {privacy_state_dir} is not a directory")
    if device is not None and device not in ("auto", "cpu", "cuda", "mps"):
        fail(f"--device: {device!r} is not one of auto, cpu, cuda, mps")
    if port is not None and not 0 < port < 65536:
        fail(f"--port: {port} is not a port")
    if max_wait_time is not None and not 0 < max_wait_time < float("inf"):
        fail(f"--max-wait-time: {max_wait_time:g} is not a number of seconds > 0")
    from fedasync.privacy.policy import PolicyError, policy_file, resolve_policy, write_policy

    try:  # the device's own DP policy, handed to its ClientApp as a 0600 JSON file in the state dir
        policy = resolve_policy(privacy_policy, {
            "epsilon": dp_epsilon, "delta": dp_delta, "accountant": dp_accountant, "min_noise_multiplier": dp_min_noise,
            "max_epsilon_per_task": dp_max_task_epsilon, "max_sample_rate": dp_max_sample_rate,
            "max_grad_norm": dp_max_grad_norm, "allow_report_loss": True if dp_allow_loss else None})
    except PolicyError as e:
        fail(str(e))
    policy_path = policy_file(policy, privacy_state_dir) if policy is not None else None
    try:
        if port is None:  # each SuperNode on this machine its own local port
            port = free_local_port()
        else:  # in use: one line now, not a traceback from Flower once it has started
            try:
                check_port_free(SUPERNODE_HOST, port)
            except DeployError as e:
                raise DeployError(f"{e} (another SuperNode?): give another --port, or none for a free one") from None
        cmd = supernode_command(superlink, partition_id, num_partitions, data, root_certificates, insecure, auth_key,
                                signing_key, port, device, privacy_state_dir, max_wait_time, poll_interval, warm,
                                privacy_policy=policy_path, task=task)
    except DeployError as e:
        fail(str(e), e.code)
    try:  # written once every input is checked
        if policy is not None:
            write_policy(policy, privacy_state_dir)
    except OSError as e:
        fail(f"--privacy-state-dir: {privacy_state_dir}: {e.strerror or e}")
    if no_signing:
        err_console.print("warning: --no-signing: this device's updates are unsigned; a server that signs "
                          "(its default) rejects them", highlight=False, markup=False)
    if no_supernode_auth:
        err_console.print("warning: --no-supernode-auth: this SuperNode does not authenticate; a SuperLink with "
                          "node authentication (the default) refuses it", highlight=False, markup=False)
    err_console.print(f"fedasync client {partition_id}/{num_partitions}: starting flower-supernode "
                      f"(SuperLink {superlink}, local port {port}, poll every {poll_interval:g} s, "
                      f"{'warm trainer' if warm else 'a flwr-clientapp process per message'}; "
                      f"DP accountants in {privacy_state_dir})", highlight=False, markup=False)
    if policy is None:
        err_console.print("fedasync client: no DP policy (--privacy-policy or --dp-*): this device refuses every "
                          "local-DP task", highlight=False, markup=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, child_env())


# -- fedasync server ---------------------------------------------------------------------


def server(
    config: Optional[str] = typer.Argument(None, help="YAML config (optional with --resume: the run's own)."),
    superlink: Optional[str] = typer.Option(None, "--superlink", help="Use the SuperLink at HOST:PORT instead of "
                                            "starting one (it must run with --disable-runtime-dependency-installation)."),
    resume: Optional[int] = typer.Option(None, "--resume", help="Continue run RUN_ID of the store in --out."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default runs/<name>-<time>/)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set server.max_versions=50 (repeatable)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the SuperLink listens on (0.0.0.0: every "
                             "interface, for devices on the network)."),
    port: int = typer.Option(9092, "--port", help="The SuperLink's public port: SuperNodes (Fleet API) only."),
    control_port: int = typer.Option(0, "--control-port", help="Port of the SuperLink's Control and Runtime APIs, "
                                     "on 127.0.0.1 only (0: a free port)."),
    certs: Optional[Path] = typer.Option(None, "--certs", help="Directory from `fedasync certs gen` (ca.crt, "
                                         "server.pem, server.key)."),
    ssl_certfile: Optional[Path] = typer.Option(None, "--ssl-certfile", help="The SuperLink's TLS certificate."),
    ssl_keyfile: Optional[Path] = typer.Option(None, "--ssl-keyfile", help="The SuperLink's TLS private key."),
    ssl_ca_certfile: Optional[Path] = typer.Option(None, "--ssl-ca-certfile", help="The CA certificate."),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates",
                                                     help="With --superlink: the CA to verify it."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP, no TLS (tests on one machine only)."),
    supernode_auth: Optional[Path] = typer.Option(None, "--supernode-auth", help="Directory of supernode-<i>.pub "
                                                  "to register (SuperNode authentication, on by default: needed "
                                                  "unless --no-supernode-auth)."),
    no_supernode_auth: bool = typer.Option(False, "--no-supernode-auth", help="Let any SuperNode that reaches the "
                                           "SuperLink join (no node authentication); prints a warning."),
    no_signing: bool = typer.Option(False, "--no-signing", help="Accept unsigned updates (update signing is on by "
                                    "default: deploy.public_keys names the client-<i>.pub directory); prints a "
                                    "warning."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="More logging."),
    track: Optional[str] = typer.Option(None, "--track", help="Send the run's metrics to tensorboard, mlflow or "
                                        "both: tracking.backends (metrics.jsonl is always written)."),
) -> None:
    """Run the asynchronous server on a SuperLink, for SuperNodes started with `fedasync client`."""
    from fedasync.cli.common import (RunProgress, check_store_or_exit, data_or_exit, deployable_or_exit,
                                     load_or_exit, progress_bars, summary_table, track_or_exit, tracking_or_exit)
    from fedasync.privacy.tracker import CalibrationBar
    from fedasync.deploy.keys import client_public_keys, supernode_auth_keys
    from fedasync.deploy.processes import check_port_free, parse_address
    from fedasync.deploy.run import ServerRun, check_control_port, check_out_dir, resolve_tls
    from fedasync.runs import RunError, resume_config

    if config is None and resume is None:
        fail("CONFIG: a YAML config is needed (optional only with --resume)")
    set_ = track_or_exit(track, set_)
    cfg = load_or_exit(config, set_)
    try:
        if resume is not None:
            cfg = resume_config(config, set_, out, resume, cfg, mode="deployment")
    except RunError as e:
        fail(str(e))
    tracking_or_exit(cfg)  # a tracker not installed: one line naming its extra, before anything starts
    deployable_or_exit(cfg)  # privacy.reproducible_noise: exit 2
    base_dir = Path(config).resolve().parent if config is not None else None  # where `task:` imports from
    if cfg.task:  # a user task: it must import (the ServerApp imports it from base_dir) and build its model
        from fedasync.task.interface import TaskError, task_from_config

        try:
            task_from_config(cfg, base_dir=base_dir).model()
        except TaskError as e:
            fail(str(e))
    else:
        data_or_exit(cfg)  # data and model: exit 2 naming the key
    try:  # attack: simulation only
        check_no_attack(cfg)
    except ConfigError as e:
        fail(str(e))
    try:  # every input is checked before anything is written
        tls = resolve_tls(superlink, certs, ssl_certfile, ssl_keyfile, ssl_ca_certfile, root_certificates,
                          insecure, supernode_auth is not None)
        if not 0 < port < 65536:
            raise DeployError(f"--port: {port} is not a port")
        if superlink is not None:
            parse_address(superlink)
            if control_port:
                raise DeployError("--control-port: only for the SuperLink fedasync starts (not with --superlink)")
        else:
            check_port_free(host, port)  # another SuperLink there would get our run
            if control_port:
                check_control_port(control_port, port)
        check_out_dir(out, resume)
    except DeployError as e:
        fail(str(e), e.code)
    check_store_or_exit(cfg.store.url, "store.url")
    try:  # secure by default: node authentication and signing each need their keys or an explicit --no-*
        if no_supernode_auth and supernode_auth is not None:
            raise DeployError("--no-supernode-auth and --supernode-auth exclude each other")
        if supernode_auth is None and not no_supernode_auth:
            raise DeployError("--supernode-auth: SuperNode authentication is on by default: pass --supernode-auth "
                              "DIR (the supernode-<i>.pub of `fedasync keys gen`; needs TLS), or --no-supernode-auth")
        auth_keys = supernode_auth_keys(supernode_auth) if supernode_auth is not None else {}
        if resume is None and "signing" in cfg.deploy.model_fields_set and not cfg.deploy.signing and not no_signing:
            raise DeployError("deploy.signing: false has no effect: fedasync server signs by default; turn signing "
                              "off with --no-signing")
        cfg.deploy.signing = not no_signing  # what the ServerApp reads; deploy.signing in the YAML does not count
        public_keys, missing = client_public_keys(cfg)
    except DeployError as e:
        fail(str(e), e.code)
    if no_supernode_auth:
        err_console.print("warning: --no-supernode-auth: any SuperNode that reaches the SuperLink can join and "
                          "claim any partition id", highlight=False, markup=False)
    if no_signing:
        err_console.print("warning: --no-signing: updates are not signed; any node serving a client id is "
                          "believed", highlight=False, markup=False)
    if missing:
        err_console.print(f"warning: no public key for client(s) {missing[:10]}: their updates will be "
                          "rejected as unknown_client", highlight=False, markup=False)
    try:  # paths and messages are printed as they are, never read as rich markup
        run = ServerRun(cfg, out, resume=resume, host=host, port=port, superlink=superlink, tls=tls,
                        auth_keys=auth_keys, public_keys=public_keys, verbose=verbose, control_port=control_port,
                        base_dir=base_dir,
                        say=lambda m: console.print(m, markup=False),
                        warn=lambda m: err_console.print(m, highlight=False, markup=False))
    except DeployError as e:
        fail(str(e), e.code)
    out = run.out
    stop_asked = {"n": 0}

    def on_sigint(signum, frame):
        stop_asked["n"] += 1
        if stop_asked["n"] >= 3:
            raise KeyboardInterrupt

    prev = signal.signal(signal.SIGINT, on_sigint)
    prev_term = signal.signal(signal.SIGTERM, on_sigint)
    try:
        run.start()
        with progress_bars() as bars:
            summary = run.follow(RunProgress(bars, cfg.name, cfg), lambda: stop_asked["n"],
                                 calibration=CalibrationBar(bars))  # DP noise calibration in the ServerApp
    except DeployError as e:
        fail(str(e), e.code)
    except KeyboardInterrupt:
        run.stop_flower_run()
        err_console.print("stopped at once (the run may be marked running; continue it with --resume)")
        raise typer.Exit(130)
    finally:
        signal.signal(signal.SIGINT, prev)
        signal.signal(signal.SIGTERM, prev_term)
        run.close()
    if summary is None:
        raise typer.Exit(1)
    console.print(summary_table({cfg.server.strategy: summary}, f"{cfg.name} (deployment, seed {cfg.seed})"))
    if summary.get("rejections"):
        console.print("rejected: " + ", ".join(f"{k}={v}" for k, v in summary["rejections"].items()),
                      markup=False)
    console.print(f"wrote {out / 'summary.json'}, {out / 'history.csv'}, {out / 'accuracy.png'}; store "
                  f"{summary['store_url']}", markup=False)
    if summary["stop_reason"] == "interrupted":
        console.print(f"stopped; continue with: fedasync server --resume {summary['run_id']} --out {out}",
                      markup=False)


def register(app: typer.Typer) -> None:
    app.command("server")(server)
    app.command("client")(client)
    app.add_typer(keys_app, name="keys")
    app.add_typer(certs_app, name="certs")
