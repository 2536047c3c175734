"""Issue 19, finding 12: etcd's signed auth tokens. A real etcd started with ``--auth-token
jwt,...`` and keys from ``mlx-fleet certs jwt-keys`` (ES256 and RS256): the store authenticates
with a user name and password and works within its role, its token is a JWT signed with etcd's
key, and a token with the same claims signed by another key is refused — unlike the default
"simple" tokens, which are random strings etcd merely remembers (docs/security.md)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from mlx_fleet import certs
from mlx_fleet.contract import Keys
from mlx_fleet.devcluster.controlplane import EtcdJwt, start_etcd
from mlx_fleet.etcd_credentials import EtcdCredentials
from mlx_fleet.etcd_security import agent_user
from mlx_fleet.store import EtcdStore, StoreError

REPO = Path(__file__).resolve().parents[1]
KEYS = Keys("/mlx-fleet-jwt")
PASSWORD = "jwt-test-password-0123"  # a test's password, not a secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(header_payload: str, key_pem: bytes) -> str:
    """``header.payload`` signed as JWS: ES256 (r‖s, 32 bytes each) or RS256 (PKCS#1 v1.5)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    data = header_payload.encode()
    if isinstance(key, ec.EllipticCurvePrivateKey):
        r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
        sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    else:
        assert isinstance(key, rsa.RSAPrivateKey)
        sig = key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    return f"{header_payload}.{_b64(sig)}"


@pytest.mark.parametrize("alg", ["ES256", "RS256"])
async def test_jwt_tokens_authenticate_and_a_foreign_key_is_refused(binaries, tmp_path: Path,
                                                                    alg: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'operator'}"}
    r = subprocess.run([sys.executable, "-m", "mlx_fleet.cli", "certs", "jwt-keys", "--alg", alg,
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    server = start_etcd(tmp_path, binaries, f"etcd-jwt-{alg.lower()}",
                        jwt=EtcdJwt(tmp_path / "jwt.pub", tmp_path / "jwt.key", sign_method=alg))
    try:
        for user in ("root", agent_user("mac-1")):
            (tmp_path / f"{user}.pw").write_text(PASSWORD + "\n")
        r = subprocess.run(
            [sys.executable, "-m", "mlx_fleet.cli", "etcd", "bootstrap-auth", "--etcd-endpoint",
             server.client_url, "--etcd-prefix", KEYS.root, "--node", "mac-1", "--node", "mac-2",
             "--password-file", f"root={tmp_path / 'root.pw'}",
             "--password-file", f"{agent_user('mac-1')}={tmp_path / (agent_user('mac-1') + '.pw')}",
             "--insecure-etcd-http"],  # passwords over loopback http: this test's own etcd
            capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr

        mac = EtcdStore(server.client_url, credentials=EtcdCredentials(
            username=agent_user("mac-1"), password=PASSWORD))
        async with mac:
            await mac.put(KEYS.node("mac-1"), b"{}")  # within its role
            with pytest.raises(StoreError, match="permission denied"):
                await mac.put(KEYS.node("mac-2"), b"{}")
            [(_, token)] = mac._client.metadata
        header_b64, payload_b64, _ = token.split(".")
        header, claims = json.loads(_unb64(header_b64)), json.loads(_unb64(payload_b64))
        assert header["alg"] == alg and claims["username"] == agent_user("mac-1")

        async def put_with(tok: str, value: bytes) -> None:
            raw = EtcdStore(server.client_url)  # no credentials: only the token we give it
            async with raw:
                raw._client.metadata = (("token", tok),)
                await raw.put(KEYS.node("mac-1"), value)

        # the same claims re-signed with etcd's own key: accepted (the signing is right) ...
        await put_with(_sign(f"{header_b64}.{payload_b64}", (tmp_path / "jwt.key").read_bytes()),
                       b'{"resigned": true}')
        # ... with another key: refused, even claiming root
        other_private, _ = certs.jwt_keys(alg)  # type: ignore[arg-type]
        for forged_claims in (claims, {**claims, "username": "root"}):
            forged = _sign(f"{header_b64}.{_b64(json.dumps(forged_claims).encode())}",
                           other_private)
            with pytest.raises(StoreError, match="(?i)invalid auth token|auth"):
                await put_with(forged, b'{"forged": true}')
        async with EtcdStore(server.client_url, credentials=EtcdCredentials(
                username="root", password=PASSWORD)) as root:
            stored = await root.get(KEYS.node("mac-1"))
            assert stored is not None and stored.value == b'{"resigned": true}'  # no forgery
    finally:
        server.process.stop()
