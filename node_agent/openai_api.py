"""The node agent's OpenAI-compatible HTTP API (aiohttp) over :class:`ServingCore`.

Routes:

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON or SSE streaming),
* ``GET /v1/models``, ``GET /health`` (200 healthy / 503 not), ``GET /metrics`` (Prometheus).

Authentication (``api_keys``, :mod:`node_agent.api_keys`): with a key file every request
except ``GET /health`` (and ``GET /metrics`` unless ``metrics_auth``) needs ``Authorization:
Bearer <key>`` with one of its keys or of the fleet-internal ``forward_keys``; otherwise 401
``invalid_request_error`` / ``invalid_api_key`` with ``WWW-Authenticate: Bearer`` (the message
never repeats what was sent). Without a key file the API is open. A forwarded request (below)
carries the first key of ``forward_keys`` as its bearer key, never the client's.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` (malformed JSON, invalid field: ``param`` names it, context overflow:
``code`` ``context_length_exceeded``; ``stream_options`` without ``stream: true``; options this
server does not implement, with ``code`` ``unsupported_parameter``: ``n`` > 1, non-empty
``tools``/``functions``, ``tool_choice``/``function_call`` other than ``"none"``,
``response_format`` other than ``{"type": "text"}``, ``logprobs``/``top_logprobs``), 404 ``model_not_found``, 405, 429 with ``Retry-After``
(seconds), 500 for anything unexpected (the server keeps running), 503 when the model goes away
mid-request or the serving core has failed (``ServingCore.failure``).

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
field), else the node's stable revision (:mod:`node_agent.routing`) — or forwarded, streaming
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
import json
import logging
import ssl
import time
import uuid
from typing import Annotated, Any, Awaitable, Callable, Iterable, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .api_keys import KeyFile, bearer_token, matches
from .serving import (ContextLengthExceeded, GenerationAborted, InvalidPrompt, ModelLoadError,
                      ModelNotLoaded, Overloaded, ServingCore)

__all__ = ["build_app", "ChatCompletionRequest", "CompletionRequest", "CORE_KEY",
           "UNKNOWN_LABEL", "REVISION_HEADER", "SESSION_HEADER", "PIN_HEADER"]

#: Response header naming the revision that served the request.
REVISION_HEADER = "X-Model-Revision"
#: Request header carrying the session key of the canary split (else the ``user`` field).
SESSION_HEADER = "X-Session-ID"
#: Request header a forwarding agent sets: serve exactly this revision, don't split again.
PIN_HEADER = "X-MLX-Fleet-Revision"
#: Paths answered without a key whatever the configuration (``/metrics`` by ``metrics_auth``).
OPEN_PATHS = frozenset({"/health"})
#: Timeout of a forwarded request's connection (seconds); the body streams for as long as it
#: takes.
FORWARD_CONNECT_TIMEOUT = 5.0

log = logging.getLogger(__name__)

CORE_KEY = web.AppKey("mlxfleet_core", ServingCore)
# Request-scoped keys (web.RequestKey where aiohttp has it: 3.11+).
_RequestKey = getattr(web, "RequestKey", None)
_MODEL: Any = _RequestKey("mlxfleet_model", str) if _RequestKey else "mlxfleet_model"
_REVISION: Any = _RequestKey("mlxfleet_revision", str) if _RequestKey else "mlxfleet_revision"
# Set by a streaming handler that saw the client hang up after the 200 header went out.
_HUNG_UP: Any = _RequestKey("mlxfleet_hung_up", bool) if _RequestKey else "mlxfleet_hung_up"
# The model/revision label of requests that name no loaded model (unknown model, malformed body,
# other routes): a constant, so that clients cannot create metric series at will.
UNKNOWN_LABEL = "unknown"

StrictInt = Annotated[int, Field(strict=True)]


# ---------------------------------------------------------------------------------------------
# Request models (unknown fields are ignored)
# ---------------------------------------------------------------------------------------------


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: Annotated[bool, Field(strict=True)] = False


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class _Sampling(_Base):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[StrictInt | None, Field(ge=1)] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    n: Annotated[StrictInt, Field(ge=1)] = 1
    user: str | None = None
    # Accepted only in their "off" spelling (see _unsupported): rejecting them is more honest
    # than silently ignoring what the client asked for.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("must be a number")
        return v


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt | None, Field(ge=1)] = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` body; ``prompt`` is one string."""

    prompt: str


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _error(status: int, message: str, *, type_: str = "invalid_request_error",
           param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status=status, headers=headers)


