"""Relay one HTTP request to another server and stream its answer back as it comes (aiohttp):
how an agent forwards a canary request to the node that holds the candidate, and how the fleet
router sends a request to the Mac it chose.

:func:`proxy` POSTs the request body to the upstream URL and relays the upstream's status, the
headers in :data:`RELAYED_HEADERS` and the body to the client chunk by chunk, as they arrive, so
an SSE stream (``text/event-stream``) stays a stream. The line that matters to a caller is the
response header: until the upstream's status and headers went to the client nothing was sent
and the request can still be answered otherwise (or tried on another server); after it, it
can't. The header goes to the client with the upstream's first body bytes, not before: an
upstream that answers its header and dies before any body (an agent killed just after it began
a stream) is still an :class:`UpstreamError`, which the caller may retry — the first chunk of a
stream comes as early either way.

* before: the upstream can't be reached, drops the connection before its first body bytes,
  or answers with a status the caller listed in ``retry_statuses`` → :class:`UpstreamError`,
  and the client has been sent nothing;
* after: the upstream drops the connection mid-body (or the client's connection fails) →
  :class:`StreamCut`, a :class:`ConnectionResetError`: the client's connection is closed (its
  response cut short; a chunked one without its last chunk, which clients report as an
  incomplete payload), nothing can be retried.

The client session (:func:`client_session`) has no total timeout — a stream lasts as long as
the generation takes — and a :data:`CONNECT_TIMEOUT` to open a connection. Network I/O: this
module is not in the "Pure decisions import no I/O" import contract.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Container, Mapping

import aiohttp
from aiohttp import web

from mlx_fleet.routing.headers import REVISION_HEADER

__all__ = ["CONNECT_TIMEOUT", "RELAYED_HEADERS", "UpstreamError", "StreamCut", "client_session",
           "proxy"]

#: Seconds to open a connection to the upstream (TCP and TLS); the body streams for as long as
#: it takes.
CONNECT_TIMEOUT = 5.0
#: Upstream response headers relayed to the client (lower case); the others (``Content-Length``,
#: ``Transfer-Encoding``, ``Date``, ``Server`` ...) are the relaying server's own.
RELAYED_HEADERS = frozenset({"content-type", "cache-control", "retry-after", "www-authenticate",
                             REVISION_HEADER.lower()})


class UpstreamError(Exception):
    """The upstream failed before anything went to the client. ``url``: the upstream URL;
    ``reason``: the aiohttp exception's class name (``ClientConnectorError``,
    ``ServerDisconnectedError``, ``TimeoutError`` ...) or ``HTTP <status>``; ``status``: the
    upstream's status when it answered with one of the caller's ``retry_statuses``, else
    None."""

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.status = status


class StreamCut(ConnectionResetError):
    """The relay failed after the response header went to the client: its response is cut
    short. A :class:`ConnectionResetError`, which aiohttp servers treat as a client gone."""


def client_session(ssl_context: ssl.SSLContext | None = None, *,
                   connect_timeout: float = CONNECT_TIMEOUT) -> aiohttp.ClientSession:
    """A client session for :func:`proxy`: no total timeout, ``connect_timeout`` seconds to
    connect; an ``https://`` upstream is verified with ``ssl_context``, else the system's trusted
    CAs. Create it on the running event loop; the caller closes it."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        connector=aiohttp.TCPConnector(ssl=ssl_context if ssl_context else True))


async def proxy(request: web.Request, session: aiohttp.ClientSession, url: str, *,
                body: bytes, headers: Mapping[str, str],
                retry_statuses: Container[int] = (),
                on_start: Callable[[int], None] | None = None,
                on_chunk: Callable[[bytes], None] | None = None) -> web.StreamResponse:
    """POST ``body`` with ``headers`` to ``url`` and relay the answer to ``request``'s client as
    it comes (module docstring); returns the finished response.

    Raises :class:`UpstreamError` when nothing went to the client yet (connection refused or
    timed out, connection dropped before the upstream's first body bytes, or a status in
    ``retry_statuses``: its body is not read); :class:`StreamCut` once the response header went
    out (with those first bytes).

    Observers (for a caller's metrics; they must not raise): ``on_start(status)`` when the
    upstream's status line arrived and is about to be relayed (not for a ``retry_statuses``
    one); ``on_chunk(data)`` for each body chunk, before it is written to the client."""
    try:
        async with session.post(url, data=body, headers=dict(headers)) as up:
            if up.status in retry_statuses:
                raise UpstreamError(url, f"HTTP {up.status}", up.status)
            if on_start is not None:
                on_start(up.status)
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in RELAYED_HEADERS})
            # the first body bytes (b"": an empty body) before anything goes to the client: a
            # failure until then raises UpstreamError below
            parts = up.content.iter_any()
            first = await anext(parts, b"")
            try:
                await resp.prepare(request)
                if first:
                    if on_chunk is not None:
                        on_chunk(first)
                    await resp.write(first)
                async for part in parts:
                    if on_chunk is not None:
                        on_chunk(part)
                    await resp.write(part)
                await resp.write_eof()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # the client's response can't be completed: close its connection, so it sees a
                # cut answer at once instead of waiting for the rest until its read timeout
                if request.transport is not None:
                    request.transport.close()
                raise StreamCut(f"relaying {url} failed: {type(e).__name__}: {e}") from e
            return resp
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise UpstreamError(url, type(e).__name__) from e
