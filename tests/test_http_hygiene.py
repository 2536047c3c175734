"""Issue 19, HTTP hygiene of the agent's server (findings 6, 8 and 9): slow clients are cut off
(header and body timeouts), connections are capped, POST bodies must be JSON, a foreign
``Host`` is refused while the API has no keys (DNS rebinding), CORS only for configured
origins, ``/health`` says only healthy or not to a request without a key, and error bodies
carry no internal exception text. The server is started as the agent starts it
(:func:`mlx_fleet.http_hygiene.start_server`) on 127.0.0.1; raw sockets play the slow clients.
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
from aiohttp.test_utils import TestClient, TestServer

from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.http_hygiene import HttpLimits, allowed_hosts, host_allowed, start_server
from node_agent.openai_api import build_app
from http_wire import one_response
from serving_fixtures import MODEL_ID, REVISION, Agent, agent, tiny_model_path  # noqa: F401

KEY = "sk-hygiene-0123456789abcdef"
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
BOUND = 30.0  # seconds any single wait here may take before the test fails


def _keys(tmp_path: Path) -> KeyFile:
    p = tmp_path / "keys"
    p.write_text(KEY + "\n")
    return KeyFile(p)


Serve = Callable[..., Awaitable[int]]


@pytest_asyncio.fixture
async def serve(agent: Agent) -> AsyncIterator[Serve]:  # noqa: F811
    """Start the real app over the session's core as the agent does; returns the port."""
    runners: list[web.AppRunner] = []

    async def start(limits: HttpLimits, **app_kwargs: Any) -> int:
        app = build_app(agent.core, health=lambda: (True, {"status": "ok", "lease": "42"}),
                        registry=agent.registry, limits=limits, **app_kwargs)
        runner, site = await start_server(app, "127.0.0.1", 0, limits=limits)
        runners.append(runner)
        return site.port

    yield start
    for r in runners:
        await r.cleanup()


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection — with a FIN, or with a reset
    (the kernel answers a close with unread client bytes pending by RST: then nothing was sent
    that the client could read, which is b"")."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def test_slow_header_clients_are_closed(serve: Serve, tmp_path: Path) -> None:
    """Slow-loris: 20 connections on a keyed port, each sending one header byte every 0.2 s,
    are all closed by the server once the header timeout (1 s) passes — aiohttp's default
    would keep them an hour."""
    port = await serve(HttpLimits(header_timeout_seconds=1.0), api_keys=_keys(tmp_path))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
    t0 = asyncio.get_running_loop().time()

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
        tails = await asyncio.wait_for(
            asyncio.gather(*(_closed_by_server(r) for r, _ in conns)), BOUND)
    finally:
        for s in senders:
            s.cancel()
        for _, w in conns:
            w.close()
    took = asyncio.get_running_loop().time() - t0
    assert all(t == b"" for t in tails)  # closed without an answer: no request head arrived
    assert took < 10, took


async def test_default_header_timeout_outlasts_client_keep_alive() -> None:
    """The header timeout is also aiohttp's server-side idle keep-alive: it must stay above the
    idle keep-alive of aiohttp's client (agents forwarding to agents, the fleet router), or a
    reused connection races the server's close and a forward fails for nothing."""
    conn = aiohttp.TCPConnector()
    try:
        assert HttpLimits().header_timeout_seconds > conn._keepalive_timeout  # 15 s
    finally:
        await conn.close()


async def test_slow_body_is_answered_408(serve: Serve) -> None:
    port = await serve(HttpLimits(body_timeout_seconds=0.5))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
        await writer.drain()
        status_line, headers, body = await asyncio.wait_for(one_response(reader), BOUND)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 408"), (status_line, body)
    assert headers["connection"] == "close"  # the server closes it (after aiohttp's lingering)
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "0.5 s" in err["message"]


async def test_body_is_not_awaited_before_authentication(serve: Serve, tmp_path: Path) -> None:
    """With keys, a POST without a key is answered 401 at once: the server never waits for (or
    buffers) the body of a client it does not know."""
    port = await serve(HttpLimits(body_timeout_seconds=BOUND), api_keys=_keys(tmp_path))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), BOUND / 3)
    finally:
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 401"), status_line


