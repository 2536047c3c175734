"""``mlx-fleet-agent`` / ``python -m node_agent``: the node agent process.

Start-up order: serving core → HTTP server (logs ``serving on http://...``) → registration in
etcd (logs ``registered node X (lease ...)``; retried with back-off while etcd is unreachable)
→ assignment controller. SIGTERM/SIGINT shut down gracefully: stop accepting connections, stop
the controller, revoke the lease (the node record and reports vanish at once), close the core.
A serving core that fails (its MLX thread died: :attr:`ServingCore.failure`) cannot serve again,
so the agent shuts down the same way — the revoked lease lets the operator re-place its replicas
at once — and exits with :data:`EXIT_CORE_FAILED`, for launchd (``KeepAlive``) to start a fresh
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Sequence

from aiohttp import web

from mlx_fleet.contract import AGENT_LABEL_PREFIX, Keys, NodeHealth, check_watermark
from mlx_fleet.exposure import INSECURE_FORWARD, exposure_check, is_loopback
from mlx_fleet.http_hygiene import allowed_hosts, server_tls_context, start_server
from mlx_fleet.routing.api_keys import KeyFile, KeyFileError
from mlx_fleet.store import EtcdStore, StoreError

from .capacity import CapacityConfig, CapacityProbe, format_bytes
from .cli import AgentConfig, StartupError, agent_version, build_parser, config_from_args
from .registration import Registration
from .serving.capabilities import served_tasks

log = logging.getLogger("node_agent")

__all__ = ["Agent", "main", "run", "EXIT_CORE_FAILED", "health_verdict", "tls_context",
           "forward_tls_context"]

#: Exit status after the serving core failed (2 is for bad flags and start-up errors).
EXIT_CORE_FAILED = 3


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server side of HTTPS (:func:`mlx_fleet.http_hygiene.server_tls_context`). Raises
    :class:`StartupError` naming the flags and paths (never the files' content)."""
    try:
        return server_tls_context(cert_file, key_file)
    except ValueError as e:
        raise StartupError(str(e)) from None


