"""The streaming relay (mlx_fleet.routing.proxy) between two real aiohttp servers on loopback:
chunks relayed as they come, the relayed headers, and the two failure sides — before the
response header (UpstreamError: nothing sent, the caller may answer or retry) and after it
(StreamCut: the client's stream is cut)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER
from mlx_fleet.routing.proxy import (RELAYED_HEADERS, StreamCut, UpstreamError, client_session,
                                     proxy)

BOUND = 30.0  # seconds: far longer than any step here takes; waiting that long means a hang

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Front:
    """A server whose one route relays to ``upstream`` with :func:`proxy`, keeping what the
    relay raised (``outcomes``: the exception, or None for a completed relay)."""

    def __init__(self, upstream: str, retry_statuses: frozenset[int] = frozenset()) -> None:
        self.upstream = upstream
        self.retry_statuses = retry_statuses
        self.outcomes: asyncio.Queue[BaseException | None] = asyncio.Queue()
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            resp = await proxy(request, self.session, self.upstream + request.path,
                               body=await request.read(),
                               headers={"Content-Type": "application/json", PIN_HEADER: "r2"},
                               retry_statuses=self.retry_statuses)
        except UpstreamError as e:
            self.outcomes.put_nowait(e)
            return web.json_response({"upstream": e.reason, "status": e.status}, status=503)
        except StreamCut as e:
            self.outcomes.put_nowait(e)
            raise
        self.outcomes.put_nowait(None)
        return resp


@pytest_asyncio.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[tuple[str, Front]]]]:
    """``start(upstream_handler | url, **front_options)`` → (the front's URL, the front)."""
    started: list[TestServer] = []
    fronts: list[Front] = []

    async def start(upstream: Handler | str, **options: frozenset[int]) -> tuple[str, Front]:
        if callable(upstream):
            up_app = web.Application()
            up_app.router.add_post("/v1/completions", upstream)
            up = TestServer(up_app)
            await up.start_server()
            started.append(up)
            upstream = str(up.make_url("")).rstrip("/")
        front = Front(upstream, **options)
        front.session = client_session()
        fronts.append(front)
        app = web.Application()
        app.router.add_post("/v1/completions", front.handle)
        server = TestServer(app)
        await server.start_server()
        started.append(server)
        return str(server.make_url("")).rstrip("/"), front

    yield start
    for front in fronts:
        assert front.session is not None
        await front.session.close()
    for server in reversed(started):
        await server.close()


async def test_relays_status_body_and_only_the_relayed_headers(servers) -> None:
    seen: dict[str, object] = {}

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.update(body=await request.read(), pin=request.headers.get(PIN_HEADER),
                    type=request.headers.get("Content-Type"))
        return web.Response(status=429, body=b'{"error": "busy"}', headers={
            "Content-Type": "application/json", "Retry-After": "3", REVISION_HEADER: "r2",
            "X-Upstream-Secret": "s3cret", "Set-Cookie": "a=b"})

    url, front = await servers(upstream)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b'{"model": "m"}') as resp:
            assert resp.status == 429
            assert await resp.read() == b'{"error": "busy"}'
            assert resp.headers["Retry-After"] == "3"
            assert resp.headers[REVISION_HEADER] == "r2"
            assert resp.headers["Content-Type"] == "application/json"
            assert "X-Upstream-Secret" not in resp.headers and "Set-Cookie" not in resp.headers
    assert seen == {"body": b'{"model": "m"}', "pin": "r2", "type": "application/json"}
    assert await front.outcomes.get() is None
    assert "x-upstream-secret" not in RELAYED_HEADERS


async def test_chunks_are_relayed_as_they_come(servers) -> None:
    """The upstream sends its second event only after the client has read the first one
    through the relay: a relay that buffered the body would wait forever (bounded here)."""
    first_read = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await asyncio.wait_for(first_read.wait(), BOUND)
        await resp.write(b"data: two\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    url, front = await servers(upstream)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), BOUND) == \
                b"data: one\n\n"
            first_read.set()
            assert await asyncio.wait_for(resp.content.read(), BOUND) == \
                b"data: two\n\ndata: [DONE]\n\n"
    assert await front.outcomes.get() is None


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_upstream_is_an_upstream_error_before_any_byte(servers) -> None:
    url, front = await servers(f"http://127.0.0.1:{_closed_port()}")
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            # the caller's own answer: nothing of the relay reached the client
            assert resp.status == 503
            assert await resp.json() == {"upstream": "ClientConnectorError", "status": None}
    err = await front.outcomes.get()
    assert isinstance(err, UpstreamError) and err.status is None
    assert err.url.endswith("/v1/completions")


@pytest.mark.parametrize("status", [502, 503, 504, 429])
async def test_a_retry_status_is_not_relayed(servers, status: int) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, text="upstream body, not for the client")

    url, front = await servers(upstream, retry_statuses=frozenset({429, 502, 503, 504}))
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 503
            assert await resp.json() == {"upstream": f"HTTP {status}", "status": status}
    err = await front.outcomes.get()
    assert isinstance(err, UpstreamError) and err.status == status


async def test_a_status_not_listed_is_relayed(servers) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="boom")

    url, front = await servers(upstream, retry_statuses=frozenset({503}))
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 500 and await resp.text() == "boom"
    assert await front.outcomes.get() is None


async def test_upstream_dying_after_its_header_before_any_body_is_an_upstream_error(
        servers) -> None:
    """An agent killed just after it began a stream (its 200 and SSE header sent, no event
    yet): nothing has gone to the client, so the caller may still retry elsewhere."""
    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"")  # the header goes out
        assert request.transport is not None
        request.transport.close()  # dies before its first event
        return resp

    url, front = await servers(upstream)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 503  # the caller's own answer, not the upstream's 200
            assert (await resp.json())["status"] is None
    err = await front.outcomes.get()
    assert isinstance(err, UpstreamError) and err.status is None


async def test_an_empty_body_is_relayed(servers) -> None:
    async def upstream(request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    url, front = await servers(upstream)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 204 and await resp.read() == b""
    assert await front.outcomes.get() is None


async def test_upstream_dropping_mid_stream_cuts_the_clients_stream(servers) -> None:
    first_read = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await asyncio.wait_for(first_read.wait(), BOUND)
        assert request.transport is not None
        request.transport.close()  # the upstream dies mid-stream
        return resp

    url, front = await servers(upstream)
    async with aiohttp.ClientSession() as client:
        async with client.post(url + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 200  # the header went out (with "one") before it died
            assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), BOUND) == \
                b"data: one\n\n"
            first_read.set()
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(resp.content.read(), BOUND)
    err = await front.outcomes.get()
    assert isinstance(err, StreamCut) and isinstance(err, ConnectionResetError)
