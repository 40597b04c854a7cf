"""``fedasync server`` end to end, below the CLI: TLS settings, the run directory, our SuperLink
(:mod:`fedasync.deploy.superlink`: its public port serves SuperNodes only; this module talks to its
Control API on the loopback listener), SuperNode key registration, submitting the deployment
ServerApp, following it to the end.

The ServerApp (``fedasync.server.app:deploy_app``) runs in a ``flwr-serverapp`` process of the
SuperLink and writes the run directory itself (``summary.json``, ``history.csv``,
``accuracy.png``, ``config.yaml``, the store, ``server.log``); :meth:`ServerRun.follow` reads its
status file and the store. A first stop request asks the ServerApp to stop (the run's store
status becomes ``stopping``; it is then marked ``stopped`` and ``--resume`` continues it); a
second stops the Flower run at once.

What travels to Flower is no secret: the run config submitted with ``flwr run`` (which the
SuperLink hands every SuperNode, and Flower merges into each ClientApp's ``context.run_config``)
holds only ``job = {"job_file": PATH, "sha256": HEX}``. The job itself (the whole config, store
URL and password included, the run directory, the keys' registry) is ``<out>/server-job.json``,
0600 in the 0700 run directory, read by the ServerApp process on this host (:data:`JOB_FILE`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fedasync.config import Config
from fedasync.deploy import DeployError
from fedasync.deploy.federation import APP_PYPROJECT, Federation, store_progress
from fedasync.deploy.processes import check_port_free, parse_address, tail, wait_for_port
from fedasync.deploy.superlink import CONTROL_HOST, names_loopback
from fedasync.private import private_dir, private_umask, write_private

Say = Callable[[str], None]

#: the server-only job file in the run directory (0600): what the deployment ServerApp runs
JOB_FILE = "server-job.json"


@dataclass
class TLS:
    """``certs`` (CA, certificate, key: our SuperLink's), ``ca`` (verifies the SuperLink), or
    ``insecure``."""

    insecure: bool
    certs: Optional[tuple[Path, Path, Path]] = None
    ca: Optional[Path] = None


def resolve_tls(superlink: Optional[str], certs: Optional[Path], ssl_certfile: Optional[Path],
                ssl_keyfile: Optional[Path], ssl_ca_certfile: Optional[Path], root_certificates: Optional[Path],
                insecure: bool, supernode_auth: bool) -> TLS:
    """The TLS settings from ``fedasync server``'s options (DeployError naming the option)."""
    if certs is not None:
        ssl_ca_certfile = ssl_ca_certfile or certs / "ca.crt"
        ssl_certfile = ssl_certfile or certs / "server.pem"
        ssl_keyfile = ssl_keyfile or certs / "server.key"
    tls = [p for p in (ssl_certfile, ssl_keyfile, ssl_ca_certfile) if p is not None]
    if insecure and (tls or root_certificates):
        raise DeployError("--insecure excludes --certs/--ssl-*/--root-certificates")
    if insecure and supernode_auth:
        raise DeployError("--supernode-auth: SuperNode authentication needs TLS (drop --insecure, give --certs)")
    if superlink is None and not insecure and len(tls) != 3:
        raise DeployError("TLS: give --certs DIR (from `fedasync certs gen`) or --ssl-certfile, --ssl-keyfile and "
                          "--ssl-ca-certfile (or --insecure for a test on one machine)")
    ca = root_certificates or ssl_ca_certfile
    if superlink is not None and not insecure and ca is None:
        raise DeployError("--superlink: give --root-certificates CA (or --certs DIR) to verify it, or --insecure")
    for opt, p in (("--ssl-certfile", ssl_certfile), ("--ssl-keyfile", ssl_keyfile),
                   ("--ssl-ca-certfile", ssl_ca_certfile), ("--root-certificates", root_certificates)):
        if p is not None and not p.is_file():
            raise DeployError(f"{opt}: {p}: no such file")
    return TLS(insecure=insecure, certs=None if insecure else (ssl_ca_certfile, ssl_certfile, ssl_keyfile), ca=ca)


def check_control_port(control_port: int, port: int) -> None:
    """DeployError naming ``--control-port`` unless our SuperLink can take ``127.0.0.1:control_port``
    for its control listener (a port, not the public ``port``, free)."""
    if not 0 < control_port < 65536:
        raise DeployError(f"--control-port: {control_port} is not a port")
    if control_port == port:
        raise DeployError(f"--control-port: {control_port} is the public --port; the control listener needs its own")
    try:
        check_port_free(CONTROL_HOST, control_port)
    except DeployError:
        raise DeployError(f"--control-port: {CONTROL_HOST}:{control_port} is in use") from None


def check_out_dir(out: Optional[Path], resume: Optional[int]) -> None:
    """DeployError (one line naming ``--out``) when ``out`` cannot take the run
    (:func:`fedasync.outputs.out_dir_problem`)."""
    from fedasync.outputs import out_dir_problem

    problem = out_dir_problem(out, resume)
    if problem:
        raise DeployError(problem)


class ServerRun:
    """One ``fedasync server``: :meth:`start`, then :meth:`follow`; :meth:`close` always."""

    def __init__(self, cfg: Config, out: Optional[Path], *, resume: Optional[int], host: str, port: int,
                 superlink: Optional[str], tls: TLS, auth_keys: dict[int, Path], public_keys: dict[int, bytes],
                 verbose: bool = False, say: Say = print, warn: Say = print, control_port: int = 0,
                 base_dir: Optional[Path] = None):
        """Creates the run directory (``out``, default ``runs/<name>-<time>/``, 0700). ``control_port``:
        our SuperLink's control listener on 127.0.0.1 (0: a free port). ``base_dir``: the YAML's folder,
        where the ServerApp imports a user ``task:`` from (in the job)."""
        from fedasync.outputs import make_run_dir

        self.cfg, self.resume, self.host, self.port, self.superlink = cfg, resume, host, port, superlink
        self.tls, self.auth_keys, self.public_keys = tls, auth_keys, public_keys
        self.say, self.warn = say, warn
        self.base_dir = None if base_dir is None else str(Path(base_dir).resolve())
        try:
            self.out = make_run_dir(out, cfg.name).resolve()
        except ValueError as e:
            raise DeployError(str(e)) from None
        (self.out / "server-status.json").unlink(missing_ok=True)
        if os.environ.get("FLWR_HOME"):
            self.home = Path(os.environ["FLWR_HOME"])
            self.home.mkdir(parents=True, exist_ok=True)
        else:
            self.home = private_dir(self.out / "flwr")
        from fedasync.store import default_sqlite_url

        self.store_url = cfg.store.url or default_sqlite_url(self.out)  # as the ServerApp opens it
        # our SuperLink's Control API is on a loopback listener (:meth:`start` moves the address there)
        self.connect = superlink or f"{CONTROL_HOST}:{port}"
        with private_umask():  # the flwr CLI's config, in the run directory
            self.fed = Federation(self.home, self.connect, tls.ca, tls.insecure, verbose, control_port)
        self.flower_run: int | None = None

    def start(self) -> None:
        """Our SuperLink (unless ``superlink`` was given), the SuperNode keys, the ServerApp. The
        SuperLink and the ServerApp processes it starts create their files private (umask 077)."""
        with private_umask():
            self._start()

    def _start(self) -> None:
        out, fed = self.out, self.fed
        if self.superlink is None:
            check_port_free(self.host, self.port)  # else another SuperLink would get our run
            if self.tls.certs is not None and not names_loopback(self.tls.certs[1]):
                raise DeployError(f"--ssl-certfile: {self.tls.certs[1]} does not name {CONTROL_HOST}, where the "
                                  "SuperLink's control listener is (`fedasync certs gen` adds it)")
            fed.start_superlink(self.host, self.port, self.tls.certs, bool(self.auth_keys), out / "superlink.log")
            # the port answering is not enough: it may be someone else's; ours must still run
            control = fed.wait_control(60)
            if control is not None:
                fed.use_address(f"{CONTROL_HOST}:{control}")  # Control API: the loopback listener only
            chost, cport = parse_address(fed.address)
            if (control is None or not wait_for_port(chost, cport, 60, fed.proc)
                    or fed.proc.poll() is not None):
                raise DeployError(f"the SuperLink did not start (see {out / 'superlink.log'}):\n"
                                  f"{tail(out / 'superlink.log')}", 1)
            self.say(f"SuperLink on {self.host}:{self.port} ({'insecure' if self.tls.insecure else 'TLS'}"
                     f"{', SuperNode authentication' if self.auth_keys else ''}; SuperNodes only), "
                     f"control listener {fed.address}; log {out / 'superlink.log'}")
        registered: dict[int, int] = {}
        for c, pub in self.auth_keys.items():
            try:
                registered[c] = fed.register(pub)
            except RuntimeError as e:
                if not already_registered(str(e)):
                    raise DeployError(str(e), 1) from None
                node = fed.registered_node(pub)  # registered before (--resume, an external SuperLink)
                if node is not None:
                    registered[c] = node
                else:
                    self.warn(f"warning: {pub.name} is already registered with this SuperLink (its node id is "
                              f"not listed to us: client {c} is not tied to its key)")
        if registered:
            self.say(f"registered {len(registered)} SuperNode key(s) (clients {sorted(registered)})")
        self.flower_run = self._submit(registered)
        self.say(f"submitted the fedasync ServerApp: Flower run {self.flower_run}; run directory {out}")

    def _submit(self, registered: dict[int, int]) -> int:
        """Write the job file and the run config that names it, build the app, ``flwr run`` it."""
        import tomli_w

        from fedasync import __version__ as fv

        job = {"config_yaml": self.cfg.to_yaml(), "out": str(self.out), "resume": self.resume,
               "public_keys": {str(c): k.hex() for c, k in self.public_keys.items()},
               "registered": {str(c): n for c, n in registered.items()}}
        if self.base_dir is not None:
            job["base_dir"] = self.base_dir
        raw = json.dumps(job).encode()
        job_file = write_private(self.out / JOB_FILE, raw)
        app_dir = self.home / "fedasync-deploy"  # what Flower packs into the app every SuperNode fetches
        app_dir.mkdir(parents=True, exist_ok=True)
        (app_dir / "pyproject.toml").write_text(APP_PYPROJECT.format(version=fv if re.fullmatch(r"\d+\.\d+\.\d+", fv)
                                                                     else "0.1.0"))
        rc = self.home / "run-config.toml"
        write_private(rc, tomli_w.dumps({"job": json.dumps({"job_file": str(job_file),
                                                            "sha256": hashlib.sha256(raw).hexdigest()})}))
        try:
            return self.fed.submit(app_dir, rc)
        except RuntimeError as e:
            raise DeployError(str(e), 1) from None

    def stop_flower_run(self) -> None:
        if self.flower_run is not None:
            self.fed.stop_run(self.flower_run)

    def close(self) -> None:
        self.fed.stop_superlink()

    def follow(self, progress: Callable[[dict], None], stop_asked: Callable[[], int],
               calibration: Callable[[int, int], None] | None = None) -> dict | None:
        """Follow the ServerApp through its status file and the store until it is done: its
        summary, or None (failed or stopped at once; said through ``warn``). ``stop_asked()``:
        how many stop requests (Ctrl-C) there were so far; ``calibration(done, total)``: the DP
        noise calibration while the ServerApp starts (its status file's ``calibration``)."""
        from fedasync.store import Store

        fed, out, flower_run, warn = self.fed, self.out, self.flower_run, self.warn
        status_path = out / "server-status.json"
        store = None
        run_id = None
        t0 = time.monotonic()
        last_flower_check = 0.0
        asked = 0
        while True:
            if fed.proc is not None and fed.proc.poll() is not None:
                warn(f"the SuperLink exited ({fed.proc.returncode}):\n{tail(fed.log_path)}")
                return None
            st = _read_status(status_path)
            state = st.get("state")
            if state == "failed":
                warn(f"the ServerApp failed: {st.get('error')}\n(see {out / 'server.log'})")
                return None
            if calibration is not None and state == "starting" and isinstance(st.get("calibration"), list):
                calibration(*st["calibration"][:2])
            if st.get("run_id") is not None and store is None:
                run_id = int(st["run_id"])
                store = Store(self.store_url, create=False)  # the status file shows it masked
            if store is not None:
                if stop_asked() > asked:
                    asked = stop_asked()
                    if asked == 1:
                        warn("stopping after the reply being handled (Ctrl-C again to stop the Flower run at once)")
                        store.set_run_status(run_id, "stopping")
                    else:
                        fed.stop_run(flower_run)
                        warn("Flower run stopped; continue it with --resume")
                        return None
                try:
                    p = store_progress(store, run_id)
                    progress({"version": p["version"], "virtual_time_s": time.monotonic() - t0, "updates": p["updates"],
                              "accepted": p["accepted"], "accuracy": p["accuracy"], "live": p["live"]})
                except Exception:
                    pass
            elif stop_asked() > asked:
                fed.stop_run(flower_run)
                warn("stopped before the ServerApp started")
                return None
            if state == "done":
                try:
                    return json.loads((out / "summary.json").read_text())
                except (OSError, json.JSONDecodeError):
                    time.sleep(0.5)
                    continue
            now = time.monotonic()
            if now - last_flower_check > 5:
                last_flower_check = now
                fs = fed.run_status(flower_run)
                if fs and fs.startswith("finished"):
                    time.sleep(1.0)
                    if _read_status(status_path).get("state") != "done":
                        warn(f"the Flower run ended ({fs}) before the ServerApp finished; see "
                             f"{out / 'server.log'} and {out / 'superlink.log'}"
                             + (f"; continue with --resume {run_id}" if run_id is not None else ""))
                        return None
            time.sleep(1.0)


def read_job(ref: str) -> dict:
    """The job that run config ``job`` (``{"job_file": PATH, "sha256": HEX}``, written by
    :meth:`ServerRun._submit`) names: the file's JSON, once its sha256 is the one submitted.
    RuntimeError (one line) otherwise. The deployment ServerApp calls it."""
    if not ref:
        raise RuntimeError("run config `job` is empty: start deployments with `fedasync server`")
    try:
        named = json.loads(ref)
        path, digest = Path(named["job_file"]), str(named["sha256"])
    except (ValueError, TypeError, KeyError):
        raise RuntimeError("run config `job` names no job file: start deployments with `fedasync server`") from None
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RuntimeError(f"run config `job`: cannot read {path}: {e.strerror or e}") from None
    if hashlib.sha256(raw).hexdigest() != digest:
        raise RuntimeError(f"run config `job`: {path} is not the job that was submitted (sha256 differs)")
    return json.loads(raw)


def already_registered(error: str) -> bool:
    """Flower's answer to a SuperNode key registered before: "Public key already in use" (gRPC)
    or HTTP 412 Precondition Failed (the Control API over HTTP)."""
    e = error.lower()
    return "already" in e or "412" in e or "precondition failed" in e


def _read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
