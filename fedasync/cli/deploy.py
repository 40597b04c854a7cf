"""Deployment: ``fedasync server``, ``fedasync client``, ``fedasync keys gen``, ``fedasync certs gen``.

``fedasync server CONFIG`` starts a Flower SuperLink (or, with ``--superlink``, uses a running
one), registers the SuperNodes' authentication keys, and submits the deployment ServerApp
(``fedasync.server.app:deploy_app``) with ``flwr run``; the SuperLink runs it in a
``flwr-serverapp`` process. This command then follows the run in the store (progress bar) and
writes nothing itself: the ServerApp writes the run directory (``summary.json``, ``history.csv``,
``accuracy.png``, ``config.yaml``, the store, ``server.log``). Ctrl-C asks the ServerApp to stop
(the run is marked ``stopped``; ``--resume`` continues it); a second Ctrl-C stops the Flower run.

``fedasync client`` replaces itself with ``flower-supernode`` running the fedasync ClientApp;
the node config carries ``partition-id``, ``num-partitions``, ``data-path``, ``signing-key``,
``device`` and ``privacy-state-dir`` (see ``fedasync.clients.app``).

Everything Flower keeps (its CLI config, the SuperLink's apps) lives in ``<out>/flwr/`` unless
``FLWR_HOME`` is set; the Flower app submitted is a generated ``pyproject.toml`` only (the
SuperLink and SuperNodes run the installed ``fedasync``).
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(out: Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """A CA (``ca.crt``, ``ca.key``) and a server certificate for ``hosts`` signed by it
    (``server.pem``, ``server.key``): what ``flower-superlink --ssl-*`` and
    ``flower-supernode --root-certificates`` take."""
    paths = {"ca": out / "ca.crt", "ca_key": out / "ca.key", "cert": out / "server.pem", "key": out / "server.key"}
    for p in paths.values():
        if p.exists():
            raise FileExistsError(f"{p} exists (not overwriting)")
    out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    until = now + _dt.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedasync CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP384R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_private(paths["ca_key"], _pem_key(ca_key))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(paths["key"], _pem_key(key))
    return paths


def make_supernode_auth_key(out: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format: what Flower's SuperNode authentication takes
    (``flower-supernode --auth-supernode-private-key``, ``flwr supernode register KEY.pub``)."""
    out.mkdir(parents=True, exist_ok=True)
    priv, pub = out / f"{name}.key", out / f"{name}.pub"
    for p in (priv, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists (not overwriting a key)")
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub


# -- small helpers ---------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment for Flower's processes: this interpreter's bin directory first on PATH,
    since flower-supernode and flower-superlink start further Flower executables by name
    (flower-superexec, flwr-clientapp, flwr-serverapp) even when the venv is not activated."""
    env = dict(os.environ, **extra)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def _exe(name: str) -> str:
    """A console script of this environment (next to the interpreter), else on PATH."""
    p = Path(sys.executable).with_name(name)
    if p.exists():
        return str(p)
    found = shutil.which(name)
    if not found:
        from fedasync.cli.common import fail

        fail(f"{name}: not found (is flwr installed in this environment?)")
    return found


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM when its parent dies, even by SIGKILL (no orphan SuperLink)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def parse_address(addr: str, what: str = "--superlink") -> tuple[str, int]:
    from fedasync.cli.common import fail

    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", addr.strip())
    if not m or not 0 < int(m.group(2)) < 65536:
        fail(f"{what}: expected HOST:PORT, got {addr!r}")
    return m.group(1), int(m.group(2))


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid`` from /proc (Linux), None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return int(rest[1]), rest[0], int(rest[19])


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process below ``pid`` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    info = {}
    for p in entries:
        st = _proc_stat(p)
        if st is not None:
            info[p] = st
            children.setdefault(st[0], []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, info[c][2]))
            todo.append(c)
    return out


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def stop_process(proc: subprocess.Popen, timeout: float = 10.0, tree: bool = True) -> None:
    """SIGTERM, then SIGKILL after ``timeout``: the process we started, by its PID, and (``tree``)
    the processes it started (Flower's SuperExec, ServerApp and ClientApp processes), found by
    walking /proc before it is stopped; each is checked by PID and start time before a signal."""
    below = descendants(proc.pid) if tree else []
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass
    # Flower's children exit when their parent does (they watch it); give them a moment
    t0 = time.monotonic()
    while any(_alive(p, s) for p, s in below) and time.monotonic() - t0 < timeout:
        time.sleep(0.2)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [(p, s) for p, s in below if _alive(p, s)]
        for p, s in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if left and sig == signal.SIGTERM:
            time.sleep(2.0)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _last_json(text: str) -> dict:
    """The last JSON object printed on stdout (flwr --format json may print other lines first)."""
    start = text.rfind("\n{")
    start = 0 if start < 0 else start + 1
    while start >= 0:
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            start = text.rfind("\n{", 0, start - 1)
            start = -1 if start < 0 else start + 1
    raise ValueError(f"no JSON in output: {text[-300:]!r}")


def resume_config(config: Optional[str], set_: list[str], out: Optional[Path], run_id: int, cfg,
                  mode: str):
    """The config that continues run ``run_id``: its stored config (with ``--set``) when no CONFIG
    is given, else CONFIG (with ``--set``), which must agree with it on everything that defines the
    experiment (:func:`fedasync.server.loop.check_resume_config`)."""
    import yaml

    from fedasync.cli.common import fail
    from fedasync.config import ConfigError, apply_overrides, config_from_dict
    from fedasync.server.loop import check_resume_config
    from fedasync.store import Store, default_sqlite_url

    url = cfg.store.url or (default_sqlite_url(out) if out is not None else None)
    if url is None:
        fail("--resume: give --out DIR, the run's directory (it holds the store), or set store.url")
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).is_file():
        fail(f"--resume: no store at {url}")
    st = Store(url)
    try:
        run = st.get_run(run_id)
    except KeyError:
        fail(f"--resume: no run {run_id} in {url}")
    finally:
        st.close()
    if run.mode != mode:
        fail(f"--resume: run {run_id} is a {run.mode} run, not a {mode} run")
    if config is None:
        try:
            new = config_from_dict(apply_overrides(yaml.safe_load(run.config_yaml) or {}, set_))
        except ConfigError as e:
            fail(str(e))
        return new.model_copy(update={"store": cfg.store}) if cfg.store.url else new
    why = check_resume_config(run.config_yaml, cfg)
    if why:
        fail(f"--resume {run_id}: {why}")
    return cfg


# -- keys and certificates --------------------------------------------------------------

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
    from fedasync.cli.common import console, fail
    from fedasync.signing import generate_key, save_keypair

    if clients <= 0 or first < 0:
        fail("--clients must be > 0 and --first >= 0")
    ids = range(first, first + clients)
    names = [f"client-{i}.{e}" for i in ids for e in ("key", "pub")]
    if supernode_auth:
        names += [f"supernode-{i}.{e}" for i in ids for e in ("key", "pub")]
    clash = [n for n in names if (out / n).exists()]
    if clash:
        fail(f"--out: {out / clash[0]} exists (not overwriting keys)")
    for i in ids:
        save_keypair(generate_key(), out, f"client-{i}")
        if supernode_auth:
            make_supernode_auth_key(out, f"supernode-{i}")
    console.print(f"wrote {len(names)} key files for clients {first}-{first + clients - 1} to {out} "
                  "(*.key are private: give device i only its own)")


@certs_app.command("gen")
def certs_gen(
    out: Path = typer.Option(..., "--out", help="Directory to write ca.crt, ca.key, server.pem, server.key to."),
    host: list[str] = typer.Option(..., "--host", help="Name or IP the devices use to reach the SuperLink "
                                   "(repeatable); 127.0.0.1 and localhost are always added."),
    days: int = typer.Option(365, "--days", help="Validity in days."),
) -> None:
    """Make a CA and a SuperLink certificate signed by it (TLS)."""
    from fedasync.cli.common import console, fail

    if days <= 0:
        fail("--days must be > 0")
    hosts = list(dict.fromkeys([h.strip() for h in host if h.strip()] + ["127.0.0.1", "localhost"]))
    try:
        paths = make_certs(out, hosts, days)
    except FileExistsError as e:
        fail(f"--out: {e}")
    console.print(f"wrote {paths['ca']} (give it to every device: --root-certificates), {paths['cert']} and "
                  f"{paths['key']} (the SuperLink's); hosts: {', '.join(hosts)}")


# -- fedasync client --------------------------------------------------------------------


def supernode_command(superlink: str, partition_id: int, num_partitions: int, data: Optional[Path] = None,
                      root_certificates: Optional[Path] = None, insecure: bool = False,
                      auth_key: Optional[Path] = None, signing_key: Optional[Path] = None,
                      port: Optional[int] = None, device: Optional[str] = None,
                      privacy_state_dir: Optional[Path] = None, max_wait_time: Optional[float] = None) -> list[str]:
    """The ``flower-supernode`` command line for one device."""
    node = {"partition-id": partition_id, "num-partitions": num_partitions, "deployed": True}
    if data is not None:
        node["data-path"] = str(data.resolve())
    if signing_key is not None:
        node["signing-key"] = str(signing_key.resolve())
    if device:
        node["device"] = device
    if privacy_state_dir is not None:
        node["privacy-state-dir"] = str(privacy_state_dir.resolve())
    node_config = " ".join(f"{k}={json.dumps(v)}" for k, v in node.items())
    cmd = [_exe("flower-supernode"), "--superlink", superlink, "--node-config", node_config]
    if insecure:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(root_certificates.resolve())]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key.resolve())]
    if port is not None:
        cmd += ["--port", str(port)]
    if max_wait_time is not None:
        cmd += ["--max-wait-time", str(max_wait_time)]
    return cmd


def client(
    superlink: str = typer.Option(..., "--superlink", help="The SuperLink's HOST:PORT."),
    partition_id: int = typer.Option(..., "--partition-id", help="This device's client id (0..N-1)."),
    num_partitions: int = typer.Option(..., "--num-partitions", help="Number of clients N (data.num_clients)."),
    data: Optional[Path] = typer.Option(None, "--data", help="This device's .npz (x, y); default: its partition "
                                        "generated from the server's setup."),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates",
                                                     help="CA certificate (ca.crt) to verify the SuperLink."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP, no TLS (tests on one machine only)."),
    auth_key: Optional[Path] = typer.Option(None, "--auth-key", help="SuperNode authentication key "
                                            "(supernode-<i>.key, registered by the server)."),
    signing_key: Optional[Path] = typer.Option(None, "--signing-key", help="Ed25519 key to sign updates "
                                               "(client-<i>.key)."),
    port: Optional[int] = typer.Option(None, "--port", help="The SuperNode's local port (one per SuperNode on a "
                                       "machine; Flower's default 9094)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu, cuda or mps (overrides train.device)."),
    privacy_state_dir: Optional[Path] = typer.Option(None, "--privacy-state-dir",
                                                     help="Where this device keeps its DP accountant."),
    max_wait_time: Optional[float] = typer.Option(None, "--max-wait-time",
                                                  help="Give up after this many seconds without the SuperLink."),
) -> None:
    """Run this device's SuperNode (flower-supernode with the fedasync ClientApp)."""
    from fedasync.cli.common import err_console, fail

    parse_address(superlink)
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
    for opt, p in (("--data", data), ("--root-certificates", root_certificates), ("--auth-key", auth_key),
                   ("--signing-key", signing_key)):
        if p is not None and not p.is_file():
            fail(f"{opt}: {p}: no such file")
    if data is not None:
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
    if device is not None and device not in ("auto", "cpu", "cuda", "mps"):
        fail(f"--device: {device!r} is not one of auto, cpu, cuda, mps")
    if port is not None and not 0 < port < 65536:
        fail(f"--port: {port} is not a port")
    cmd = supernode_command(superlink, partition_id, num_partitions, data, root_certificates, insecure, auth_key,
                            signing_key, port, device, privacy_state_dir, max_wait_time)
    err_console.print(f"fedasync client {partition_id}/{num_partitions}: starting flower-supernode "
                      f"(SuperLink {superlink})", highlight=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, child_env())


# -- fedasync server ---------------------------------------------------------------------

APP_PYPROJECT = """[project]
name = "fedasync-deploy"
version = "{version}"
description = "fedasync deployment ServerApp (generated by `fedasync server`)"
dependencies = []

[tool.flwr.app]
publisher = "fedasync"

[tool.flwr.app.components]
serverapp = "fedasync.server.app:deploy_app"
clientapp = "fedasync.clients.app:app"

[tool.flwr.app.config]
job = ""
"""


class Federation:
    """The Flower side of ``fedasync server``: a SuperLink (ours or given) and the flwr CLI."""

    def __init__(self, home: Path, address: str, ca: Optional[Path], insecure: bool, verbose: bool = False):
        self.home = home
        self.address = address
        self.cli_home = home / "cli"
        self.cli_home.mkdir(parents=True, exist_ok=True)
        lines = ['[superlink]', 'default = "fedasync"', '', '[superlink.fedasync]', f'address = "{address}"']
        lines.append("insecure = true" if insecure else f'root-certificates = "{ca.resolve()}"')
        (self.cli_home / "config.toml").write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.verbose = verbose
        self._client = None  # Flower's Control API client, in this process (each flwr CLI call costs seconds)

    def control(self):
        """Flower's Control API client for our connection (its internals; None if they moved)."""
        if self._client is None:
            old = os.environ.get("FLWR_HOME")
            os.environ["FLWR_HOME"] = str(self.cli_home.resolve())
            try:
                from flwr.cli.flower_config import read_superlink_connection
                from flwr.cli.utils import init_http_client_from_connection

                self._client = init_http_client_from_connection(read_superlink_connection("fedasync"))
            except Exception:
                self._client = False
            finally:
                if old is None:
                    os.environ.pop("FLWR_HOME", None)
                else:
                    os.environ["FLWR_HOME"] = old
        return self._client or None

    def start_superlink(self, host: str, port: int, certs: Optional[tuple[Path, Path, Path]], auth: bool,
                        log_path: Path) -> None:
        cmd = [_exe("flower-superlink"), "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
        if certs is None:
            cmd.append("--insecure")
        else:
            ca, cert, key = certs
            cmd += ["--ssl-ca-certfile", str(ca.resolve()), "--ssl-certfile", str(cert.resolve()),
                    "--ssl-keyfile", str(key.resolve())]
        if auth:
            cmd.append("--enable-supernode-auth")
        env = child_env()
        env.setdefault("FLWR_HOME", str((self.home / "superlink").resolve()))
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        self.log_path = log_path
        logf = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        logf.close()

    def stop_superlink(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def flwr(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
        env = child_env(FLWR_HOME=str(self.cli_home.resolve()))
        try:
            return subprocess.run([_exe("flwr"), *args], capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, stdout="", stderr=f"timed out after {timeout:.0f} s")

    def register(self, pub: Path) -> int:
        """Register a SuperNode auth key; Flower answers with the node id it will have."""
        client = self.control()
        if client is not None:
            try:
                from flwr.cli.supernode.register import try_load_public_key
                from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=E0611

                res = client.RegisterNode(request=RegisterNodeRequest(public_key=try_load_public_key(pub)))
                if res.node_id:
                    return int(res.node_id)
            except ImportError:
                pass
            except Exception as e:  # e.g. already registered
                raise RuntimeError(f"registering {pub.name} failed: {e}") from None
        r = self.flwr("supernode", "register", str(pub.resolve()), "fedasync", "--format", "json")
        try:
            data = _last_json(r.stdout)
        except ValueError:
            data = {}
        if r.returncode != 0 or not data.get("success"):
            raise RuntimeError(f"registering {pub.name} failed: {(r.stdout + r.stderr).strip()[-300:]}")
        return int(data["node-id"])

    def submit(self, app_dir: Path, run_config: Path) -> int:
        r = self.flwr("run", str(app_dir.resolve()), "fedasync", "--run-config", str(run_config.resolve()),
                      "--format", "json")
        try:
            data = _last_json(r.stdout)
        except ValueError:
            data = {}
        if r.returncode != 0 or not data.get("success"):
            raise RuntimeError(f"flwr run failed: {(r.stdout + r.stderr).strip()[-500:]}")
        return int(data["run-id"])

    def run_status(self, flower_run: int) -> str | None:
        """``pending``, ``starting``, ``running`` or ``finished:<completed|failed|stopped>``."""
        client = self.control()
        if client is not None:
            try:
                from flwr.common.serde import run_from_proto
                from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611

                res = client.ListRuns(ListRunsRequest(run_id=flower_run))
                for proto in res.run_dict.values():
                    st = run_from_proto(proto).status
                    return f"{st.status}:{st.sub_status}" if st.sub_status else st.status
                return None
            except ImportError:
                pass
            except Exception:
                return None
        r = self.flwr("ls", "fedasync", "--run-id", str(flower_run), "--format", "json", timeout=30)
        try:
            runs = _last_json(r.stdout).get("runs") or []
        except ValueError:
            return None
        return runs[0].get("status") if runs else None

    def stop_run(self, flower_run: int) -> None:
        self.flwr("stop", str(flower_run), "fedasync", timeout=30)


def _store_progress(store, run_id: int) -> dict:
    from sqlalchemy import func, select

    from fedasync.store import schema as S

    run = store.get_run(run_id)
    counts = store.counts(run_id)
    with store.session() as s:
        acc = s.execute(select(S.ModelVersion.accuracy).where(S.ModelVersion.run_id == run_id,
                                                              S.ModelVersion.accuracy.is_not(None))
                        .order_by(S.ModelVersion.version.desc()).limit(1)).scalar()
        live = s.scalar(select(func.count()).select_from(S.Dispatch)
                        .where(S.Dispatch.run_id == run_id, S.Dispatch.status == "in_flight"))
    return {"status": run.status, "version": run.current_version, "updates": counts["updates"],
            "accepted": counts["accepted"], "accuracy": acc, "live": live}


def server(
    config: Optional[str] = typer.Argument(None, help="YAML config (optional with --resume: the run's own)."),
    superlink: Optional[str] = typer.Option(None, "--superlink", help="Use the SuperLink at HOST:PORT instead of "
                                            "starting one (it must run with --disable-runtime-dependency-installation)."),
    resume: Optional[int] = typer.Option(None, "--resume", help="Continue run RUN_ID of the store in --out."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (default runs/<name>-<time>/)."),
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set server.max_versions=50 (repeatable)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the SuperLink listens on (0.0.0.0: every "
                             "interface, for devices on the network)."),
    port: int = typer.Option(9092, "--port", help="The SuperLink's port (Fleet, Control and Runtime APIs)."),
    certs: Optional[Path] = typer.Option(None, "--certs", help="Directory from `fedasync certs gen` (ca.crt, "
                                         "server.pem, server.key)."),
    ssl_certfile: Optional[Path] = typer.Option(None, "--ssl-certfile", help="The SuperLink's TLS certificate."),
    ssl_keyfile: Optional[Path] = typer.Option(None, "--ssl-keyfile", help="The SuperLink's TLS private key."),
    ssl_ca_certfile: Optional[Path] = typer.Option(None, "--ssl-ca-certfile", help="The CA certificate."),
    root_certificates: Optional[Path] = typer.Option(None, "--root-certificates",
                                                     help="With --superlink: the CA to verify it."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP, no TLS (tests on one machine only)."),
    supernode_auth: Optional[Path] = typer.Option(None, "--supernode-auth", help="Directory of supernode-<i>.pub: "
                                                  "turn SuperNode authentication on and register these keys."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="More logging."),
) -> None:
    """Run the asynchronous server on a SuperLink, for SuperNodes started with `fedasync client`."""
    from fedasync.cli.common import (RunProgress, console, deployable_or_exit, err_console, fail, load_or_exit,
                                     progress_bars)
    from fedasync.cli.simulate import _summary_table

    if config is None and resume is None:
        fail("CONFIG: a YAML config is needed (optional only with --resume)")
    cfg = load_or_exit(config, set_)
    if resume is not None:
        cfg = resume_config(config, set_, out, resume, cfg, mode="deployment")
    deployable_or_exit(cfg)  # privacy.reproducible_noise: exit 2
    # -- TLS ---------------------------------------------------------------------------
    if certs is not None:
        ssl_ca_certfile = ssl_ca_certfile or certs / "ca.crt"
        ssl_certfile = ssl_certfile or certs / "server.pem"
        ssl_keyfile = ssl_keyfile or certs / "server.key"
    tls = [p for p in (ssl_certfile, ssl_keyfile, ssl_ca_certfile) if p is not None]
    if insecure and (tls or root_certificates):
        fail("--insecure excludes --certs/--ssl-*/--root-certificates")
    if insecure and supernode_auth is not None:
        fail("--supernode-auth: SuperNode authentication needs TLS (drop --insecure, give --certs)")
    if superlink is None and not insecure and len(tls) != 3:
        fail("TLS: give --certs DIR (from `fedasync certs gen`) or --ssl-certfile, --ssl-keyfile and "
             "--ssl-ca-certfile (or --insecure for a test on one machine)")
    ca = root_certificates or ssl_ca_certfile
    if superlink is not None and not insecure and ca is None:
        fail("--superlink: give --root-certificates CA (or --certs DIR) to verify it, or --insecure")
    for opt, p in (("--ssl-certfile", ssl_certfile), ("--ssl-keyfile", ssl_keyfile),
                   ("--ssl-ca-certfile", ssl_ca_certfile), ("--root-certificates", root_certificates)):
        if p is not None and not p.is_file():
            fail(f"{opt}: {p}: no such file")
    if not 0 < port < 65536:
        fail(f"--port: {port} is not a port")
    # -- keys --------------------------------------------------------------------------
    public_keys: dict[int, bytes] = {}
    if cfg.deploy.signing:
        from fedasync.signing import SigningKeyError, load_public_keys, public_raw

        if not cfg.deploy.public_keys:
            fail("deploy.public_keys: needed when deploy.signing is true (a directory of client-<i>.pub)")
        try:
            public_keys = {c: public_raw(k) for c, k in load_public_keys(cfg.deploy.public_keys).items()}
        except SigningKeyError as e:
            fail(f"deploy.public_keys: {e}")
        outside = [c for c in public_keys if c >= cfg.data.num_clients]
        if outside:
            fail(f"deploy.public_keys: client-{outside[0]}.pub is outside 0-{cfg.data.num_clients - 1}")
        missing = [c for c in range(cfg.data.num_clients) if c not in public_keys]
        if len(missing) == cfg.data.num_clients:
            fail(f"deploy.public_keys: no client-<i>.pub in {cfg.deploy.public_keys}")
        if missing:
            err_console.print(f"warning: no public key for client(s) {missing[:10]}: their updates will be "
                              "rejected as unknown_client", highlight=False)
    auth_keys: dict[int, Path] = {}
    if supernode_auth is not None:
        if not supernode_auth.is_dir():
            fail(f"--supernode-auth: {supernode_auth}: no such directory")
        for p in sorted(supernode_auth.glob("supernode-*.pub")):
            m = re.fullmatch(r"supernode-(\d+)\.pub", p.name)
            if m:
                auth_keys[int(m.group(1))] = p
        if not auth_keys:
            fail(f"--supernode-auth: no supernode-<i>.pub in {supernode_auth}")
    # -- the run directory -----------------------------------------------------------------
    from fedasync.outputs import new_run_dir

    if resume is None and out is not None and out.exists() and any(out.iterdir()):
        fail(f"--out: {out} exists and is not empty")
    if out is None:
        out = new_run_dir(Path("runs"), cfg.name)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "server-status.json").unlink(missing_ok=True)
    home = Path(os.environ["FLWR_HOME"]) if os.environ.get("FLWR_HOME") else out / "flwr"
    home.mkdir(parents=True, exist_ok=True)
    connect = superlink or f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    chost, cport = parse_address(connect)
    fed = Federation(home, connect, ca, insecure, verbose)
    stop_asked = {"n": 0}

    def on_sigint(signum, frame):
        stop_asked["n"] += 1
        if stop_asked["n"] >= 3:
            raise KeyboardInterrupt

    prev = signal.signal(signal.SIGINT, on_sigint)
    prev_term = signal.signal(signal.SIGTERM, on_sigint)
    flower_run = None
    try:
        if superlink is None:
            certs_t = None if insecure else (ssl_ca_certfile, ssl_certfile, ssl_keyfile)
            fed.start_superlink(host, port, certs_t, bool(auth_keys), out / "superlink.log")
            if not wait_for_port(chost, cport, 60, fed.proc):
                fail(f"the SuperLink did not start (see {out / 'superlink.log'}):\n{_tail(out / 'superlink.log')}", 1)
            console.print(f"SuperLink on {host}:{port} ({'insecure' if insecure else 'TLS'}"
                          f"{', SuperNode authentication' if auth_keys else ''}); log {out / 'superlink.log'}")
        registered: dict[int, int] = {}
        for c, pub in auth_keys.items():
            try:
                registered[c] = fed.register(pub)
            except RuntimeError as e:
                if "already" in str(e).lower():
                    err_console.print(f"warning: {pub.name} is already registered with this SuperLink", highlight=False)
                else:
                    fail(str(e), 1)
        if registered:
            console.print(f"registered {len(registered)} SuperNode key(s) (clients {sorted(registered)})")
        job = {"config_yaml": cfg.to_yaml(), "out": str(out), "resume": resume,
               "public_keys": {str(c): k.hex() for c, k in public_keys.items()},
               "registered": {str(c): n for c, n in registered.items()}}
        import tomli_w

        from fedasync import __version__ as fv

        app_dir = home / "fedasync-deploy"
        app_dir.mkdir(parents=True, exist_ok=True)
        (app_dir / "pyproject.toml").write_text(APP_PYPROJECT.format(version=fv if re.fullmatch(r"\d+\.\d+\.\d+", fv)
                                                                     else "0.1.0"))
        rc = home / "run-config.toml"
        rc.write_text(tomli_w.dumps({"job": json.dumps(job)}))
        try:
            flower_run = fed.submit(app_dir, rc)
        except RuntimeError as e:
            fail(str(e), 1)
        console.print(f"submitted the fedasync ServerApp: Flower run {flower_run}; run directory {out}")
        summary = _follow(fed, flower_run, out, cfg, stop_asked, RunProgress, progress_bars, console, err_console)
    except KeyboardInterrupt:
        if flower_run is not None:
            fed.stop_run(flower_run)
        err_console.print("stopped at once (the run may be marked running; continue it with --resume)")
        raise typer.Exit(130)
    finally:
        signal.signal(signal.SIGINT, prev)
        signal.signal(signal.SIGTERM, prev_term)
        fed.stop_superlink()
    if summary is None:
        raise typer.Exit(1)
    console.print(_summary_table({cfg.server.strategy: summary}, f"{cfg.name} (deployment, seed {cfg.seed})"))
    if summary.get("rejections"):
        console.print("rejected: " + ", ".join(f"{k}={v}" for k, v in summary["rejections"].items()))
    console.print(f"wrote {out / 'summary.json'}, {out / 'history.csv'}, {out / 'accuracy.png'}; store "
                  f"{summary['store_url']}")
    if summary["stop_reason"] == "interrupted":
        console.print(f"stopped; continue with: fedasync server --resume {summary['run_id']} --out {out}")


def _follow(fed: Federation, flower_run: int, out: Path, cfg, stop_asked: dict, RunProgress, progress_bars,
            console, err_console) -> dict | None:
    """Follow the ServerApp through its status file and the store until it is done."""
    from fedasync.store import Store

    status_path = out / "server-status.json"
    store = None
    run_id = None
    t0 = time.monotonic()
    last_flower_check = 0.0
    asked = 0
    with progress_bars() as bars:
        prog = RunProgress(bars, cfg.name, cfg)
        while True:
            if fed.proc is not None and fed.proc.poll() is not None:
                err_console.print(f"the SuperLink exited ({fed.proc.returncode}):\n{_tail(fed.log_path)}")
                return None
            try:
                st = json.loads(status_path.read_text())
            except (OSError, json.JSONDecodeError):
                st = {}
            state = st.get("state")
            if state == "failed":
                err_console.print(f"the ServerApp failed: {st.get('error')}\n(see {out / 'server.log'})")
                return None
            if st.get("run_id") is not None and store is None:
                run_id = int(st["run_id"])
                store = Store(st["store_url"], create=False)
            if store is not None:
                if stop_asked["n"] > asked:
                    asked = stop_asked["n"]
                    if asked == 1:
                        err_console.print("stopping after the reply being handled (Ctrl-C again to stop the "
                                          "Flower run at once)")
                        store.set_run_status(run_id, "stopping")
                    else:
                        fed.stop_run(flower_run)
                        err_console.print("Flower run stopped; continue it with --resume")
                        return None
                try:
                    p = _store_progress(store, run_id)
                    prog({"version": p["version"], "virtual_time_s": time.monotonic() - t0, "updates": p["updates"],
                          "accepted": p["accepted"], "accuracy": p["accuracy"], "live": p["live"]})
                except Exception:
                    pass
            elif stop_asked["n"] > asked:
                fed.stop_run(flower_run)
                err_console.print("stopped before the ServerApp started")
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
                    try:
                        st = json.loads(status_path.read_text())
                    except (OSError, json.JSONDecodeError):
                        st = {}
                    if st.get("state") != "done":
                        err_console.print(f"the Flower run ended ({fs}) before the ServerApp finished; see "
                                          f"{out / 'server.log'} and {out / 'superlink.log'}"
                                          + (f"; continue with --resume {run_id}" if run_id is not None else ""))
                        return None
            time.sleep(1.0)


def register(app: typer.Typer) -> None:
    app.command("server")(server)
    app.command("client")(client)
    app.add_typer(keys_app, name="keys")
    app.add_typer(certs_app, name="certs")