async def test_connections_over_the_cap_get_503_and_are_closed(serve: Serve) -> None:
    port = await serve(HttpLimits(max_connections=3))
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), BOUND)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            "too_many_connections"
        # one of the held connections is still served
        r0, w0 = held[0]
        w0.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(r0.read(), BOUND)).startswith(b"HTTP/1.1 200")
        w0.close()
        # once a slot is free again, a new connection is served
        async def served() -> bytes:
            while True:
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                out = await r.read()
                w.close()
                if not out.startswith(b"HTTP/1.1 503"):
                    return out
                await asyncio.sleep(0.05)  # the server sees the close asynchronously
        assert (await asyncio.wait_for(served(), BOUND)).startswith(b"HTTP/1.1 200")
    finally:
        for _, w in held:
            w.close()


async def test_failed_tls_handshakes_do_not_use_up_the_cap(agent: Agent,  # noqa: F811
                                                           tmp_path: Path) -> None:
    """Over HTTPS a connection counts from its TCP open, and a failed handshake (a port
    scanner, plain HTTP to the TLS port) frees its slot at once: such clients never fill the
    cap."""
    import ssl

    from etcd_tls import make_pki
    from node_agent.main import forward_tls_context, tls_context

    pki = make_pki(tmp_path / "pki", [])
    limits = HttpLimits(max_connections=1)
    app = build_app(agent.core, health=lambda: (True, {"status": "ok"}),
                    registry=agent.registry, limits=limits)
    runner, site = await start_server(app, "127.0.0.1", 0, limits=limits,
                                      ssl_context=tls_context(str(pki.server.cert),
                                                              str(pki.server.key)))
    try:
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # not TLS
            await asyncio.wait_for(reader.read(), BOUND)  # the server drops it
            writer.close()
        trusting: ssl.SSLContext = forward_tls_context(str(pki.ca))
        async with aiohttp.ClientSession() as http:
            async def healthy() -> int:
                while True:  # the server sees the failed handshakes end asynchronously
                    async with http.get(f"https://localhost:{site.port}/health",
                                        ssl=trusting) as resp:
                        if resp.status != 503:
                            return resp.status
                    await asyncio.sleep(0.05)
            assert await asyncio.wait_for(healthy(), BOUND) == 200
        assert site.refused_connections == 0
    finally:
        await runner.cleanup()


def _bare_app() -> web.Application:
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})
    app.router.add_get("/health", health)
    return app


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


async def _one_response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    return head + await asyncio.wait_for(reader.readexactly(length), BOUND)


async def test_one_client_address_cannot_take_every_slot() -> None:
    """The review's probe: one peer keeps every slot of the cap busy with GET /health (each
    answer restarts the idle timer). With a per-client cap it holds only its share: its next
    connection is refused, a client from another address is served."""
    limits = HttpLimits(max_connections=8, max_connections_per_client=4)
    runner, site = await start_server(_bare_app(), "127.0.0.1", 0, limits=limits)
    held = []
    try:
        for _ in range(4):
            r, w = await asyncio.open_connection("127.0.0.1", site.port)
            held.append((r, w))
            w.write(HEALTH)
            assert (await _one_response(r)).startswith(b"HTTP/1.1 200")
        r, w = await asyncio.open_connection("127.0.0.1", site.port)
        answer = await asyncio.wait_for(r.read(), BOUND)
        w.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            "too_many_connections_from_client"
        for r, w in held:  # the peer's held connections still work (and stay busy)
            w.write(HEALTH)
            assert (await _one_response(r)).startswith(b"HTTP/1.1 200")
        # another client address (127.0.0.2 reaches 127.0.0.1 over lo) is served
        r, w = await asyncio.open_connection("127.0.0.1", site.port,
                                             local_addr=("127.0.0.2", 0))
        w.write(HEALTH)
        assert (await _one_response(r)).startswith(b"HTTP/1.1 200")
        w.close()
        assert site.per_client == {"127.0.0.1": 4, "127.0.0.2": 1} or \
            site.per_client == {"127.0.0.1": 4}  # the last close may already be seen
    finally:
        for _, w in held:
            w.close()
        await runner.cleanup()


