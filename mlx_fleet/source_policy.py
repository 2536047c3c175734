"""Which model sources a fleet may load: the source policy (issue 19, docs/security.md
"Source policy"). A pure decision over plain data — no sockets, no DNS, no file system.

The same record configures the operator (``--source-policy``: a ModelDeployment or Canary
whose source is refused gets ``SourceAllowed=False`` and no assignment) and every agent
(``--source-policy``: defence in depth, checked before any connection or file access, and
again on every resolved address and every redirect hop). Both read it as JSON or YAML
(:func:`parse_policy`)::

    schemes: [hf, https, file]        # allowed schemes (http:// is never allowed)
    httpsHosts: [models.example.com, "*.cdn.example.com:8443", "mirror.example:*"]
    fileRoots: [/Volumes/models]      # file:// (and bare absolute paths) only under these
    hfOrganizations: [mlx-community]  # hf://<org>/... only for these
    hfTokenOrganizations: [my-org]    # HF_TOKEN is sent only for these organisations
    allowPrivateNetworks: false       # loopback, private, link-local, ULA, CGNAT addresses
    maxRedirects: 5                   # redirect hops followed (each one checked)

The default (:data:`DEFAULT_POLICY`, an empty record) is the secure one: ``https://`` to any
host whose addresses are public, ``hf://`` of any organisation without the Mac's
``HF_TOKEN``, no ``file://`` (no roots), no private network, at most 5 redirect hops. A dev or
demo fleet that serves models from loopback or local directories says so explicitly
(``allowPrivateNetworks: true``, ``fileRoots``; :data:`DEV_POLICY` is what the dev cluster
and the demo pass, and they print it).

Rules (each :class:`Refusal` names its ``rule``, the policy field to change):

* ``schemes`` — the URI's scheme (a bare absolute path counts as ``file``) must be listed;
  ``http://`` is never accepted (weights over plain HTTP can be swapped on the path).
* ``https`` — no ``user:password@`` in the authority (it could disguise the host); the host is
  compared lower-cased without trailing dots; an IPv4 address must be four decimal numbers
  (``2130706433``, ``0177.0.0.1``, ``0x7f.1`` and ``127.1`` are refused: resolvers read them
  differently); an address literal (IPv4, IPv6, IPv4-mapped IPv6) goes through
  :func:`check_address`; ``localhost`` and ``*.localhost`` (RFC 6761) count as loopback.
  ``httpsHosts`` (when not empty): ``host`` matches that host on port 443, ``host:PORT`` on
  that port, ``host:*`` on any port; ``*.example.com`` matches any subdomain (not
  ``example.com`` itself). A host name's addresses are checked by the agent after it resolves
  it (:func:`check_address`), and it connects to exactly the checked addresses.
* ``file`` — ``file:///abs/path`` (host empty or ``localhost``) or ``/abs/path``, without
  ``..`` segments, under one of ``fileRoots`` (none by default). The agent checks the path
  again after resolving symlinks (:func:`check_file_path` with the resolved path and roots).
* ``hf`` — ``hf://<org>/<repo>[@rev]`` with ``<org>`` in ``hfOrganizations`` when that list
  is not empty (compared case-insensitively). :func:`hf_token_allowed`: whether the Mac's
  ``HF_TOKEN`` may be sent for it (``hfTokenOrganizations``; none by default).
* addresses — refused unless globally routable: loopback, private (RFC 1918), link-local,
  ULA (``fc00::/7``), CGNAT (``100.64.0.0/10``), documentation, benchmarking and reserved
  ranges, also inside IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible and NAT64
  (``64:ff9b::/96``) IPv6 addresses. ``allowPrivateNetworks`` allows loopback, private,
  link-local, ULA and CGNAT ones; the unspecified address (``0.0.0.0``, ``::``), multicast and
  the cloud metadata address (``169.254.169.254``, ``fd00:ec2::254``) are always refused.
* redirects — :func:`check_redirect`: hop count within ``maxRedirects``; the target must be
  ``https://`` and pass the ``https`` rule like the source itself (so a cross-host redirect
  goes only to an allowed host).

Refusal messages start with ``refused by the source policy:`` and name the rule, never what a
connection or the file system answered (no oracle); they are safe to put into a status.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import posixpath
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["SourcePolicy", "Refusal", "PolicyError", "DEFAULT_POLICY", "DEV_POLICY",
           "REFUSED", "SOURCE_REFUSED", "parse_policy", "check_source",
           "check_address", "check_redirect", "check_file_path", "hf_token_allowed",
           "source_scheme", "KNOWN_SCHEMES"]

#: The prefix of every refusal message (statuses and events say it as it is).
REFUSED = "refused by the source policy"
#: The reason (report, condition, event) of a refused source.
SOURCE_REFUSED = "SourceRefused"
#: Schemes a policy may allow (what the agent can load).
KNOWN_SCHEMES = ("file", "hf", "https")
_DEFAULT_REDIRECTS = 5
_METADATA = (ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_HOST_CHARS = re.compile(r"^[a-z0-9_.-]+$")
_HOST_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$")
_CAMEL = {"schemes": "schemes", "httpsHosts": "https_hosts", "fileRoots": "file_roots",
          "hfOrganizations": "hf_organizations", "hfTokenOrganizations": "hf_token_organizations",
          "allowPrivateNetworks": "allow_private_networks", "maxRedirects": "max_redirects"}


class PolicyError(ValueError):
    """A malformed policy record (one line naming the field)."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a source (or an address, a redirect, a path) is refused: ``rule`` is the policy
    field that refuses it (``schemes``, ``httpsHosts``, ``fileRoots``, ``hfOrganizations``,
    ``allowPrivateNetworks``, ``maxRedirects``) or ``source`` for a URI the policy can't
    judge (user info, an ambiguous address spelling, ``..``); ``message`` starts with
    :data:`REFUSED` and holds no network or file-system detail."""

    rule: str
    message: str


@dataclasses.dataclass(frozen=True)
class SourcePolicy:
    """A fleet's source policy (module docstring; JSON/YAML field names in camelCase).

    ``schemes``: allowed schemes (of :data:`KNOWN_SCHEMES`); ``https_hosts``: host patterns
    (empty: any host with public addresses); ``file_roots``: absolute directories;
    ``hf_organizations``: allowed hub organisations (empty: any); ``hf_token_organizations``:
    organisations the Mac's ``HF_TOKEN`` is sent for; ``allow_private_networks``: allow
    non-public addresses (not unspecified, multicast or metadata); ``max_redirects``: hops
    followed, 0..20."""

    schemes: tuple[str, ...] = KNOWN_SCHEMES
    https_hosts: tuple[str, ...] = ()
    file_roots: tuple[str, ...] = ()
    hf_organizations: tuple[str, ...] = ()
    hf_token_organizations: tuple[str, ...] = ()
    allow_private_networks: bool = False
    max_redirects: int = _DEFAULT_REDIRECTS

    def __post_init__(self) -> None:
        for s in self.schemes:
            if s not in KNOWN_SCHEMES:
                raise PolicyError(f"schemes: {s!r} is not one of {', '.join(KNOWN_SCHEMES)} "
                                  "(http:// is never allowed)")
        for h in self.https_hosts:
            _parse_host_pattern(h)
        for r in self.file_roots:
            if not r.startswith("/") or ".." in r.split("/"):
                raise PolicyError(f"fileRoots: {r!r} must be an absolute path without '..'")
        if not 0 <= self.max_redirects <= 20:
            raise PolicyError(f"maxRedirects: {self.max_redirects} is not in 0..20")

    def to_dict(self) -> dict[str, Any]:
        """The record in its JSON/YAML form (camelCase), as :func:`parse_policy` reads it."""
        return {camel: (list(v) if isinstance(v := getattr(self, snake), tuple) else v)
                for camel, snake in _CAMEL.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


#: The secure default: https to public hosts, hf:// of any organisation (no token), no file://.
DEFAULT_POLICY = SourcePolicy()
#: What the dev cluster, the demo and local tests pass: models on loopback servers and in local
#: directories (any absolute path), still no http://. Never for a production fleet.
DEV_POLICY = SourcePolicy(file_roots=("/",), allow_private_networks=True)


def parse_policy(data: Mapping[str, Any] | str | None) -> SourcePolicy:
    """A policy from its record: a mapping, or JSON/YAML text (empty or None: the default).
    Unknown fields and wrong types raise :class:`PolicyError` naming the field."""
    if data is None or (isinstance(data, str) and not data.strip()):
        return DEFAULT_POLICY
    if isinstance(data, str):
        import yaml  # JSON is YAML; a pure parse, no I/O

        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as e:
            raise PolicyError(f"source policy is not valid JSON/YAML: "
                              f"{str(e).splitlines()[0]}") from None
        if data is None:
            return DEFAULT_POLICY
    if not isinstance(data, Mapping):
        raise PolicyError("source policy must be a mapping (JSON object)")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        snake = _CAMEL.get(key)
        if snake is None:
            raise PolicyError(f"unknown source policy field {key!r} (known: "
                              f"{', '.join(_CAMEL)})")
        if snake == "allow_private_networks":
            if not isinstance(value, bool):
                raise PolicyError(f"{key}: expected true or false")
            kwargs[snake] = value
        elif snake == "max_redirects":
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolicyError(f"{key}: expected an integer")
            kwargs[snake] = value
        else:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise PolicyError(f"{key}: expected a list of strings")
            items = [v.strip() for v in value]
            if snake in ("schemes", "hf_organizations", "hf_token_organizations",
                         "https_hosts"):
                items = [v.lower() for v in items]
            kwargs[snake] = tuple(items)
    return SourcePolicy(**kwargs)


# -- checks ----------------------------------------------------------------------------------


def _refuse(rule: str, why: str) -> Refusal:
    return Refusal(rule, f"{REFUSED}: {why}")


def source_scheme(uri: str) -> str:
    """The scheme a source is judged by: lower-case, ``file`` for a bare absolute path, ""
    for anything else without a scheme."""
    raw = (uri or "").strip()
    if raw.startswith("/"):
        return "file"
    return urlsplit(raw).scheme.lower()


def check_source(policy: SourcePolicy, uri: str) -> Refusal | None:
    """None when ``policy`` allows the model source ``uri``, else the :class:`Refusal`.
    Judges the URI alone: the agent checks resolved addresses (:func:`check_address`),
    redirects (:func:`check_redirect`) and resolved paths (:func:`check_file_path`) too."""
    raw = (uri or "").strip()
    scheme = source_scheme(raw)
    if scheme == "http":
        return _refuse("schemes", "http:// is never allowed (weights without TLS can be "
                                  "swapped on the way); use https://")
    if scheme not in KNOWN_SCHEMES:
        return _refuse("schemes", f"the scheme {scheme + '://' if scheme else '(none)'} is not "
                                  "a model source (file://, hf://, https://)")
    if scheme not in policy.schemes:
        return _refuse("schemes", f"{scheme}:// sources are not allowed (schemes: "
                                  f"{', '.join(policy.schemes) or 'none'})")
    if scheme == "https":
        return _check_https(policy, raw)
    if scheme == "hf":
        return _check_hf(policy, raw)
    return _check_file(policy, raw)


def _check_https(policy: SourcePolicy, url: str) -> Refusal | None:
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return _refuse("source", "user information (user@host) in the URL is not allowed")
    try:
        port = parts.port or 443
    except ValueError:
        return _refuse("source", "the port is not a number in 1..65535")
    host = _canonical_host(parts.hostname or "")
    if isinstance(host, Refusal):
        return host
    addr = _address_literal(host)
    if isinstance(addr, Refusal):
        return addr
    if policy.https_hosts and not any(_host_matches(p, host, port) for p in policy.https_hosts):
        shown = host if port == 443 else f"{host}:{port}"
        return _refuse("httpsHosts", f"the host {shown} is not in httpsHosts")
    if addr is not None:
        return check_address(policy, addr)
    if host == "localhost" or host.endswith(".localhost"):
        if not policy.allow_private_networks:
            return _refuse("allowPrivateNetworks", f"{host} is a loopback name; loopback, "
                                                   "private and link-local addresses are "
                                                   "refused (allowPrivateNetworks)")
    return None


def _canonical_host(raw: str) -> str | Refusal:
    """The host as a resolver sees it: NFKC-normalised and IDNA-encoded when not ASCII (so
    ``①②⑦.0.0.1`` is ``127.0.0.1``), lower-case, without trailing dots; only letters, digits,
    ``-``, ``_``, ``.`` (or an IPv6 literal) — a percent sign, a backslash or a space is
    refused, whatever a parser would make of it."""
    host = raw.strip().lower()
    if not host.isascii():
        host = unicodedata.normalize("NFKC", host)
        if not host.isascii():
            try:
                host = host.encode("idna").decode("ascii")
            except UnicodeError:
                return _refuse("source", "the host is not a valid host name")
    host = host.rstrip(".")
    if not host:
        return _refuse("source", "the URL has no host")
    if ":" in host:  # an IPv6 literal (urlsplit dropped the brackets)
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return _refuse("source", "the host is not a valid IPv6 address")
        return host
    if not _HOST_CHARS.match(host):
        return _refuse("source", "the host is not a valid host name (letters, digits, '-', "
                                 "'_' and '.')")
    return host


def _address_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | Refusal | None:
    """The address a host literal spells, None for a name, a Refusal for an ambiguous
    numeric spelling."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    if _NUMERIC_HOST.match(host):
        return _refuse("source", f"the host {host!r} looks like an IPv4 address in a "
                                 "non-standard spelling (write four decimal numbers)")
    return None


