"""The agent API's OpenAPI 3.1 document (``GET /openapi.json``): a pure function.

Built from the pydantic models the server itself validates requests with and builds responses
through (:mod:`node_agent.api_models`, ``pydantic.json_schema.models_json_schema``; JSON
Schema 2020-12 is OpenAPI 3.1's schema dialect), so it cannot drift from what the server does.
The paths, statuses and headers below mirror :func:`node_agent.openai_api.build_app`'s routes;
``tests/test_openapi.py`` runs schemathesis against the live app with this document to keep
them honest (every answer's status, content type and body are documented).

``info.description`` holds the capability table
(:func:`mlx_fleet.capabilities.rules_markdown`): which request fields need which capability of
the serving model (``GET /v1/models`` ``capabilities``), refused with a 400 otherwise.

It reflects the app's configuration: with API keys the ``/v1/*`` operations (and
``/metrics`` with ``metrics_auth``) declare bearer authentication and a 401; ``/health`` and
``/openapi.json`` are always open.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from mlx_fleet.capabilities import rules_markdown
from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER, SESSION_HEADER

from .api_models import REQUEST_MODELS

from .api_responses import RESPONSE_MODELS

__all__ = ["openapi_document", "OPENAPI_PATH", "TITLE", "STREAM_DONE"]

#: Where the app serves the document.
OPENAPI_PATH = "/openapi.json"
TITLE = "mlx-fleet node agent: OpenAI-compatible API"
_REF = "#/components/schemas/{model}"



def _schemas() -> dict[str, Any]:
    _, defs = models_json_schema(
        [(m, "validation") for m in REQUEST_MODELS]
        + [(m, "serialization") for m in RESPONSE_MODELS],
        ref_template=_REF)
    return defs.get("$defs", {})


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    if headers:
        out["headers"] = headers
    return out


_REVISION = {"description": "The model revision that served (or refused) the request.",
             "schema": {"type": "string"}}
_RETRY_AFTER = {"description": "Seconds to wait before retrying.",
                "schema": {"type": "string"}}


#: ``info.description``: what the API accepts beyond the schemas, with the capability table.
_DESCRIPTION = (
    "OpenAI-compatible API of one Mac's node agent. Every accepted field is in the request "
    "schemas below; any other field of a request body (or of its `stream_options`, `tools`, "
    "`tool_choice`, `response_format`) is a 400 `invalid_request_error` with `code` "
    "`unsupported_parameter` naming it (\"Unrecognized request argument supplied\", as "
    "OpenAI answers). OpenAI fields this server does not apply (penalties, `logit_bias`, "
    "`echo`, `best_of`, `suffix`, `store`, ...) are accepted only in the spelling that asks "
    "for nothing, as each one's description says, else the same 400; `metadata`, "
    "`prompt_cache_key` and `safety_identifier` are accepted and change nothing. Nothing is "
    "accepted and then ignored.\n\n"
    "**Capabilities.** Some fields need a capability of the model revision that serves the "
    "request; `GET /v1/models` shows each revision's `capabilities`. A request that needs one "
    "the revision lacks is answered 400 `invalid_request_error` with `param` naming the field "
    "and `code` `unsupported_parameter` (`unsupported_value` when only the bound is too small; "
    "`wrong_model_task`, `param` `model`, when the model is served for another task than the "
    "endpoint's); the switched-off spellings (`tools: []`, "
    "`tool_choice: \"none\"`, `response_format: {\"type\": \"text\"}`, `logprobs: false`, "
    "`n: 1`) are always accepted. The fleet router answers the same when no Mac has it. The "
    "legacy `functions` / `function_call` are refused by every model (use `tools` / "
    "`tool_choice`).\n\n"
    + rules_markdown())

#: The end of a stream: ``data: [DONE]``.
STREAM_DONE = "[DONE]"


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1 with a sequential media type: ``schema``
    describes each event): ``data`` is ``[DONE]`` or JSON, a chunk or, when the generation
    fails mid-stream, an error."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": STREAM_DONE},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}]}}}


def _completion(request: str, response: str, chunk: str, summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [
            {"name": SESSION_HEADER, "in": "header", "required": False,
             "schema": {"type": "string"},
             "description": "Session key of a canary split (else the body's `user`)."},
            {"name": PIN_HEADER, "in": "header", "required": False,
             "schema": {"type": "string"},
             "description": "Fleet-internal: serve exactly this revision. Honoured only from "
                            "the fleet-internal forward key (or when the API has no keys); "
                            "ignored otherwise."},
        ],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion: JSON, or with `stream: true` server-sent "
                                   "events (`data: <chunk JSON>` ... `data: [DONE]`; a "
                                   "generation that fails mid-stream ends with `data: "
                                   "<ErrorResponse JSON>`).",
                    "headers": {REVISION_HEADER: _REVISION},
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _event(chunk)}}},
            "400": _error("Malformed JSON, an invalid field (`param` names it), an option "
                          "the serving model's capabilities lack (`unsupported_parameter`, or "
                          "`unsupported_value` for a bound; `param` names the field: see the "
                          "capability table above), a prompt over the context, or over "
                          "`--max-prompt-bytes` (`prompt_too_large`), tools or a response "
                          "format that cannot be served as asked, a JSON schema using a keyword "
                          "constrained decoding cannot enforce (`invalid_schema`)."),
            "404": _error("The model is not loaded on this node (`model_not_found`)."),
            "408": _error("The body did not arrive within `--body-timeout-seconds` "
                          "(`request_timeout`)."),
            "413": _error("Request body over 1 MiB (or twice `--max-prompt-bytes`)."),
            "415": _error("The body is not `Content-Type: application/json` "
                          "(`unsupported_media_type`)."),
            "421": _error("Without API keys: a `Host` this node does not answer for "
                          "(`misdirected_request`)."),
            "429": _error("Too many requests queued (`overloaded`).",
                          {"Retry-After": _RETRY_AFTER}),
            "503": _error("The node cannot serve: the model went away, the serving core "
                          "failed, a reload failed or a forward target is unreachable."),
        },
    }


def _embeddings() -> dict[str, Any]:
    """``POST /v1/embeddings``: the completion routes' headers and errors, a JSON answer."""
    op = _completion("EmbeddingRequest", "EmbeddingList", "EmbeddingList",
                     "Embeddings (OpenAI) of a TextEmbedding model")
    op["responses"]["200"] = {
        "description": "The vectors in input order (numbers, or base64 float32 with "
                       "`encoding_format: base64`).",
        "headers": {REVISION_HEADER: _REVISION},
        "content": {"application/json": {"schema": _ref("EmbeddingList")}}}
    op["responses"]["400"] = _error(
        "Malformed JSON, an invalid field (`param` names it), an input over the context "
        "(`context_length_exceeded`, `param` `input`), `dimensions` the model does not allow, "
        "or a TextGeneration model (`wrong_model_task`, `param` `model`).")
    return op