def _unauthorized(presented: str | None) -> web.Response:
    """401 in OpenAI's shape; the message never contains what was presented."""
    message = ("Incorrect API key provided." if presented is not None else
               "You didn't provide an API key. Provide it in an Authorization header using "
               "Bearer auth (Authorization: Bearer YOUR_KEY).")
    return _error(401, message, code="invalid_api_key",
                  headers={"WWW-Authenticate": "Bearer"})


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


def _unsupported(req: _Sampling) -> web.Response | None:
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
              forward_ssl: ssl.SSLContext | None = None) -> web.Application:
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
    fleet-internal keys, accepted like client keys when ``api_keys`` is set, and the first of
    them sent with every forwarded request; ``metrics_auth``: ``GET /metrics`` needs a key too.
    Both files are re-read when they change (:meth:`KeyFile.current`, a stat per request).
    ``forward_ssl``: how forwarded requests verify an ``https://`` node (default: the system's
    trusted CAs).
    """
    metrics = core.metrics
    open_paths = OPEN_PATHS if metrics_auth else OPEN_PATHS | {"/metrics"}

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        if api_keys is None or request.path in open_paths:
            return await handler(request)
        digests = api_keys.current()
        if forward_keys is not None:
            digests += forward_keys.current()
        presented = bearer_token(request.headers.get("Authorization"))
        if not matches(presented, digests):
            return _unauthorized(presented)
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

    # errors outermost: a 401 is counted in the request metrics like any other answer
    app = web.Application(middlewares=[errors, authenticate])
    app[CORE_KEY] = core

    sessions: dict[str, Any] = {}

    async def client_session() -> Any:
        import aiohttp

        if "s" not in sessions:
            sessions["s"] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=FORWARD_CONNECT_TIMEOUT),
                connector=aiohttp.TCPConnector(ssl=forward_ssl if forward_ssl else True))
        return sessions["s"]

    async def close_sessions(_: web.Application) -> None:
        if "s" in sessions:
            await sessions.pop("s").close()

    app.on_cleanup.append(close_sessions)
    refused_by: set[str] = set()  # forward targets that answered 401 (logged once each)

    async def forward(request: web.Request, routed: Any, body: bytes) -> web.StreamResponse:
        """Relay the request to ``routed.route.forward`` pinned to its revision; stream the
        answer back as it comes. The serving node counts the request in its statistics (it
        sees the tokens); this node counts only what the serving node cannot see — a node that
        can't be reached or drops the connection: a 503 here, a candidate failure for the
        statistics (the client saw a server error)."""
        import aiohttp

        t0 = time.perf_counter()
        url = routed.route.forward.rstrip("/") + request.path
        headers = {"Content-Type": "application/json", PIN_HEADER: routed.route.revision}
        if forward_keys is not None:
            forward_keys.current()  # a rotated file is in force for this request already
            headers["Authorization"] = f"Bearer {forward_keys.first}"
        resp: web.StreamResponse | None = None
        failed = False  # counted here only when the serving node could not be reached
        try:
            session = await client_session()
            async with session.post(url, data=body, headers=headers) as up:
                target = routed.route.forward
                if up.status == 401 and target not in refused_by:
                    refused_by.add(target)
                    log.warning("node %s refused a forwarded request (401): check that both "
                                "nodes have the same --forward-key-file", target)
                elif up.status != 401:
                    refused_by.discard(target)
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items()
                    if k.lower() in {"content-type", "cache-control", "retry-after",
                                     "www-authenticate", REVISION_HEADER.lower()}})
                await resp.prepare(request)
                async for part in up.content.iter_any():
                    await resp.write(part)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failed = True
            if resp is not None:  # the header went out: end the stream with an error event
                raise ConnectionResetError(f"forwarding to {url} failed: {e}") from e
            return _error(503, f"the node serving revision {routed.route.revision} is not "
                          f"reachable: {type(e).__name__}", type_="server_error",
                          code="unavailable")
        finally:
            tm = router()
            if tm is not None and failed:
                tm.record(routed, latency_s=time.perf_counter() - t0, ttft_s=None,
                          completion_tokens=0, decode_seconds=None, failed=failed)

    async def parse(request: web.Request, cls: type[_Sampling]) -> _Sampling | web.Response:
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

    async def complete(request: web.Request, req: _Sampling, kind: Literal["chat", "text"],
                       max_tokens: int | None, *, messages: list[dict] | None = None,
                       prompt: str | None = None) -> web.StreamResponse:
        if core.failure is not None:
            return _error(503, f"this node cannot serve: {core.failure}", type_="server_error",
                          code="unavailable")
        not_found = _error(404, f"The model '{req.model}' does not exist or is not loaded on "
                           "this node", param="model", code="model_not_found")
        tm = router()
        routed = None
        revision: str | None = None
        if tm is not None:
            routed = tm.route(req.model, session_header=request.headers.get(SESSION_HEADER),
                              user=req.user, pinned=request.headers.get(PIN_HEADER, ""))
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
                                  f"unloaded while idle and could not be reloaded: {e.reason}: "
                                  f"{e.message}", type_="server_error",
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
        except InvalidPrompt as e:
            return _error(400, str(e), param="messages" if kind == "chat" else "prompt",
                          code="invalid_prompt", headers=headers)
        except GenerationAborted as e:
            outcome.done(failed=True)
            return _error(503, str(e), type_="server_error", code="unavailable",
                          headers=headers)

        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        async with gen:
            if req.stream:
                return await stream(request, req, kind, gen, rid, created, headers, outcome)
            parts: list[str] = []
            try:
                async for chunk in gen:
                    outcome.token(chunk.completion_tokens)
                    parts.append(chunk.text)
                    if _client_gone(request):
                        gen.cancel()
                        raise ConnectionResetError("client disconnected")
            except GenerationAborted as e:
                outcome.done(failed=True)
                return _error(503, str(e), type_="server_error", code="unavailable",
                              headers=headers)
        outcome.done(failed=False)
        text = "".join(parts)
        usage = _usage(gen.prompt_tokens, gen.completion_tokens)
        if kind == "chat":
            body = {"id": rid, "object": "chat.completion", "created": created,
                    "model": req.model,
                    "choices": [{"index": 0,
                                 "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": gen.finish_reason}],
                    "usage": usage}
        else:
            body = {"id": rid, "object": "text_completion", "created": created,
                    "model": req.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": gen.finish_reason}],
                    "usage": usage}
        return web.json_response(body, headers=headers)

    async def stream(request: web.Request, req: _Sampling, kind: str, gen: Any, rid: str,
                     created: int, headers: dict[str, str], outcome: "_Outcome"
                     ) -> web.StreamResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def event(choices: list[dict], usage: dict | None = None) -> bytes:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                    "model": req.model, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        def choice(text: str, finish: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta = {"role": "assistant", "content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        try:
            if kind == "chat":
                await resp.write(event([choice("", None, first=True)]))
            try:
                async for chunk in gen:
                    outcome.token(chunk.completion_tokens)
                    if chunk.text or chunk.finish_reason is not None:
                        await resp.write(event([choice(chunk.text, chunk.finish_reason)]))
            except GenerationAborted as e:
                outcome.done(failed=True)
                err = {"error": {"message": str(e), "type": "server_error", "param": None,
                                 "code": "unavailable"}}
                await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                await resp.write_eof()
                return resp
            outcome.done(failed=False)
            if include_usage:
                await resp.write(event([], _usage(gen.prompt_tokens, gen.completion_tokens)))
            await resp.write(b"data: [DONE]\n\n")
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
        data = [{"id": m.model_id, "object": "model", "created": m.created_unix,
                 "owned_by": "mlx-fleet", "revision": m.revision,
                 "max_context_tokens": m.max_context_tokens, "status": "loaded"}
                for m in core.models()]
        resident = {(m["id"], m["revision"]) for m in data}
        data += [{"id": m.model_id, "object": "model", "created": m.created_unix,
                  "owned_by": "mlx-fleet", "revision": m.revision,
                  "max_context_tokens": m.max_context_tokens, "status": "standby",
                  "standby_reason": m.reason}
                 for m in standby() if (m.model_id, m.revision) not in resident]
        return web.json_response({"object": "list", "data": data})

    async def health_handler(request: web.Request) -> web.Response:
        ok, details = health()
        return web.json_response(details, status=200 if ok else 503)

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
    return app
