"""TLS for the SuperLink: a CA and a server certificate signed by it (``cryptography``)."""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedasync.deploy import DeployError


def write_private(path: Path, data: bytes) -> None:
    """Write a private key: mode 0600, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def tls_hosts(hosts: list[str]) -> list[str]:
    """``hosts`` (stripped, in order, once each) plus 127.0.0.1 and localhost."""
    return list(dict.fromkeys([h.strip() for h in hosts if h.strip()] + ["127.0.0.1", "localhost"]))


def check_out(out: Path, opt: str = "--out") -> None:
    """DeployError naming ``opt`` when ``out`` or a directory above it is a file."""
    from fedasync.outputs import file_in_the_way, not_a_directory

    p = file_in_the_way(out)
    if p is not None:
        raise DeployError(not_a_directory(opt, out, p))


def make_certs(out: Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """A CA (``ca.crt``, ``ca.key``) and a server certificate for ``hosts`` signed by it
    (``server.pem``, ``server.key``): what ``flower-superlink --ssl-*`` and
    ``flower-supernode --root-certificates`` take."""
    check_out(out)
    paths = {"ca": out / "ca.crt", "ca_key": out / "ca.key", "cert": out / "server.pem", "key": out / "server.key"}
    for p in paths.values():
        if p.exists():
            raise FileExistsError(f"{p} exists (not overwriting)")
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(f"--days: {days} is not in 1-{MAX_DAYS}")
    for h in hosts:
        check_tls_host(h)
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
    made = [p for p in (out, *out.parents) if not p.exists()]
    written = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, data, private in (("ca", ca.public_bytes(serialization.Encoding.PEM), False),
                                    ("ca_key", _pem_key(ca_key), True),
                                    ("cert", cert.public_bytes(serialization.Encoding.PEM), False),
                                    ("key", _pem_key(key), True)):
            if private:
                write_private(paths[name], data)
            else:
                with open(paths[name], "xb") as f:
                    f.write(data)
            written.append(paths[name])
    except OSError:  # nothing left behind
        for p in written:
            p.unlink(missing_ok=True)
        for d in made:
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    return paths


MAX_DAYS = 36500  # 100 years; beyond it datetime overflows soon enough


def check_tls_host(h: str) -> None:
    """ValueError naming ``--host`` unless ``h`` is an IP address or an ASCII DNS name."""
    try:
        ipaddress.ip_address(h)
        return
    except ValueError:
        pass
    if len(h) > 253 or not re.fullmatch(r"(\*\.)?[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?"
                                        r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?", h):
        raise ValueError(f"--host: {h!r} is not an IP address or a DNS name (ASCII letters, digits, '-', '.'; "
                         "punycode for other names)")