async def test_connection_closes_after_its_request_budget(serve: Serve) -> None:
    """nginx's keepalive_requests: the response to the last request a connection may carry
    says Connection: close and the server closes it, so busy connections are recycled."""
    port = await serve(HttpLimits(max_requests_per_connection=2))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEALTH)
        first = await _one_response(reader)
        assert first.startswith(b"HTTP/1.1 200") and b"Connection: close" not in first
        writer.write(HEALTH)
        second = await _one_response(reader)
        assert second.startswith(b"HTTP/1.1 200")
        assert b"connection: close" in second.lower(), second
        assert await asyncio.wait_for(_closed_by_server(reader), BOUND) == b""
    finally:
        writer.close()


async def test_connection_closes_after_its_age(serve: Serve) -> None:
    """nginx's keepalive_time: the first response after the connection's age limit closes it."""
    port = await serve(HttpLimits(max_connection_age_seconds=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(HEALTH)
        young = await _one_response(reader)
        assert young.startswith(b"HTTP/1.1 200") and b"connection: close" not in young.lower()
        await asyncio.sleep(0.25)  # the connection ages past its limit (what is tested)
        writer.write(HEALTH)
        answer = await _one_response(reader)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
        assert await asyncio.wait_for(_closed_by_server(reader), BOUND) == b""
    finally:
        writer.close()


async def test_silent_tls_connections_count_and_time_out(tmp_path: Path) -> None:
    """The review's probe: TCP connections that never send a ClientHello. They count against
    the cap from the moment they open (the rest are refused: no file descriptors beyond the
    cap), and the handshake timeout (the header timeout) closes them and frees their slots."""
    import ssl

    from etcd_tls import make_pki
    from node_agent.main import forward_tls_context, tls_context

    pki = make_pki(tmp_path / "pki", [])
    limits = HttpLimits(max_connections=4, header_timeout_seconds=1.0)
    runner, site = await start_server(_bare_app(), "127.0.0.1", 0, limits=limits,
                                      ssl_context=tls_context(str(pki.server.cert),
                                                              str(pki.server.key)))
    held = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(12)]
    try:
        answers = await asyncio.wait_for(
            asyncio.gather(*(_closed_by_server(r) for r, _ in held)), BOUND)
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 8 and site.refused_connections == 8
        assert [a for a in answers if a not in refused] == [b""] * 4  # timed out, unanswered
        trusting: ssl.SSLContext = forward_tls_context(str(pki.ca))
        async with aiohttp.ClientSession() as http:
            async def healthy() -> int:
                while True:  # the server sees the timed-out handshakes end asynchronously
                    async with http.get(f"https://localhost:{site.port}/health",
                                        ssl=trusting) as resp:
                        if resp.status != 503:
                            return resp.status
                    await asyncio.sleep(0.05)
            assert await asyncio.wait_for(healthy(), BOUND) == 200
    finally:
        for _, w in held:
            w.close()
        await runner.cleanup()


# -- requests a browser can make --------------------------------------------------------------


@pytest_asyncio.fixture
async def client_for(agent: Agent,  # noqa: F811
                     ) -> AsyncIterator[Callable[..., Awaitable[TestClient]]]:
    clients: list[TestClient] = []

    async def make(**kwargs: Any) -> TestClient:
        app = build_app(agent.core,
                        health=lambda: (True, {"status": "ok", "lease": "7587", "assignments": {
                            "default/chat/r1": {"last_error": "/Users/x/models: denied"}}}),
                        registry=agent.registry, **kwargs)
        c = TestClient(TestServer(app, host="127.0.0.1"))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


async def _error(resp: aiohttp.ClientResponse) -> dict:
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
async def test_post_body_that_is_not_json_is_415(client_for, content_type: str | None) -> None:
    """A browser's cross-origin "simple" POST (text/plain, a form) never reaches a handler,
    even though its body is valid JSON."""
    c = await client_for()
    headers = {"Content-Type": content_type} if content_type else {}
    resp = await c.post(CHAT, data=json.dumps(BODY).encode(), headers=headers,
                        skip_auto_headers=["Content-Type"])
    assert resp.status == 415
    err = await _error(resp)
    assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    resp = await c.post(CHAT, json=BODY,
                        headers={"Content-Type": "application/json; charset=utf-8"})
    assert resp.status == 200, await resp.text()


async def test_foreign_host_is_421_without_keys(client_for, tmp_path: Path) -> None:
    """DNS rebinding: a page on rebind.example whose name now resolves to the Mac sends
    ``Host: rebind.example``; without keys only loopback names and the configured hosts are
    answered. With keys, the Host is not checked (the page has no key)."""
    c = await client_for(hosts=allowed_hosts("studio-1.lan"))
    for path in ("/v1/models", "/metrics"):
        resp = await c.get(path, headers={"Host": "rebind.example:8000"})
        assert resp.status == 421
        assert (await _error(resp))["code"] == "misdirected_request"
    resp = await c.post(CHAT, json=BODY, headers={"Host": "rebind.example"})
    assert resp.status == 421
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "studio-1.lan:8000", "STUDIO-1.LAN"):
        resp = await c.get("/v1/models", headers={"Host": host})
        assert resp.status == 200, host
    keyed = await client_for(api_keys=_keys(tmp_path))
    resp = await keyed.get("/v1/models", headers={"Host": "rebind.example",
                                                  "Authorization": f"Bearer {KEY}"})
    assert resp.status == 200
    resp = await keyed.get("/v1/models", headers={"Host": "rebind.example"})
    assert resp.status == 401