def _parse_host_pattern(pattern: str) -> tuple[str, str]:
    """``host[:port|:*]`` → ``(host, port or "443" or "*")``; raises :class:`PolicyError`."""
    p = pattern.strip().lower()
    if p.startswith("["):  # [v6]:port
        end = p.find("]")
        host, rest = p[1:end], p[end + 1:]
        port = rest[1:] if rest.startswith(":") else ("443" if not rest else None)
    else:
        host, sep, port_s = p.rpartition(":")
        if not sep:
            host, port_s = p, "443"
        port = port_s
    if port is None or not (port == "*" or (port.isdigit() and 1 <= int(port) <= 65535)):
        raise PolicyError(f"httpsHosts: bad port in {pattern!r} (host, host:PORT or host:*)")
    host = host.rstrip(".")
    name = host[2:] if host.startswith("*.") else host
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if not name or not all(_HOST_LABEL.match(label) for label in name.split(".")):
            raise PolicyError(f"httpsHosts: {pattern!r} is not a host name, *.domain or "
                              "address") from None
    return host, port


def _host_matches(pattern: str, host: str, port: int) -> bool:
    want_host, want_port = _parse_host_pattern(pattern)
    if want_port != "*" and int(want_port) != port:
        return False
    host = host.lower().strip("[]")
    if want_host.startswith("*."):
        return host.endswith(want_host[1:]) and len(host) > len(want_host) - 1
    try:
        return ipaddress.ip_address(want_host) == ipaddress.ip_address(host)
    except ValueError:
        return want_host == host


