"""The agent under the source policy (issue 19, finding 2): a local HTTPS server on 127.0.0.1
stands in for a private host; redirect chains; a host name resolving to loopback; ``file://``
outside the roots and through a symlink; ``hf://`` organisations and the Mac's token; reports
that say "refused by the source policy" or "download failed" without network detail. Every
connection stays on 127.0.0.0/8 (``mirror.example`` is only ever "resolved" by a stub)."""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from mlx_fleet.contract import AssignmentReport, AssignmentState, Keys
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.source_policy import DEFAULT_POLICY, DEV_POLICY, REFUSED, SourcePolicy
from node_agent import model_dir as model_dir_mod
from node_agent.controller import Controller
from node_agent.fetch import fetch, hops
from node_agent.model_dir import MAX_MODEL_DIR_ENTRIES, SourceError, check_model_dir
from node_agent.registration import Registration
from node_agent.serving import ServingCore
from node_agent.sources import resolve_source
from test_agent_controller import ADVERTISED, NODE, Capacity, assignment, core  # noqa: F401
from test_sources import (COMMIT_MAIN, FakeHub, Mirror, https_assignment,  # noqa: F401
                          mirror, model_files, report_events, settled, small_model, tls)


def refused(e: pytest.ExceptionInfo[SourceError], rule_words: str = "") -> None:
    assert e.value.reason == "SourceRefused", e.value
    assert e.value.message.startswith(REFUSED) and rule_words in e.value.message, e.value


def loopback_url(m: Mirror) -> str:
    return m.url.replace("localhost", "127.0.0.1")


# ---------------------------------------------------------------------------------------------
# a private host (127.0.0.1) and names that resolve to it
# ---------------------------------------------------------------------------------------------


