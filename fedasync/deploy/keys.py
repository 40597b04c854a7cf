"""Keys of a deployment: clients' Ed25519 signing keys (``client-<i>.key/.pub``, updates are
signed with them) and SuperNodes' ECDSA P-384 authentication keys (``supernode-<i>.key/.pub``,
Flower's node authentication); the server's registry of both."""

from __future__ import annotations

import re
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedasync.config import Config
from fedasync.deploy import DeployError
from fedasync.deploy.certs import check_out, write_private


def make_supernode_auth_key(out: Path, name: str) -> tuple[Path, Path]:
    """An ECDSA P-384 key pair in OpenSSH format: what Flower's SuperNode authentication takes
    (``flower-supernode --auth-supernode-private-key``, ``flwr supernode register KEY.pub``)."""
    out.mkdir(parents=True, exist_ok=True)
    priv, pub = out / f"{name}.key", out / f"{name}.pub"
    for p in (priv, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists (not overwriting a key)")
    key = ec.generate_private_key(ec.SECP384R1())
    write_private(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub


def key_file_names(ids: range, supernode_auth: bool) -> list[str]:
    names = [f"client-{i}.{e}" for i in ids for e in ("key", "pub")]
    if supernode_auth:
        names += [f"supernode-{i}.{e}" for i in ids for e in ("key", "pub")]
    return names


def generate_keys(out: Path, ids: range, supernode_auth: bool) -> list[str]:
    """Write client-<i>.key/.pub (and supernode-<i>.key/.pub) for ``ids`` to ``out``; nothing is
    written if any of them exists (DeployError naming it). Returns the file names."""
    from fedasync.signing import generate_key, save_keypair

    names = key_file_names(ids, supernode_auth)
    check_out(out)
    clash = [n for n in names if (out / n).exists()]
    if clash:
        raise DeployError(f"--out: {out / clash[0]} exists (not overwriting keys)")
    made = not out.exists()
    try:
        for i in ids:
            save_keypair(generate_key(), out, f"client-{i}")
            if supernode_auth:
                make_supernode_auth_key(out, f"supernode-{i}")
    except OSError as e:  # nothing left behind: the files written so far (all new) go
        for n in names:
            (out / n).unlink(missing_ok=True)
        if made:
            try:
                out.rmdir()
            except OSError:
                pass
        raise DeployError(f"--out: {out}: cannot write the keys ({e.strerror or e})") from None
    return names


def client_public_keys(cfg: Config) -> tuple[dict[int, bytes], list[int]]:
    """``deploy.signing`` (which ``fedasync server`` sets: on unless ``--no-signing``): each client's
    raw Ed25519 public key from ``deploy.public_keys`` and the clients without one (their updates
    are rejected ``unknown_client``); ({}, []) when off. The config's ``deploy.public_keys`` is the
    one way the server learns them."""
    if not cfg.deploy.signing:
        return {}, []
    from fedasync.signing import SigningKeyError, load_public_keys, public_raw

    if not cfg.deploy.public_keys:
        raise DeployError("deploy.public_keys: updates are signed by default: set deploy.public_keys to the "
                          "directory of client-<i>.pub (from `fedasync keys gen`), or pass --no-signing")
    try:
        keys = {c: public_raw(k) for c, k in load_public_keys(cfg.deploy.public_keys).items()}
    except SigningKeyError as e:
        raise DeployError(f"deploy.public_keys: {e}") from None
    n = cfg.data.num_clients
    outside = [c for c in keys if c >= n]
    if outside:
        raise DeployError(f"deploy.public_keys: client-{outside[0]}.pub is outside 0-{n - 1}")
    missing = [c for c in range(n) if c not in keys]
    if len(missing) == n:
        raise DeployError(f"deploy.public_keys: no client-<i>.pub in {cfg.deploy.public_keys}")
    return keys, missing


def check_supernode_pub(p: Path) -> None:
    """DeployError (naming ``--supernode-auth`` and the file) unless ``p`` is an OpenSSH EC public
    key, what Flower registers: found before anything starts, not by the SuperLink."""
    try:
        key = serialization.load_ssh_public_key(p.read_bytes())
    except OSError as e:
        raise DeployError(f"--supernode-auth: {p}: cannot read it ({e.strerror or e})") from None
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise DeployError(f"--supernode-auth: {p}: not an OpenSSH public key (make one with "
                          "`fedasync keys gen`)") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise DeployError(f"--supernode-auth: {p}: not an ECDSA key (make one with `fedasync keys gen`)")


def supernode_auth_keys(directory: Path) -> dict[int, Path]:
    """``--supernode-auth DIR``: client id -> its ``supernode-<i>.pub``."""
    if not directory.is_dir():
        raise DeployError(f"--supernode-auth: {directory}: no such directory")
    keys = {}
    for p in sorted(directory.glob("supernode-*.pub")):
        m = re.fullmatch(r"supernode-(\d+)\.pub", p.name)
        if m:
            check_supernode_pub(p)
            keys[int(m.group(1))] = p
    if not keys:
        raise DeployError(f"--supernode-auth: no supernode-<i>.pub in {directory}")
    return keys
