"""Issue 19, secure defaults with an explicit opt-out (findings 1 and 7): the agent refuses to
listen beyond loopback without API keys, to use a plain-http etcd beyond loopback and to send
an etcd password over http, unless the matching ``--insecure-…`` flag is given (then it warns);
the fleet forward key goes to peers only over TLS or loopback. The pure rule table-driven, the
CLI's refusal as one line with exit status 2, and a forwarded request to a plain-http peer on
"another host" (a name resolved to 127.0.0.1 by the test's own resolver: no traffic leaves
loopback)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from mlx_fleet.exposure import (INSECURE_ETCD, INSECURE_FORWARD, INSECURE_HTTP_LISTEN,
                                INSECURE_LISTEN, Exposure, etcd_exposure_check, exposure_check,
                                is_loopback, may_send_key)
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.route import Route
from node_agent import openai_api
from node_agent.api import forward
from node_agent.main import Agent, main
from node_agent.cli import build_parser, config_from_args
from node_agent.serving import ServingCore

KEY_FLEET = "fleet-secure-defaults-0123456789"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LOCALHOST.", True),
    ("0.0.0.0", False), ("::", False), ("", False),
    ("studio-1.lan", False), ("localhost.evil.example", False), ("128.0.0.1", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


LOOPBACK_ETCD = "http://127.0.0.1:2379"


@pytest.mark.parametrize("listen, keys, etcd, password, flags, refused, warned", [
    # the defaults: loopback everything, nothing to say
    ("127.0.0.1", False, LOOPBACK_ETCD, False, set(), [], []),
    # LAN without keys: refused, or a warning with the flag
    ("0.0.0.0", False, LOOPBACK_ETCD, False, set(), [INSECURE_LISTEN], []),
    ("studio-1.lan", False, LOOPBACK_ETCD, False, {INSECURE_LISTEN}, [], [INSECURE_LISTEN]),
    # LAN with keys over plain http: keys and prompts in cleartext, refused (review of issue
    # 19); with the flag a warning; over HTTPS (tls below) fine
    ("0.0.0.0", True, LOOPBACK_ETCD, False, set(), [INSECURE_HTTP_LISTEN], []),
    ("studio-1.lan", True, LOOPBACK_ETCD, False, {INSECURE_HTTP_LISTEN}, [],
     [INSECURE_HTTP_LISTEN]),
    ("127.0.0.1", True, LOOPBACK_ETCD, False, set(), [], []),
    # plain http etcd on another host: refused; https fine
    ("127.0.0.1", False, "http://etcd.lan:2379", False, set(), [INSECURE_ETCD], []),
    ("127.0.0.1", False, "etcd.lan:2379", False, set(), [INSECURE_ETCD], []),
    ("127.0.0.1", False, "http://etcd.lan:2379", False, {INSECURE_ETCD}, [], [INSECURE_ETCD]),
    ("127.0.0.1", False, "https://etcd.lan:2379", True, set(), [], []),
    # a password over http, even to loopback
    ("127.0.0.1", False, LOOPBACK_ETCD, True, set(), [INSECURE_ETCD], []),
    ("127.0.0.1", False, LOOPBACK_ETCD, True, {INSECURE_ETCD}, [], [INSECURE_ETCD]),
    # both at once: both named; one flag accepts only its own
    ("0.0.0.0", False, "http://etcd.lan:2379", False, {INSECURE_ETCD},
     [INSECURE_LISTEN], [INSECURE_ETCD]),
])
def test_exposure_check(listen: str, keys: bool, etcd: str, password: bool, flags: set[str],
                        refused: list[str], warned: list[str]) -> None:
    got = exposure_check(listen_host=listen, api_keys=keys, etcd_endpoint=etcd,
                         etcd_password=password, insecure=frozenset(flags))
    flags_named = (INSECURE_LISTEN, INSECURE_HTTP_LISTEN, INSECURE_ETCD)
    assert [flag for r in got.refusals for flag in flags_named if f"{flag})" in r] == refused
    assert [flag for w in got.warnings for flag in flags_named if f"({flag})" in w] == warned
    for line in (*got.refusals, *got.warnings):
        assert "\n" not in line
    if not refused and not warned:
        assert got == Exposure()


@pytest.mark.parametrize("listen, keys, refused", [
    ("0.0.0.0", True, ()),  # keys over HTTPS beyond loopback: the closed setup
    ("studio-1.lan", True, ()),
    ("0.0.0.0", False, (INSECURE_LISTEN,)),  # HTTPS does not replace keys
    ("127.0.0.1", False, ()),
])
def test_exposure_check_over_tls(listen: str, keys: bool, refused: tuple[str, ...]) -> None:
    got = exposure_check(listen_host=listen, api_keys=keys, etcd_endpoint=LOOPBACK_ETCD,
                         etcd_password=False, tls=True)
    assert tuple(f for r in got.refusals for f in (INSECURE_LISTEN, INSECURE_HTTP_LISTEN)
                 if f"{f})" in r) == refused and got.warnings == ()


@pytest.mark.parametrize("url, insecure, ok", [
    ("https://studio-2.lan:8000", False, True),
    ("http://127.0.0.1:8000", False, True),
    ("http://localhost:8000", False, True),
    ("http://[::1]:8000", False, True),
    ("http://studio-2.lan:8000", False, False),
    ("http://studio-3.example:8000", False, False),
    ("http://studio-2.lan:8000", True, True)])
def test_may_send_key(url: str, insecure: bool, ok: bool) -> None:
    assert may_send_key(url, insecure=insecure) is ok


@pytest.mark.parametrize("argv, flag", [
    (["--listen", "0.0.0.0:0"], INSECURE_LISTEN),
    (["--listen", "[::]:0"], INSECURE_LISTEN),
    (["--etcd-endpoint", "http://etcd.lan:2379"], INSECURE_ETCD)])
def test_agent_refuses_an_exposed_setting_in_one_line(argv: list[str], flag: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    """Exit status 2 and one line naming the flag, before anything starts (nothing connects:
    the refused endpoint is never dialled)."""
    assert main(["--node-name", "n", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlx-fleet-agent: error: "), err
    assert flag in err[0]


def test_keyed_agent_beyond_loopback_needs_https(tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """Review of issue 19: keys over plain http beyond loopback are refused (the keys and the
    prompts would cross the LAN in cleartext) unless --insecure-http-listen; with a TLS
    certificate the agent's check passes."""
    from etcd_tls import make_pki

    keys = tmp_path / "keys"
    keys.write_text("sk-secure-defaults-0123456789\n")
    argv = ["--node-name", "n", "--listen", "0.0.0.0:0", "--api-key-file", str(keys)]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert INSECURE_HTTP_LISTEN in line and "cleartext" in line
    config = config_from_args(build_parser().parse_args([*argv, INSECURE_HTTP_LISTEN]))
    assert config.insecure == {INSECURE_HTTP_LISTEN}
    pki = make_pki(tmp_path / "pki", [])
    tls = config_from_args(build_parser().parse_args([
        *argv, "--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key)]))
    from node_agent.main import check_exposure

    assert check_exposure(tls) == ()  # the agent's own check: nothing refused or warned
    assert len(check_exposure(config)) == 1  # the opt-out: one INSECURE warning


def test_agent_refuses_an_etcd_password_over_http(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    assert main(["--node-name", "n", "--etcd-username", "mac-1",
                 "--etcd-password-file", str(pw)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert INSECURE_ETCD in line and "cleartext" in line and "s3cret" not in line


def test_insecure_flags_are_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser().parse_args([
        "--node-name", "n", "--listen", "0.0.0.0:0", "--etcd-endpoint", "http://etcd.lan:2379",
        INSECURE_LISTEN, INSECURE_ETCD, INSECURE_FORWARD])
    config = config_from_args(args)
    assert config.insecure == {INSECURE_LISTEN, INSECURE_ETCD, INSECURE_FORWARD}
    with caplog.at_level(logging.WARNING, logger="node_agent"):
        Agent(config)  # constructed only: nothing listens, nothing dials etcd
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(INSECURE_LISTEN in w for w in warnings), warnings
    assert any(INSECURE_ETCD in w and "etcd.lan" in w for w in warnings), warnings
    # and without flags the defaults are quiet
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node_agent"):
        Agent(config_from_args(build_parser().parse_args(["--node-name", "n"])))
    assert not [r for r in caplog.records if "INSECURE" in r.getMessage()]


# -- the forward key travels only over TLS or loopback ----------------------------------------


class _StaticResolver(aiohttp.abc.AbstractResolver):
    """Resolves every name to 127.0.0.1: "another host" without leaving loopback."""

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[dict[str, Any]]:
        return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        pass


class _Router:
    """The agent's TrafficManager as far as forwarding needs it: every request goes to
    ``target`` pinned to revision r2."""

    def __init__(self, target: str) -> None:
        self.target = target

    def route(self, model: str, **_: Any) -> Any:
        class Routed:
            route = Route("r2", forward=self.target, canary=True, role="candidate")
            standby = False
        return Routed()

    def record(self, *_: Any, **__: Any) -> None:
        pass


@pytest.mark.parametrize("insecure", [False, True])
async def test_forward_key_is_not_sent_over_plain_http_to_another_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        insecure: bool) -> None:
    seen: list[str | None] = []

    async def peer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"ok": True})

    peer_app = web.Application()
    peer_app.router.add_post("/v1/completions", peer)
    peer_server = TestServer(peer_app, host="127.0.0.1")
    await peer_server.start_server()

    def session(ssl_context: Any = None) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_StaticResolver()))

    monkeypatch.setattr(forward, "client_session", session)
    keys = tmp_path / "fleet"
    keys.write_text(KEY_FLEET + "\n")
    core = ServingCore(registry=CollectorRegistry())
    target = f"http://studio-2.lan:{peer_server.port}"
    app = openai_api.build_app(core, health=lambda: (True, {}), registry=core.registry,
                               router=lambda: _Router(target),
                               forward_keys=KeyFile(keys, flag="--forward-key-file"),
                               insecure_forward=insecure)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        for _ in range(2):
            resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            assert resp.status == 200, await resp.text()
    finally:
        await client.close()
        await peer_server.close()
    assert seen == [f"Bearer {KEY_FLEET}"] * 2 if insecure else [None, None]
    said = [r.getMessage() for r in caplog.records if "not sending the forward key" in
            r.getMessage()]
    assert said == ([] if insecure else [
        f"not sending the forward key to {target} over plain http (give the nodes "
        f"--tls-cert-file, or accept the risk with {INSECURE_FORWARD})"])  # once per node


# --- the processes that listen for no clients: the operator and `mlx-fleet etcd bootstrap-auth`
# check the etcd rules alone (review of issue 19: they accepted a password over http silently)

@pytest.mark.parametrize("etcd, password, flags, refused, warned", [
    (LOOPBACK_ETCD, False, set(), False, False),          # the dev cluster's and demo's etcd
    ("https://etcd.lan:2379", True, set(), False, False),
    ("http://etcd.lan:2379", False, set(), True, False),
    ("http://etcd.lan:2379", True, set(), True, False),
    (LOOPBACK_ETCD, True, set(), True, False),            # cleartext password even on loopback
    ("http://etcd.lan:2379", True, {INSECURE_ETCD}, False, True),
    ("http://etcd.lan:2379", False, {INSECURE_LISTEN}, True, False),  # only its own flag
])
def test_etcd_exposure_check_is_the_etcd_half_of_exposure_check(
        etcd: str, password: bool, flags: set[str], refused: bool, warned: bool) -> None:
    got = etcd_exposure_check(etcd_endpoint=etcd, etcd_password=password,
                              insecure=frozenset(flags))
    assert (bool(got.refusals), bool(got.warnings)) == (refused, warned)
    assert all(INSECURE_ETCD in line for line in (*got.refusals, *got.warnings))
    assert got == exposure_check(listen_host="127.0.0.1", api_keys=False, etcd_endpoint=etcd,
                                 etcd_password=password, insecure=frozenset(flags))


def test_operator_refuses_an_etcd_password_over_http_to_another_host(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Exit status 2 and one line naming the flag, before Kubernetes or etcd are touched."""
    from mlx_fleet_operator.main import main as operator_main

    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    argv = ["--etcd-endpoint", "http://etcd.example:2379", "--etcd-username",
            "mlx-fleet-operator", "--etcd-password-file", str(pw), "--metrics-port", "0"]
    assert operator_main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlx-fleet-operator: error: ") and INSECURE_ETCD in line
    assert "s3cret" not in line
    assert operator_main(["--etcd-endpoint", "http://etcd.example:2379",
                          "--metrics-port", "0"]) == 2
    assert INSECURE_ETCD in capsys.readouterr().err


def test_operator_accepts_the_risk_with_the_flag_and_loopback_without() -> None:
    from mlx_fleet.etcd_credentials import EtcdCredentials
    from mlx_fleet_operator.main import build_parser, check_etcd_exposure

    creds = EtcdCredentials(username="mlx-fleet-operator", password="s3cret")
    args = build_parser().parse_args(["--etcd-endpoint", "http://etcd.example:2379",
                                      INSECURE_ETCD])
    (warning,) = check_etcd_exposure(args, creds)
    assert warning.startswith(f"INSECURE ({INSECURE_ETCD})") and "s3cret" not in warning
    loopback = build_parser().parse_args(["--etcd-endpoint", LOOPBACK_ETCD])
    assert check_etcd_exposure(loopback, EtcdCredentials()) == ()


def _bootstrap(argv: list[str]) -> int:
    from mlx_fleet.cli import build_parser as fleet_parser

    args = fleet_parser().parse_args(["etcd", "bootstrap-auth", *argv])
    return args.func(args)


@pytest.mark.parametrize("endpoint, what", [
    ("http://etcd.example:2379", []),                          # plain http to another host
    (LOOPBACK_ETCD, ["--password-file", "root={pw}"]),          # root's new password in clear
    (LOOPBACK_ETCD, ["--etcd-username", "root", "--etcd-password-file", "{pw}"]),  # the login
])
def test_bootstrap_auth_refuses_passwords_over_http(tmp_path: Path, capsys, monkeypatch,
                                                    endpoint: str, what: list[str]) -> None:
    from mlx_fleet import etcdcli

    async def applied(*_a, **_kw) -> int:
        return 0

    monkeypatch.setattr(etcdcli, "_apply", applied)  # etcd is never dialled either way
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    argv = ["--etcd-endpoint", endpoint, "--node", "mac-1",
            *[a.format(pw=pw) for a in what]]
    assert _bootstrap(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlx-fleet etcd bootstrap-auth: ") and INSECURE_ETCD in line
    assert "s3cret" not in line
    assert _bootstrap([*argv, INSECURE_ETCD]) == 0  # accepted, with a warning
    assert f"INSECURE ({INSECURE_ETCD})" in capsys.readouterr().err


def test_bootstrap_auth_on_loopback_without_passwords_needs_no_flag(capsys, monkeypatch) -> None:
    from mlx_fleet import etcdcli

    async def applied(*_a, **_kw) -> int:
        return 0

    monkeypatch.setattr(etcdcli, "_apply", applied)
    assert _bootstrap(["--etcd-endpoint", LOOPBACK_ETCD, "--node", "mac-1"]) == 0
    assert "INSECURE" not in capsys.readouterr().err


def test_kind_up_is_closed_by_default() -> None:
    """scripts/kind-up.sh (issue 19 review): its unauthenticated development etcd is published
    on 127.0.0.1 unless --etcd-listen says otherwise, and an external plain-http etcd needs
    --insecure-etcd-http (refused before kind, docker or anything else is touched)."""
    import re
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "kind-up.sh"
    usage = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True,
                           timeout=30)
    assert usage.returncode == 0
    assert re.search(r"--etcd-listen ADDR\s+host address it is published on \(default: "
                     r"127\.0\.0\.1", usage.stdout), usage.stdout
    refused = subprocess.run(["bash", str(script), "--etcd-endpoint", "http://etcd.example:2379"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and INSECURE_ETCD in refused.stderr, refused.stderr
    assert "is required on PATH" not in refused.stderr  # refused before looking for kind
