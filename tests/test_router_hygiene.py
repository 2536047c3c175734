"""Issue 19, the fleet router's HTTP hygiene (findings 6, 8, 9 for the router): the agent's rules
(:mod:`mlx_fleet.http_hygiene`) on the router's own server — slow clients cut off, connections
capped, JSON POST bodies only, a foreign ``Host`` refused while the router has no keys, CORS only
for configured origins, an oversized body answered 413 — and its secure defaults at start
(:func:`mlx_fleet.exposure.exposure_check`). The router is served as ``mlx-fleet-router``
serves it (:func:`mlx_fleet.http_hygiene.start_server`) on 127.0.0.1; raw sockets play the slow
clients. No upstream is needed: every request here is answered by the router itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry

from mlx_fleet.exposure import INSECURE_ETCD, INSECURE_HTTP_LISTEN, INSECURE_LISTEN
from mlx_fleet.http_hygiene import HttpLimits, allowed_hosts, start_server
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.body_size import max_body_bytes
from mlx_fleet_router.app import build_app
from mlx_fleet_router.main import configure, main, parse_args
from mlx_fleet_router.state import RouterSettings
from mlx_fleet_router.table import Table
from http_wire import one_response

KEY = "sk-router-hygiene-0123456789"
CHAT = "/v1/chat/completions"
BODY = {"model": "chat", "messages": [{"role": "user", "content": "Hi"}]}
BOUND = 30.0  # seconds any single wait here may take before the test fails


def _keys(tmp_path: Path) -> KeyFile:
    p = tmp_path / "keys"
    p.write_text(KEY + "\n")
    return KeyFile(p)


Serve = Callable[..., Awaitable[str]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start the router's app (an empty routing table) as ``mlx-fleet-router`` does; returns
    its base URL."""
    runners: list[web.AppRunner] = []

    async def start(limits: HttpLimits = HttpLimits(), **app_kwargs: Any) -> str:
        app = build_app(Table, registry=CollectorRegistry(),
                        settings=RouterSettings(probe_interval_seconds=0),
                        http_limits=limits, **app_kwargs)
        runner, site = await start_server(app, "127.0.0.1", 0, limits=limits)
        runners.append(runner)
        return f"http://127.0.0.1:{site.port}"

    yield start
    for r in runners:
        await r.cleanup()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (b"" after a reset: the kernel
    answers a close with unread client bytes pending by RST)."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def test_hundred_slow_header_clients_are_closed(serve: Serve, tmp_path: Path) -> None:
    """Slow-loris (the review's 100 connections, one header byte at a time) on a keyed router:
    all are closed by the server once the header timeout (1 s) passes — aiohttp's default keeps
    them an hour — and the router still answers a normal request meanwhile."""
    url = await serve(HttpLimits(header_timeout_seconds=1.0), api_keys=_keys(tmp_path))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    conns = [await asyncio.open_connection("127.0.0.1", _port(url)) for _ in range(100)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def dribble(writer: asyncio.StreamWriter) -> None:
        for b in head:
            if writer.is_closing():
                return
            try:
                writer.write(bytes([b]))
                await writer.drain()
            except ConnectionError:
                return
            await asyncio.sleep(0.2)  # the client's pace: one byte every 0.2 s

    senders = [asyncio.create_task(dribble(w)) for _, w in conns]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:
                assert resp.status == 200
        tails = await asyncio.wait_for(
            asyncio.gather(*(_closed_by_server(r) for r, _ in conns)), BOUND)
    finally:
        for s in senders:
            s.cancel()
        for _, w in conns:
            w.close()
    took = loop.time() - t0
    assert all(t == b"" for t in tails)  # closed without an answer: no request head arrived
    assert took < 15, took


async def test_slow_body_is_answered_408(serve: Serve) -> None:
    url = await serve(HttpLimits(body_timeout_seconds=0.5))
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        await writer.drain()
        status_line, headers, body = await asyncio.wait_for(one_response(reader), BOUND)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 408"), (status_line, body)
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


async def test_body_is_not_awaited_before_authentication(serve: Serve, tmp_path: Path) -> None:
    url = await serve(HttpLimits(body_timeout_seconds=BOUND), api_keys=_keys(tmp_path))
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), BOUND / 3)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 401"), status_line


