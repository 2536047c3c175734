"""The node agent's OpenAI-compatible HTTP API (aiohttp) over :class:`ServingCore`: the app's
wiring; the parts are in :mod:`node_agent.api` (middlewares, request parsing, forwarding, the
completion handlers).

Routes:

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON or SSE streaming) for a
  ``TextGeneration`` model; ``POST /v1/embeddings`` (:mod:`node_agent.api.embeddings`) for a
  ``TextEmbedding`` one (``spec.model.task``; the other task's route answers 400
  ``wrong_model_task`` naming ``model``),
* ``GET /v1/models``, ``GET /health`` (200 healthy / 503 not), ``GET /metrics`` (Prometheus),
* ``GET /openapi.json``: the API's OpenAPI 3.1 document (:mod:`node_agent.openapi`, built from
  the request and response models of :mod:`node_agent.api_models` that this module validates
  with and answers through); open like ``/health``.

Authentication (``api_keys``, :mod:`mlx_fleet.routing.api_keys`): with a key file every request
except ``GET /health`` (and ``GET /metrics`` unless ``metrics_auth``) needs ``Authorization:
Bearer <key>`` with one of its keys or of the fleet-internal ``forward_keys``; otherwise 401
``invalid_request_error`` / ``invalid_api_key`` with ``WWW-Authenticate: Bearer`` (the message
never repeats what was sent). Without a key file the API is open. A forwarded request (below)
carries the first key of ``forward_keys`` as its bearer key, never the client's. The revision
pin of a forwarded request (:data:`PIN_HEADER`) is honoured only when the request authenticated
with one of ``forward_keys`` — or when the API has no keys at all (then anyone who can reach it
could as well pick any revision); a client key presenting it has it ignored: the request is
routed as if the header were absent (the canary split, the stable revision).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` (malformed JSON, invalid field: ``param`` names it, context overflow:
``code`` ``context_length_exceeded``; ``stream_options`` without ``stream: true``, a chat
``top_logprobs`` without ``logprobs: true``, ``code`` ``invalid_value``; the legacy
``functions``/``function_call``, ``code`` ``unsupported_parameter``; what the serving revision's
capabilities lack — ``tools``/``tool_choice``, ``response_format`` other than ``{"type":
"text"}``, ``logprobs``/``top_logprobs``, ``n`` > 1 —, ``code`` ``unsupported_parameter`` or
``unsupported_value`` (:mod:`mlx_fleet.capabilities`, the fleet router's answer too)), 404
``model_not_found``, 405, 429 with ``Retry-After``
(seconds), 500 for anything unexpected (the server keeps running), 503 when the model goes away
mid-request or the serving core has failed (``ServingCore.failure``).

``usage`` (non-streaming, and the last event of a stream with ``stream_options.include_usage``)
has OpenAI's ``prompt_tokens_details.cached_tokens``: the prompt tokens whose KV cache came from
the prompt cache (0 with ``--no-prompt-cache``).

A stream whose client reads more slowly than the model generates is bounded
(``--stream-buffer-chunks``): once that many chunks wait for the client, the generation stops
and leaves the batch (the other streams never wait for it) and the stream ends, after the chunks
already generated, with an error event ``{"error": {..., "type": "server_error", "code":
"stream_buffer_overflow"}}`` and no ``[DONE]``.

``seed`` is honoured best-effort: a seeded request samples from its own seed-derived random keys
(not MLX's global random state, so other requests in the batch are unaffected); the same seed,
prompt and parameters repeat the same tokens unless batching with other sequences changes the
logits in their last bits. Cost: mlx-lm (0.32) samples a batch in one call only while all its
sequences share one sampler object; a seeded request (always its own sampler), like one with a
different ``temperature``/``top_p`` (or a greedy one among sampling ones), makes mlx-lm sample
*every* row of its model's batch separately for as long as it runs, slowing sampling for all
requests in that batch (see :mod:`node_agent.serving`).

Revisions and the canary split: with a ``router`` (the agent's
:class:`~node_agent.traffic.TrafficManager`), each request is routed to one loaded revision of its
model — by the canary split on the session key (``X-Session-ID`` header, else the ``user``
field), else the node's stable revision (:mod:`mlx_fleet.routing.route`) — or forwarded, streaming
preserved, to a node that serves the candidate. Every response names the revision that served it
in the ``X-Model-Revision`` header, and the outcome of a request under a split (server-side
failure or not, latency, time to first token, tokens/s) feeds the per-revision statistics and
the local guard.

Idle unload (scale from zero): a request routed to a revision that was unloaded for idleness
(``Routed.standby``) waits for the router's ``ensure_loaded`` — one reload, shared by every
request waiting for it — and is then served as usual; too many waiting requests get 429 with
``Retry-After``, a reload that fails 503 ``server_error`` (``code`` ``model_reload_failed``).
Every request served here tells the router it used its revision (``touch``), which resets the
revision's idle time.

Run the app with ``handler_cancellation=True`` (as ``node_agent.main`` and
``aiohttp.test_utils.TestServer`` do) so a client disconnect cancels the handler; the handler
additionally notices a closed transport between tokens (a failed write while streaming, a
closing transport otherwise), whichever comes first. Either way the generation leaves the batch,
and the request is counted with code ``499`` (also a stream whose ``200`` header was already
sent) and logged as one INFO line ``client disconnected during POST <path>`` (no traceback).
"""

