"""HTTP error answers in OpenAI's shape (aiohttp), shared by the node agent's API and the fleet
router: the body is :class:`mlx_fleet.openai_errors.ErrorResponse`; :func:`errors_middleware` is
their outermost middleware (every answer in that shape, nothing internal in a 500, one count per
request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from mlx_fleet.openai_errors import ErrorDetail, ErrorResponse, unauthorized_message

__all__ = ["error_response", "unauthorized", "errors_middleware"]


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response with ``status`` and body ``{"error": {"message", "type", "param",
    "code"}}``; ``headers`` added (e.g. ``Retry-After``)."""
    body = ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    return web.json_response(body.model_dump(), status=status, headers=headers)


def unauthorized(presented: str | None) -> web.Response:
    """401 ``invalid_api_key`` with ``WWW-Authenticate: Bearer``; the message never contains
    what was presented (``presented``: the bearer token sent, None when none was)."""
    return error_response(401, unauthorized_message(presented), code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: ``code`` of an :class:`aiohttp.web.HTTPException` turned into an error body.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def errors_middleware(*, log: logging.Logger, count: Callable[[web.Request, int, float], None],
                      cut: Callable[[web.Request], bool] = lambda request: False,
                      hung_up: Callable[[web.Request], bool] = lambda request: False,
                      clock: Callable[[], float] = time.monotonic) -> Any:
    """The outermost aiohttp middleware of the agent's API and the fleet router: every answer
    leaves in OpenAI's shape, and each request is counted once.

    * an :class:`aiohttp.web.HTTPException` of status ≥ 400 → :func:`error_response` with its
      reason (404 ``not_found``, 405 ``method_not_allowed`` with ``Allow``, 413
      ``request_too_large`` naming the limit);
    * a client that hung up (``ConnectionResetError``, or the handler cancelled by aiohttp's
      ``handler_cancellation``) → status 499, one INFO line ``client disconnected during METHOD
      path`` (no traceback); when ``cut(request)`` — the upstream's answer broke off after its
      first byte, not the client's doing — 502 and ``upstream answer cut during …``;
    * a response whose client left mid-stream (``hung_up(request)``) is counted 499;
    * anything else raised → 500 ``internal_error`` without the exception's text (logged with
      its traceback on ``log``).

    ``count(request, status, seconds)`` is called once per request, whatever happened
    (``seconds``: on ``clock``, from the middleware's start)."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = clock()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            if hung_up(request):
                # a stream the client left mid-way: its 200 header is already out, but the
                # request did not complete
                status = 499
                log.info("client disconnected during %s %s", request.method, request.path)
            return resp
        except web.HTTPException as e:
            status = e.status
            if e.status < 400:
                raise
            message = (e.text if e.status == 413 and e.text and not e.text.startswith("413")
                       else e.reason) or "error"
            return error_response(
                e.status, message,
                type_="invalid_request_error" if e.status < 500 else "server_error",
                code=_HTTP_CODES.get(e.status),
                headers={k: v for k, v in e.headers.items() if k.lower() == "allow"})
        except (ConnectionResetError, asyncio.CancelledError) as e:
            # the client left (499), or an upstream's answer broke off mid-way (502)
            status = 502 if cut(request) else 499
            log.info("%s during %s %s", "upstream answer cut" if status == 502
                     else "client disconnected", request.method, request.path)
            if isinstance(e, asyncio.CancelledError):
                raise
            return web.Response(status=499)  # aiohttp drops it: the transport is closing
        except Exception:  # noqa: BLE001 - never let a request take the server down
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return error_response(500, "internal server error", type_="server_error",
                                  code="internal_error")
        finally:
            count(request, status, clock() - started)

    return errors
