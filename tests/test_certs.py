"""``mlx-fleet certs`` (mlx_fleet.certcli, mlx_fleet.certs; issue 19): a fleet CA, a per-Mac
certificate signed by it (or by a CA the operator gives), API key files, files written 0600 and
never replaced without --force — and a real etcd started with those certificates accepts the Mac's
as the Mac's etcd user (``--client-cert-auth``: its CN), refuses it for another Mac's key, and
refuses a certificate of another CA."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mlx_fleet import certs
from mlx_fleet.cli import main
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import EtcdServerTLS, start_etcd
from mlx_fleet.etcd_credentials import load_credentials
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.store import EtcdStore, StoreError

REPO = Path(__file__).resolve().parents[1]


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ca_and_node_certificate(tmp_path: Path, capsys) -> None:
    assert main(["certs", "ca", "--out", str(tmp_path)]) == 0
    assert main(["certs", "node", "studio-1", "--host", "studio-1.example", "--host",
                 "192.0.2.10", "--ca-cert", str(tmp_path / "ca.crt"), "--ca-key",
                 str(tmp_path / "ca.key"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "BEGIN" not in out and out.count("(mode 0600)") == 4
    for name in ("ca.crt", "ca.key", "studio-1.crt", "studio-1.key"):
        assert _mode(tmp_path / name) == 0o600, name
    ca, leaf = _cert(tmp_path / "ca.crt"), _cert(tmp_path / "studio-1.crt")
    leaf.verify_directly_issued_by(ca)  # raises when the signature is not the CA's
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    # its etcd user (with --client-cert-auth the CN is the user), both TLS roles, its names
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == \
        "mlx-fleet-agent-studio-1"
    assert set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["studio-1", "studio-1.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("192.0.2.10")]
    # the key in studio-1.key is the certificate's
    key = serialization.load_pem_private_key((tmp_path / "studio-1.key").read_bytes(),
                                             password=None)
    assert key.public_key().public_numbers() == leaf.public_key().public_numbers()


def test_nothing_is_replaced_without_force(tmp_path: Path, capsys) -> None:
    assert main(["certs", "ca", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "ca.key").read_bytes()
    assert main(["certs", "ca", "--out", str(tmp_path)]) == 2
    assert "ca.crt exists (give --force to replace it)" in capsys.readouterr().err
    assert (tmp_path / "ca.key").read_bytes() == before
    # one file of the pair missing: still nothing written
    (tmp_path / "ca.crt").unlink()
    assert main(["certs", "ca", "--out", str(tmp_path)]) == 2
    assert (tmp_path / "ca.key").read_bytes() == before and not (tmp_path / "ca.crt").exists()
    assert main(["certs", "ca", "--out", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.key").read_bytes() != before and _mode(tmp_path / "ca.key") == 0o600


def test_a_missing_output_directory_is_created_private(tmp_path: Path) -> None:
    """docs/security.md's first step writes into a directory that does not exist yet."""
    out = tmp_path / "pki"
    assert main(["certs", "ca", "--out", str(out)]) == 0
    assert (out / "ca.crt").exists() and _mode(out) == 0o700 and _mode(out / "ca.key") == 0o600


def test_a_ca_the_operator_gives(tmp_path: Path, capsys) -> None:
    """Any PEM CA with its unencrypted key signs; a certificate that is no CA, or a key of
    another certificate, is refused naming the file."""
    key, ca = certs.make_ca("Example Corp Issuing CA")
    certs.write_private({tmp_path / "corp.crt": certs.cert_pem(ca),
                         tmp_path / "corp.key": certs.key_pem(key)})
    args = ["--ca-cert", str(tmp_path / "corp.crt"), "--ca-key", str(tmp_path / "corp.key"),
            "--out", str(tmp_path)]
    assert main(["certs", "client", "mlx-fleet-operator", *args]) == 0
    op = _cert(tmp_path / "mlx-fleet-operator.crt")
    op.verify_directly_issued_by(ca)
    assert op.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == \
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
    # a leaf is no CA
    leaf_args = ["--ca-cert", str(tmp_path / "mlx-fleet-operator.crt"), "--ca-key",
                 str(tmp_path / "mlx-fleet-operator.key"), "--out", str(tmp_path)]
    assert main(["certs", "client", "x", *leaf_args]) == 2
    assert "not a CA certificate" in capsys.readouterr().err
    other_key, _ = certs.make_ca("other")
    certs.write_private({tmp_path / "other.key": certs.key_pem(other_key)})
    assert main(["certs", "client", "y", "--ca-cert", str(tmp_path / "corp.crt"), "--ca-key",
                 str(tmp_path / "other.key"), "--out", str(tmp_path)]) == 2
    assert "does not belong to" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a name that is a path: refused by the parser
        main(["certs", "node", "../evil", *args])
    assert e.value.code == 2 and not (tmp_path.parent / "evil.crt").exists()


