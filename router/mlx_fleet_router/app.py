"""The fleet router's HTTP API (aiohttp): one OpenAI endpoint for the whole fleet.

Routes:

* ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE streaming),
  ``POST /v1/embeddings``: relayed to a Mac that serves the requested model and what the request
  needs (below), the Mac's answer streamed back as it comes;
* ``GET /v1/models``: the served names in scope with a Ready replica, each with its
  ``deployment`` (``namespace/name``), ``revisions`` and ``ready_replicas`` (``created``: 0,
  unknown to the router); behind the API key like the other OpenAI routes;
* ``GET /health``: 200 once the router follows etcd (its views synced), 503 before;
* ``GET /fleet``: what this router routes to, per Mac — breaker state, in-flight requests,
  seconds until a half-open trial (:func:`mlx_fleet_router.fleet.view`, the shape
  :class:`mlx_fleet.routing.fleet.FleetRouting`); read-only, and behind the same API key as the
  OpenAI routes when a key file is set (401 without one), while ``/health`` stays minimal and
  open;
* ``GET /metrics``: Prometheus (:mod:`~mlx_fleet_router.metrics`).

Before any route: the agent's HTTP hygiene (:mod:`mlx_fleet.http_hygiene`, run the app with
:func:`mlx_fleet.http_hygiene.start_server` as :mod:`~mlx_fleet_router.main` does): header and
body read timeouts, a connection cap, ``application/json`` POST bodies (415), a ``Host``
allow-list while the router has no keys (421), CORS only for configured origins, and a body
larger than :func:`mlx_fleet.routing.body_size.max_body_bytes` of the agents' prompt bound
answered 413 ``request_too_large``.

Per generation request (each step a pure decision; this module gathers inputs, applies
outputs):

1. **Key** (``api_keys``, :mod:`mlx_fleet.routing.api_keys`): ``Authorization: Bearer`` must be
   a key of the file (401 otherwise, OpenAI's ``invalid_api_key``); the key's line names the
   tenant. Without a key file the API is open and every request is tenant ``default``.
2. **Body**: JSON object with a string ``model`` (400 ``invalid_json`` / ``invalid_value``
   otherwise, OpenAI's shape). A name the routing table does not know: 404
   ``model_not_found`` naming it; a name two deployments in scope claim: 409
   ``model_name_conflict`` naming both (:mod:`~mlx_fleet_router.table`).
   **Capabilities**: what the body needs (:func:`mlx_fleet.capabilities.required_capabilities`
   of the same parsed body: tools, structured outputs, logprobs, ``n``, the endpoint's task);
   when no replica of the model serves it (:meth:`~mlx_fleet_router.table.Served.missing`, from
   the capabilities the agents report), 400 ``invalid_request_error`` with ``param`` naming the
   field and ``code`` ``unsupported_parameter`` / ``unsupported_value`` — the agents' own answer
   (:class:`mlx_fleet.capabilities.Missing`) — without trying any Mac.
3. **Tenant limits** (:func:`mlx_fleet_router.limits.admit`): 429 ``rate_limit_error`` /
   ``rate_limit_exceeded`` with ``Retry-After``; the request's usage (``total_tokens``, read
   from the end of the relayed answer) is charged when it ends.
4. **Pick** (:func:`mlx_fleet_router.picker.pick`): the session key
   (:func:`mlx_fleet.routing.session.session_key`: ``X-Session-ID``, else ``user``, else the
   prompt-prefix key) → the Macs to try, in order, each with the revision to pin; a Mac whose
   model lacks what the request needs is not one of them. When every
   Mac is at its admission limit (``batch_limit × admission_batches`` requests in flight from
   this router), the request waits in the bounded queue (:func:`~mlx_fleet_router.limits.
   backpressure`), then 429 with ``Retry-After``. No usable Mac: 503 ``unavailable``.
5. **Attempts** (:func:`mlx_fleet.routing.proxy.proxy`): the request goes to the first Mac
   with the pin header (:data:`~mlx_fleet.routing.headers.PIN_HEADER`, honoured by an agent
   only from its fleet-internal key: the router presents ``forward_key``'s first key, else the
   client's own ``Authorization``). Before any byte went to the client, a connection error, a
   reset, or a 429/502/503/504 is retried on the next Mac (:func:`mlx_fleet_router.retry.
   decide`, within the retry budget); the last possible attempt relays the Mac's own answer.
   Once a byte went out nothing is retried (a cut stream). Each outcome feeds the Mac's
   circuit breaker (:mod:`~mlx_fleet_router.breaker`: a refused connection ejects it at once).
6. **Cancel**: run the app with ``handler_cancellation=True`` (as :mod:`~mlx_fleet_router.main`
   does): a client that disconnects cancels the handler, which closes the upstream connection;
   the agent then stops the generation.

A background task probes every Mac of the table (``GET /health``) each
``probe_interval_seconds`` and feeds the breakers (three failed probes open one; a probe is a
half-open breaker's trial as well as a request), and drops the state of Macs that left the
table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mlx_fleet.capabilities import Need, required_capabilities
from mlx_fleet.exposure import may_send_key
from mlx_fleet.http_errors import error_response, errors_middleware, unauthorized
from mlx_fleet.http_hygiene import HttpLimits, hygiene_middlewares
from mlx_fleet.routing.api_keys import DEFAULT_TENANT, KeyFile, bearer_token
from mlx_fleet.routing.body_size import DEFAULT_MAX_PROMPT_BYTES, max_body_bytes
from mlx_fleet.routing.headers import PIN_HEADER, SESSION_HEADER
from mlx_fleet.routing.proxy import StreamCut, UpstreamError, client_session, proxy
from mlx_fleet.routing.session import prefix_key, session_key

from . import breaker, fleet, limits, retry
from .metrics import UNKNOWN_MODEL, RouterMetrics
from .picker import Target, pick
from .state import RouterSettings, RouterState
from .table import Served, Table

__all__ = ["build_app", "usage_tokens", "STATE_KEY", "OPEN_PATHS"]

log = logging.getLogger(__name__)

_RequestKey = getattr(web, "RequestKey", None)
_MODEL: Any = _RequestKey("mlxfleet_router_model", str) if _RequestKey else "mlxfleet_model"
_TENANT: Any = _RequestKey("mlxfleet_router_tenant", str) if _RequestKey else "mlxfleet_tenant"
# Set when a Mac's answer broke off after its first byte went to the client (not the client's
# doing): counted with code 502, not 499.
_CUT: Any = _RequestKey("mlxfleet_router_cut", bool) if _RequestKey else "mlxfleet_cut"


STATE_KEY = web.AppKey("mlxfleet_router_state", RouterState)
#: Paths answered without a key when the router has keys (probes); ``/metrics`` too with
#: ``metrics_auth`` off (``--metrics-auth open``).
OPEN_PATHS = frozenset({"/health"})
#: The open path whose Host is checked even with keys (DNS rebinding would read it).
_METRICS = "/metrics"

#: ``"total_tokens": N`` in an OpenAI ``usage`` object (the last one in the bytes wins).
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
#: Bytes of an answer's end kept to find its usage (a stream's last events, a JSON body's
#: ``usage`` at its end).
_TAIL_BYTES = 4096


def usage_tokens(tail: bytes) -> int:
    """Prompt + completion tokens of an answer whose last bytes are ``tail``: the last
    ``"total_tokens"`` in them (a JSON completion's ``usage``, a stream's final usage event
    with ``stream_options.include_usage``), else 0."""
    found = _TOTAL_TOKENS.findall(tail)
    return int(found[-1]) if found else 0


class _Relay:
    """Observes one attempt's relay: when its status came, its first body byte, its tail."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started: float | None = None
        self.first_chunk: float | None = None
        self.tail = b""

    def start(self, status: int) -> None:
        self.started = self.clock()

    def chunk(self, data: bytes) -> None:
        if self.first_chunk is None:
            self.first_chunk = self.clock()
        self.tail = (self.tail + data)[-_TAIL_BYTES:]


