"""etcd over mutual TLS with authentication and least-privilege roles: the pure parts (the
permission plan, credential loading, the bootstrap command's dry run and refusals), table-tested.

The rest runs against a real etcd started with ``--client-cert-auth`` and TLS, in
tests/test_integration_etcd.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_fleet.contract import ROOT, Keys
from mlx_fleet.etcd_credentials import (PASSWORD_ENV, CredentialsError, EtcdCredentials,
                                        load_credentials)
from mlx_fleet.etcd_security import (OPERATOR_USER, ROOT_USER, ROUTER_USER, agent_user, allowed,
                                     plan_auth)
from mlx_fleet.store import EtcdStore

REPO = Path(__file__).resolve().parents[1]
K = Keys(ROOT)
PLAN = plan_auth(K, ["mac-1", "mac-2"])
A1 = agent_user("mac-1")


# ---------------------------------------------------------------------------------------------
# The plan (pure)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("user", "op", "key", "ok"), [
    (OPERATOR_USER, "write", K.assignment("mac-1", "ns", "m", "r1"), True),
    (OPERATOR_USER, "read", K.node("mac-2"), True),
    (OPERATOR_USER, "write", K.placement_epoch, True),
    (OPERATOR_USER, "write", "/other-app/key", False),
    (A1, "write", K.node("mac-1"), True),
    (A1, "read", K.node("mac-1"), True),
    (A1, "write", K.node("mac-2"), False),
    (A1, "write", K.node("mac-10"), False),          # its own key is not a prefix
    (A1, "write", K.report("mac-1", "ns", "m", "r1"), True),
    (A1, "write", K.report("mac-2", "ns", "m", "r1"), False),
    (A1, "write", K.report("mac-10", "ns", "m", "r1"), False),
    (A1, "write", K.stats("mac-1", "ns", "m"), True),
    (A1, "write", K.stats("mac-2", "ns", "m"), False),
    (A1, "read", K.assignment("mac-1", "ns", "m", "r1"), True),
    (A1, "write", K.assignment("mac-1", "ns", "m", "r1"), False),
    (A1, "read", K.assignment("mac-2", "ns", "m", "r1"), False),
    (A1, "read", K.traffic("ns", "m"), True),
    (A1, "write", K.traffic("ns", "m"), False),
    (A1, "read", K.placement_epoch, False),
    (A1, "read", K.node("mac-2"), False),
    (ROUTER_USER, "read", K.node("mac-2"), True),
    (ROUTER_USER, "read", K.assignment("mac-1", "ns", "m", "r1"), True),
    (ROUTER_USER, "read", K.report("mac-1", "ns", "m", "r1"), True),
    (ROUTER_USER, "read", K.traffic("ns", "m"), True),
    (ROUTER_USER, "read", K.stats("mac-1", "ns", "m"), True),
    (ROUTER_USER, "read", K.placement_epoch, False),
    (ROUTER_USER, "write", K.node("mac-1"), False),
    (ROUTER_USER, "write", K.assignment("mac-1", "ns", "m", "r1"), False),
    (ROUTER_USER, "write", K.report("mac-1", "ns", "m", "r1"), False),
    (ROUTER_USER, "write", K.traffic("ns", "m"), False),
    (ROUTER_USER, "read", "/other-app/key", False),
    (ROOT_USER, "write", "/anything", True),
    ("nobody", "read", K.node("mac-1"), False),
])
def test_plan_grants_least_privilege(user: str, op: str, key: str, ok: bool) -> None:
    assert allowed(PLAN, user, op, key) is ok


def test_plan_has_one_role_and_user_per_agent() -> None:
    plan = plan_auth(K, ["mac-1", "mac-2", "mac-1"])
    assert [r.name for r in plan.roles] == [OPERATOR_USER, ROUTER_USER, agent_user("mac-1"),
                                            agent_user("mac-2")]
    assert [(u.name, u.roles) for u in plan.users] == [
        (ROOT_USER, ("root",)), (OPERATOR_USER, (OPERATOR_USER,)), (ROUTER_USER, (ROUTER_USER,)),
        (agent_user("mac-1"), (agent_user("mac-1"),)), (agent_user("mac-2"), (agent_user("mac-2"),))]


def test_plan_refuses_a_bad_node_name() -> None:
    with pytest.raises(ValueError, match="node name"):
        plan_auth(K, ["a/b"])


# ---------------------------------------------------------------------------------------------
# Credentials (pure-ish: files in tmp_path)
# ---------------------------------------------------------------------------------------------

PEM_CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = b"-----BEGIN PRIVATE KEY-----\nSECRETKEYBODY\n-----END PRIVATE KEY-----\n"


@pytest.mark.parametrize(("files", "kwargs", "message"), [
    ({}, {"ca_file": "missing.crt"}, "--etcd-ca-file '.*missing.crt': cannot read"),
    ({"empty.crt": b"\n"}, {"ca_file": "empty.crt"}, "--etcd-ca-file .*: file is empty"),
    ({"k.key": PEM_KEY}, {"ca_file": "k.key"}, "--etcd-ca-file .*: not a PEM certificate file"),
    ({"c.crt": PEM_CERT}, {"cert_file": "c.crt", "key_file": "c.crt"},
     "--etcd-key-file .*: not a PEM private key file"),
    ({"c.crt": PEM_CERT}, {"cert_file": "c.crt"}, "--etcd-cert-file and --etcd-key-file"),
    ({}, {"username": "u"}, "--etcd-username needs a password"),
    ({"pw": b"hunter2\n"}, {"password_file": "pw"}, "--etcd-password-file needs --etcd-username"),
])
def test_bad_credentials_are_one_clear_line(tmp_path: Path, files, kwargs, message) -> None:
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    kwargs = {k: (str(tmp_path / v) if k.endswith("_file") else v) for k, v in kwargs.items()}
    with pytest.raises(CredentialsError, match=message) as e:
        load_credentials(environ={}, **kwargs)
    text = str(e.value)
    assert "\n" not in text and "SECRETKEYBODY" not in text and "hunter2" not in text


def test_password_from_file_or_environment_never_in_repr(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret-from-file\n")
    c = load_credentials(username="u", password_file=tmp_path / "pw", environ={})
    assert c.password == "s3cret-from-file"
    c2 = load_credentials(username="u", environ={PASSWORD_ENV: "s3cret-from-env"})
    assert c2.password == "s3cret-from-env"
    assert "s3cret" not in repr(c) + repr(c2)


def _bootstrap(argv: list[str]) -> int:
    from mlx_fleet.cli import build_parser

    args = build_parser().parse_args(["etcd", "bootstrap-auth", *argv])
    return args.func(args)


def test_bootstrap_dry_run_prints_the_plan(capsys) -> None:
    assert _bootstrap(["--node", "mac-1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"READ      {K.node_assignments_prefix('mac-1')}*" in out
    assert f"READWRITE {K.node('mac-1')}\n" in out
    assert f"user {A1}: roles {A1}" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--node", "a/b"], "--node: invalid node name 'a/b'"),
    (["--node", "m", "--password-file", "nobody=/x"], "'nobody' is not a user of the plan"),
    (["--node", "m", "--password-file", "root=/nonexistent/pw"],
     "--password-file root='/nonexistent/pw': cannot read"),
    (["--node", "m", "--etcd-endpoint", "https://127.0.0.1:1"], "--etcd-ca-file is required"),
])
def test_bootstrap_refuses_bad_input_before_touching_etcd(capsys, argv, message) -> None:
    assert _bootstrap(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_endpoint_scheme_must_match_tls() -> None:
    with pytest.raises(ValueError, match="is https: --etcd-ca-file is required"):
        EtcdStore("https://127.0.0.1:2379")
    with pytest.raises(ValueError, match="plain http but TLS files were given"):
        EtcdStore("http://127.0.0.1:2379", credentials=EtcdCredentials(ca_pem=PEM_CERT))