def test_api_key_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "router-api-keys"
    assert main(["certs", "keys", "--out", str(path), "--count", "3", "--tenant", "team-a"]) == 0
    assert _mode(path) == 0o600
    assert str(path) in capsys.readouterr().out
    keys = KeyFile(path)  # the agents' and the router's own parser
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and len({ln.split()[0] for ln in lines}) == 3
    for line in lines:
        key = line.split()[0]
        assert key.startswith("sk-") and len(key) == 46
        assert keys.tenant_of(key) == "team-a"
    assert main(["certs", "keys", "--out", str(path)]) == 2  # exists
    assert main(["certs", "keys", "--out", str(tmp_path / "k"), "--tenant", "Team A"]) == 2
    assert "--tenant 'Team A'" in capsys.readouterr().err and not (tmp_path / "k").exists()


# -- a real etcd with these certificates ---------------------------------------------------------


def _certs(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "certs", *args],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"})
    assert r.returncode == 0, r.stderr


async def test_real_etcd_accepts_the_node_certificate(binaries, tmp_path: Path) -> None:
    pki, other = tmp_path / "pki", tmp_path / "other"
    pki.mkdir()
    other.mkdir()
    ca = ("--ca-cert", str(pki / "ca.crt"), "--ca-key", str(pki / "ca.key"), "--out", str(pki))
    _certs("ca", "--out", str(pki))
    _certs("server", "etcd", "--host", "127.0.0.1", "--host", "localhost", *ca)
    _certs("client", "root", *ca)
    _certs("node", "mac-1", "--host", "mac-1.example", *ca)
    _certs("ca", "--out", str(other))
    _certs("node", "mac-1", "--ca-cert", str(other / "ca.crt"), "--ca-key",
           str(other / "ca.key"), "--out", str(other))
    server = start_etcd(tmp_path, binaries, "etcd-certs",
                        tls=EtcdServerTLS(pki / "etcd.crt", pki / "etcd.key", pki / "ca.crt"))
    try:
        keys = Keys("/mlx-fleet-certs")
        r = subprocess.run(
            [sys.executable, "-m", "mlx_fleet.cli", "etcd", "bootstrap-auth", "--etcd-endpoint",
             server.client_url, "--etcd-prefix", keys.root, "--etcd-ca-file", str(pki / "ca.crt"),
             "--etcd-cert-file", str(pki / "root.crt"), "--etcd-key-file", str(pki / "root.key"),
             "--node", "mac-1", "--node", "mac-2"], capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"})
        assert r.returncode == 0, r.stderr

        def creds(d: Path, name: str):
            return load_credentials(ca_file=pki / "ca.crt", cert_file=d / f"{name}.crt",
                                    key_file=d / f"{name}.key")

        async with EtcdStore(server.client_url, credentials=creds(pki, "mac-1")) as mac:
            await mac.put(keys.node("mac-1"), b"{}")  # its own record: its role allows it
            with pytest.raises(StoreError, match="permission denied"):
                await mac.put(keys.node("mac-2"), b"{}")  # another Mac's: refused
        foreign = EtcdStore(server.client_url, credentials=creds(other, "mac-1"))
        with pytest.raises(StoreError):  # the TLS handshake fails: not signed by etcd's CA
            await asyncio.wait_for(foreign.connect(), 30)
            await foreign.get(keys.node("mac-1"))
        await foreign.close()
    finally:
        server.process.stop()