@pytest.mark.parametrize("header, ok", [
    ("localhost", True), ("127.0.0.1:80", True), ("[::1]", True), ("mac.lan:1", True),
    ("mac.lan.evil", False), ("", False), (None, False), ("127.0.0.1.nip.io", False)])
def test_host_allowed(header: str | None, ok: bool) -> None:
    assert host_allowed(header, allowed_hosts("http://mac.lan:8000", "0.0.0.0")) is ok


async def test_cors_only_for_configured_origins(client_for) -> None:
    plain = await client_for()
    resp = await plain.get("/v1/models", headers={"Origin": "https://app.example"})
    assert resp.status == 200 and not any(h.startswith("Access-Control-")
                                          for h in resp.headers)
    resp = await plain.options(CHAT, headers={"Origin": "https://app.example",
                                              "Access-Control-Request-Method": "POST"})
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers

    c = await client_for(limits=HttpLimits(cors_origins=frozenset({"https://app.example"})))
    resp = await c.options(CHAT, headers={"Origin": "https://app.example",
                                          "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization"})
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
    assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
    resp = await c.post(CHAT, json=BODY, headers={"Origin": "https://app.example"})
    assert resp.status == 200
    assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
    resp = await c.get("/v1/models", headers={"Origin": "https://other.example"})
    assert "Access-Control-Allow-Origin" not in resp.headers
    resp = await c.options(CHAT, headers={"Origin": "https://other.example",
                                          "Access-Control-Request-Method": "POST"})
    assert resp.status == 405


async def test_health_without_a_key_says_only_healthy_or_not(client_for, tmp_path: Path) -> None:
    keyed = await client_for(api_keys=_keys(tmp_path))
    resp = await keyed.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}
    resp = await keyed.get("/health", headers={"Authorization": "Bearer wrong"})
    assert await resp.json() == {"status": "ok"}
    resp = await keyed.get("/health", headers={"Authorization": f"Bearer {KEY}"})
    assert (await resp.json())["lease"] == "7587"
    # no keys, listening beyond loopback (the agent passes health_details=False)
    open_lan = await client_for(health_details=False)
    assert await (await open_lan.get("/health")).json() == {"status": "ok"}


async def test_error_bodies_carry_no_internal_text(client_for, agent: Agent,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer that fails with an internal path in its message: the client is told what
    went wrong (it could not tokenize) but not the exception's text."""
    real = agent.core._tokenizers[(MODEL_ID, REVISION)]

    class Failing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def apply_chat_template(self, *a: Any, **k: Any) -> Any:
            raise TypeError("/opt/mlx-fleet/lib/python3.11/site-packages/x.py: bad arg 0x7f3a")

    monkeypatch.setitem(agent.core._tokenizers, (MODEL_ID, REVISION), Failing())
    c = await client_for()
    resp = await c.post(CHAT, json=BODY)
    text = await resp.text()
    assert resp.status == 400
    assert "/opt/" not in text and "0x7f3a" not in text and "site-packages" not in text
    err = json.loads(text)["error"]
    assert err["code"] == "invalid_prompt" and "cannot tokenize" in err["message"]