def _check_hf(policy: SourcePolicy, uri: str) -> Refusal | None:
    org = uri.strip()[5:].split("/", 1)[0].lower()
    if policy.hf_organizations and org not in policy.hf_organizations:
        return _refuse("hfOrganizations", f"the Hugging Face organisation {org!r} is not in "
                                          "hfOrganizations")
    return None


def hf_token_allowed(policy: SourcePolicy, uri: str) -> bool:
    """Whether the Mac's ``HF_TOKEN`` may be sent when fetching ``hf://<org>/...``: only for an
    organisation in ``hfTokenOrganizations``."""
    raw = (uri or "").strip()
    if not raw.lower().startswith("hf://"):
        return False
    return raw[5:].split("/", 1)[0].lower() in policy.hf_token_organizations


def _file_path(uri: str) -> str | Refusal:
    raw = uri.strip()
    if raw.startswith("/"):
        path = raw
    else:
        parts = urlsplit(raw)
        if parts.netloc not in ("", "localhost"):
            return _refuse("source", "a file:// URI must not name a host")
        path = unquote(parts.path)
    if not path.startswith("/"):
        return _refuse("source", "a local model path must be absolute")
    if ".." in path.split("/") or "\x00" in path:
        return _refuse("source", "a local model path must not contain '..'")
    return path


