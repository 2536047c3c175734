"""Test PKI and a mutual-TLS, auth-enabled etcd (certificates made by :mod:`mlx_fleet.certs`,
what ``mlx-fleet certs`` uses).

:func:`make_pki` writes a CA, a server certificate for 127.0.0.1 and one client certificate
per user (``CN=<user>``: with ``--client-cert-auth`` etcd maps the CN to the etcd user), plus a
second, unrelated CA for the "wrong CA" cases.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlx_fleet.certs import cert_pem, key_pem, make_ca, make_leaf, write_private


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


def _leaf(ca_key, ca_cert, cn: str, *, server: bool, dir: Path, stem: str) -> Pair:
    key, cert = make_leaf(ca_key, ca_cert, cn, server=server, client=True,
                          hosts=("127.0.0.1", "localhost") if server else (), days=1)
    pair = Pair(dir / f"{stem}.crt", dir / f"{stem}.key")
    write_private({pair.cert: cert_pem(cert), pair.key: key_pem(key)}, force=True)
    return pair


def make_pki(dir: Path, users: list[str]) -> PKI:
    dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca("mlx-fleet test CA", days=1)
    other_key, other_cert = make_ca("some other CA", days=1)
    (dir / "ca.crt").write_bytes(cert_pem(ca_cert))
    (dir / "other-ca.crt").write_bytes(cert_pem(other_cert))
    return PKI(
        ca=dir / "ca.crt", other_ca=dir / "other-ca.crt",
        server=_leaf(ca_key, ca_cert, "etcd", server=True, dir=dir, stem="server"),
        clients={u: _leaf(ca_key, ca_cert, u, server=False, dir=dir, stem=f"client-{u}")
                 for u in users},
        other_client=_leaf(other_key, other_cert, "root", server=False, dir=dir, stem="other-root"))
