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
* **Connection caps** — aiohttp has none (``backlog`` only bounds the kernel's accept queue):
  :class:`CappedTCPSite` answers connections beyond ``max_connections``, or beyond
  ``max_connections_per_client`` from one client address, with a 503 and closes them at once;
  it counts a connection when it opens, before its TLS handshake, which must finish within the
  header timeout (:mod:`mlx_fleet.connection_limits`: nginx's ``limit_conn``). So one peer can't
  hold every slot or file descriptor; a connection also closes after
  ``max_requests_per_connection`` requests or ``max_connection_age_seconds`` (nginx's
  ``keepalive_requests``/``keepalive_time``), so no slot is held forever by keeping it busy.
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
import json
import math
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from mlx_fleet.connection_limits import (TOO_MANY, TOO_MANY_FROM_CLIENT, admit, client_key,
                                         fd_limit_plan, keep_alive)
from mlx_fleet.exposure import is_loopback

__all__ = ["HttpLimits", "hygiene_middlewares", "CappedTCPSite", "host_allowed",
           "allowed_hosts", "JSON_TYPES", "start_server", "add_http_arguments",
           "http_limits_from_args", "raise_fd_limit", "server_tls_context",
           "add_tls_arguments", "check_tls_arguments", "add_metrics_auth_argument",
           "metrics_auth", "positive_number"]

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
    router's queue 64 per model); ``max_connections_per_client``: open connections from one
    client address (an IPv6 /64) at once, 128 — above aiohttp's client connector limit of 100,
    so a router or agent forwarding to this server never meets it (nginx ``limit_conn``);
    ``max_requests_per_connection``: requests on one connection before it closes, 1000 (nginx
    ``keepalive_requests``); ``max_connection_age_seconds``: a connection closes after its
    first response past this age, 3600 s (nginx ``keepalive_time``);
    ``cors_origins``: origins (``scheme://host[:port]``) allowed cross-origin, none by default;
    ``allowed_hosts``: extra ``Host`` names accepted when the API has no keys (besides
    loopback and the listen/advertised host)."""

    header_timeout_seconds: float = 60.0
    body_timeout_seconds: float = 60.0
    max_connections: int = 512
    max_connections_per_client: int = 128
    max_requests_per_connection: int = 1000
    max_connection_age_seconds: float = 3600.0
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
                        error: ErrorFn,
                        host_paths: frozenset[str] = frozenset()) -> tuple[Any, Any]:
    """``(before_auth, after_auth)``: the aiohttp middlewares of this module's request checks,
    to be placed around the authentication middleware.

    ``before_auth``, in order: ``Host`` (421, when ``check_host``: the API has no keys; else
    only for ``host_paths``, the open paths that expose data such as an open ``/metrics``), a
    CORS preflight from a configured origin (204: a preflight carries no credentials), and for a
    POST with a body to a route that takes POSTs its ``Content-Type`` (415); responses to a
    configured origin carry ``Access-Control-Allow-Origin``. ``after_auth``: such a POST's
    body is read under the body timeout (408) — after authentication, so a client without a key
    never makes the server buffer a body. Every response on a connection of a
    :class:`CappedTCPSite` that reached ``max_requests_per_connection`` or
    ``max_connection_age_seconds`` carries ``Connection: close`` (the connection closes after
    it)."""

    @web.middleware
    async def before_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        gate = request.transport.get_protocol() if request.transport is not None else None
        if not isinstance(gate, _Gate):
            return await checks(request, handler)
        gate.requests += 1
        last = not keep_alive(gate.requests, asyncio.get_running_loop().time() - gate.opened,
                              max_requests=limits.max_requests_per_connection,
                              max_age_seconds=limits.max_connection_age_seconds)
        resp = await checks(request, handler)
        if last:
            resp.force_close()  # Connection: close, unless already sent (a stream)
            request.protocol.close()  # aiohttp closes the connection after this response
        return resp

    async def checks(request: web.Request, handler: Handler) -> web.StreamResponse:
        if ((check_host or request.path in host_paths)
                and not host_allowed(request.headers.get("Host"), hosts)):
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


_REFUSALS = {
    TOO_MANY: "too many open connections",
    TOO_MANY_FROM_CLIENT: "too many open connections from this client address",
}


def _refusal_response(code: str) -> bytes:
    """The raw HTTP/1.1 503 a refused connection gets before it is closed (OpenAI's error
    shape, ``code`` one of :mod:`mlx_fleet.connection_limits`' refusal codes)."""
    body = json.dumps({"error": {"message": _REFUSALS[code], "type": "server_error",
                                 "param": None, "code": code}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Gate(asyncio.Protocol):
    """One connection of a :class:`CappedTCPSite`. When the TCP connection is made — before any
    TLS handshake — it is either counted (globally and for its client address,
    :func:`mlx_fleet.connection_limits.admit`) or answered 503 and closed. A counted connection
    is handed to a fresh aiohttp ``RequestHandler``; with TLS first through
    ``loop.start_tls`` under the site's handshake timeout (a client that never sends its
    ClientHello is closed then, and its slot freed). The count is released exactly once, when
    the connection is lost or its handshake fails. ``requests`` and ``opened`` (loop time) are
    read by :func:`hygiene_middlewares` (requests and age per connection)."""

    def __init__(self, site: "CappedTCPSite") -> None:
        self._site = site
        self._inner: Any = None
        self._client: str | None = None  # counted under this key until released
        self._early: list[bytes] = []  # TLS data that arrived before the handler took over
        self._early_eof = False
        self._tls: asyncio.Task[None] | None = None
        self.requests = 0
        self.opened = asyncio.get_running_loop().time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site = self._site
        peer = transport.get_extra_info("peername")
        client = client_key(peer[0] if isinstance(peer, (tuple, list)) and peer else None)
        refusal = admit(site.open_connections, site.per_client.get(client, 0),
                        max_connections=site.max_connections,
                        max_per_client=site.max_connections_per_client)
        if refusal is not None:
            site.refused(transport, refusal)
            return
        self._client = client
        site.count(client, +1)
        if site.tls_context is None:
            self._hand_over(transport)
            return
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # start_tls reads the ClientHello
        self._tls = asyncio.ensure_future(self._start_tls(transport))
        site.handshaking.add(self._tls)
        self._tls.add_done_callback(site.handshaking.discard)

    async def _start_tls(self, transport: asyncio.Transport) -> None:
        site = self._site
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, self, site.tls_context, server_side=True,
                ssl_handshake_timeout=site.handshake_timeout)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as e:
            log.debug("TLS handshake failed: %s", e)
            self._release()
            transport.close()
            return
        except BaseException:
            self._release()
            transport.close()
            raise
        if tls is None or self._client is None:  # lost meanwhile
            return
        self._hand_over(tls)
        early, self._early = self._early, []
        for data in early:
            self._inner.data_received(data)
        if self._early_eof:
            self._inner.eof_received()

    def _hand_over(self, transport: asyncio.BaseTransport) -> None:
        server = self._site._runner.server
        assert server is not None
        self._inner = server()
        self._inner.connection_made(transport)

    def _release(self) -> None:
        if self._client is not None:
            self._site.count(self._client, -1)
            self._client = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        if self._inner is not None:
            inner, self._inner = self._inner, None
            inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
        elif self._client is not None:
            self._early.append(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        self._early_eof = True
        return None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class CappedTCPSite(web.TCPSite):
    """``web.TCPSite`` that keeps at most ``max_connections`` connections open, at most
    ``max_connections_per_client`` from one client address
    (:func:`mlx_fleet.connection_limits.client_key`): one more is answered 503
    (``too_many_connections`` / ``too_many_connections_from_client``) and closed at once.
    Connections are counted when the TCP connection opens, before TLS; an ``ssl_context``'s
    handshake must finish within ``handshake_timeout`` seconds. ``open_connections``: the count
    now; ``per_client``: the count per client key; ``refused_connections``: how many were
    turned away (logged at the 1st, 10th, 100th and every 1000th)."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *,
                 max_connections: int, max_connections_per_client: int | None = None,
                 handshake_timeout: float = 60.0, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.max_connections = max_connections
        self.max_connections_per_client = (max_connections if max_connections_per_client is None
                                           else max_connections_per_client)
        self.handshake_timeout = handshake_timeout
        self.tls_context = self._ssl_context
        self.open_connections = 0
        self.per_client: dict[str, int] = {}
        self.refused_connections = 0
        self.handshaking: set[asyncio.Task[None]] = set()

    def count(self, client: str, delta: int) -> None:
        """Add ``delta`` (+1 opened, -1 released) to the counts of ``client``."""
        self.open_connections += delta
        n = self.per_client.get(client, 0) + delta
        if n > 0:
            self.per_client[client] = n
        else:
            self.per_client.pop(client, None)

    def refused(self, transport: asyncio.BaseTransport, code: str = TOO_MANY) -> None:
        self.refused_connections += 1
        n = self.refused_connections
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("refused %d connection(s) over --max-connections %d / "
                        "--max-connections-per-client %d (last: %s)", n, self.max_connections,
                        self.max_connections_per_client, code)
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_refusal_response(code))
        transport.close()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        # no ssl= here: _Gate counts the TCP connection, then starts TLS itself
        self._server = await loop.create_server(
            lambda: _Gate(self), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        for task in list(self.handshaking):
            task.cancel()
        await asyncio.gather(*self.handshaking, return_exceptions=True)
        await super().stop()


def raise_fd_limit(max_connections: int) -> str | None:
    """Raise the soft open-file limit to what ``max_connections`` needs
    (:func:`mlx_fleet.connection_limits.fd_limit_plan`); returns the plan's warning line (or
    ``None``), also when the limit can't be read or set."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new_soft, warning = fd_limit_plan(max_connections, soft, hard)
    if new_soft is not None:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        except (ValueError, OSError) as e:
            return f"could not raise the open-file limit from {soft} to {new_soft}: {e}"
    return warning


async def start_server(app: web.Application, host: str, port: int, *, limits: HttpLimits,
                       ssl_context: Any = None) -> tuple[web.AppRunner, CappedTCPSite]:
    """Serve ``app`` on ``host:port`` with ``limits`` (header timeout, which also bounds the TLS
    handshake; connection caps) and ``handler_cancellation`` (a client that disconnects cancels
    its handler, and so its generation). Raises the soft open-file limit for the cap first
    (:func:`raise_fd_limit`; its warning is logged). Returns the runner (clean it up) and the
    started site. Raises ``OSError`` when the address can't be bound (the runner is cleaned up
    then)."""
    warning = raise_fd_limit(limits.max_connections)
    if warning:
        log.warning("%s", warning)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           **limits.runner_kwargs())
    await runner.setup()
    site = CappedTCPSite(runner, host, port, ssl_context=ssl_context,
                         max_connections=limits.max_connections,
                         max_connections_per_client=limits.max_connections_per_client,
                         handshake_timeout=limits.header_timeout_seconds)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def positive_number(kind: type[float] | type[int]) -> Callable[[str], Any]:
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
    g.add_argument("--header-timeout-seconds", type=positive_number(float),
                   default=d.header_timeout_seconds, metavar="SECONDS",
                   help="a connection that has not sent a whole request head this long after "
                        "it opened (or after its last response) is closed: slow-loris clients "
                        "and idle keep-alive connections (default: %(default)s)")
    g.add_argument("--body-timeout-seconds", type=positive_number(float),
                   default=d.body_timeout_seconds, metavar="SECONDS",
                   help="a POST body that has not arrived this long after its head is answered "
                        "408 and the connection closed (default: %(default)s)")
    g.add_argument("--max-connections", type=positive_number(int),
                   default=d.max_connections, metavar="N",
                   help="open connections at once; one more is answered 503 and closed "
                        "(default: %(default)s)")
    g.add_argument("--max-connections-per-client", type=positive_number(int),
                   default=d.max_connections_per_client, metavar="N",
                   help="open connections from one client address (an IPv6 /64; loopback "
                        "included) at once; one more is answered 503 and closed (default: "
                        "%(default)s; raise it behind a reverse proxy on one address)")
    g.add_argument("--max-requests-per-connection", type=positive_number(int),
                   default=d.max_requests_per_connection, metavar="N",
                   help="requests on one connection; the response to the last closes it "
                        "(default: %(default)s)")
    g.add_argument("--max-connection-age-seconds", type=positive_number(float),
                   default=d.max_connection_age_seconds, metavar="SECONDS",
                   help="the first response on a connection this old closes it "
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
                      max_connections_per_client=args.max_connections_per_client,
                      max_requests_per_connection=args.max_requests_per_connection,
                      max_connection_age_seconds=args.max_connection_age_seconds,
                      cors_origins=frozenset(args.cors_origin),
                      allowed_hosts=frozenset(h.lower() for h in args.allowed_host))


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server side of HTTPS (``--tls-cert-file``/``--tls-key-file``; TLS 1.2 or newer,
    Python's defaults for server sockets). Raises ``ValueError`` naming the flags and paths
    (never the files' content)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or type(e).__name__
        raise ValueError(f"--tls-cert-file {cert_file!r} / --tls-key-file {key_file!r}: "
                         f"cannot use ({reason})") from None
    return ctx


def add_tls_arguments(p: argparse.ArgumentParser, *, cert_help: str = "") -> None:
    """``--tls-cert-file`` and ``--tls-key-file`` (the agent's and the router's, one
    definition; :func:`server_tls_context`). ``cert_help``: a sentence the server adds."""
    p.add_argument("--tls-cert-file", default=None, metavar="PATH",
                   help="serve HTTPS with this PEM certificate (chain); needs --tls-key-file"
                        + (f"; {cert_help}" if cert_help else ""))
    p.add_argument("--tls-key-file", default=None, metavar="PATH",
                   help="the PEM private key of --tls-cert-file")


def check_tls_arguments(args: argparse.Namespace) -> None:
    """Raises ``ValueError`` when only one of ``--tls-cert-file``/``--tls-key-file`` is given."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")


def add_metrics_auth_argument(p: argparse.ArgumentParser) -> None:
    """``--metrics-auth {open,api-key}`` (the agent's and the router's, one definition;
    :func:`metrics_auth`)."""
    p.add_argument("--metrics-auth", choices=["open", "api-key"], default=None,
                   help="GET /metrics open to anyone, or needing a key like the API "
                        "(api-key needs --api-key-file); /health is always open (default: "
                        "api-key with --api-key-file, else open)")


def metrics_auth(choice: str | None, *, api_keys: bool) -> str:
    """The ``--metrics-auth`` in force: ``choice`` when given, else ``"api-key"`` when the
    server has API keys and ``"open"`` when not. Raises ``ValueError`` for ``api-key`` without
    keys."""
    if choice == "api-key" and not api_keys:
        raise ValueError("--metrics-auth api-key needs --api-key-file")
    return choice or ("api-key" if api_keys else "open")
