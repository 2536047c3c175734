"""The agent's OpenAPI document (``GET /openapi.json``) and schemathesis against the live app.

schemathesis generates requests from the document the app serves — valid ones (positive) and
invalid ones (negative) — for a bounded, derandomised number of examples, sends them to the real
app over a real tiny model (a small context, so a generation is short whatever ``max_tokens``
says) and checks every answer: no 5xx, the status, content type, headers and body documented,
invalid input refused with a 4xx, and every 4xx in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from mlx_fleet.routing.api_keys import KeyFile
from node_agent.api_models import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                   ErrorResponse)
from node_agent.openai_api import build_app
from node_agent.openapi import OPENAPI_PATH, openapi_document
from serving_fixtures import MODEL_ID, Agent, close_agent, make_agent, tiny_model_path  # noqa: F401

#: Examples per generation mode (positive, negative) over all operations: bounded so the test
#: takes seconds; derandomised, so every run sends the same requests.
EXAMPLES = 40
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest_asyncio.fixture(scope="module")
async def small_agent(tiny_model_path: Path) -> AsyncIterator[Agent]:  # noqa: F811
    """The real app over the tiny model with a 32-token context: generations stay short."""
    a = await make_agent(tiny_model_path, max_context_tokens=32)
    yield a
    await close_agent(a)


def _keys(node: object) -> list[str]:
    """Every key of every object in a JSON document, but the names under ``properties``."""
    if isinstance(node, list):
        return [k for v in node for k in _keys(v)]
    if not isinstance(node, dict):
        return []
    out = [k for k in node if k != "properties"]
    for k, v in node.items():
        out += (_keys(list(v.values())) if k == "properties" and isinstance(v, dict)
                else _keys(v))
    return out


async def test_document_is_served_open_and_built_from_the_models(small_agent: Agent) -> None:
    resp = await small_agent.client.get(OPENAPI_PATH)
    assert resp.status == 200
    doc = await resp.json()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                 "/v1/models", "/health", "/metrics", OPENAPI_PATH}
    schemas = doc["components"]["schemas"]
    # the request schemas are the validating models' own (one source of truth)
    for model in (ChatCompletionRequest, CompletionRequest, EmbeddingRequest):
        assert (set(schemas[model.__name__]["properties"])
                == set(model.model_json_schema()["properties"]))
        assert schemas[model.__name__]["required"] == model.model_json_schema()["required"]
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    # constraints are JSON Schema keywords (pydantic writes its own "ge" where it cannot
    # translate one: a validator would then be stricter than the document says)
    assert not set(_keys(doc)) & {"ge", "gt", "le", "lt", "strict"}
    props = schemas["CompletionRequest"]["properties"]
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, small_agent.core.max_choices)
    assert props["max_tokens"]["anyOf"][0] == {"minimum": 1, "type": "integer"}
    # without keys, nothing declares authentication
    assert "securitySchemes" not in doc["components"]
    assert "401" not in doc["paths"]["/v1/models"]["get"]["responses"]


def test_document_declares_bearer_keys_where_the_app_asks_for_them() -> None:
    for metrics_auth in (False, True):
        doc = openapi_document(api_keys=True, metrics_auth=metrics_auth)
        assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
        keyed = {p for p, ops in doc["paths"].items()
                 for op in ops.values() if "401" in op["responses"] and op.get("security")}
        want = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"}
        assert keyed == (want | {"/metrics"} if metrics_auth else want)


def _fuzz_mode(schema: schemathesis.BaseSchema, base_url: str, mode: GenerationMode,
               checks: list, seen: dict[str, int], *, examples: int = EXAMPLES,
               headers: dict[str, str] | None = None) -> None:
    flip = itertools.count()

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=schema.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        # half of the valid completion requests name the loaded model, so that they generate
        # (the others ask for a model that isn't here: 404)
        if (mode is GenerationMode.POSITIVE and isinstance(case.body, dict)
                and "model" in case.body and next(flip) % 2 == 0):
            case.body["model"] = MODEL_ID
        response = case.call(base_url=base_url, timeout=60, headers=headers)
        case.validate_response(response, checks=checks, headers=headers)
        key = f"{mode.value} {case.method} {case.path} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        if 400 <= response.status_code < 500:
            ErrorResponse.model_validate_json(response.content)  # OpenAI's error shape

    run()


def _fuzz(base_url: str) -> dict[str, int]:
    """Run schemathesis (blocking: requests over real HTTP) against ``base_url``, valid then
    invalid examples; returns how many answers of each (mode, method, path, status) it got."""
    schema = schemathesis.openapi.from_url(base_url + OPENAPI_PATH)
    seen: dict[str, int] = {}
    _fuzz_mode(schema, base_url, GenerationMode.POSITIVE, CHECKS, seen)
    _fuzz_mode(schema, base_url, GenerationMode.NEGATIVE, CHECKS + [negative_data_rejection],
               seen)
    return seen


async def test_schemathesis_finds_nothing(small_agent: Agent) -> None:
    base_url = str(small_agent.client.make_url("")).rstrip("/")
    seen = await asyncio.to_thread(_fuzz, base_url)
    statuses = {k.rsplit(" ", 1)[1] for k in seen}
    # the examples got through to generation and to refusals, not only to one kind of answer
    assert any(k.startswith("positive POST") and k.endswith(" 200") for k in seen), seen
    assert any(k.startswith("negative POST") and k.endswith(" 400") for k in seen), seen
    assert not any(s.startswith("5") for s in statuses), seen
    # the app is still healthy and idle
    assert (await small_agent.client.get("/health")).status == 200
    assert small_agent.core.inflight_requests() == 0, json.dumps(seen)


def _fuzz_keyed(base_url: str, key: str) -> dict[str, int]:
    schema = schemathesis.openapi.from_url(base_url + OPENAPI_PATH)
    seen: dict[str, int] = {}
    _fuzz_mode(schema, base_url, GenerationMode.POSITIVE, CHECKS, seen, examples=15)
    _fuzz_mode(schema, base_url, GenerationMode.POSITIVE, CHECKS, seen, examples=15,
               headers={"Authorization": f"Bearer {key}"})
    return seen


async def test_schemathesis_with_api_keys(small_agent: Agent, tmp_path: Path) -> None:
    """With keys (and a keyed /metrics) the document declares bearer auth and the 401s; the
    answers with and without a key match it."""
    key = "sk-openapi-test-0123456789abcdef"
    (tmp_path / "keys").write_text(key + "\n")
    app = build_app(small_agent.core, health=lambda: (True, {}), registry=small_agent.registry,
                    api_keys=KeyFile(tmp_path / "keys"), metrics_auth=True)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        base_url = str(client.make_url("")).rstrip("/")
        seen = await asyncio.to_thread(_fuzz_keyed, base_url, key)
    finally:
        await client.close()
    assert any(k.endswith(" 401") for k in seen), seen
    assert any(k.startswith("positive POST") and k.endswith(" 200") for k in seen), seen
    assert not any(k.rsplit(" ", 1)[1].startswith("5") for k in seen), seen
