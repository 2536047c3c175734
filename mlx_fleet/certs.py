"""Certificates, API keys and JWT signing keys for a fleet, made with ``cryptography`` (issue 19):
what ``mlx-fleet certs`` writes (:mod:`mlx_fleet.certcli`) and what the tests' PKI is made of
(``tests/etcd_tls.py``) — one source.

* :func:`make_ca`: a CA (self-signed, ``BasicConstraints(ca=True)``, key usage certificate and
  CRL signing);
* :func:`make_leaf`: a certificate signed by a CA: ``CN=<common name>`` (with etcd's
  ``--client-cert-auth`` the CN is the etcd user: ``mlx-fleet-agent-<node>``,
  ``mlx-fleet-operator``, ``mlx-fleet-router``, ``root``), extended key usage client and/or
  server, and for a server the subject alternative names of its ``hosts`` (DNS names and IP
  addresses, as clients dial them);
* :func:`api_key`: a random bearer key (``sk-`` and 43 URL-safe characters, 256 bits from
  :mod:`secrets`), the agent's and the router's key-file format;
* :func:`jwt_keys`: a key pair for etcd's ``--auth-token jwt`` (``ES256``: P-256, ``RS256``: RSA
  2048), PEM.

Keys are ECDSA P-256 (``SECP256R1``), which Go's TLS (etcd) and OpenSSL (Python) accept; they are
written unencrypted (PKCS#8 PEM), so the files must be kept private: :func:`write_private` writes
mode 0600 and refuses to replace a file unless told to.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["make_ca", "make_leaf", "load_ca", "cert_pem", "key_pem", "api_key", "jwt_keys",
           "write_private", "JwtAlgorithm", "DEFAULT_CA_DAYS", "DEFAULT_LEAF_DAYS"]

#: Validity of a CA made by :func:`make_ca` (days): ten years, replaced with the fleet.
DEFAULT_CA_DAYS = 3650
#: Validity of a leaf certificate (days): about 13 months, the CA/Browser Forum's former limit
#: for public server certificates (398 days); re-issue with ``mlx-fleet certs node`` before.
DEFAULT_LEAF_DAYS = 398
#: Clock skew allowed at the start of a certificate's validity.
_BACKDATE = dt.timedelta(minutes=5)

JwtAlgorithm = Literal["ES256", "RS256"]

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _validity(builder: x509.CertificateBuilder, days: float) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return builder.not_valid_before(now - _BACKDATE).not_valid_after(now + dt.timedelta(days=days))


def make_ca(common_name: str, *, days: float = DEFAULT_CA_DAYS
            ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new CA: ``(key, certificate)``, self-signed, ``CN=common_name``, valid ``days``."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (_validity(x509.CertificateBuilder(), days).subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_leaf(ca_key: PrivateKey, ca_cert: x509.Certificate, common_name: str, *,
              hosts: Iterable[str] = (), server: bool = False, client: bool = True,
              days: float = DEFAULT_LEAF_DAYS
              ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key and a certificate for it signed by ``ca_key``/``ca_cert``: ``CN=common_name``,
    extended key usage ``client`` and/or ``server`` authentication, the subject alternative
    names of ``hosts`` (an IP address or a DNS name each; required for a server: TLS clients
    verify the name they dialled against them), valid ``days``. Raises ``ValueError`` for a
    server without hosts or a certificate for neither use."""
    hosts = list(dict.fromkeys(hosts))
    if server and not hosts:
        raise ValueError("a server certificate needs at least one host name or address")
    if not (server or client):
        raise ValueError("a certificate must be for client or server authentication")
    key = _key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    b = (_validity(x509.CertificateBuilder(), days)
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
         .issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                      content_commitment=False, data_encipherment=False,
                                      key_agreement=False, key_cert_sign=False, crl_sign=False,
                                      encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
             ca_cert.public_key()), critical=False))  # type: ignore[arg-type]
    if hosts:
        b = b.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]),
                            critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def load_ca(cert_path: Path, key_path: Path) -> tuple[PrivateKey, x509.Certificate]:
    """A CA the operator gives (PEM certificate and unencrypted PEM key). Raises ``ValueError``
    naming the file when either can't be read or parsed, the certificate is no CA, or the key
    does not belong to it."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{cert_path}: not a PEM certificate ({type(e).__name__})") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{key_path}: not an unencrypted PEM private key "
                         f"({type(e).__name__})") from None
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise ValueError(f"{key_path}: an EC or RSA key is needed")
    try:
        ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        ca = False
    if not ca:
        raise ValueError(f"{cert_path}: not a CA certificate (BasicConstraints ca=false)")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise ValueError(f"{key_path}: this key does not belong to {cert_path}")
    return key, cert


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: PrivateKey) -> bytes:
    """An unencrypted PKCS#8 PEM private key."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def api_key() -> str:
    """A random bearer API key: ``sk-`` and 43 URL-safe characters (256 random bits)."""
    return "sk-" + secrets.token_urlsafe(32)


def jwt_keys(algorithm: JwtAlgorithm = "ES256") -> tuple[bytes, bytes]:
    """``(private, public)`` PEM keys for etcd's ``--auth-token
    jwt,pub-key=…,priv-key=…,sign-method=<algorithm>``: P-256 for ``ES256``, RSA 2048 for
    ``RS256``."""
    key: PrivateKey = (_key() if algorithm == "ES256" else
                       rsa.generate_private_key(public_exponent=65537, key_size=2048))
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return key_pem(key), public


def write_private(files: Mapping[Path, bytes], *, force: bool = False) -> None:
    """Write each file with mode 0600 (created so: never readable by others, not even for a
    moment). Without ``force`` nothing is written when any of them exists
    (``FileExistsError`` naming it); with it they are replaced. A missing directory is created
    with mode 0700 (its parents as usual)."""
    for directory in {path.parent for path in files}:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
    if not force:
        for path in files:
            if path.exists() or path.is_symlink():
                raise FileExistsError(f"{path} exists (give --force to replace it)")
    for path, data in files.items():
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
