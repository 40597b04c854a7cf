"""Ed25519 signing of client updates (the ``cryptography`` package).

A client signs every update it returns; the server verifies it with the public key
registered for that client before the update can touch the model.

What is signed is :func:`update_message`: a fixed prefix and the JSON list
``[run_id, task_id, base_version, params_sha256]``, where ``params_sha256`` is
:func:`fedasync.server.strategies.params_sha256` of the returned parameters. The run and
task ids bind a signature to one dispatch (a signature cannot be replayed for another
task or run); the base version binds it to the model the client started from; the hash
binds it to the exact arrays (key order, dtypes, shapes, bytes).

Ledger blocks (:mod:`fedasync.serverless.flchain`): :func:`sign_block` signs
``b"fedasync-block-v1\\n" + bytes.fromhex(block hash)``; a block carries its signer's raw public
key as 64 lowercase hex digits (:func:`valid_block_key`), and the chain's genesis block pins
which keys may sign.

Key files (``fedasync keys gen``):

- ``client-<i>.key``: the private key, PEM (PKCS#8, unencrypted, mode 0600);
- ``client-<i>.pub``: the public key, PEM (SubjectPublicKeyInfo).

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PREFIX = b"fedasync-update-v1\n"
_CLIENT_PUB = re.compile(r"^client-(\d+)\.pub$")


class SigningKeyError(ValueError):
    """A key file that is missing, unreadable or not an Ed25519 key (one-line message)."""


# -- keys ------------------------------------------------------------------------------


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def public_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def public_raw(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of the public key (what a hello reply and the store carry, hex)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def save_keypair(key: Ed25519PrivateKey, directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (0600) and ``name.pub`` in ``directory``; refuses to overwrite."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / f"{name}.key", d / f"{name}.pub"
    for p in (priv, pub):
        if p.exists():
            raise FileExistsError(f"{p} exists (not overwriting a key)")
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem(key))
    pub.write_bytes(public_pem(key))
    return priv, pub


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SigningKeyError(f"{p}: cannot read signing key ({e.strerror or e})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise SigningKeyError(f"{p}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{p}: not an Ed25519 private key ({type(key).__name__})")
    return key


def load_public_key(path_or_bytes: str | Path | bytes) -> Ed25519PublicKey:
    """A PEM public key from a file (or PEM bytes), or 32 raw bytes."""
    where = "public key"
    if isinstance(path_or_bytes, (str, Path)):
        p = Path(path_or_bytes)
        where = str(p)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise SigningKeyError(f"{p}: cannot read public key ({e.strerror or e})") from None
    else:
        data = path_or_bytes
    try:
        if len(data) == 32 and not data.startswith(b"-----"):
            return Ed25519PublicKey.from_public_bytes(data)
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise SigningKeyError(f"{where}: not a PEM public key ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{where}: not an Ed25519 public key ({type(key).__name__})")
    return key


def load_public_keys(directory: str | Path) -> dict[int, Ed25519PublicKey]:
    """Every ``client-<i>.pub`` in ``directory``: {client id: key}."""
    d = Path(directory)
    if not d.is_dir():
        raise SigningKeyError(f"{d}: no such directory of public keys")
    out: dict[int, Ed25519PublicKey] = {}
    for p in sorted(d.iterdir()):
        m = _CLIENT_PUB.match(p.name)
        if m:
            out[int(m.group(1))] = load_public_key(p)
    return out


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """A short, stable label for logs: the first 16 hex digits of the raw public key."""
    return public_raw(key).hex()[:16]


# -- signing ---------------------------------------------------------------------------


def update_message(run_id: int, task_id: int, base_version: int, params_sha256: str) -> bytes:
    """The exact bytes a client signs for one update."""
    if not (isinstance(params_sha256, str) and re.fullmatch(r"[0-9a-f]{64}", params_sha256)):
        raise ValueError("params_sha256: expected 64 lowercase hex digits")
    return PREFIX + json.dumps([int(run_id), int(task_id), int(base_version), params_sha256]).encode()


def sign_update(key: Ed25519PrivateKey, run_id: int, task_id: int, base_version: int,
                params_sha256: str) -> bytes:
    return key.sign(update_message(run_id, task_id, base_version, params_sha256))


def verify_update(key: Ed25519PublicKey, signature: bytes | None, run_id: int, task_id: int,
                  base_version: int, params_sha256: str) -> bool:
    """True iff ``signature`` is ``key``'s signature over this update. Never raises."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 64:
        return False
    try:
        key.verify(bytes(signature), update_message(run_id, task_id, base_version, params_sha256))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


# -- ledger blocks (FLchain) -------------------------------------------------------------

BLOCK_PREFIX = b"fedasync-block-v1\n"


def sign_block(key: Ed25519PrivateKey, hash_hex: str) -> str:
    return key.sign(BLOCK_PREFIX + bytes.fromhex(hash_hex)).hex()


def verify_block_signature(public_key_hex: str, hash_hex: str, signature_hex: str) -> bool:
    """True iff ``signature_hex`` is a valid Ed25519 signature of the block hash. Never raises."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
        key.verify(bytes.fromhex(signature_hex), BLOCK_PREFIX + bytes.fromhex(hash_hex))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def valid_block_key(public_key_hex) -> bool:
    """True iff ``public_key_hex`` is a raw Ed25519 public key as blocks carry it: 64 lowercase
    hex digits that decode to a key. Never raises."""
    if not (isinstance(public_key_hex, str) and re.fullmatch(r"[0-9a-f]{64}", public_key_hex)):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
    except ValueError:
        return False
    return True
