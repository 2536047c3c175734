"""HTTP hygiene of the aiohttp servers of the node agent and the fleet router (issue 19): what a
slow client, a browser or a rebinding DNS name can do before authentication is bounded here,
the same way on both (their flags: :func:`add_http_arguments`).

* **Header read timeout** — aiohttp's own knob: ``keepalive_timeout`` (``AppRunner`` keyword,
  :meth:`HttpLimits.runner_kwargs`). aiohttp arms it when a connection opens and again after
  each response, and closes the connection when it fires while no complete request head has
  arrived (``RequestHandler._process_keepalive``), so it bounds the time to send a request head
  (Go's ``http.Server.ReadHeaderTimeout``, nginx's ``client_header_timeout``) as well as the
  idle time of a kept-alive connection. aiohttp's default is 3630 s.
* **Body read timeout** — aiohttp has none: :func:`hygiene_middlewares` reads a POST body
  under ``body_timeout_seconds`` (408 after it), after authentication; the handlers' later
  ``request.read()`` returns the body aiohttp cached.
* **Connection cap** — aiohttp has none (``backlog`` only bounds the kernel's accept queue):
  :class:`CappedTCPSite` answers connections beyond ``max_connections`` with a 503 and closes
  them at once, so the slow clients of one peer can't hold every file descriptor.
* **``Content-Type: application/json``** required on POST bodies (415): a browser's "simple"
  cross-origin POST (``text/plain``, a form) never reaches a handler.
* **``Host`` allow-list** when the API has no keys (421): a DNS-rebinding page can't read
  ``/v1/*`` or ``/metrics`` through a name it controls (Ollama after CVE-2024-28224).
* **CORS** only for the configured origins (``--cors-origin``; none by default: no
  ``Access-Control-*`` header is ever sent, so browsers keep cross-origin reads blocked).

Errors use the caller's ``error(status, message, code=...)`` (OpenAI's error shape).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from mlx_fleet.exposure import is_loopback

__all__ = ["HttpLimits", "hygiene_middlewares", "CappedTCPSite", "host_allowed",
           "allowed_hosts", "JSON_TYPES", "start_server", "add_http_arguments",
           "http_limits_from_args"]

log = logging.getLogger(__name__)

#: Media types a POST body may have (``application/json``, any parameters such as charset).
JSON_TYPES = frozenset({"application/json"})
#: Request headers a configured origin may send cross-origin (preflight answer).
CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Session-ID"


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """The server's limits (``--header-timeout-seconds``, ``--body-timeout-seconds``,
    ``--max-connections``, ``--cors-origin``, ``--allowed-host``).

    ``header_timeout_seconds``: time to send a request head (and idle time of a kept-alive
    connection), 60 s like nginx's ``client_header_timeout``: it must stay above the idle
    keep-alive of the clients that reuse connections (aiohttp's client connector: 15 s, the
    agents' forwarding and the fleet router), or a reused connection races the server's
    close; ``body_timeout_seconds``:
    time to send a POST body once the head arrived, 60 s like nginx's ``client_body_timeout``
    (the body is at most aiohttp's ``client_max_size``, 1 MiB); ``max_connections``: open
    connections at once (512; the agent's own queue holds 64 requests by default, the
    router's queue 64 per model);
    ``cors_origins``: origins (``scheme://host[:port]``) allowed cross-origin, none by default;
    ``allowed_hosts``: extra ``Host`` names accepted when the API has no keys (besides
    loopback and the listen/advertised host)."""

    header_timeout_seconds: float = 60.0
    body_timeout_seconds: float = 60.0
    max_connections: int = 512
    cors_origins: frozenset[str] = frozenset()
    allowed_hosts: frozenset[str] = frozenset()

    def runner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``web.AppRunner`` (passed on to every ``RequestHandler``)."""
        return {"keepalive_timeout": self.header_timeout_seconds}


def _hostname(host_header: str) -> str:
    """The host part of a ``Host`` header (``name:port``, ``[v6]:port``), lower case."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    name, _, port = h.rpartition(":")
    return name if name and port.isdigit() else h


def allowed_hosts(*names: str | None, extra: Iterable[str] = ()) -> frozenset[str]:
    """The host names of ``names`` (bare hosts or URLs) and ``extra``, lower case;
    wildcard addresses (``0.0.0.0``, ``::``, empty) are left out."""
    from urllib.parse import urlsplit

    out: set[str] = set()
    for n in [*names, *extra]:
        host = (urlsplit(n).hostname if "://" in n else n.strip().strip("[]")) if n else None
        if host and host not in {"0.0.0.0", "::"}:
            out.add(host.lower())
    return frozenset(out)


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's ``Host`` header names this server: a loopback name or one of
    ``allowed`` (host names without ports). A missing header is refused."""
    if not host_header:
        return False
    name = _hostname(host_header)
    return is_loopback(name) or name in allowed


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorFn = Callable[..., web.Response]


def hygiene_middlewares(limits: HttpLimits, *, check_host: bool, hosts: frozenset[str],
                        error: ErrorFn) -> tuple[Any, Any]:
    """``(before_auth, after_auth)``: the aiohttp middlewares of this module's request checks,
    to be placed around the authentication middleware.

    ``before_auth``, in order: ``Host`` (421, only when ``check_host``: the API has no keys), a
    CORS preflight from a configured origin (204: a preflight carries no credentials), and for a
    POST with a body to a route that takes POSTs its ``Content-Type`` (415); responses to a
    configured origin carry ``Access-Control-Allow-Origin``. ``after_auth``: such a POST's
    body is read under the body timeout (408) — after authentication, so a client without a key
    never makes the server buffer a body."""

    @web.middleware
    async def before_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if check_host and not host_allowed(request.headers.get("Host"), hosts):
            return error(421, "this server does not answer for the host named in the Host "
                         "header (give --allowed-host, or API keys)", code="misdirected_request")
        origin = request.headers.get("Origin")
        if (request.method == "OPTIONS" and origin in limits.cors_origins
                and "Access-Control-Request-Method" in request.headers):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": origin or "", "Vary": "Origin",
                "Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": CORS_ALLOW_HEADERS,
                "Access-Control-Max-Age": "600"})
        if _has_body(request) and request.content_type not in JSON_TYPES:
            return error(415, "the request body must be JSON, sent with Content-Type: "
                         "application/json", code="unsupported_media_type")
        resp = await handler(request)
        if origin and origin in limits.cors_origins and not resp.prepared:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Vary"] = "Origin"
        return resp

    @web.middleware
    async def after_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _has_body(request):
            try:
                async with asyncio.timeout(limits.body_timeout_seconds):
                    await request.read()  # cached: the handler's read() returns it
            except TimeoutError:
                return error(408, f"the request body did not arrive within "
                             f"{limits.body_timeout_seconds:g} s", code="request_timeout",
                             headers={"Connection": "close"})
        return await handler(request)

    return before_auth, after_auth


def _has_body(request: web.Request) -> bool:
    """A POST with a body to a route that exists and takes POSTs (not a 404/405)."""
    return (request.method == "POST" and request.body_exists
            and request.match_info.http_exception is None)


_TOO_MANY = (b'{"error": {"message": "too many open connections", "type": "server_error", '
             b'"param": null, "code": "too_many_connections"}}')
_TOO_MANY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                      + str(len(_TOO_MANY)).encode() + b"\r\n\r\n" + _TOO_MANY)


class _Gate(asyncio.Protocol):
    """One connection of a :class:`CappedTCPSite`. When it is made (after the TLS handshake,
    for HTTPS) it is either counted and handed to a fresh aiohttp ``RequestHandler``, or — over
    the cap — answered 503 ``too_many_connections`` and closed. Counting at
    ``connection_made``/``connection_lost`` keeps the count exact: a connection whose handshake
    fails is never counted."""

    def __init__(self, site: "CappedTCPSite") -> None:
        self._site = site
        self._inner: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        if site.open_connections >= site.max_connections:
            site.refused(transport)
            return
        site.open_connections += 1
        server = site._runner.server
        assert server is not None
        self._inner = server()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._inner is not None:
            self._site.open_connections -= 1
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class CappedTCPSite(web.TCPSite):
    """``web.TCPSite`` that keeps at most ``max_connections`` connections open: one more is
    answered 503 ``too_many_connections`` and closed at once. ``open_connections``: the count
    now; ``refused_connections``: how many were turned away (logged at the 1st, 10th, 100th
    and every 1000th)."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *,
                 max_connections: int, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused_connections = 0

    def refused(self, transport: asyncio.BaseTransport) -> None:
        self.refused_connections += 1
        n = self.refused_connections
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("refused %d connection(s) over --max-connections %d", n,
                        self.max_connections)
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_TOO_MANY_RESPONSE)
        transport.close()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Gate(self), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


async def start_server(app: web.Application, host: str, port: int, *, limits: HttpLimits,
                       ssl_context: Any = None) -> tuple[web.AppRunner, CappedTCPSite]:
    """Serve ``app`` on ``host:port`` with ``limits`` (header timeout, connection cap) and
    ``handler_cancellation`` (a client that disconnects cancels its handler, and so its
    generation). Returns the runner (clean it up) and the started site. Raises ``OSError`` when
    the address can't be bound (the runner is cleaned up then)."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           **limits.runner_kwargs())
    await runner.setup()
    site = CappedTCPSite(runner, host, port, ssl_context=ssl_context,
                         max_connections=limits.max_connections)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def _positive(kind: type[float] | type[int]) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``kind`` above 0 (one line naming the value)."""
    def parse(text: str) -> Any:
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole ' if kind is int else ''}number, got {text!r}") from None
        if not (x > 0 and math.isfinite(x)):
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
        return x
    parse.__name__ = kind.__name__
    return parse


def add_http_arguments(p: argparse.ArgumentParser, *, own_hosts: str) -> None:
    """The hygiene flags of :class:`HttpLimits` (the agent's and the router's, one definition):
    ``--header-timeout-seconds``, ``--body-timeout-seconds``, ``--max-connections``,
    ``--cors-origin``, ``--allowed-host``. ``own_hosts``: which names the server already
    accepts besides loopback (for ``--allowed-host``'s help, e.g. "the --listen host")."""
    d = HttpLimits()
    g = p.add_argument_group("HTTP server limits (docs/security.md, 'HTTP hygiene')")
    g.add_argument("--header-timeout-seconds", type=_positive(float),
                   default=d.header_timeout_seconds, metavar="SECONDS",
                   help="a connection that has not sent a whole request head this long after "
                        "it opened (or after its last response) is closed: slow-loris clients "
                        "and idle keep-alive connections (default: %(default)s)")
    g.add_argument("--body-timeout-seconds", type=_positive(float),
                   default=d.body_timeout_seconds, metavar="SECONDS",
                   help="a POST body that has not arrived this long after its head is answered "
                        "408 and the connection closed (default: %(default)s)")
    g.add_argument("--max-connections", type=_positive(int),
                   default=d.max_connections, metavar="N",
                   help="open connections at once; one more is answered 503 and closed "
                        "(default: %(default)s)")
    g.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="an origin (scheme://host[:port]) browsers may call the API from "
                        "(repeatable; default: none, no CORS headers are sent)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help=f"a Host header name accepted when the API has no keys, besides "
                        f"loopback names and {own_hosts} (repeatable; other names are answered "
                        f"421: DNS rebinding)")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The :class:`HttpLimits` of :func:`add_http_arguments`' parsed flags."""
    return HttpLimits(header_timeout_seconds=args.header_timeout_seconds,
                      body_timeout_seconds=args.body_timeout_seconds,
                      max_connections=args.max_connections,
                      cors_origins=frozenset(args.cors_origin),
                      allowed_hosts=frozenset(h.lower() for h in args.allowed_host))