from __future__ import annotations

import ssl
from typing import Any, Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.http_hygiene import HttpLimits, hygiene_middlewares
from mlx_fleet.routing.api_keys import KeyFile
from mlx_fleet.routing.body_size import max_body_bytes

from .api.completions import Completions
from .api.context import OPEN_PATHS, UNKNOWN_LABEL
from .api.embeddings import EmbeddingsRoute
from .api.forward import Forwarder
from .api.middleware import authentication, keyed, request_errors
from .api_models import ChatCompletionRequest, CompletionRequest
from .api_responses import ModelCard, ModelList
from .openapi import OPENAPI_PATH, openapi_document
from .serving import ServingCore
from .serving.capabilities import model_capabilities

__all__ = ["build_app", "ChatCompletionRequest", "CompletionRequest", "CORE_KEY",
           "UNKNOWN_LABEL"]

CORE_KEY = web.AppKey("mlxfleet_core", ServingCore)


def build_app(core: ServingCore, *, health: Callable[[], tuple[bool, dict]],
              registry: CollectorRegistry,
              router: Callable[[], Any] = lambda: None,
              standby: Callable[[], Iterable[Any]] = tuple,
              api_keys: KeyFile | None = None, forward_keys: KeyFile | None = None,
              metrics_auth: bool = False,
              forward_ssl: ssl.SSLContext | None = None,
              insecure_forward: bool = False,
              limits: HttpLimits = HttpLimits(),
              hosts: frozenset[str] = frozenset(),
              health_details: bool = True) -> web.Application:
    """Build the OpenAI-compatible app over ``core``.

    ``health()`` returns ``(serving, details)``; ``GET /health`` answers 200 (serving: healthy,
    or degraded with its models still served) or 503 with ``details`` as JSON. ``GET /metrics`` exposes ``registry`` (pass the core's registry, or one
    that includes it, to see the serving metrics). ``router()`` returns the agent's
    :class:`~node_agent.traffic.TrafficManager`, or None while there is none (then a request is
    served by the model's only, or most recently loaded, revision). Request counts go to ``core.metrics``, labelled
    with the model and revision only when the request names a loaded model, else with
    :data:`UNKNOWN_LABEL` for both. ``standby()`` returns the revisions assigned here
    but not resident (the controller's
    :meth:`~node_agent.controller.Controller.standby_models`: ``model_id``, ``revision``,
    ``max_context_tokens``, ``reason``, ``created_unix``); ``GET /v1/models`` lists them too.

    ``api_keys``: the client keys (None: no authentication); ``forward_keys``: the
    fleet-internal keys, accepted like client keys when ``api_keys`` is set, the only keys
    whose requests may pin a revision (:data:`PIN_HEADER`), and the first of them sent with
    every forwarded request; ``metrics_auth``: ``GET /metrics`` needs a key too.
    Both files are re-read when they change (:meth:`KeyFile.current`, a stat per request).
    ``forward_ssl``: how forwarded requests verify an ``https://`` node (default: the system's
    trusted CAs). The forward key goes only to ``https://`` or loopback nodes unless
    ``insecure_forward`` (``--insecure-forward-http``; :func:`mlx_fleet.exposure.may_send_key`):
    a request forwarded to a plain-http node on another host carries no key (logged once per
    node).

    ``limits``: the server's HTTP hygiene (:mod:`mlx_fleet.http_hygiene`: body timeout,
    ``application/json`` POST bodies, CORS origins); without ``api_keys`` a request's ``Host``
    must be loopback or one of ``hosts`` (421 otherwise). ``GET /health`` answers its
    ``details`` only to a request with a valid key, or with no keys configured when
    ``health_details`` (the agent: it listens on loopback only); anyone else gets
    ``{"status": ...}`` alone (no lease, assignments or errors).
    """
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}
    # errors outermost: a 401 is counted in the request metrics like any other answer; the
    # hygiene checks (Host, CORS, Content-Type) come before authentication, the body read
    # (under its timeout) after it
    # an open /metrics keeps its Host check with keys too (DNS rebinding would read it)
    before_auth, after_auth = hygiene_middlewares(limits, check_host=api_keys is None,
                                                  hosts=hosts, error=_error,
                                                  host_paths=frozenset({"/metrics"}) & open_paths)
    # a body may hold a prompt of max_prompt_bytes plus its JSON (the router's rule too)
    app = web.Application(middlewares=[request_errors(core.metrics.requests), before_auth,
                                       authentication(api_keys, forward_keys, open_paths),
                                       after_auth],
                          client_max_size=max_body_bytes(core.max_prompt_bytes))
    app[CORE_KEY] = core
    forwarder = Forwarder(forward_keys=forward_keys, forward_ssl=forward_ssl,
                          insecure_forward=insecure_forward, router=router)
    app.on_cleanup.append(forwarder.close)
    completions = Completions(core, router=router, forward=forwarder)
    embeddings = EmbeddingsRoute(core, router=router, forward=forwarder)

    async def list_models(request: web.Request) -> web.Response:
        """OpenAI's model list: every resident revision (``status: loaded``) and every standby
        one (``status: standby``, ``standby_reason``: ``IdleUnloaded``, ``Evicted`` or
        ``AwaitingRequest``) — a request for a standby model loads it first. Each card has the
        revision's ``capabilities`` (:func:`~node_agent.serving.capabilities.
        model_capabilities`; a standby card those of its last load here, absent if none)."""
        data = [ModelCard(id=m.model_id, object="model", created=m.created_unix,
                          owned_by="mlx-fleet", revision=m.revision,
                          max_context_tokens=m.max_context_tokens, status="loaded",
                          capabilities=model_capabilities(m, max_choices=core.max_choices))
                for m in core.models()]
        resident = {(m.id, m.revision) for m in data}
        data += [ModelCard(id=m.model_id, object="model", created=m.created_unix,
                           owned_by="mlx-fleet", revision=m.revision,
                           max_context_tokens=m.max_context_tokens, status="standby",
                           standby_reason=m.reason, capabilities=m.capabilities)
                 for m in standby() if (m.model_id, m.revision) not in resident]
        # standby_reason and unknown capabilities left out (a card's only optional fields);
        # inside capabilities a null (tool_parser) is a value
        body = ModelList(object="list", data=data).model_dump()
        for card in body["data"]:
            for field in ("standby_reason", "capabilities"):
                if card[field] is None:
                    del card[field]
        return web.json_response(body)

    async def health_handler(request: web.Request) -> web.Response:
        ok, details = health()
        shown_all = health_details if api_keys is None else keyed(request, api_keys,
                                                                  forward_keys)
        shown = details if shown_all else {
            "status": details.get("status", "ok" if ok else "unhealthy")}
        return web.json_response(shown, status=200 if ok else 503)

    async def metrics_handler(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    document = openapi_document(api_keys=api_keys is not None,
                                metrics_auth=api_keys is not None and metrics_auth,
                                version=_version(), max_choices=core.max_choices)

    async def openapi_handler(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_post("/v1/chat/completions", completions.chat)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_post("/v1/embeddings", embeddings.create)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get(OPENAPI_PATH, openapi_handler)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-fleet")
    except PackageNotFoundError:
        return "0"
