"""HTTP error answers in OpenAI's shape (aiohttp), shared by the node agent's API and the fleet
router: the body is :class:`mlx_fleet.openai_errors.ErrorResponse`.
"""

from __future__ import annotations

from aiohttp import web

from mlx_fleet.openai_errors import ErrorDetail, ErrorResponse, unauthorized_message

__all__ = ["error_response", "unauthorized"]


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
