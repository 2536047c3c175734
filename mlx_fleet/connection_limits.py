"""Which connections the agent's and the router's HTTP servers admit and keep (issue 19): pure
decisions over plain numbers; :class:`mlx_fleet.http_hygiene.CappedTCPSite` applies them.

The model is nginx: ``limit_conn`` (connections per client address), ``keepalive_requests``
(1000 requests per connection) and ``keepalive_time`` (1 h per connection). With only a global
cap, one peer that keeps ``max_connections`` connections busy (a ``GET /health`` on each every
few seconds restarts the idle timer) denies the API to everyone; with a per-client cap it holds
at most ``max_per_client`` of them.

A *client* is its IP address; IPv6 addresses count per /64 (one host usually owns a whole /64,
RFC 4291 §2.5.1), so a peer can't take a fresh slot budget from each of its 2**64 addresses.
Loopback is no exception: a process on the same host is a peer like any other (a reverse proxy
on the host must raise the per-client cap to its own connection count).

A reserve of slots for requests with an API key is not kept: a connection takes its slot when it
opens (it holds a file descriptor from then on) and the key arrives only in a request head,
after the TLS handshake; a connection can carry keyed and unkeyed requests in turn. The
per-client cap bounds what one address holds; many addresses (a botnet) are for a firewall.
"""

from __future__ import annotations

import ipaddress

__all__ = ["TOO_MANY", "TOO_MANY_FROM_CLIENT", "client_key", "admit", "keep_alive",
           "FD_HEADROOM", "fd_limit_plan"]

#: Refusal codes (OpenAI error ``code`` of the 503): the global cap, the per-client cap.
TOO_MANY = "too_many_connections"
TOO_MANY_FROM_CLIENT = "too_many_connections_from_client"

#: File descriptors the process needs besides its connections (etcd, model and log files, the
#: agent's connections to peers): the soft ``RLIMIT_NOFILE`` should be at least
#: ``max_connections + FD_HEADROOM``.
FD_HEADROOM = 256


def client_key(host: str | None) -> str:
    """The per-client bucket of a peer address: the address itself for IPv4 (and an IPv4-mapped
    IPv6 address), its /64 network (``"2001:db8::/64"``) for IPv6, ``""`` when the peer has no IP
    address (a Unix socket): they share one bucket."""
    if not host:
        return ""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def admit(open_total: int, open_from_client: int, *, max_connections: int,
          max_per_client: int) -> str | None:
    """Whether a new connection may open: ``None`` (yes) or the refusal code —
    :data:`TOO_MANY` when ``open_total`` (open connections now) is at ``max_connections``,
    :data:`TOO_MANY_FROM_CLIENT` when ``open_from_client`` (those of its :func:`client_key`) is
    at ``max_per_client``."""
    if open_total >= max_connections:
        return TOO_MANY
    if open_from_client >= max_per_client:
        return TOO_MANY_FROM_CLIENT
    return None


def keep_alive(requests: int, age_seconds: float, *, max_requests: int,
               max_age_seconds: float) -> bool:
    """Whether a connection stays open after the response to its ``requests``-th request (1 for
    the first), ``age_seconds`` after it opened: not once it served ``max_requests`` (nginx
    ``keepalive_requests``) or lived ``max_age_seconds`` (nginx ``keepalive_time``); the
    response then carries ``Connection: close``."""
    return requests < max_requests and age_seconds < max_age_seconds


def fd_limit_plan(max_connections: int, soft: int, hard: int) -> tuple[int | None, str | None]:
    """``(new_soft, warning)`` for the open-file limit (``RLIMIT_NOFILE``; ``-1`` is
    unlimited): the soft limit to set (``None``: leave it) — raised towards
    ``max_connections + FD_HEADROOM``, at most to ``hard`` — and a warning line when even that
    stays below the need (connections beyond it fail with ``EMFILE`` before the cap answers
    503; launchd's default soft limit is 256)."""
    need = max_connections + FD_HEADROOM
    if soft < 0 or soft >= need:
        return None, None
    target = need if hard < 0 else min(need, hard)
    new_soft = target if target > soft else None
    if target < need:
        return new_soft, (f"the open-file limit (RLIMIT_NOFILE, hard {hard}) is below "
                          f"--max-connections {max_connections} + {FD_HEADROOM}: connections "
                          f"beyond it fail before the cap answers 503; raise it (launchd: "
                          f"SoftResourceLimits/HardResourceLimits NumberOfFiles) or lower "
                          f"--max-connections")
    return new_soft, None
