"""Ed25519 signing of client updates (the ``cryptography`` package).

A client signs every update it returns; the server verifies it with the public key
registered for that client before the update can touch the model.

What is signed is :func:`update_message` (version 3): a fixed prefix and the JSON list
``[run_key, run_id, task_id, base_version, params_sha256, num_examples, metrics_sha256]``, where
``run_key`` is the run's random identifier (32 lowercase hex digits, ``secrets.token_hex(16)``, made
when the store creates the run, kept on resume, carried by every task), ``params_sha256`` is
:func:`fedasync.server.strategies.params_sha256` of the returned parameters, ``num_examples`` is
:func:`num_examples_of` the reply's metrics (the aggregation weight the server uses) and
``metrics_sha256`` is :func:`metrics_digest` of the reply's metrics (everything the client reports
and the server records: loss, epsilon and the DP accounting). The run key binds a signature to one
deployment: ``run_id`` is the store's counter (1 in every fresh store), so without the key a reply
signed for one deployment verified in another. The run key, run id and task id bind a signature to
one dispatch (a signature cannot be replayed for another task or run); the base version binds it to
the model the client started from; the hash binds it to the exact arrays (key order, dtypes, shapes,
bytes); the example count and the metrics digest bind what the server weights the update by and
records about its privacy. Versions 1 and 2 (``fedasync-update-v1``/``-v2``: no metrics, no run
key) are no longer accepted.

Ledger blocks (:mod:`fedasync.serverless.flchain`): :func:`sign_block` signs
``b"fedasync-block-v1\\n" + bytes.fromhex(block hash)``; a block carries its signer's raw public
key as 64 lowercase hex digits (:func:`valid_block_key`) and its signature as 128 lowercase hex
digits (any other spelling of the same bytes is refused, so a stored signature's text cannot
change unnoticed), and the chain's genesis block pins which keys may sign.

Key files (``fedasync keys gen``):

- ``client-<i>.key``: the private key, PEM (PKCS#8, unencrypted, mode 0600);
- ``client-<i>.pub``: the public key, PEM (SubjectPublicKeyInfo).

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PREFIX = b"fedasync-update-v3\n"
_CLIENT_PUB = re.compile(r"^client-(\d+)\.pub$")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


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


def num_examples_of(metrics: Any) -> int:
    """The aggregation weight of a reply, as the server takes it from ``metrics["num_examples"]``:
    a non-negative int (0 when missing, negative or not an integer)."""
    x = metrics.get("num_examples", 0) if isinstance(metrics, dict) else 0
    try:
        n = int(x)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(0, n)


def _plain(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays
        return o.tolist()
    raise TypeError(f"metrics: {type(o).__name__} is not JSON")


def metrics_digest(metrics: Any) -> str:
    """sha256 (hex) of the reply's metrics as canonical JSON (sorted keys, no spaces; tuples are
    lists), the same before and after the metrics travel as JSON. Raises TypeError for a value
    that is not JSON."""
    m = metrics if isinstance(metrics, dict) else {}
    body = json.dumps(m, sort_keys=True, separators=(",", ":"), default=_plain)
    return hashlib.sha256(body.encode()).hexdigest()


def update_message(run_id: int, task_id: int, base_version: int, params_sha256: str, num_examples: int,
                   metrics_sha256: str, *, run_key: str) -> bytes:
    """The exact bytes a client signs for one update of the run whose random identifier is
    ``run_key`` (32 lowercase hex digits; anything else raises ValueError)."""
    if not (isinstance(run_key, str) and _HEX32.fullmatch(run_key)):
        raise ValueError("run_key: expected 32 lowercase hex digits (the run's random identifier)")
    for name, v in (("params_sha256", params_sha256), ("metrics_sha256", metrics_sha256)):
        if not (isinstance(v, str) and _HEX64.fullmatch(v)):
            raise ValueError(f"{name}: expected 64 lowercase hex digits")
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples: expected a non-negative int, got {num_examples!r}")
    return PREFIX + json.dumps([run_key, int(run_id), int(task_id), int(base_version), params_sha256,
                                num_examples, metrics_sha256]).encode()


def reply_message(run_id: int, task_id: int, base_version: int, params_sha256: str, metrics: Any, *,
                  run_key: str) -> bytes:
    """:func:`update_message` of a reply with these ``metrics`` (its weight and its metrics digest)."""
    return update_message(run_id, task_id, base_version, params_sha256, num_examples_of(metrics),
                          metrics_digest(metrics), run_key=run_key)


def sign_update(key: Ed25519PrivateKey, run_id: int, task_id: int, base_version: int, params_sha256: str,
                metrics: dict, *, run_key: str) -> bytes:
    """Sign an update of the run ``run_key`` (the task's ``run_key``): its parameters' hash and the
    ``metrics`` it is sent with (sign last: the metrics must not change after this)."""
    return key.sign(reply_message(run_id, task_id, base_version, params_sha256, metrics, run_key=run_key))


def verify_update(key: Ed25519PublicKey, signature: bytes | None, run_id: int, task_id: int,
                  base_version: int, params_sha256: str, metrics: Any, *, run_key: str | None) -> bool:
    """True iff ``signature`` is ``key``'s signature over this update of the run ``run_key`` (the
    verifier's own run: a reply signed for another run fails) and exactly these ``metrics`` (the
    server passes the metrics it uses). Never raises; a missing or malformed ``run_key`` is False."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 64:
        return False
    try:
        key.verify(bytes(signature), reply_message(run_id, task_id, base_version, params_sha256, metrics,
                                                   run_key=run_key))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


# -- ledger blocks (FLchain) -------------------------------------------------------------

BLOCK_PREFIX = b"fedasync-block-v1\n"


def sign_block(key: Ed25519PrivateKey, hash_hex: str) -> str:
    return key.sign(BLOCK_PREFIX + bytes.fromhex(hash_hex)).hex()


def verify_block_signature(public_key_hex: str, hash_hex: str, signature_hex: str) -> bool:
    """True iff ``signature_hex`` (128 lowercase hex digits) is a valid Ed25519 signature of the
    block hash by ``public_key_hex`` (64 lowercase hex digits). Never raises."""
    if not (isinstance(signature_hex, str) and _HEX128.fullmatch(signature_hex)):
        return False
    if not (isinstance(hash_hex, str) and _HEX64.fullmatch(hash_hex)):
        return False
    if not valid_block_key(public_key_hex):
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
        key.verify(bytes.fromhex(signature_hex), BLOCK_PREFIX + bytes.fromhex(hash_hex))
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def valid_block_key(public_key_hex) -> bool:
    """True iff ``public_key_hex`` is a raw Ed25519 public key as blocks carry it: 64 lowercase
    hex digits that decode to a key. Never raises."""
    if not (isinstance(public_key_hex, str) and _HEX64.fullmatch(public_key_hex)):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex))
    except ValueError:
        return False
    return True