async def test_a_private_host_is_refused_by_default_before_any_connection(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    for url in (mirror.url, loopback_url(mirror)):  # localhost, 127.0.0.1
        with pytest.raises(SourceError) as e:
            await fetch(url, tmp_path)  # the secure default policy
        refused(e, "allowPrivateNetworks")
    assert mirror.requests == []  # not one request reached the server
    assert not (tmp_path / "https").exists()
    # allowed when the fleet says so
    path = await fetch(loopback_url(mirror), tmp_path,
                       policy=SourcePolicy(allow_private_networks=True))
    assert (path / "config.json").read_bytes() == model_files["config.json"]


class StubResolver(AbstractResolver):
    """Resolves every name to ``address`` (a name that points at loopback: DNS rebinding)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        self.asked.append(host)
        return [{"hostname": host, "host": self.address, "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": 0}]

    async def close(self) -> None:
        pass


async def test_a_name_resolving_to_loopback_is_refused_and_the_checked_address_is_used(
        mirror: Mirror, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the system resolver: localhost's addresses are loopback
    with pytest.raises(SourceError) as e:
        await hops.PolicyResolver(DEFAULT_POLICY).resolve("localhost", 443)
    refused(e, "allowPrivateNetworks")
    assert await hops.PolicyResolver(DEV_POLICY).resolve("localhost", 443)

    # a public-looking name whose DNS answer is 127.0.0.1: refused after resolution
    stub = StubResolver("127.0.0.1")
    monkeypatch.setattr(hops, "ThreadedResolver", lambda: stub)
    url = mirror.url.replace("localhost", "mirror.example")
    with pytest.raises(SourceError) as e:
        await fetch(url, tmp_path)
    refused(e, "allowPrivateNetworks")
    assert stub.asked == ["mirror.example"] and mirror.requests == []
    # allowed for private networks: the connection goes to the address the resolver checked
    # (the stub's 127.0.0.1; the certificate names mirror.example too)
    path = await fetch(url, tmp_path, policy=SourcePolicy(allow_private_networks=True))
    assert (path / "config.json").is_file() and mirror.requests


# ---------------------------------------------------------------------------------------------
# redirects: each hop checked, none followed automatically
# ---------------------------------------------------------------------------------------------


class Redirector:
    """An HTTPS server whose ``/r/<n>/<rest>`` answers 302 to ``/r/<n-1>/<rest>`` and
    ``/r/0/<rest>`` 302 to ``target + rest``; records every path asked for."""

    def __init__(self) -> None:
        self.target = ""
        self.paths: list[str] = []
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        n, rest = int(request.match_info["n"]), request.match_info["rest"]
        where = f"/r/{n - 1}/{rest}" if n else self.target + rest
        return web.Response(status=302, headers={"Location": where})

    def url(self, hops_: int, host: str = "localhost") -> str:
        return f"https://{host}:{self.port}/r/{hops_ - 1}/"


@pytest.fixture
async def redirector(tls: tuple[Path, Path]) -> AsyncIterator[Redirector]:
    r = Redirector()
    app = web.Application()
    app.router.add_get("/r/{n:\\d+}/{rest:.*}", r.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*tls)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    r.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield r
    await runner.cleanup()


async def test_redirect_chains_are_checked_hop_by_hop(
        mirror: Mirror, redirector: Redirector, tmp_path: Path) -> None:
    local = SourcePolicy(allow_private_networks=True, https_hosts=("localhost:*",),
                         max_redirects=3)
    # to an allowed host, within the hop limit: followed (3 hops per file)
    redirector.target = mirror.url
    path = await fetch(redirector.url(3), tmp_path / "ok", policy=local)
    assert (path / "config.json").is_file()
    assert {p for p in redirector.paths if p.startswith("/r/2/")} >= {"/r/2/manifest.json",
                                                                     "/r/2/config.json"}
    # over the hop limit
    redirector.paths.clear()
    with pytest.raises(SourceError) as e:
        await fetch(redirector.url(4), tmp_path / "long", policy=local)
    refused(e, "more than 3 redirects")
    assert redirector.paths == ["/r/3/manifest.json", "/r/2/manifest.json",
                                "/r/1/manifest.json", "/r/0/manifest.json"]
    # cross-host to a host the allow-list lacks (the same server by address): not connected
    mirror.requests.clear()
    redirector.target = loopback_url(mirror)
    with pytest.raises(SourceError) as e:
        await fetch(redirector.url(1), tmp_path / "cross", policy=local)
    refused(e, "not in httpsHosts")
    assert mirror.requests == []
    # to plain http://, to another scheme, to the metadata address: refused
    for target, words in [(f"http://localhost:{mirror.port}/models/tiny/", "https://"),
                          ("file:///etc/", "https://"),
                          ("https://169.254.169.254/latest/", "metadata")]:
        redirector.target = target
        with pytest.raises(SourceError) as e:
            await fetch(redirector.url(1), tmp_path / "bad", policy=DEV_POLICY)
        refused(e, words)
    assert mirror.requests == []


# ---------------------------------------------------------------------------------------------
# file:// roots, symlinks, the bounded directory check
# ---------------------------------------------------------------------------------------------


def test_local_directories_only_under_the_roots_after_resolving_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "models"
    inside = small_model(root, "m")
    outside = small_model(tmp_path / "elsewhere", "secret")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "alias").symlink_to(inside, target_is_directory=True)
    policy = SourcePolicy(file_roots=(str(root),))
    assert resolve_source(f"file://{inside}", policy=policy) == inside
    assert resolve_source(str(root / "alias"), policy=policy) == root / "alias"
    cases = [(f"file://{outside}", "fileRoots"), (str(outside), "fileRoots"),
             (f"file://{root}/escape", "after resolving symlinks"),
             (f"file://{tmp_path}/models-evil/m", "fileRoots"),
             (f"file://{tmp_path}/nowhere/at/all", "fileRoots"),  # said before any stat
             ("file:///usr", "fileRoots")]
    for uri, words in cases:
        with pytest.raises(SourceError) as e:
            resolve_source(uri, policy=policy)
        refused(e, words)
        assert str(tmp_path) not in e.value.message  # no path comes back
    with pytest.raises(SourceError) as e:
        resolve_source(f"file://{inside}")  # the default: no roots at all
    refused(e, "none are configured")


def test_the_model_dir_check_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[str] = []
    real_walk = os.walk

    def counting_walk(top, *a, **k):  # noqa: ANN001, ANN202
        for item in real_walk(top, *a, **k):
            walked.append(item[0])
            yield item

    monkeypatch.setattr(model_dir_mod.os, "walk", counting_walk)
    big = tmp_path / "big"
    for i in range(3):
        d = big / f"d{i}"
        d.mkdir(parents=True)
        for j in range(MAX_MODEL_DIR_ENTRIES // 2):
            (d / f"f{j}").touch()
    with pytest.raises(SourceError) as e:
        check_model_dir(big)  # no config.json: refused before any walk (file:///usr)
    assert e.value.reason == "ModelNotFound" and walked == []
    (big / "config.json").write_text("{}")
    with pytest.raises(SourceError) as e:
        check_model_dir(big)
    assert e.value.reason == "InvalidSource" and str(MAX_MODEL_DIR_ENTRIES) in e.value.message
    assert len(walked) <= 3  # stopped once past the bound, not the whole tree


# ---------------------------------------------------------------------------------------------
# hf:// organisations and the Mac's token
# ---------------------------------------------------------------------------------------------


class TokenHub(FakeHub):
    """The fake hub, recording every request's ``Authorization`` header."""

    def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **k)
        self.auth: list[str | None] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def record(request: web.Request, handler):  # noqa: ANN001, ANN202
            self.auth.append(request.headers.get("Authorization"))
            return await handler(request)

        app.middlewares.append(record)
        return app


