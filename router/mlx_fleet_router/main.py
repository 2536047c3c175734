"""``mlx-fleet-router``: the command line of the fleet router (``python -m mlx_fleet_router``).

Parses the flags, connects to etcd (:class:`mlx_fleet.store.EtcdStore`, the agent's and the
operator's TLS/auth flags: :func:`mlx_fleet.etcd_credentials.add_etcd_arguments`), follows the
fleet (:class:`~mlx_fleet_router.follow.Follower`) and serves the app
(:func:`~mlx_fleet_router.app.build_app`) with the agent's HTTP hygiene and
``handler_cancellation=True`` (:func:`mlx_fleet.http_hygiene.start_server`: a client that
disconnects cancels its upstream request), over HTTPS with ``--tls-cert-file``. Logs
``router listening on http(s)://HOST:PORT`` once
serving; SIGTERM/SIGINT stop it.

Secure defaults (:func:`mlx_fleet.exposure.exposure_check`, the agent's rule): listening beyond
loopback without ``--api-key-file`` or, with keys, over plain http, a plain ``http://`` etcd on another host or an etcd
password over ``http://`` stop it at start (exit status 2, one line naming the
``--insecure-…`` flag that accepts the risk); with that flag it logs ``INSECURE (…)`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
import textwrap
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from mlx_fleet.contract import ROOT, Keys
from mlx_fleet.etcd_credentials import (EtcdCredentials, add_etcd_arguments,
                                        credentials_from_args)
from mlx_fleet.exposure import (INSECURE_ETCD, INSECURE_FORWARD, INSECURE_HTTP_LISTEN,
                                INSECURE_LISTEN, add_insecure_arguments, exposure_check)
from mlx_fleet.http_hygiene import (HttpLimits, add_http_arguments, allowed_hosts,
                                    http_limits_from_args, positive_number, start_server)
from mlx_fleet.http_hygiene import (add_metrics_auth_argument, add_tls_arguments,
                                    check_tls_arguments, metrics_auth, server_tls_context)
from mlx_fleet.quantity import positive_quantity
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.body_size import DEFAULT_MAX_PROMPT_BYTES
from mlx_fleet.store import EtcdStore, check_endpoint, parse_endpoint

from . import breaker, limits, retry
from .app import build_app
from .state import RouterSettings
from .follow import Follower
from .picker import LOAD_FACTOR

__all__ = ["main", "parse_args", "settings_from_args"]

log = logging.getLogger("mlx_fleet_router")

DESCRIPTION = """\
mlx-fleet fleet router: one OpenAI-compatible endpoint for the whole fleet.

