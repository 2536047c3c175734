"""``mlx_fleet.devcluster.loadgen.LoadGenerator.one`` classifies each request's end — here the
non-streamed path (``stream=False``, the demo's and the router benchmark's plain clients)
against a small aiohttp app answering as an agent or a router would."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestServer

from mlx_fleet.devcluster.loadgen import LoadGenerator
from mlx_fleet.routing.headers import REVISION_HEADER, SESSION_HEADER

COMPLETION = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "hi"}}]}


async def _server() -> TestServer:
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get(SESSION_HEADER)})
        session = request.headers[SESSION_HEADER]
        if session == "busy":
            return web.json_response({"error": {"message": "overloaded"}}, status=429)
        if session == "odd":
            return web.json_response({"object": "list", "data": []})
        return web.json_response(COMPLETION, headers={REVISION_HEADER: "v7"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    server.seen = seen  # type: ignore[attr-defined]
    return server


async def test_non_streamed_requests_are_classified() -> None:
    server = await _server()
    base = str(server.make_url("")).rstrip("/")
    try:
        async with LoadGenerator(lambda: [base], "m", sessions=[], stream=False) as load:
            ok = await load.one(base, "s1")
            busy = await load.one(base, "busy")
            odd = await load.one(base, "odd")
    finally:
        await server.close()
    assert server.seen[0]["body"]["stream"] is False  # type: ignore[attr-defined]
    assert server.seen[0]["session"] == "s1"  # type: ignore[attr-defined]
    assert (ok.failed, ok.status, ok.revision, ok.error_kind) == (False, 200, "v7", "")
    assert ok.first_token is None  # no stream: no first token to time
    assert (busy.failed, busy.status, busy.error_kind) == (True, 429, "http")
    assert (odd.failed, odd.status, odd.error_kind) == (True, 200, "incomplete")


async def test_a_refused_connection_is_a_connection_failure() -> None:
    server = await _server()
    base = str(server.make_url("")).rstrip("/")
    await server.close()  # nothing listens there any more
    async with LoadGenerator(lambda: [base], "m", sessions=[], stream=False) as load:
        gone = await load.one(base, "s1")
    assert (gone.failed, gone.status, gone.error_kind) == (True, 0, "connection")
