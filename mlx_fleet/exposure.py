"""Secure defaults with an explicit opt-out: which start-up settings expose a process to its
network, and which flag a person must give to accept that (issue 19, docs/security.md).

A pure decision over plain data (no sockets, no DNS): the agent (``node_agent.main``) calls
:func:`exposure_check` before it starts anything and refuses to start — one line naming the
flag, exit status 2 — on any :attr:`Exposure.refusals`; it logs every
:attr:`Exposure.warnings` (a refusal turned into a warning by its ``--insecure-…`` flag) at
start. The operator and ``mlx-fleet etcd bootstrap-auth``, which listen for no clients, call
:func:`etcd_exposure_check` (the etcd rules alone) the same way. :func:`may_send_key` decides whether a bearer key may travel to a peer URL.

The rules (the model: Ollama binds to 127.0.0.1 unless told otherwise):

* listening on an address other than loopback without API keys → refused unless
  :data:`INSECURE_LISTEN` (anyone on the LAN could use every model);
* listening on an address other than loopback over plain HTTP (no ``--tls-cert-file``) with API
  keys → refused unless :data:`INSECURE_HTTP_LISTEN` (client keys and prompts would cross the
  network in cleartext; whoever reads one key uses the API as that client);
* an ``http://`` etcd endpoint whose host is not loopback → refused unless :data:`INSECURE_ETCD`
  (whoever reaches etcd on the path can read and write every assignment);
* an etcd password over ``http://`` (any host: it travels in cleartext) → refused unless
  :data:`INSECURE_ETCD`;
* a bearer key (the fleet forward key) is sent to a peer only over ``https://`` or to a loopback
  host, unless :data:`INSECURE_FORWARD`.

Loopback means ``localhost`` or an IP address in 127.0.0.0/8 or ``::1``; a host name other than
``localhost`` is never assumed loopback (it is not resolved here).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from urllib.parse import urlsplit

__all__ = ["INSECURE_LISTEN", "INSECURE_HTTP_LISTEN", "INSECURE_ETCD", "INSECURE_FORWARD",
           "Exposure", "is_loopback", "exposure_check", "etcd_exposure_check", "may_send_key",
           "add_insecure_arguments"]

INSECURE_LISTEN = "--insecure-listen-without-keys"
"""Flag: accept listening on a non-loopback address with no ``--api-key-file``."""
INSECURE_HTTP_LISTEN = "--insecure-http-listen"
"""Flag: accept plain HTTP (no ``--tls-cert-file``) on a non-loopback address with API keys."""
INSECURE_ETCD = "--insecure-etcd-http"
"""Flag: accept a non-loopback ``http://`` etcd endpoint, or an etcd password over ``http://``."""
INSECURE_FORWARD = "--insecure-forward-http"
"""Flag: send the fleet forward key to peers over plain ``http://`` on other hosts."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and IP addresses in the loopback range (``127.0.0.0/8``,
    ``::1``); brackets around an IPv6 address are allowed. False for anything else, including
    the wildcard addresses ``0.0.0.0``/``::``/``""`` and every other host name."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _url_host(url: str) -> tuple[str, str]:
    """``(scheme, host)`` of ``url`` (``host:port`` without a scheme counts as ``http``)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return parts.scheme.lower(), parts.hostname or ""


@dataclasses.dataclass(frozen=True)
class Exposure:
    """What :func:`exposure_check` found: ``refusals`` (one line each, naming the flag that
    would accept it; non-empty: do not start) and ``warnings`` (accepted by their flag; log
    each at start)."""

    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def exposure_check(*, listen_host: str, api_keys: bool, etcd_endpoint: str,
                   etcd_password: bool, tls: bool = False,
                   insecure: frozenset[str] = frozenset()) -> Exposure:
    """Check a process's start-up settings against the rules of this module.

    ``listen_host``: the host of ``--listen``; ``api_keys``: an ``--api-key-file`` is given;
    ``etcd_endpoint``: the etcd client URL; ``etcd_password``: an etcd password is configured;
    ``tls``: the listener serves HTTPS (``--tls-cert-file``); ``insecure``: the ``--insecure-…``
    flags given (:data:`INSECURE_LISTEN`, :data:`INSECURE_HTTP_LISTEN`, :data:`INSECURE_ETCD`).
    Returns an :class:`Exposure`; never raises."""
    found: list[tuple[str, str]] = []  # (flag, problem)
    if not api_keys and not is_loopback(listen_host):
        shown = listen_host or "every address"
        found.append((INSECURE_LISTEN,
                      f"--listen {shown} is not a loopback address and no --api-key-file is "
                      f"given: anyone who can reach it may use every model"))
    elif not tls and not is_loopback(listen_host):
        shown = listen_host or "every address"
        found.append((INSECURE_HTTP_LISTEN,
                      f"--listen {shown} is not a loopback address and serves plain http: "
                      f"client keys and prompts would cross the network in cleartext (give "
                      f"--tls-cert-file and --tls-key-file)"))
    found += _etcd_problems(etcd_endpoint, etcd_password)
    return _judged(found, insecure)


