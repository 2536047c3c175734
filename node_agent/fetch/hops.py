"""HTTP under the source policy: every address checked after DNS, every redirect hop checked.

:func:`policy_session` is the ``aiohttp`` session of an ``https://`` download: its connector
resolves host names through :class:`PolicyResolver`, which checks **every** address a name
resolves to (:func:`mlx_fleet.source_policy.check_address`) and hands aiohttp exactly the
checked addresses, so the connection goes to an address that was checked (a DNS answer that
changes between a check and the connect — DNS rebinding — can't slip by: there is no second
lookup; the connector's DNS cache is off, so each connection resolves and checks again). An
address literal in a URL never reaches a resolver: the hop loop checks it from the URL
(:func:`~mlx_fleet.source_policy.check_source` / ``check_redirect``). The session reads no
proxy settings from the environment.

:func:`get` does one GET without following redirects automatically
(``allow_redirects=False``): a 301/302/303/307/308 with a ``Location`` is checked against the
policy (:func:`~mlx_fleet.source_policy.check_redirect`: the hop count within
``maxRedirects``, ``https://`` only, an allowed host) and then followed by hand, its target's
addresses checked by the resolver when it is connected.

A refusal raises :class:`~node_agent.model_dir.SourceError` with reason
:data:`~mlx_fleet.source_policy.SOURCE_REFUSED` and the policy's message (which names the
rule and no network detail).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from mlx_fleet.source_policy import (SOURCE_REFUSED, SourcePolicy, check_address,
                                     check_redirect, check_source)

from ..model_dir import SourceError

__all__ = ["PolicyResolver", "policy_session", "get", "refuse_source", "REDIRECT_STATUSES"]

log = logging.getLogger("node_agent.fetch")

#: Statuses whose ``Location`` is a redirect to follow (each hop checked).
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


def refuse_source(policy: SourcePolicy, uri: str) -> None:
    """Raise ``SourceError(SourceRefused)`` when ``policy`` refuses ``uri``
    (:func:`~mlx_fleet.source_policy.check_source`)."""
    refusal = check_source(policy, uri)
    if refusal is not None:
        raise SourceError(SOURCE_REFUSED, refusal.message)


def _refuse_literal(policy: SourcePolicy, url: URL) -> None:
    """The host aiohttp will connect to, as aiohttp reads it from ``url``: when it is an
    address literal aiohttp uses it without a resolver, so it is checked here (a second check
    of the one :func:`refuse_source` made on the text, against any difference between the two
    URL parsers)."""
    host = (url.raw_host or "").strip("[]")
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return  # a name: the resolver checks its addresses
    refusal = check_address(policy, addr)
    if refusal is not None:
        raise SourceError(SOURCE_REFUSED, refusal.message)


class PolicyResolver(AbstractResolver):
    """Resolves with ``inner`` (default aiohttp's threaded ``getaddrinfo`` resolver) and
    refuses the host when any address it resolves to is refused by ``policy`` (a name with
    one private address among public ones is refused whole). Returns the checked addresses
    themselves, which aiohttp connects to."""

    def __init__(self, policy: SourcePolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self._inner = inner or ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family=family)
        for r in results:
            refusal = check_address(self.policy, r["host"])
            if refusal is not None:
                log.warning("source policy: %s resolves to %s: %s", host, r["host"],
                            refusal.message)
                raise SourceError(SOURCE_REFUSED, refusal.message)
        return results

    async def close(self) -> None:
        await self._inner.close()


def policy_session(policy: SourcePolicy, *, ssl_context: ssl.SSLContext,
                   timeout: aiohttp.ClientTimeout,
                   headers: Mapping[str, str] | None = None,
                   resolver: AbstractResolver | None = None) -> aiohttp.ClientSession:
    """A session whose connections go only to addresses ``policy`` allows (module
    docstring). ``resolver``: the inner resolver (tests); no proxy from the environment, no
    automatic decompression."""
    connector = aiohttp.TCPConnector(ssl=ssl_context, use_dns_cache=False,
                                     resolver=PolicyResolver(policy, resolver))
    return aiohttp.ClientSession(timeout=timeout, auto_decompress=False, trust_env=False,
                                 headers=dict(headers or {}), connector=connector)


@contextlib.asynccontextmanager
async def get(session: aiohttp.ClientSession, policy: SourcePolicy, url: str, *,
              headers: Mapping[str, str] | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
    """GET ``url``, following redirects by hand, each hop checked (module docstring); yields
    the final response. Raises ``SourceError(SourceRefused)`` for a refused hop or address,
    and what aiohttp raises otherwise."""
    refuse_source(policy, url)
    current = URL(url, encoded=True)
    hop = 0
    while True:
        _refuse_literal(policy, current)
        resp = await session.get(current, headers=dict(headers or {}), allow_redirects=False)
        location = resp.headers.get("Location") if resp.status in REDIRECT_STATUSES else None
        if location is None:
            try:
                yield resp
            finally:
                resp.release()
            return
        resp.release()
        hop += 1
        try:
            target = current.join(URL(location))
        except ValueError:
            raise SourceError("DownloadFailed", f"{current}: an invalid redirect "
                                                f"Location") from None
        refusal = check_redirect(policy, str(target), hop)
        if refusal is not None:
            log.warning("source policy: redirect %d from %s to %s refused: %s", hop, current,
                        target, refusal.message)
            raise SourceError(SOURCE_REFUSED, refusal.message)
        log.info("following redirect %d from %s to %s", hop, current, target)
        current = target