def _check_file(policy: SourcePolicy, uri: str) -> Refusal | None:
    path = _file_path(uri)
    if isinstance(path, Refusal):
        return path
    return check_file_path(policy, path)


def check_file_path(policy: SourcePolicy, path: str,
                    roots: Iterable[str] | None = None) -> Refusal | None:
    """None when the absolute ``path`` lies under one of ``roots`` (default the policy's
    ``fileRoots``; the agent passes both resolved, symlinks followed), compared by path
    segments (``/models-evil`` is not under ``/models``)."""
    norm = posixpath.normpath(path)
    for root in (policy.file_roots if roots is None else roots):
        r = posixpath.normpath(root)
        if r == "/" or norm == r or norm.startswith(r + "/"):
            return None
    if not policy.file_roots:
        return _refuse("fileRoots", "file:// sources are allowed only under fileRoots, and "
                                    "none are configured")
    return _refuse("fileRoots", "the path is not under any of fileRoots (after resolving "
                                "symlinks)")


def check_address(policy: SourcePolicy,
                  ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> Refusal | None:
    """None when ``policy`` allows connecting to the address ``ip`` (a string or
    :mod:`ipaddress` address; IPv4-mapped, -compatible and NAT64 IPv6 addresses are judged by
    the IPv4 address inside; 6to4 and Teredo ones by the IPv4 addresses inside — server and
    client — and then as themselves), else the :class:`Refusal` (module docstring, "addresses")."""
    try:
        addr = ip if not isinstance(ip, str) else ipaddress.ip_address(ip.strip().strip("[]")
                                                                       .split("%", 1)[0])
    except ValueError:
        return _refuse("source", "not an IP address")
    if isinstance(addr, ipaddress.IPv6Address):
        inner = addr.ipv4_mapped
        if inner is None and addr in _NAT64:
            inner = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if inner is None and int(addr) >> 32 == 0 and int(addr) > 1:  # ::a.b.c.d (deprecated)
            inner = ipaddress.IPv4Address(int(addr))
        if inner is not None:
            return check_address(policy, inner)
        # 6to4 (2002::/16) and Teredo (2001::/32, server and client) carry IPv4 addresses a
        # relay may deliver to: each must pass too, then the IPv6 address itself is judged
        embedded = ([addr.sixtofour] if addr.sixtofour is not None else []) + list(
            addr.teredo or ())
        for v4 in embedded:
            refused = check_address(policy, v4)
            if refused is not None:
                return refused
    if (addr.is_unspecified or addr.is_multicast or addr in _METADATA
            or (isinstance(addr, ipaddress.IPv4Address) and addr in _THIS_NETWORK)):
        return _refuse("source", "the unspecified (0.0.0.0/8, ::), multicast and cloud "
                                 "metadata addresses are never allowed")
    if addr.is_global and not addr.is_reserved:
        return None
    local = (addr.is_loopback or addr.is_link_local or addr.is_private
             or (isinstance(addr, ipaddress.IPv4Address) and addr in _CGNAT))
    if (local and policy.allow_private_networks and not _documentation(addr)
            and (addr.is_loopback or not addr.is_reserved)):  # ::1 lies in ::/8, "reserved"
        return None
    return _refuse("allowPrivateNetworks", "loopback, private, link-local and other non-public "
                                           "addresses are refused (allowPrivateNetworks)")


def _documentation(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    nets = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15",
            "2001:db8::/32")
    return any(addr in ipaddress.ip_network(n) for n in nets
               if ipaddress.ip_network(n).version == addr.version)


def check_redirect(policy: SourcePolicy, target: str, hop: int) -> Refusal | None:
    """None when the ``hop``-th redirect (1-based) to the absolute URL ``target`` may be
    followed: within ``maxRedirects``, to ``https://`` only, and the target passes the
    ``https`` rule (an allowed host; addresses are checked when it is connected)."""
    if hop > policy.max_redirects:
        return _refuse("maxRedirects", f"more than {policy.max_redirects} redirects")
    if urlsplit(target).scheme.lower() != "https":
        return _refuse("schemes", "a redirect may lead only to https://")
    return _check_https(policy, target)
