"""Test PKI and a mutual-TLS, auth-enabled etcd (certificates made with ``cryptography``).

:func:`make_pki` writes a CA, a server certificate for 127.0.0.1 and one client certificate
per user (``CN=<user>``: with ``--client-cert-auth`` etcd maps the CN to the etcd user), plus a
second, unrelated CA for the "wrong CA" cases.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclasses.dataclass(frozen=True)
class PKI:
    ca: Path
    other_ca: Path
    server: Pair
    clients: dict[str, Pair]
    other_client: Pair  # CN=root, signed by other_ca

    def secrets(self) -> list[str]:
        """Every private key's base64 body lines (what must never appear in a log)."""
        lines: list[str] = []
        for pair in [self.server, self.other_client, *self.clients.values()]:
            body = [ln for ln in pair.key.read_text().splitlines() if ln and "-----" not in ln]
            lines += body
        return lines


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _ca(name: str):
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca_key, ca_cert, cn: str, *, server: bool, dir: Path, stem: str) -> Pair:
    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
         .issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                               ExtendedKeyUsageOID.CLIENT_AUTH] if server
                                              else [ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    pair = Pair(dir / f"{stem}.crt", dir / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def make_pki(dir: Path, users: list[str]) -> PKI:
    dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("mlx-fleet test CA")
    other_key, other_cert = _ca("some other CA")
    (dir / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (dir / "other-ca.crt").write_bytes(other_cert.public_bytes(serialization.Encoding.PEM))
    return PKI(
        ca=dir / "ca.crt", other_ca=dir / "other-ca.crt",
        server=_leaf(ca_key, ca_cert, "etcd", server=True, dir=dir, stem="server"),
        clients={u: _leaf(ca_key, ca_cert, u, server=False, dir=dir, stem=f"client-{u}")
                 for u in users},
        other_client=_leaf(other_key, other_cert, "root", server=False, dir=dir, stem="other-root"))