def etcd_exposure_check(*, etcd_endpoint: str, etcd_password: bool,
                        insecure: frozenset[str] = frozenset()) -> Exposure:
    """The etcd rules of :func:`exposure_check` alone, for a process that listens for no
    clients (the operator, ``mlx-fleet etcd bootstrap-auth``): ``etcd_password`` is true when
    any password travels to etcd (a login, or passwords being set). Only :data:`INSECURE_ETCD`
    in ``insecure`` matters. Returns an :class:`Exposure`; never raises."""
    return _judged(_etcd_problems(etcd_endpoint, etcd_password), insecure)


def _etcd_problems(etcd_endpoint: str, etcd_password: bool) -> list[tuple[str, str]]:
    """``(flag, problem)`` pairs of the etcd rules (none, or one)."""
    scheme, host = _url_host(etcd_endpoint)
    if scheme == "http" and not is_loopback(host):
        return [(INSECURE_ETCD,
                 f"etcd endpoint {etcd_endpoint} is plain http to a host that is not "
                 f"loopback: use https:// with --etcd-ca-file and a client certificate")]
    if scheme == "http" and etcd_password:
        return [(INSECURE_ETCD,
                 f"an etcd password would travel in cleartext to {etcd_endpoint}: use "
                 f"https:// with --etcd-ca-file")]
    return []


def _judged(found: list[tuple[str, str]], insecure: frozenset[str]) -> Exposure:
    """Problems not accepted by their flag are refusals, the others warnings."""
    refusals = tuple(f"{problem} (or accept the risk with {flag})"
                     for flag, problem in found if flag not in insecure)
    warnings = tuple(f"INSECURE ({flag}): {problem}"
                     for flag, problem in found if flag in insecure)
    return Exposure(refusals, warnings)


def may_send_key(url: str, *, insecure: bool = False) -> bool:
    """Whether a bearer key may be sent to ``url``: over ``https://``, to a loopback host, or
    with ``insecure`` (:data:`INSECURE_FORWARD`)."""
    scheme, host = _url_host(url)
    return insecure or scheme == "https" or is_loopback(host)


def add_insecure_arguments(parser: argparse.ArgumentParser, program: str
                           ) -> argparse._ArgumentGroup:
    """The opt-out flags of :func:`exposure_check` (:data:`INSECURE_LISTEN`,
    :data:`INSECURE_HTTP_LISTEN`, :data:`INSECURE_ETCD`) in one argument group of ``parser``,
    their help naming ``program`` ("the agent", "the router"); returns the group (the agent
    adds its forward-key opt-out to it)."""
    g = parser.add_argument_group("insecure opt-outs (docs/security.md, 'Secure defaults')")
    g.add_argument(INSECURE_LISTEN, action="store_true",
                   help="accept a --listen address that is not loopback without "
                        "--api-key-file (anyone who reaches it may use every model); without "
                        f"this flag {program} refuses to start")
    g.add_argument(INSECURE_HTTP_LISTEN, action="store_true",
                   help="accept a --listen address that is not loopback over plain http with "
                        "--api-key-file (client keys and prompts cross the network in "
                        f"cleartext); without this flag {program} refuses to start unless "
                        "--tls-cert-file is given")
    g.add_argument(INSECURE_ETCD, action="store_true",
                   help="accept a plain http:// etcd endpoint on a host that is not loopback, "
                        f"or an etcd password over http://; without this flag {program} "
                        "refuses to start")
    return g
