"""OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: one definition for
every OpenAI-compatible API of the fleet (the node agent's, the fleet router's).

The HTTP answers built from it are :mod:`mlx_fleet.http_errors`'s. Pure: pydantic only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ErrorDetail", "ErrorResponse", "unauthorized_message"]


class ErrorDetail(BaseModel):
    """``type``: ``invalid_request_error`` (4xx but 429), ``rate_limit_error`` (429),
    ``server_error`` (5xx). ``param``: the request field at fault, or null. ``code``: a
    machine-readable reason (``invalid_value``, ``invalid_json``, ``unsupported_parameter``,
    ``context_length_exceeded``, ``model_not_found``, ``invalid_api_key``, ``overloaded``,
    ``unavailable`` ...) or null."""

    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer of the API, in OpenAI's shape."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


def unauthorized_message(presented: str | None) -> str:
    """The message of a 401: OpenAI's wording; it never contains what was presented."""
    return ("Incorrect API key provided." if presented is not None else
            "You didn't provide an API key. Provide it in an Authorization header using "
            "Bearer auth (Authorization: Bearer YOUR_KEY).")