def openapi_document(*, api_keys: bool = False, metrics_auth: bool = False,
                     version: str = "0", max_choices: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict) for an app with (``api_keys``) or without
    client keys, with ``/metrics`` keyed (``metrics_auth``, only with keys) or open.
    ``version``: ``info.version`` (the package's version); ``max_choices``: the app's bound on
    ``n`` (the core's ``max_choices``, ``--max-choices``), the ``maximum`` of both request
    schemas' ``n`` (none when ``None``)."""
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _completion(
            "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk",
            "Chat completion (OpenAI)")},
        "/v1/completions": {"post": _completion(
            "CompletionRequest", "TextCompletion", "TextCompletionChunk",
            "Text completion (OpenAI, legacy)")},
        "/v1/embeddings": {"post": _embeddings()},
        "/v1/models": {"get": {
            "summary": "Models resident or on standby on this node",
            "responses": {"200": {"description": "The model list.", "content": {
                "application/json": {"schema": _ref("ModelList")}}}}}},
        "/health": {"get": {
            "summary": "Liveness and readiness (always open)",
            "responses": {
                code: {"description": what, "content": {"application/json": {
                    "schema": {"type": "object"}}}}
                for code, what in (("200", "Healthy; details as JSON."),
                                   ("503", "Not healthy; details as JSON."))}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics (text exposition format)",
            "responses": {"200": {"description": "The metrics.", "content": {
                "text/plain": {"schema": {"type": "string"}}}}}}},
        OPENAPI_PATH: {"get": {
            "summary": "This document (always open)",
            "responses": {"200": {"description": "OpenAPI 3.1.", "content": {
                "application/json": {"schema": {"type": "object"}}}}}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": TITLE, "version": version, "description": _DESCRIPTION},
        "paths": paths,
        "components": {"schemas": _schemas()},
    }
    if max_choices is not None:
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            doc["components"]["schemas"][name]["properties"]["n"]["maximum"] = max_choices
    if api_keys:
        doc["components"]["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer",
                       "description": "A key of --api-key-file (clients) or "
                                      "--forward-key-file (fleet-internal)."}}
        keyed = [p for p in paths if p.startswith("/v1/")]
        if metrics_auth:
            keyed.append("/metrics")
        for p in keyed:
            for op in paths[p].values():
                op["security"] = [{"apiKey": []}]
                op["responses"]["401"] = _error(
                    "Missing or wrong API key (`invalid_api_key`).",
                    {"WWW-Authenticate": {"schema": {"type": "string"}}})
    return doc
