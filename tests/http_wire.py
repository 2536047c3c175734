"""Reading one raw HTTP/1.1 response off a socket, for the tests that speak HTTP by hand
(slow clients, timeouts): the status line, the headers and a ``Content-Length`` body — without
waiting for the server to close (aiohttp lingers up to 10 s reading the rest of an unread
request body before it does)."""

from __future__ import annotations

import asyncio


async def one_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """``(status line, headers (lower-cased names), body)`` of the next response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status.encode(), headers, body