async def test_connections_over_the_cap_get_503(serve: Serve) -> None:
    url = await serve(HttpLimits(max_connections=3))
    held = [await asyncio.open_connection("127.0.0.1", _port(url)) for _ in range(3)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(url))
        answer = await asyncio.wait_for(reader.read(), BOUND)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            "too_many_connections"
    finally:
        for _, w in held:
            w.close()


async def _error(resp: aiohttp.ClientResponse) -> dict:
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          None])
async def test_post_body_that_is_not_json_is_415(serve: Serve, content_type: str | None) -> None:
    """A browser's cross-origin "simple" POST never reaches the router's handler (which would
    parse it as JSON and relay it): 415, before the model is even looked up."""
    url = await serve()
    headers = {"Content-Type": content_type} if content_type else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + CHAT, data=json.dumps(BODY).encode(), headers=headers,
                             skip_auto_headers=["Content-Type"]) as resp:
            assert resp.status == 415
            assert (await _error(resp))["code"] == "unsupported_media_type"
        async with http.post(url + CHAT, json=BODY) as resp:  # JSON: on to the routing
            assert resp.status == 404
            assert (await _error(resp))["code"] == "model_not_found"


async def test_foreign_host_is_421_without_keys(serve: Serve, tmp_path: Path) -> None:
    """DNS rebinding: ``Host: rebind.example`` reads nothing from a keyless router (``/v1/*``,
    ``/metrics``, ``/fleet``); loopback names and ``--allowed-host`` names are answered; with
    keys the Host is not checked (the page has no key)."""
    url = await serve(hosts=allowed_hosts("router.example"))
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/models", "/metrics", "/fleet"):
            async with http.get(url + path, headers={"Host": "rebind.example:8090"}) as resp:
                assert resp.status == 421, path
                assert (await _error(resp))["code"] == "misdirected_request"
        async with http.post(url + CHAT, json=BODY, headers={"Host": "rebind.example"}) as resp:
            assert resp.status == 421
        for host in ("localhost:8090", "127.0.0.1", "[::1]:8090", "router.example:80"):
            async with http.get(url + "/v1/models", headers={"Host": host}) as resp:
                assert resp.status == 200, host
        keyed = await serve(api_keys=_keys(tmp_path))
        async with http.get(keyed + "/v1/models", headers={
                "Host": "rebind.example", "Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200
        async with http.get(keyed + "/v1/models", headers={"Host": "rebind.example"}) as resp:
            assert resp.status == 401  # the model list is behind the key like the other routes
        async with http.get(keyed + "/health", headers={"Host": "rebind.example"}) as resp:
            assert resp.status == 200 and set(await resp.json()) == {"status", "models"}


async def test_cors_only_for_configured_origins(serve: Serve) -> None:
    async with aiohttp.ClientSession() as http:
        plain = await serve()
        async with http.get(plain + "/v1/models", headers={"Origin": "https://app.example"}) as r:
            assert r.status == 200
            assert not any(h.startswith("Access-Control-") for h in r.headers)
        async with http.options(plain + CHAT, headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers
        url = await serve(HttpLimits(cors_origins=frozenset({"https://app.example"})))
        async with http.options(url + CHAT, headers={
                "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        async with http.get(url + "/v1/models", headers={"Origin": "https://app.example"}) as r:
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        async with http.get(url + "/v1/models", headers={"Origin": "https://other.example"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers


async def test_oversized_body_is_413(serve: Serve) -> None:
    """The agents' body rule (:func:`max_body_bytes` of ``--max-prompt-bytes``): one byte over
    is 413 ``request_too_large`` before the model is looked up; a body at the bound is read."""
    url = await serve(max_prompt_bytes=2**20)
    limit = max_body_bytes(2**20)
    async with aiohttp.ClientSession() as http:
        async with http.post(url + CHAT, data=b" " * (limit + 1),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 413
            err = await _error(resp)
            assert err["code"] == "request_too_large" and str(limit) in err["message"]
        doc = json.dumps(BODY).encode()
        async with http.post(url + CHAT, data=doc + b" " * (limit - len(doc)),
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 404  # read whole and parsed: the model is unknown


async def test_errors_carry_no_internal_text(tmp_path: Path) -> None:
    """An unexpected exception inside the router: 500 ``internal_error``, without its text."""
    def broken() -> Table:
        raise RuntimeError("/opt/mlx-fleet/lib/site-packages/x.py: secret 0x7f3a")

    limits = HttpLimits()
    app = build_app(broken, registry=CollectorRegistry(),
                    settings=RouterSettings(probe_interval_seconds=0), http_limits=limits)
    runner, site = await start_server(app, "127.0.0.1", 0, limits=limits)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{site.port}{CHAT}", json=BODY) as resp:
                text = await resp.text()
                assert resp.status == 500
    finally:
        await runner.cleanup()
    assert "/opt/" not in text and "0x7f3a" not in text and "RuntimeError" not in text
    assert json.loads(text)["error"]["code"] == "internal_error"


# -- secure defaults at start -----------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["--listen", "0.0.0.0"], INSECURE_LISTEN),
    (["--listen", "::"], INSECURE_LISTEN),
    (["--etcd-endpoint", "http://etcd.example:2379"], INSECURE_ETCD),
])
def test_exposed_settings_are_refused_at_start(argv: list[str], flag: str, capsys) -> None:
    """Nothing starts (exit 2, one line naming the flag); with the flag it is accepted and
    logged as INSECURE."""
    assert main(argv) == 2
    assert flag in capsys.readouterr().err
    setup = configure(parse_args([*argv, flag]))
    assert len(setup.warnings) == 1 and setup.warnings[0].startswith(f"INSECURE ({flag})")


def test_etcd_password_over_http_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    argv = ["--etcd-username", "mlx-fleet-router", "--etcd-password-file", str(tmp_path / "pw")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert INSECURE_ETCD in err and "s3cret" not in err


def test_keyed_router_may_listen_beyond_loopback_over_https(tmp_path: Path, capsys) -> None:
    """Review of issue 19: keys alone are not enough beyond loopback — over plain http they
    and the prompts cross the network in cleartext. With a TLS certificate it starts quietly;
    over http only with --insecure-http-listen (and a warning)."""
    from etcd_tls import make_pki

    (tmp_path / "keys").write_text(KEY + "\n")
    keyed = ["--listen", "0.0.0.0", "--api-key-file", str(tmp_path / "keys")]
    assert main(keyed) == 2
    assert INSECURE_HTTP_LISTEN in capsys.readouterr().err
    setup = configure(parse_args([*keyed, INSECURE_HTTP_LISTEN]))
    assert len(setup.warnings) == 1 and setup.warnings[0].startswith(
        f"INSECURE ({INSECURE_HTTP_LISTEN})")
    assert setup.tls is None
    pki = make_pki(tmp_path / "pki", [])
    setup = configure(parse_args([*keyed, "--tls-cert-file", str(pki.server.cert),
                                  "--tls-key-file", str(pki.server.key)]))
    assert setup.warnings == () and setup.tls is not None
    with pytest.raises(ValueError, match="go together"):
        configure(parse_args([*keyed, "--tls-cert-file", str(pki.server.cert)]))
    with pytest.raises(ValueError, match="--tls-cert-file"):
        configure(parse_args([*keyed, "--tls-cert-file", str(tmp_path / "nope"),
                              "--tls-key-file", str(tmp_path / "nope")]))


def test_metrics_need_a_key_by_default_when_the_router_has_keys(tmp_path: Path) -> None:
    """Review of issue 19: /metrics defaults to api-key with --api-key-file; open stays an
    explicit choice, and api-key without keys is refused."""
    (tmp_path / "keys").write_text(KEY + "\n")
    keyed = ["--api-key-file", str(tmp_path / "keys")]
    assert configure(parse_args(keyed)).metrics_auth is True
    assert configure(parse_args([*keyed, "--metrics-auth", "open"])).metrics_auth is False
    assert configure(parse_args([])).metrics_auth is False
    with pytest.raises(ValueError, match="--metrics-auth api-key needs --api-key-file"):
        configure(parse_args(["--metrics-auth", "api-key"]))


def test_http_flags_reach_the_limits() -> None:
    setup = configure(parse_args([
        "--header-timeout-seconds", "5", "--body-timeout-seconds", "7", "--max-connections",
        "9", "--cors-origin", "https://app.example", "--allowed-host", "Router.Example"]))
    assert setup.http == HttpLimits(header_timeout_seconds=5, body_timeout_seconds=7,
                                    max_connections=9,
                                    cors_origins=frozenset({"https://app.example"}),
                                    allowed_hosts=frozenset({"router.example"}))
    for bad in (["--max-connections", "0"], ["--header-timeout-seconds", "inf"],
                ["--max-prompt-bytes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