async def test_hf_organisations_and_the_token(tmp_path: Path, model_files: dict[str, bytes],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    only = SourcePolicy(hf_organizations=("hub-org",))
    with pytest.raises(SourceError) as e:
        await fetch(f"hf://someone/tiny@{COMMIT_MAIN}", tmp_path, policy=only, offline=False,
                    hf_endpoint="http://127.0.0.1:9", hf_cache_dir=tmp_path / "hf")
    refused(e, "hfOrganizations")

    monkeypatch.setenv("HF_TOKEN", "hf_secret_of_this_mac")
    hub = TokenHub(model_files, COMMIT_MAIN)
    runner = web.AppRunner(hub.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore
    try:
        for i, (policy, sent) in enumerate([(only, False), (SourcePolicy(
                hf_organizations=("hub-org",), hf_token_organizations=("hub-org",)), True)]):
            hub.auth.clear()
            await fetch(f"hf://hub-org/tiny@{COMMIT_MAIN}", tmp_path, policy=policy,
                        offline=False,
                        hf_endpoint=endpoint, hf_cache_dir=tmp_path / f"hf{i}")
            assert hub.auth, "the fake hub was asked"
            assert all((a == "Bearer hf_secret_of_this_mac") is sent for a in hub.auth), hub.auth
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------------------------------
# reports: no oracle
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    return memory_store


async def failed_report(store: MemoryStore, keys: Keys, core: ServingCore, tmp_path: Path,
                        policy: SourcePolicy, name: str, uri: str) -> AssignmentReport:
    reg = Registration(store, keys, node_name=NODE, address=ADVERTISED, capacity=Capacity(),
                       ttl=5)
    await reg.start()
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=reg,
                     advertise_url=ADVERTISED, model_cache=tmp_path / "cache",
                     source_policy=policy, retry_backoff=(30, 30))
    await ctl.start()
    try:
        start = (await store.list(keys.root + "/")).revision + 1
        await store.put(keys.assignment(NODE, "default", name, "r1"),
                        https_assignment(name, uri).to_json())
        seen = await report_events(store, keys.report(NODE, "default", name, "r1"), start,
                                   settled)
    finally:
        await ctl.stop()
        await reg.stop()
    r = seen[-1]
    assert r is not None and r.state == AssignmentState.FAILED
    return r


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NETWORK_WORDS = ("127.0.0.1", "localhost", "connect", "refused", "certificate", "ssl", "tls",
                 "errno", "verify", "reset")


async def test_reports_say_refused_or_download_failed_without_network_details(
        store: MemoryStore, keys: Keys, core: ServingCore, mirror: Mirror, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = closed_port()
    # the default policy: refused, naming the rule
    r = await failed_report(store, keys, core, tmp_path / "a", DEFAULT_POLICY, "private",
                            f"https://127.0.0.1:{port}/m/")
    assert r.reason == "SourceRefused" and r.message.startswith(REFUSED)
    assert "allowPrivateNetworks" in r.message and "attempt" not in r.message  # not retried
    # allowed, but nothing listens / the certificate is untrusted / HTTP 503 / a path
    policy = SourcePolicy(allow_private_networks=True, file_roots=(str(tmp_path),))
    cases = {"closed": f"https://127.0.0.1:{port}/m/"}
    r = await failed_report(store, keys, core, tmp_path / "b", policy, "closed", cases["closed"])
    assert r.reason == "DownloadFailed" and r.message.startswith("download failed")
    assert not any(w in r.message.lower() for w in NETWORK_WORDS) and str(port) not in \
        r.message.replace(cases["closed"], ""), r.message

    with monkeypatch.context() as m:
        m.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.pem"))
        m.setenv("SSL_CERT_DIR", str(tmp_path))
        r = await failed_report(store, keys, core, tmp_path / "c", policy, "untrusted",
                                loopback_url(mirror))
    assert r.reason == "DownloadFailed" and r.message.startswith("download failed")
    assert not any(w in r.message.lower().replace(loopback_url(mirror), "")
                   for w in NETWORK_WORDS), r.message

    mirror.status["manifest.json"] = 503
    r = await failed_report(store, keys, core, tmp_path / "d", policy, "unavailable",
                            loopback_url(mirror))
    assert r.reason == "DownloadFailed" and "HTTP 5xx" in r.message and "503" not in r.message

    secret = small_model(tmp_path / "private", "m")
    (secret / "tokenizer.json").symlink_to("/etc/hostname")
    for name, uri in [("missing", f"file://{tmp_path}/private/none"),
                      ("link", f"file://{secret}")]:
        r = await failed_report(store, keys, core, tmp_path / name, policy, name, uri)
        assert r.reason in ("ModelNotFound", "InvalidSource"), r
        shown = r.message.replace(uri, "")
        assert str(tmp_path) not in shown and "/etc" not in shown, r.message


# ---------------------------------------------------------------------------------------------
# the flag: one record for agent and operator, a bad one stops either at start
# ---------------------------------------------------------------------------------------------


def test_agent_and_operator_read_the_same_record_and_refuse_a_bad_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_fleet_operator.main import _source_policy
    from mlx_fleet_operator.main import main as operator_main
    from node_agent.cli import build_parser, config_from_args
    from node_agent.main import main as agent_main

    record = tmp_path / "policy.yaml"
    record.write_text("fileRoots: [/srv/models]\nallowPrivateNetworks: true\n")
    agent = config_from_args(build_parser().parse_args(["--node-name", "n", "--source-policy",
                                                        str(record)]))
    assert agent.source_policy == _source_policy(str(record)) == SourcePolicy(
        file_roots=("/srv/models",), allow_private_networks=True)
    monkeypatch.setenv("MLX_FLEET_SOURCE_POLICY", '{"hfOrganizations": ["mlx-community"]}')
    from_env = config_from_args(build_parser().parse_args(["--node-name", "n"]))
    assert from_env.source_policy.hf_organizations == ("mlx-community",)
    monkeypatch.delenv("MLX_FLEET_SOURCE_POLICY")
    assert config_from_args(build_parser().parse_args(["--node-name", "n"])).source_policy \
        == DEFAULT_POLICY

    bad = '{"schemes": ["http"]}'
    assert agent_main(["--node-name", "n", "--source-policy", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlx-fleet-agent: error: schemes: 'http'"), err
    assert operator_main(["--source-policy", str(tmp_path / "missing.yaml"),
                          "--metrics-port", "0", "--liveness-port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlx-fleet-operator: error: --source-policy: "
                                               "cannot read the source policy file"), err


@pytest.mark.parametrize("reason, detail, status, uri, says", [
    ("DownloadFailed", "GET https://127.0.0.7:8443/m/manifest.json: ClientConnectorError: "
     "Cannot connect to host 127.0.0.7:8443 ssl:default [Connect call failed]", None,
     "https://m.example/m/", "download failed; details in the agent's log"),
    ("DownloadFailed", "GET https://m.example/m/x: HTTP 503 Service Unavailable", 503,
     "https://m.example/m/", "download failed (HTTP 5xx); details in the agent's log"),
    ("ModelNotFound", "no manifest.json at https://m.example/m/manifest.json (HTTP 404)", 404,
     "https://m.example/m/", "download failed (HTTP 4xx): no model mirror at the source"),
    ("ModelNotFound", "/srv/models/x holds no config.json", None, "file:///srv/models/x",
     "no usable model directory at the source"),
    ("InvalidSource", "tokenizer.json in /srv/m is a symlink to /etc/passwd", None,
     "/srv/m", "the source is not a usable model"),
    ("InvalidSource", "/srv/m/config.json is not valid JSON: Expecting value", None,
     "/srv/m", "config.json is not valid JSON"),  # what is wrong inside the model: said
    ("DownloadStalled", "no data from https://m.example/m/x for 60s", None,
     "https://m.example/m/", "download stalled"),
    ("DownloadCorrupt", "x: sha256 ab.. does not match", None, "https://m.example/m/",
     "download failed verification"),
    ("SourceRefused", "refused by the source policy: the host a.example is not in httpsHosts",
     None, "https://a.example/m/", "refused by the source policy: the host a.example"),
])
def test_status_messages_say_the_kind_of_failure_only(reason: str, detail: str,
                                                      status: int | None, uri: str,
                                                      says: str) -> None:
    from node_agent.model_dir import status_message

    public = "config.json is not valid JSON" if "Expecting" in detail else None
    shown = status_message(SourceError(reason, detail, http_status=status, public=public), uri)
    assert shown.startswith(says), shown
    for leak in ("127.0.0.7", "Connect call", "/etc/passwd", "/srv", "503 Service", "ab.."):
        assert leak not in shown, shown