def _outcome(e: UpstreamError) -> tuple[retry.Outcome, bool]:
    """The retry outcome of a failed attempt, and whether the connection was refused."""
    if e.status is not None:
        return retry.Outcome("status", e.status), False
    cause = e.__cause__
    timeout_cls = getattr(aiohttp, "ConnectionTimeoutError", ())
    if isinstance(cause, aiohttp.ClientConnectorError) or (
            timeout_cls and isinstance(cause, timeout_cls)):
        refused = isinstance(getattr(cause, "os_error", None), ConnectionRefusedError)
        return retry.Outcome("connect_error"), refused
    if isinstance(cause, asyncio.TimeoutError):
        return retry.Outcome("timeout"), False
    return retry.Outcome("reset"), False


def build_app(table: Callable[[], Table], *, registry: CollectorRegistry,
              synced: Callable[[], bool] = lambda: True,
              settings: RouterSettings | None = None,
              api_keys: KeyFile | None = None, forward_key: KeyFile | None = None,
              upstream_ssl: ssl.SSLContext | None = None, insecure_forward: bool = False,
              http_limits: HttpLimits = HttpLimits(), hosts: frozenset[str] = frozenset(),
              max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES, metrics_auth: bool = False,
              clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The router's app over ``table()`` (the current routing table, e.g.
    :attr:`mlx_fleet_router.follow.Follower.table`). ``registry``: where its metrics go (and
    what ``/metrics`` exposes). ``synced()``: the table follows etcd (``/health``).
    ``api_keys``: client keys with their tenants (None: open API); ``forward_key``: the fleet's
    forward key file (its first key is presented to agents, so they honour the pin — only over
    ``https://`` or to loopback, unless ``insecure_forward``: the agent's own rule,
    :func:`mlx_fleet.exposure.may_send_key`); without the forward key the client's own
    ``Authorization`` is relayed, by the same rule and never with ``insecure_forward`` (a client
    key does not go to a plain-http agent on another host; logged once per agent);
    ``metrics_auth``: ``GET /metrics`` needs a key (with ``api_keys``; else it is open, and its
    ``Host`` is checked like a keyless server's);
    ``upstream_ssl``: how ``https://`` agents are verified (default: the system's CAs);
    ``http_limits``: the server's HTTP hygiene (:class:`mlx_fleet.http_hygiene.HttpLimits`);
    without ``api_keys`` a request's ``Host`` must be loopback or one of ``hosts`` (421 otherwise);
    ``max_prompt_bytes``: the agents' prompt bound (``--max-prompt-bytes``), which sets the
    largest body (:func:`~mlx_fleet.routing.body_size.max_body_bytes`, 413 above it);
    ``clock``: monotonic seconds (breakers, budget, buckets)."""
    settings = settings or RouterSettings()
    metrics = RouterMetrics(registry)
    state = RouterState(settings, metrics, clock)
    sessions: dict[str, aiohttp.ClientSession] = {}
    open_paths = OPEN_PATHS if metrics_auth and api_keys is not None else OPEN_PATHS | {_METRICS}
    withheld: set[str] = set()  # agents a client key was not relayed to (logged once each)

    def session() -> aiohttp.ClientSession:
        if "s" not in sessions:  # created on the running loop, by the first use
            sessions["s"] = client_session(upstream_ssl)
        return sessions["s"]

    def count(request: web.Request, status: int, seconds: float) -> None:
        if request.path.startswith("/v1/") and request.method == "POST":
            model = request.get(_MODEL, UNKNOWN_MODEL)
            metrics.requests.labels(model, str(status),
                                    request.get(_TENANT, DEFAULT_TENANT)).inc()
            metrics.duration.labels(model).observe(seconds)

    # the Mac's answer broke off mid-way (502), not the client's doing (499)
    errors = errors_middleware(log=log, count=count, cut=lambda r: bool(r.get(_CUT)),
                               clock=clock)

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        """Every path but the open ones (:data:`OPEN_PATHS`, ``/metrics`` unless
        ``metrics_auth``) needs a key of ``api_keys`` when there is a key
        file (401 otherwise); the key's tenant (``default`` without a key file) is noted."""
        if api_keys is None:
            request[_TENANT] = DEFAULT_TENANT
        elif request.path not in open_paths:
            presented = bearer_token(request.headers.get("Authorization"))
            found = api_keys.tenant_of(presented)
            if found is None:
                return unauthorized(presented)
            request[_TENANT] = found
        return await handler(request)

    async def generate(request: web.Request) -> web.StreamResponse:
        t0 = clock()
        tenant = request[_TENANT]
        body = await request.read()  # read under the body timeout by the hygiene middleware
        try:
            doc = json.loads(body)
        except ValueError as e:
            return error_response(400, f"malformed JSON body: {e}", code="invalid_json")
        if not isinstance(doc, dict):
            return error_response(400, "the request body must be a JSON object",
                                  code="invalid_value")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            return error_response(400, "model: a model name (string) is required",
                                  param="model", code="invalid_value")
        current = table()
        if model in current.conflicts:
            request[_MODEL] = model
            claimed = " and ".join(current.conflicts[model])
            return error_response(
                409, f"The model '{model}' is served by more than one ModelDeployment in this "
                f"router's scope ({claimed}); the router refuses it until one is renamed",
                param="model", code="model_name_conflict")
        served = current.models.get(model)
        if served is None:
            return error_response(404, f"The model '{model}' does not exist in this fleet",
                                  param="model", code="model_not_found")
        request[_MODEL] = model
        needs = required_capabilities(request.path, doc)
        missing = served.missing(needs)
        if missing is not None:
            return error_response(400, missing.message(model), param=missing.param,
                                  code=missing.code)
        lim = settings.tenant_limits.get(tenant, settings.default_limits)
        verdict, st = limits.admit(lim, state.tenants.get(tenant, limits.TenantState()),
                                   clock())
        if not verdict.admitted:
            metrics.rate_limited.labels(tenant, verdict.limit).inc()
            return error_response(429, f"Rate limit reached for tenant '{tenant}': "
                                  f"{verdict.limit}; retry after {verdict.retry_after} s",
                                  type_="rate_limit_error", code="rate_limit_exceeded",
                                  headers={"Retry-After": str(verdict.retry_after)})
        state.tenants[tenant] = st
        relayed: list[_Relay] = []
        try:
            return await route(request, served, body, doc, needs, t0, relayed)
        finally:
            tokens = usage_tokens(relayed[-1].tail) if relayed else 0
            state.tenants[tenant] = limits.release(lim, state.tenants[tenant], tokens, clock())

    async def route(request: web.Request, served: Served, body: bytes, doc: dict,
                    needs: frozenset[Need], t0: float,
                    relayed: list[_Relay]) -> web.StreamResponse:
        model, dep = served.model, served.deployment
        messages = doc.get("messages")
        user = doc.get("user")
        key, _ = session_key(
            request.headers.get(SESSION_HEADER), user if isinstance(user, str) else None,
            prefix=prefix_key(messages=messages if isinstance(messages, list) else None,
                              prompt=doc.get("prompt")))
        enqueued_at: float | None = None
        try:
            while True:
                chosen = pick(state.ring(served), dep, key, state.candidates(served),
                              served.split, now=clock(), breaker_config=settings.breaker,
                              load_factor=settings.load_factor,
                              guard_tripped=served.guard_tripped, needs=needs)
                d = limits.backpressure(settings.queue, saturated=chosen.saturated,
                                        queued=state.queued.get(dep, 0),
                                        enqueued_at=enqueued_at, now=clock())
                if d.action == "proceed":
                    break
                if d.action == "refuse":
                    metrics.rate_limited.labels(request[_TENANT], d.reason).inc()
                    return error_response(
                        429, f"Every Mac serving '{model}' is at capacity ({d.reason}); "
                        f"retry after {d.retry_after} s", type_="rate_limit_error",
                        code="overloaded", headers={"Retry-After": str(d.retry_after)})
                if d.action == "queue":
                    enqueued_at = clock()
                    state.queued[dep] = state.queued.get(dep, 0) + 1
                await state.wait_release(
                    enqueued_at + settings.queue.max_wait_seconds - clock())
                served = table().models.get(model, served)
        finally:
            if enqueued_at is not None:
                state.queued[dep] -= 1
        if not chosen.targets:
            return error_response(503, f"No Mac can serve the model '{model}' now (no Ready "
                                  "replica, or every one cordoned or failing)",
                                  type_="server_error", code="unavailable",
                                  headers={"Retry-After": "1"})
        metrics.affinity.labels(model, "spilled" if chosen.spilled else "kept").inc()
        return await attempt_all(request, served, chosen.targets, body, t0, relayed)

    def upstream_headers(request: web.Request, target: Target) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if target.revision:
            headers[PIN_HEADER] = target.revision
        if request.headers.get(SESSION_HEADER):
            headers[SESSION_HEADER] = request.headers[SESSION_HEADER]
        if forward_key is not None and may_send_key(target.endpoint, insecure=insecure_forward):
            forward_key.current()  # a rotated file is in force for this request already
            headers["Authorization"] = f"Bearer {forward_key.first}"
        elif request.headers.get("Authorization"):
            if may_send_key(target.endpoint):
                headers["Authorization"] = request.headers["Authorization"]
            elif target.endpoint not in withheld:
                withheld.add(target.endpoint)
                log.warning("not relaying clients' Authorization to %s: plain http to a host "
                            "that is not loopback (give the agents --tls-cert-file, or the "
                            "router --forward-key-file)", target.endpoint)
        return headers

    async def attempt_all(request: web.Request, served: Served, targets: tuple[Target, ...],
                          body: bytes, t0: float, relayed: list[_Relay]) -> web.StreamResponse:
        model, dep = served.model, served.deployment
        cfg = settings.retry
        state.budget = retry.record_request(cfg, state.budget, clock())
        attempts = 0
        last_reason = "no Mac admitted the request"
        for i, target in enumerate(targets):
            if not state.admits(target.name):  # its breaker opened since the pick
                continue
            attempts += 1
            # the Macs still to try: a later one whose breaker opened is skipped, so it counts
            # neither for "the last attempt relays the Mac's own answer" nor for macs_left
            left = sum(1 for t in targets[i + 1:] if state.admits(t.name))
            final = attempts >= cfg.max_attempts or left == 0
            state.feed(target.name, breaker.Sent())
            relay = _Relay(clock)
            relayed.append(relay)
            sent_at = clock()
            state.enter(dep, target.name)
            try:
                resp = await proxy(request, session(), target.endpoint + request.path,
                                   body=body, headers=upstream_headers(request, target),
                                   retry_statuses=() if final else retry.RETRYABLE_STATUSES,
                                   on_start=relay.start, on_chunk=relay.chunk)
            except UpstreamError as e:
                outcome, refused = _outcome(e)
                last_reason = f"{target.name}: {e.reason}"
                metrics.attempts.labels(model, target.name, outcome.kind).inc()
                # a 429 (busy) or a 404 (the model just left that Mac) is no sign of sickness
                state.feed(target.name, breaker.Refused() if refused else breaker.Finished(
                    ok=outcome.status in (404, 429), seconds=clock() - sent_at))
                decision, state.budget = retry.decide(
                    cfg, state.budget, outcome, attempts=attempts,
                    macs_left=left, now=clock())
                metrics.retries.labels(model, decision.reason).inc()
                if decision.retry:
                    log.info("retrying %s on the next Mac after %s", model, last_reason)
                    continue
                if outcome.status == 429:
                    return error_response(429, f"Every Mac serving '{model}' is at capacity",
                                          type_="rate_limit_error", code="overloaded",
                                          headers={"Retry-After": "1"})
                return error_response(503, f"No Mac could serve the model '{model}' "
                                      f"({last_reason}; {decision.reason})",
                                      type_="server_error", code="unavailable",
                                      headers={"Retry-After": "1"})
            except StreamCut as e:
                metrics.attempts.labels(model, target.name, "reset").inc()
                metrics.retries.labels(model, "BytesSent").inc()
                if e.__cause__ is not None and not isinstance(e.__cause__, ConnectionResetError):
                    # the Mac's side failed (the client's side fails with a reset of its own)
                    request[_CUT] = True
                    state.feed(target.name, breaker.Finished(ok=False))
                raise
            finally:
                state.leave(dep, target.name)
            metrics.attempts.labels(model, target.name, "ok").inc()
            started = relay.started if relay.started is not None else clock()
            state.feed(target.name, breaker.Finished(ok=resp.status < 500,
                                                     seconds=started - sent_at))
            if relay.first_chunk is not None:
                metrics.ttft.labels(model).observe(relay.first_chunk - t0)
            return resp
        return error_response(503, f"No Mac could serve the model '{model}' ({last_reason})",
                              type_="server_error", code="unavailable",
                              headers={"Retry-After": "1"})

    async def list_models(request: web.Request) -> web.Response:
        current = table()
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "mlx-fleet",
                 "deployment": s.deployment, "revisions": list(s.revisions),
                 "ready_replicas": len(s.replicas)}
                for name, s in sorted(current.models.items()) if s.replicas]
        return web.json_response({"object": "list", "data": data})

    async def health(request: web.Request) -> web.Response:
        ok = synced()
        return web.json_response({"status": "ok" if ok else "syncing",
                                  "models": len(table().models)}, status=200 if ok else 503)

    async def fleet_handler(request: web.Request) -> web.Response:
        doc = fleet.view(table(), state.breakers, state.in_flight, settings.breaker, clock())
        return web.json_response(doc.model_dump(mode="json"))

    async def metrics_handler(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    async def probe_once() -> None:
        current = table()
        macs = {r.node: r.endpoint for s in current.models.values() for r in s.replicas}
        state.forget(current)
        for node, endpoint in macs.items():
            now = clock()
            st = state.breakers.get(node, breaker.CLOSED)
            if breaker.phase(settings.breaker, st, now) is breaker.Phase.OPEN:
                continue  # cooling down: nothing to learn yet
            if not breaker.admits(settings.breaker, st, now):
                continue  # half-open with its trial out
            state.feed(node, breaker.Sent())
            ok = False
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session().get(
                        endpoint + "/health",
                        timeout=aiohttp.ClientTimeout(total=settings.breaker.slow_seconds)) as r:
                    ok = r.status == 200
            state.feed(node, breaker.Probed(ok=ok))

    async def probe_forever() -> None:
        while True:
            await asyncio.sleep(settings.probe_interval_seconds)
            try:
                await probe_once()
            except Exception:  # noqa: BLE001 - a probe round must not end the loop
                log.exception("health probe round failed")

    async def start_probes(app: web.Application) -> Any:
        task = (asyncio.create_task(probe_forever(), name="router health probes")
                if settings.probe_interval_seconds > 0 else None)
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if "s" in sessions:
            await sessions.pop("s").close()

    # errors outermost (a 401, 415 or 421 is counted like any other answer); the hygiene checks
    # (Host, CORS, Content-Type) before authentication, the body read (under its timeout) after
    before_auth, after_auth = hygiene_middlewares(
        http_limits, check_host=api_keys is None, hosts=hosts, error=error_response,
        host_paths=frozenset({_METRICS}) & open_paths)
    app = web.Application(middlewares=[errors, before_auth, authenticate, after_auth],
                          client_max_size=max_body_bytes(max_prompt_bytes))
    app[STATE_KEY] = state
    app.cleanup_ctx.append(start_probes)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/embeddings", generate)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/fleet", fleet_handler)
    app.router.add_get("/metrics", metrics_handler)
    return app