It follows the fleet in etcd (node records, assignments, reports, canary traffic splits) and
relays each request to a Mac that serves the requested model:

  POST /v1/chat/completions, POST /v1/completions   JSON or SSE streaming, as the agents
  GET  /v1/models     served names with a Ready replica in scope, with their revisions
  GET  /health        200 once following etcd, 503 before
  GET  /fleet         per Mac: breaker state, in-flight, seconds until a half-open trial
                      (behind --api-key-file's keys; mlx-fleet status --router reads it)
  GET  /metrics       Prometheus (mlxfleet_router_*)

Per request: the session key (X-Session-ID, else the OpenAI "user" field, else a hash of the
prompt's prefix) picks the revision (the canary split, the agents' own bucket hash) and the Mac
(consistent hashing with bounded loads). A connection error, a reset, or a 429/502/503/504
before the first byte is retried on the next Mac (bounded attempts, retry budget); a Mac that
refuses connections, fails too often or fails its health probes is ejected by its circuit
breaker until a half-open trial succeeds. When every Mac is saturated requests wait in a bounded
queue, then get 429 with Retry-After. With --api-key-file each key names its tenant
(`<key> tenant=<name>`), and --tenant-limits sets per-tenant requests/tokens per minute and
concurrency. Errors use OpenAI's error object; an unknown model is a 404 naming it.

Closed by default (docs/security.md): it refuses to listen beyond loopback without
--api-key-file, or over plain http (no --tls-cert-file) with keys, to use a plain http:// etcd on another host or an etcd password over http://,
unless the matching --insecure-... flag accepts the risk. POST bodies must be JSON; without keys
only loopback and --allowed-host names are answered (DNS rebinding); slow clients are cut off.
"""


def _prompt_bytes(text: str) -> int:
    """``--max-prompt-bytes``: :func:`mlx_fleet.quantity.positive_quantity` for argparse."""
    try:
        return positive_quantity(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def _tenant_limits(text: str) -> tuple[str, limits.TenantLimits]:
    """``NAME:rpm=N,tpm=N,concurrent=N`` (each part optional) → (tenant, limits)."""
    name, sep, spec = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:rpm=N,tpm=N,concurrent=N, got {text!r}")
    fields = {"rpm": "requests_per_minute", "tpm": "tokens_per_minute",
              "concurrent": "max_concurrent"}
    values: dict[str, int] = {}
    for part in filter(None, spec.split(",")):
        k, _, v = part.partition("=")
        if k not in fields or not v.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: expected rpm=N, tpm=N or concurrent=N")
        values[fields[k]] = int(v)
    try:
        return name, limits.TenantLimits(**values)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-fleet-router", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1",
                   help="address to serve on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8090, help="port (default: %(default)s)")
    p.add_argument("--etcd-endpoint",
                   default=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", "http://127.0.0.1:2379"),
                   help="etcd client URL (default: env MLX_FLEET_ETCD_ENDPOINT, else "
                        "%(default)s)")
    p.add_argument("--etcd-prefix", default=ROOT,
                   help="key root of the etcd contract (default: %(default)s)")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="serve the ModelDeployments of this namespace (repeatable; default: "
                        "every namespace)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="client API keys, one per line, optionally `<key> tenant=<name>` (the "
                        "agent's format); re-read when it changes. Without it the API is open")
    p.add_argument("--forward-key-file", default=None, metavar="PATH",
                   help="the fleet-internal key file the agents have as --forward-key-file: its "
                        "first key is presented to them, so they honour the router's revision "
                        "pin. Without it the client's Authorization header is passed on")
    p.add_argument(INSECURE_FORWARD, action="store_true",
                   help="send the forward key to agents over plain http:// on other hosts; "
                        "without this flag it goes only over https:// or to loopback (as the "
                        "agents' own rule), and a request to an http:// agent carries the "
                        "client's Authorization header instead")
    p.add_argument("--upstream-ca-file", default=None, metavar="PATH",
                   help="PEM CA bundle that verifies https:// agents (default: the system's)")
    add_tls_arguments(p)
    add_metrics_auth_argument(p)
    p.add_argument("--tenant-limits", type=_tenant_limits, action="append", default=[],
                   metavar="NAME:rpm=N,tpm=N,concurrent=N",
                   help="limits of one tenant (repeatable); tenant 'default' is keys without a "
                        "tenant and every request without --api-key-file")
    p.add_argument("--load-factor", type=float, default=LOAD_FACTOR,
                   help="CHWBL load bound: a Mac above load-factor × mean in-flight is skipped "
                        "(default: %(default)s)")
    p.add_argument("--max-attempts", type=positive_number(int),
                   default=retry.RetryConfig().max_attempts,
                   help="attempts per request, the first included (default: %(default)s)")
    p.add_argument("--breaker-cooldown", type=float, metavar="SECONDS",
                   default=breaker.BreakerConfig().cooldown_seconds,
                   help="seconds a breaker stays open before a half-open trial "
                        "(default: %(default)s)")
    p.add_argument("--max-queued", type=int, default=limits.QueueConfig().max_queued,
                   help="requests waiting per model when every Mac is saturated "
                        "(default: %(default)s)")
    p.add_argument("--max-queue-wait", type=positive_number(float), metavar="SECONDS",
                   default=limits.QueueConfig().max_wait_seconds,
                   help="longest wait in that queue before 429 (default: %(default)s)")
    p.add_argument("--probe-interval", type=float, default=5.0, metavar="SECONDS",
                   help="health probes of every Mac, 0 for none (default: %(default)s)")
    p.add_argument("--max-prompt-bytes", type=_prompt_bytes, default=DEFAULT_MAX_PROMPT_BYTES,
                   metavar="QUANTITY",
                   help="the agents' --max-prompt-bytes: a request body larger than twice this "
                        "(at least 1Mi) is answered 413 before it is read whole (default: "
                        "%(default)s, the agents' default)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    add_http_arguments(p, own_hosts="the --listen host")
    add_insecure_arguments(p, "the router")
    add_etcd_arguments(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    try:
        parse_endpoint(args.etcd_endpoint)
    except ValueError as e:
        build_parser().error(f"--etcd-endpoint: {e}")
    return args


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        breaker=breaker.BreakerConfig(cooldown_seconds=args.breaker_cooldown),
        retry=retry.RetryConfig(max_attempts=args.max_attempts),
        queue=limits.QueueConfig(max_queued=args.max_queued,
                                 max_wait_seconds=args.max_queue_wait),
        load_factor=args.load_factor, tenant_limits=dict(args.tenant_limits),
        probe_interval_seconds=args.probe_interval)


@dataclass(frozen=True)
class Setup:
    """What the flags resolve to before anything starts (files read, TLS checked)."""

    credentials: EtcdCredentials
    api_keys: KeyFile | None
    forward_key: KeyFile | None
    upstream_ssl: ssl.SSLContext | None
    http: HttpLimits
    #: HTTPS of the listener (``--tls-cert-file``/``--tls-key-file``), else plain http
    tls: ssl.SSLContext | None = None
    #: ``GET /metrics`` needs a key (``--metrics-auth``, :func:`mlx_fleet.http_hygiene.metrics_auth`)
    metrics_auth: bool = False
    #: accepted exposures (``INSECURE (--insecure-…): …``), logged at start
    warnings: tuple[str, ...] = ()


def _flag(args: argparse.Namespace, flag: str) -> bool:
    return bool(getattr(args, flag[2:].replace("-", "_")))


def configure(args: argparse.Namespace) -> Setup:
    """Read the credential and key files, check the etcd endpoint against them and the exposure
    of the settings (:func:`mlx_fleet.exposure.exposure_check`). Raises ``ValueError`` (a
    :class:`CredentialsError`, a :class:`KeyFileError`, a refused exposure ...) naming the
    flag."""
    credentials = credentials_from_args(args)
    check_endpoint(args.etcd_endpoint, credentials)
    check_tls_arguments(args)
    metrics = metrics_auth(args.metrics_auth, api_keys=args.api_key_file is not None)
    exposure = exposure_check(
        listen_host=args.listen, api_keys=args.api_key_file is not None,
        etcd_endpoint=args.etcd_endpoint, etcd_password=credentials.password is not None,
        tls=args.tls_cert_file is not None,
        insecure=frozenset(f for f in (INSECURE_LISTEN, INSECURE_ETCD, INSECURE_HTTP_LISTEN)
                           if _flag(args, f)))
    if exposure.refusals:
        raise ValueError(exposure.refusals[0])
    api_keys = KeyFile(args.api_key_file, flag="--api-key-file") if args.api_key_file else None
    forward_key = (KeyFile(args.forward_key_file, flag="--forward-key-file")
                   if args.forward_key_file else None)
    try:
        upstream_ssl = (ssl.create_default_context(cafile=args.upstream_ca_file)
                        if args.upstream_ca_file else None)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--upstream-ca-file {args.upstream_ca_file!r}: {e}") from None
    tls = (server_tls_context(args.tls_cert_file, args.tls_key_file)
           if args.tls_cert_file else None)
    return Setup(credentials, api_keys, forward_key, upstream_ssl, http_limits_from_args(args),
                 warnings=exposure.warnings, tls=tls, metrics_auth=metrics == "api-key")


async def serve(args: argparse.Namespace, setup: Setup) -> None:
    credentials, api_keys, forward_key, upstream_ssl = (
        setup.credentials, setup.api_keys, setup.forward_key, setup.upstream_ssl)
    for line in setup.warnings:
        log.warning("%s", line)
    store = EtcdStore(args.etcd_endpoint, credentials=credentials)
    await store.connect()
    follower = Follower(store, Keys(args.etcd_prefix), namespaces=args.namespace or None)
    app = build_app(lambda: follower.table, registry=CollectorRegistry(),
                    synced=lambda: follower.synced, settings=settings_from_args(args),
                    api_keys=api_keys, forward_key=forward_key, upstream_ssl=upstream_ssl,
                    insecure_forward=_flag(args, INSECURE_FORWARD), http_limits=setup.http,
                    hosts=allowed_hosts(args.listen, extra=setup.http.allowed_hosts),
                    max_prompt_bytes=args.max_prompt_bytes, metrics_auth=setup.metrics_auth)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = None
    follow = asyncio.create_task(follower.run(), name="router follower")
    try:
        runner, _ = await start_server(app, args.listen, args.port, limits=setup.http,
                                       ssl_context=setup.tls)
        log.info("router listening on %s://%s:%d (scope: %s; /metrics %s)",
                 "https" if setup.tls else "http", args.listen, args.port,
                 ", ".join(args.namespace) or "every namespace",
                 "needs a key" if setup.metrics_auth else "is open")
        done, _ = await asyncio.wait([follow, asyncio.create_task(stop.wait())],
                                     return_when=asyncio.FIRST_COMPLETED)
        if follow in done:
            follow.result()  # a bug in a view: raise it
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()
        await store.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        setup = configure(args)
    except ValueError as e:
        print(textwrap.fill(f"mlx-fleet-router: {e}", 100), file=sys.stderr)
        return 2
    asyncio.run(serve(args, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