def forward_tls_context(ca_file: str) -> ssl.SSLContext:
    """The client side of forwarding to ``https://`` nodes, trusting ``ca_file`` (PEM).
    Raises :class:`StartupError` naming the flag and path."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        reason = getattr(e, "strerror", None) or getattr(e, "reason", None) or type(e).__name__
        raise StartupError(f"--forward-ca-file {ca_file!r}: cannot use ({reason})") from None


def check_exposure(config: AgentConfig) -> tuple[str, ...]:
    """:func:`mlx_fleet.exposure.exposure_check` of ``config``: raises :class:`StartupError`
    with the first refusal (one line naming its ``--insecure-…`` flag); returns the warnings of
    the settings accepted by such a flag, for the caller to log."""
    exposure = exposure_check(
        listen_host=config.listen_host, api_keys=config.api_key_file is not None,
        etcd_endpoint=config.etcd_endpoint,
        etcd_password=(config.etcd_credentials is not None
                       and config.etcd_credentials.password is not None),
        tls=config.tls_cert_file is not None, insecure=config.insecure)
    if exposure.refusals:
        raise StartupError(exposure.refusals[0])
    return exposure.warnings


def health_verdict(*, registered: bool, etcd_problem: str | None,
                   failures: Sequence[str]) -> tuple[bool, str, list[str]]:
    """``(serving, status, reasons)`` of a node agent for ``GET /health``.

    ``registered``: the node has registered in etcd at least once; ``etcd_problem``: what is
    wrong with its link to etcd now (:meth:`Registration.connectivity_problem`), None when
    nothing; ``failures``: anything else that is wrong (serving core failed, a supervised task
    restarting). ``status`` is ``"unhealthy"`` (``serving`` False: 503) before the first
    registration or with any failure; ``"degraded"`` (``serving`` True: 200) when the only
    problem is the link to etcd — the models it holds keep serving, a load balancer should keep
    sending it requests, only assignment changes wait for etcd; ``"ok"`` otherwise. ``reasons``
    lists every problem, the etcd one first.
    """
    problems = ([] if registered else ["not registered in etcd yet"]) + list(failures)
    reasons = ([etcd_problem] if etcd_problem is not None else []) + problems
    if problems:
        return False, "unhealthy", reasons
    return True, ("degraded" if etcd_problem is not None else "ok"), reasons


class Agent:
    """The whole agent in one object (the CLI runs it; tests run several in one process).

    :meth:`start` brings everything up and returns once the HTTP server listens and the node
    is registered (it keeps retrying registration while etcd is unreachable, until
    :meth:`stop`). :meth:`stop` is the graceful shutdown. ``url`` is the advertised base URL.
    """

    def __init__(self, config: AgentConfig) -> None:
        from prometheus_client import CollectorRegistry

        from .serving import ServingCore

        self.config = config
        for warning in check_exposure(config):
            log.warning("%s", warning)
        if config.downloads.allow_unpinned_hub:
            log.warning("--allow-unpinned-hub-revisions: hf:// sources may follow a branch or "
                        "tag, so replicas of one revision may hold different weights (each "
                        "reports the commit it downloaded; the operator's ReplicasConsistent "
                        "condition shows a mismatch)")
        ignored = sorted(k for k in config.labels if not k.startswith(AGENT_LABEL_PREFIX))
        if ignored:
            log.warning("--label %s: placement ignores labels an agent sets outside %s (label "
                        "the MacNode instead: kubectl label macnode %s KEY=VALUE)",
                        ", ".join(ignored), AGENT_LABEL_PREFIX, config.node_name)
        self.keys = Keys(config.etcd_prefix)
        self.keys.node(config.node_name)  # validates the name early (ValueError)
        self.registry = CollectorRegistry()
        self.core = ServingCore(registry=self.registry,
                                max_queued_requests=config.max_queued_requests,
                                options=config.serving,
                                max_prompt_bytes=config.max_prompt_bytes,
                                max_choices=config.max_choices)
        self.probe = CapacityProbe(CapacityConfig(config.simulated_chip,
                                                  config.simulated_memory_bytes,
                                                  config.max_loaded_models,
                                                  config.memory_watermark))
        self.store = EtcdStore(config.etcd_endpoint, credentials=config.etcd_credentials)
        self.registration: Registration | None = None
        self.controller = None
        self.traffic = None
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        try:
            self.api_keys = (KeyFile(config.api_key_file, flag="--api-key-file")
                             if config.api_key_file else None)
            self.forward_keys = (KeyFile(config.forward_key_file, flag="--forward-key-file")
                                 if config.forward_key_file else None)
        except KeyFileError as e:
            raise StartupError(str(e)) from None
        if config.metrics_auth == "api-key" and self.api_keys is None:
            raise StartupError("--metrics-auth api-key needs --api-key-file")
        self.tls = (tls_context(config.tls_cert_file, config.tls_key_file)
                    if config.tls_cert_file and config.tls_key_file else None)
        self.forward_tls = (forward_tls_context(config.forward_ca_file)
                            if config.forward_ca_file else None)

    def _node_health(self) -> NodeHealth:
        """What the node record says: Degraded while the serving core has failed or stopped,
        so placement (which uses only Healthy nodes) moves replicas elsewhere."""
        return NodeHealth.HEALTHY if self.core.healthy else NodeHealth.DEGRADED

    def health(self) -> tuple[bool, dict]:
        """``(serving, details)`` for ``GET /health``: :func:`health_verdict` over the
        registration, the serving core and the supervised background tasks (heartbeat,
        assignment follower, converge worker, traffic); the details also list the registration,
        the tasks, every assignment's state and the loaded models."""
        reg, ctl, core = self.registration, self.controller, self.core
        failures: list[str] = []
        if not core.healthy:
            failures.append(f"serving core failed: {core.failure}" if core.failure
                            else "serving core is not running")
        tasks = [*(reg.tasks if reg is not None else []), *(ctl.tasks if ctl is not None else []),
                 *(self.traffic.tasks if self.traffic is not None else [])]
        failures += [f"task {t.name} failed ({t.last_error}); restarting"
                     for t in tasks if t.backing_off]
        registered = reg is not None and reg.registrations > 0
        serving, status, reasons = health_verdict(
            registered=registered,
            etcd_problem=reg.connectivity_problem() if reg is not None and registered else None,
            failures=failures)
        return serving, {
            "status": status,
            "reasons": reasons,
            "node": self.config.node_name,
            "registration": reg.status() if reg is not None else None,
            "tasks": [t.status() for t in tasks],
            "assignments": ctl.states() if ctl is not None else {},
            "models": [{"id": m.model_id, "revision": m.revision} for m in core.models()],
        }

    async def start(self) -> None:
        from .controller import Controller
        from .openai_api import build_app
        from .traffic import TrafficManager

        cap = await self.probe.read()
        if cap.simulated:
            log.warning("capacity is SIMULATED: chip %r (generation %d), %s unified memory — "
                        "this node is not a real Mac", cap.chip, cap.chip_generation,
                        format_bytes(cap.memory_total_bytes))
        else:
            log.info("capacity: %s (generation %d), %s unified memory, wired limit %s",
                     cap.chip, cap.chip_generation, format_bytes(cap.memory_total_bytes),
                     format_bytes(cap.wired_limit_bytes) if cap.wired_limit_bytes else "default")
        log.info("memory budget for models: %s (watermark %g)", format_bytes(cap.budget_bytes()),
                 cap.memory_watermark)
        await self.core.start()
        app = build_app(self.core, health=self.health, registry=self.registry,
                        router=lambda: self.traffic,
                        standby=lambda: (self.controller.standby_models()
                                         if self.controller is not None else ()),
                        api_keys=self.api_keys, forward_keys=self.forward_keys,
                        metrics_auth=self.config.metrics_auth == "api-key",
                        forward_ssl=self.forward_tls,
                        insecure_forward=INSECURE_FORWARD in self.config.insecure,
                        limits=self.config.http, hosts=self._host_names(),
                        health_details=is_loopback(self.config.listen_host))
        host = self.config.listen_host
        shown = f"[{host}]" if ":" in host else host
        try:
            self._runner, site = await start_server(app, host, self.config.listen_port,
                                                    limits=self.config.http,
                                                    ssl_context=self.tls)
        except OSError as e:  # address in use, not permitted, unknown host, …
            reason = (e.strerror or str(e)).rstrip(".")
            if e.errno == errno.EADDRINUSE:
                reason = "address already in use"
            raise StartupError(f"cannot listen on {shown}:{self.config.listen_port} "
                               f"(--listen): {reason}") from None
        self._site = site
        port = self._bound_port()
        scheme = "https" if self.tls is not None else "http"
        log.info("serving on %s://%s:%d", scheme, shown, port)
        if self.api_keys is None:
            log.warning("the API is OPEN: no --api-key-file, anyone who can reach %s:%d may "
                        "use it", shown, port)
        else:
            log.info("API keys required (%d in --api-key-file%s); /metrics %s",
                     len(self.api_keys),
                     f", {len(self.forward_keys)} fleet-internal" if self.forward_keys else "",
                     "needs a key" if self.config.metrics_auth == "api-key" else "is open")
            if self.forward_keys is None:
                log.warning("no --forward-key-file: requests forwarded to other nodes carry "
                            "no key, and nodes that require keys answer them 401")
        if self.config.advertise_url:
            self.url = self.config.advertise_url.rstrip("/")
        else:
            adv = socket.gethostname() if host in {"0.0.0.0", "::", ""} else shown
            self.url = f"{scheme}://{adv}:{port}"

        self.registration = Registration(
            self.store, self.keys, node_name=self.config.node_name, address=self.url,
            capacity=self.probe.read, health=self._node_health, labels=self.config.labels,
            ttl=self.config.lease_ttl,
            agent_version=agent_version(),
            serving_options=self.core.options.as_record(), tasks=served_tasks())
        delay = 0.5
        while True:
            try:
                await self.store.connect()
                await self.registration.start()
                break
            except StoreError as e:
                log.warning("cannot register node %s yet (%s); retrying in %.1fs",
                            self.config.node_name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        cap = await self.probe.read()  # the budget's inputs are static (hw.memsize, wired limit)
        budget = cap.budget_bytes()  # the rule placement uses on the node record
        self.controller = Controller(self.store, self.keys, node_name=self.config.node_name,
                                     core=self.core, registration=self.registration,
                                     advertise_url=self.url, budget_bytes=budget,
                                     prefetch_window_seconds=self.config.prefetch_window_seconds,
                                     max_prefetches=self.config.max_prefetches,
                                     max_loaded_models=self.config.max_loaded_models,
                                     download_limits=self.config.downloads,
                                     source_policy=self.config.source_policy)
        await self.controller.start()
        self.traffic = TrafficManager(self.store, self.keys, node_name=self.config.node_name,
                                      registration=self.registration,
                                      served=self.controller.served, crashes=self.core.crashes,
                                      memory_bytes=self.core.memory_bytes,
                                      touch=self.controller.touch,
                                      ensure_loaded=self.controller.ensure_loaded,
                                      stats_interval=self.config.stats_interval_seconds)
        await self.traffic.start()

    def _host_names(self) -> frozenset[str]:
        """``Host`` names this agent answers for without keys (besides loopback): the listen
        host, the advertised host (this host's name when listening on every address) and
        ``--allowed-host``."""
        host = self.config.listen_host
        wildcard = host in {"0.0.0.0", "::", ""}
        return allowed_hosts(host, self.config.advertise_url,
                             socket.gethostname() if wildcard else None,
                             extra=self.config.http.allowed_hosts)

    def _bound_port(self) -> int:
        server = self._site._server if self._site is not None else None  # type: ignore[attr-defined]
        sockets = getattr(server, "sockets", None) or []
        return sockets[0].getsockname()[1] if sockets else self.config.listen_port

    async def stop(self) -> None:
        """Graceful shutdown; safe to call more than once and after a partial start."""
        if self._site is not None:
            with contextlib.suppress(Exception):
                await self._site.stop()  # stop accepting new connections
            self._site = None
        if self.traffic is not None:
            await self.traffic.stop()
        if self.controller is not None:
            await self.controller.stop()
        if self.registration is not None:
            await self.registration.stop(revoke=True)
        await self.core.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(Exception):
            await self.store.close()
        log.info("node agent %s stopped", self.config.node_name)


async def run(config: AgentConfig) -> int:
    """Run an agent until SIGTERM or SIGINT (returns 0) or until its serving core fails
    (returns :data:`EXIT_CORE_FAILED`), then shut it down gracefully: the lease is revoked in
    both cases."""
    from .serving.preload import preload_and_freeze

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    # before any model exists: unloads then collect garbage in ~1 ms, not ~100 ms
    preload_and_freeze()
    agent = Agent(config)
    starting = asyncio.create_task(agent.start())
    waiting = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(agent.core.wait_failure())
    status = 0
    try:
        await asyncio.wait({starting, waiting, failed}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # raise a start-up bug
            await asyncio.wait({waiting, failed}, return_when=asyncio.FIRST_COMPLETED)
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        if failed.done():
            status = EXIT_CORE_FAILED
            log.critical("serving core failed (%s): stopping node agent %s, revoking its lease "
                         "so its models are placed elsewhere, exit status %d",
                         failed.result(), config.node_name, status)
        else:
            log.info("shutting down")
    finally:
        waiting.cancel()
        failed.cancel()
        await agent.stop()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Console script entry point. Returns the process exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        Keys(config.etcd_prefix).node(config.node_name)
        if config.lease_ttl < 1:
            raise ValueError("--lease-ttl must be at least 1 second")
        check_exposure(config)  # before anything heavy; the Agent logs the accepted risks
        logging.getLogger("node_agent").info("source policy: %s",
                                             config.source_policy.to_json())
    except (ValueError, StartupError) as e:
        print(f"mlx-fleet-agent: error: {e}", file=sys.stderr)
        return 2
    try:
        status = asyncio.run(run(config))
    except StartupError as e:
        print(f"mlx-fleet-agent: error: {e}", file=sys.stderr)
        return 2
    if status == EXIT_CORE_FAILED:
        # Everything is shut down (lease revoked, sockets closed). A process whose MLX thread
        # died is in an unknown MLX state, and interpreter finalisation with such threads can
        # abort (SIGABRT instead of our status; see node_agent.serving.worker): leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
