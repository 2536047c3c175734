"""The node agent's OpenAI-compatible HTTP API (aiohttp) over :class:`ServingCore`.

Routes:

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON or SSE streaming),
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
``code`` ``context_length_exceeded``; ``stream_options`` without ``stream: true``; options this
server does not implement, with ``code`` ``unsupported_parameter``: ``n`` > 1, non-empty
``tools``/``functions``, ``tool_choice``/``function_call`` other than ``"none"``,
``response_format`` other than ``{"type": "text"}``, ``logprobs``/``top_logprobs``), 404 ``model_not_found``, 405, 429 with ``Retry-After``
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

import asyncio
import logging
import ssl
import time
import uuid
from typing import Any, Awaitable, Callable, Iterable, Literal

from aiohttp import ClientSession, web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.http_errors import unauthorized as _unauthorized
from mlx_fleet.exposure import INSECURE_FORWARD, may_send_key
from mlx_fleet.routing.api_keys import KeyFile, bearer_token, matches
from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER, SESSION_HEADER
from mlx_fleet.routing.proxy import StreamCut, UpstreamError, client_session, proxy

from .api_models import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest,
                         CompletionRequest, ErrorDetail, ErrorResponse, ModelCard, ModelList,
                         PromptTokensDetails, SamplingRequest, TextChoice, TextCompletion, Usage)
from .http_hygiene import HttpLimits, hygiene_middlewares
from .openapi import OPENAPI_PATH, openapi_document
from .sse import DONE, StreamEncoder, data_event
from .serving import (ContextLengthExceeded, GenerationAborted, InvalidPrompt, ModelLoadError,
                      ModelNotLoaded, Overloaded, PromptTooLarge, ServingCore,
                      StreamBufferOverflow)

__all__ = ["build_app", "ChatCompletionRequest", "CompletionRequest", "CORE_KEY",
           "UNKNOWN_LABEL"]

#: Paths answered without a key whatever the configuration (``/metrics`` by ``metrics_auth``).
OPEN_PATHS = frozenset({"/health", OPENAPI_PATH})

log = logging.getLogger(__name__)

CORE_KEY = web.AppKey("mlxfleet_core", ServingCore)
# Request-scoped keys (web.RequestKey where aiohttp has it: 3.11+).
_RequestKey = getattr(web, "RequestKey", None)
_MODEL: Any = _RequestKey("mlxfleet_model", str) if _RequestKey else "mlxfleet_model"
_REVISION: Any = _RequestKey("mlxfleet_revision", str) if _RequestKey else "mlxfleet_revision"
# True when the request may pin a revision (PIN_HEADER): it authenticated with a
# fleet-internal forward key, or the API has no keys at all (set by `authenticate`).
_FLEET_INTERNAL: Any = (_RequestKey("mlxfleet_fleet_internal", bool) if _RequestKey
                        else "mlxfleet_fleet_internal")
# Set by a streaming handler that saw the client hang up after the 200 header went out.
_HUNG_UP: Any = _RequestKey("mlxfleet_hung_up", bool) if _RequestKey else "mlxfleet_hung_up"
# The model/revision label of requests that name no loaded model (unknown model, malformed body,
# other routes): a constant, so that clients cannot create metric series at will.
UNKNOWN_LABEL = "unknown"

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _validation_error(e: ValidationError) -> web.Response:
    err = e.errors(include_url=False)[0]
    if err.get("type") == "json_invalid":
        return _error(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if not _is_type_tag(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if param is None and err.get("type") == "model_type":
        msg = "the request body must be a JSON object"
    return _error(400, f"{param + ': ' if param else ''}{msg}", param=param,
                  code="invalid_value")


def _unsupported(req: SamplingRequest) -> web.Response | None:
    """400 for options this server cannot honour, naming the first such parameter."""
    if req.stream_options is not None and not req.stream:
        return _error(400, "stream_options: only allowed when stream is true",
                      param="stream_options", code="invalid_value")
    off = {
        "n": req.n == 1,
        "tools": not req.tools,
        "tool_choice": req.tool_choice in (None, "none"),
        "functions": not req.functions,
        "function_call": req.function_call in (None, "none"),
        "response_format": req.response_format in (None, {"type": "text"}),
        "logprobs": req.logprobs in (None, False, 0),
        "top_logprobs": req.top_logprobs in (None, 0),
    }
    for param, ok in off.items():
        if not ok:
            what = "n > 1" if param == "n" else param
            return _error(400, f"{param}: {what} is not supported by this server",
                          param=param, code="unsupported_parameter")
    return None


def _is_type_tag(part: object) -> bool:
    """pydantic puts union-member names (``str``, ``list[str]`` ...) into error locations."""
    if isinstance(part, int):
        return False
    p = str(part)
    return ("[" in p or "-" in p or p in {"str", "int", "float", "bool", "none",
                                          "ContentPart", "ChatMessage"})


def _usage(gen: Any) -> Usage:
    """OpenAI's ``usage`` of a finished generation, with
    ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prompt cache)."""
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                 total_tokens=gen.prompt_tokens + gen.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens))


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class _Outcome:
    """Times one request for the per-revision statistics (only when it is under a split):
    end-to-end latency, time to first token, decode time of its tokens; :meth:`done` reports it
    once. A request that never reaches :meth:`done` (the client hung up) is not counted."""

    __slots__ = ("tm", "routed", "t0", "first", "last", "tokens", "reported")

    def __init__(self, tm: Any, routed: Any) -> None:
        self.tm, self.routed = tm, routed
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.reported = False

    def token(self, completion_tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens = completion_tokens

    def done(self, *, failed: bool) -> None:
        if self.reported or self.tm is None or self.routed is None:
            return
        self.reported = True
        now = time.perf_counter()
        self.tm.record(self.routed, latency_s=now - self.t0,
                       ttft_s=None if self.first is None else self.first - self.t0,
                       completion_tokens=self.tokens,
                       decode_seconds=None if self.first is None or self.last is None
                       else self.last - self.first, failed=failed)


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


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

    ``limits``: the server's HTTP hygiene (:mod:`node_agent.http_hygiene`: body timeout,
    ``application/json`` POST bodies, CORS origins); without ``api_keys`` a request's ``Host``
    must be loopback or one of ``hosts`` (421 otherwise). ``GET /health`` answers its
    ``details`` only to a request with a valid key, or with no keys configured when
    ``health_details`` (the agent: it listens on loopback only); anyone else gets
    ``{"status": ...}`` alone (no lease, assignments or errors).
    """
    metrics = core.metrics
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        if api_keys is None:
            request[_FLEET_INTERNAL] = True  # no keys at all: nothing to tell apart
            return await handler(request)
        if request.path in open_paths:
            return await handler(request)
        presented = bearer_token(request.headers.get("Authorization"))
        # both sets are always compared (no early exit: the time does not say which matched)
        client = matches(presented, api_keys.current())
        internal = forward_keys is not None and matches(presented, forward_keys.current())
        if not (client or internal):
            return _unauthorized(presented)
        request[_FLEET_INTERNAL] = internal
        return await handler(request)

    @web.middleware
    async def errors(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if request.get(_HUNG_UP):
                # a stream the client left mid-way: its 200 header is already out, but the
                # request did not complete
                status = 499
                log.info("client disconnected during %s %s", request.method, request.path)
            return resp
        except web.HTTPException as e:
            status = e.status
            if e.status < 400:
                raise
            headers = {k: v for k, v in e.headers.items() if k.lower() in {"allow"}}
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            code = {404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(e.status)
            return _error(e.status, e.reason or "error", type_=type_, code=code,
                          headers=headers)
        except ConnectionResetError:
            # the client hung up before the response: not a server error, so no traceback
            status = 499
            log.info("client disconnected during %s %s", request.method, request.path)
            return web.Response(status=499)  # aiohttp drops it: the transport is closing
        except asyncio.CancelledError:
            # handler_cancellation: aiohttp cancels the handler when the client disconnects
            status = 499
            log.info("client disconnected during %s %s", request.method, request.path)
            raise
        except Exception:  # noqa: BLE001 - never let a request take the server down
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return _error(500, "internal server error", type_="server_error",
                          code="internal_error")
        finally:
            route = request.match_info.route
            endpoint = (route.resource.canonical if route is not None
                        and route.resource is not None else "unmatched")
            metrics.requests.labels(request.get(_MODEL, UNKNOWN_LABEL),
                                    request.get(_REVISION, UNKNOWN_LABEL),
                                    endpoint, str(status)).inc()

    # errors outermost: a 401 is counted in the request metrics like any other answer; the
    # hygiene checks (Host, CORS, Content-Type) come before authentication, the body read
    # (under its timeout) after it
    before_auth, after_auth = hygiene_middlewares(limits, check_host=api_keys is None,
                                                  hosts=hosts, error=_error)
    # a body may hold a prompt of max_prompt_bytes plus its JSON (aiohttp's default: 1 MiB)
    app = web.Application(middlewares=[errors, before_auth, authenticate, after_auth],
                          client_max_size=max(2**20, 2 * core.max_prompt_bytes))
    app[CORE_KEY] = core

    sessions: dict[str, ClientSession] = {}

    def forward_session() -> ClientSession:
        if "s" not in sessions:  # created on the running loop, by the first forward
            sessions["s"] = client_session(forward_ssl)
        return sessions["s"]

    async def close_sessions(_: web.Application) -> None:
        if "s" in sessions:
            await sessions.pop("s").close()

    app.on_cleanup.append(close_sessions)
    refused_by: set[str] = set()  # forward targets that answered 401 (logged once each)
    cleartext_refused: set[str] = set()  # http:// targets not sent the key (logged once each)

    async def forward(request: web.Request, routed: Any, body: bytes) -> web.StreamResponse:
        """Relay the request to ``routed.route.forward`` pinned to its revision; stream the
        answer back as it comes (:func:`mlx_fleet.routing.proxy.proxy`). The serving node
        counts the request in its statistics (it sees the tokens); this node counts only what
        the serving node cannot see — a node that can't be reached or drops the connection: a
        503 here (or, once the answer's header went out, a cut stream), a candidate failure for
        the statistics (the client saw a server error)."""
        t0 = time.perf_counter()
        target = routed.route.forward
        headers = {"Content-Type": "application/json", PIN_HEADER: routed.route.revision}
        if forward_keys is not None and may_send_key(target, insecure=insecure_forward):
            forward_keys.current()  # a rotated file is in force for this request already
            headers["Authorization"] = f"Bearer {forward_keys.first}"
        elif forward_keys is not None and target not in cleartext_refused:
            cleartext_refused.add(target)
            log.warning("not sending the forward key to %s over plain http (give the nodes "
                        "--tls-cert-file, or accept the risk with %s)", target,
                        INSECURE_FORWARD)
        failed = False  # counted here only when the serving node could not be reached
        try:
            resp = await proxy(request, forward_session(), target.rstrip("/") + request.path,
                               body=body, headers=headers)
        except UpstreamError as e:
            failed = True
            log.warning("forwarding to %s failed: %s", target, e.reason)
            return _error(503, f"the node serving revision {routed.route.revision} is not "
                          f"reachable", type_="server_error", code="unavailable")
        except StreamCut:
            failed = True
            raise
        finally:
            tm = router()
            if tm is not None and failed:
                tm.record(routed, latency_s=time.perf_counter() - t0, ttft_s=None,
                          completion_tokens=0, decode_seconds=None, failed=failed)
        if resp.status == 401 and target not in refused_by:
            refused_by.add(target)
            log.warning("node %s refused a forwarded request (401): check that both nodes "
                        "have the same --forward-key-file", target)
        elif resp.status != 401:
            refused_by.discard(target)
        return resp

    def aborted(e: GenerationAborted) -> str:
        """A client's message for ``e``: never the serving core's failure text (it is in
        the log and in /health for a keyed request)."""
        return "this node's serving core failed" if core.failure is not None else e.public

    async def parse(request: web.Request, cls: type[SamplingRequest]) -> SamplingRequest | web.Response:
        body = await request.read()
        try:
            req = cls.model_validate_json(body)
        except ValidationError as e:
            return _validation_error(e)
        return _unsupported(req) or req

    async def chat(request: web.Request) -> web.StreamResponse:
        req = await parse(request, ChatCompletionRequest)
        if isinstance(req, web.Response):
            return req
        assert isinstance(req, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await complete(request, req, "chat", max_tokens, messages=messages)

    async def completions(request: web.Request) -> web.StreamResponse:
        req = await parse(request, CompletionRequest)
        if isinstance(req, web.Response):
            return req
        assert isinstance(req, CompletionRequest)
        return await complete(request, req, "text", req.max_tokens, prompt=req.prompt)

    async def complete(request: web.Request, req: SamplingRequest, kind: Literal["chat", "text"],
                       max_tokens: int | None, *, messages: list[dict] | None = None,
                       prompt: str | None = None) -> web.StreamResponse:
        if core.failure is not None:
            return _error(503, "this node cannot serve: its serving core failed",
                          type_="server_error", code="unavailable")
        not_found = _error(404, f"The model '{req.model}' does not exist or is not loaded on "
                           "this node", param="model", code="model_not_found")
        tm = router()
        routed = None
        revision: str | None = None
        if tm is not None:
            pinned = request.headers.get(PIN_HEADER, "") if request.get(_FLEET_INTERNAL) else ""
            routed = tm.route(req.model, session_header=request.headers.get(SESSION_HEADER),
                              user=req.user, pinned=pinned)
            if routed is None:
                return not_found
            if routed.route.forward:
                return await forward(request, routed, await request.read())
            revision = routed.route.revision
            if routed.standby:  # unloaded while idle: reload it (once), then serve
                try:
                    await tm.ensure_loaded(req.model, revision)
                except Overloaded as e:
                    return _error(429, f"Too many requests: {e}", type_="rate_limit_error",
                                  code="overloaded",
                                  headers={"Retry-After": str(e.retry_after_seconds),
                                           REVISION_HEADER: revision})
                except ModelNotLoaded:
                    return not_found
                except ModelLoadError as e:
                    return _error(503, f"revision {revision} of model '{req.model}' was "
                                  f"unloaded while idle and could not be reloaded ({e.reason})",
                                  type_="server_error",
                                  code="model_reload_failed",
                                  headers={REVISION_HEADER: revision})
            tm.touch(req.model, revision)
        try:
            info = core.model_info(req.model, revision)
        except ModelNotLoaded:
            return not_found
        # labelled only now that the model is known to be loaded (bounded label values)
        request[_MODEL] = req.model
        request[_REVISION] = info.revision
        headers = {REVISION_HEADER: info.revision}  # on every response from here on
        outcome = _Outcome(tm, routed)
        try:
            gen = await core.generate(req.model, revision=info.revision, prompt=prompt,
                                      messages=messages,
                                      max_tokens=max_tokens, temperature=req.temperature,
                                      top_p=req.top_p, stop=req.stop, seed=req.seed)
        except ModelNotLoaded:
            return _error(404, f"The model '{req.model}' is not loaded on this node",
                          param="model", code="model_not_found")
        except Overloaded as e:
            return _error(429, f"Too many requests: {e}", type_="rate_limit_error",
                          code="overloaded",
                          headers={"Retry-After": str(e.retry_after_seconds), **headers})
        except ContextLengthExceeded as e:
            return _error(400, str(e), param="messages" if kind == "chat" else "prompt",
                          code="context_length_exceeded", headers=headers)
        except PromptTooLarge as e:
            return _error(400, str(e), param="messages" if kind == "chat" else "prompt",
                          code="prompt_too_large", headers=headers)
        except InvalidPrompt as e:
            return _error(400, str(e), param="messages" if kind == "chat" else "prompt",
                          code="invalid_prompt", headers=headers)
        except GenerationAborted as e:
            outcome.done(failed=True)
            return _error(503, aborted(e), type_="server_error", code="unavailable",
                          headers=headers)

        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        async with gen:
            if req.stream:
                return await stream(request, req, kind, gen, rid, created, headers, outcome)
            parts: list[str] = []
            try:
                while batch := await gen.next_batch():
                    outcome.token(batch[-1].completion_tokens)
                    parts.extend(chunk.text for chunk in batch)
                    if _client_gone(request):
                        gen.cancel()
                        raise ConnectionResetError("client disconnected")
            except GenerationAborted as e:
                outcome.done(failed=True)
                return _error(503, aborted(e), type_="server_error", code="unavailable",
                              headers=headers)
        outcome.done(failed=False)
        text = "".join(parts)
        usage = _usage(gen)
        body: ChatCompletion | TextCompletion
        if kind == "chat":
            body = ChatCompletion(
                id=rid, object="chat.completion", created=created, model=req.model,
                choices=[ChatChoice(index=0, message=AssistantMessage(role="assistant",
                                                                      content=text),
                                    logprobs=None, finish_reason=gen.finish_reason)],
                usage=usage)
        else:
            body = TextCompletion(
                id=rid, object="text_completion", created=created, model=req.model,
                choices=[TextChoice(index=0, text=text, logprobs=None,
                                    finish_reason=gen.finish_reason)],
                usage=usage)
        return web.json_response(body.model_dump(), headers=headers)

    async def stream(request: web.Request, req: SamplingRequest, kind: Literal["chat", "text"],
                     gen: Any, rid: str,
                     created: int, headers: dict[str, str], outcome: "_Outcome"
                     ) -> web.StreamResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        events = StreamEncoder(kind, rid, created, req.model, include_usage)
        try:
            if kind == "chat":
                await resp.write(events.first())
            try:
                # every chunk already waiting goes out in one write (a stream that fell behind
                # catches up in one wake-up); the events are those of one chunk each
                while batch := await gen.next_batch():
                    outcome.token(batch[-1].completion_tokens)
                    data = events.chunks(batch)
                    if data:
                        await resp.write(data)
            except GenerationAborted as e:
                slow = isinstance(e, StreamBufferOverflow)
                if not slow:  # a slow client is not a failure of the revision
                    outcome.done(failed=True)
                err = ErrorResponse(error=ErrorDetail(
                    message=aborted(e), type="server_error", param=None,
                    code="stream_buffer_overflow" if slow else "unavailable"))
                await resp.write(data_event(err.model_dump_json().encode()))
                await resp.write_eof()
                return resp
            outcome.done(failed=False)
            if include_usage:
                await resp.write(events.usage(_usage(gen).model_dump()))
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream: stop generating (the caller's `async with`
            # cancels too) and end quietly; the middleware counts it as 499 (not the 200
            # already sent) and logs it.
            gen.cancel()
            request[_HUNG_UP] = True
        return resp

    async def list_models(request: web.Request) -> web.Response:
        """OpenAI's model list: every resident revision (``status: loaded``) and every standby
        one (``status: standby``, ``standby_reason``: ``IdleUnloaded``, ``Evicted`` or
        ``AwaitingRequest``) — a request for a standby model loads it first."""
        data = [ModelCard(id=m.model_id, object="model", created=m.created_unix,
                          owned_by="mlx-fleet", revision=m.revision,
                          max_context_tokens=m.max_context_tokens, status="loaded")
                for m in core.models()]
        resident = {(m.id, m.revision) for m in data}
        data += [ModelCard(id=m.model_id, object="model", created=m.created_unix,
                           owned_by="mlx-fleet", revision=m.revision,
                           max_context_tokens=m.max_context_tokens, status="standby",
                           standby_reason=m.reason)
                 for m in standby() if (m.model_id, m.revision) not in resident]
        # standby_reason only on standby cards (exclude_none: no other field can be None)
        return web.json_response(ModelList(object="list", data=data).model_dump(
            exclude_none=True))

    def keyed(request: web.Request) -> bool:
        """The request presents one of the client or fleet-internal keys."""
        presented = bearer_token(request.headers.get("Authorization"))
        client = api_keys is not None and matches(presented, api_keys.current())
        internal = forward_keys is not None and matches(presented, forward_keys.current())
        return client or internal

    async def health_handler(request: web.Request) -> web.Response:
        ok, details = health()
        shown = details if (health_details if api_keys is None else keyed(request)) else {
            "status": details.get("status", "ok" if ok else "unhealthy")}
        return web.json_response(shown, status=200 if ok else 503)

    async def metrics_handler(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        resp.charset = "utf-8"
        return resp

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    document = openapi_document(api_keys=api_keys is not None,
                                metrics_auth=api_keys is not None and metrics_auth,
                                version=_version())

    async def openapi_handler(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get(OPENAPI_PATH, openapi_handler)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-fleet")
    except PackageNotFoundError:
        return "0"
