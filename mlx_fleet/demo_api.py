"""The demo's tour of the OpenAI API beyond plain completions (issue 20), every request through
the fleet router with the official ``openai`` client: a JSON-schema structured output and a
forced tool call (constrained decoding: the random-weight model emits valid JSON only because
nothing else is allowed), ``n`` = 3 choices with ``logprobs``, an embedding ModelDeployment
(``spec.model.task: TextEmbedding``) applied, Ready and queried on ``/v1/embeddings``, and a
request the model cannot serve refused by the router naming the capability, before any Mac is
tried."""

from __future__ import annotations

import json
import math
import string
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.panel import Panel

from mlx_fleet.devcluster.controlplane import REPO_ROOT

__all__ = ["EMBED_EXAMPLE", "api_tour"]

EMBED_EXAMPLE = REPO_ROOT / "examples" / "embedding-deployment.yaml"

#: The structured output's schema: bounds the constrained decoder enforces token by token.
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
    "coastal": {"type": "boolean"}},
    "required": ["city", "population_millions", "coastal"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


def api_tour(console: Console, cp: Any, router: str, model: str, embed_dir: Path,
             wait_listed: Callable[..., None]) -> None:
    """Run the tour against ``router`` (its base URL) serving chat model ``model``; apply the
    embedding example with ``embed_dir`` as its model directory through ``cp.kubectl``.
    ``wait_listed(router, model, ready=N)`` waits until the router lists N Ready replicas.
    Raises what the client raises on an unexpected answer."""
    import openai

    client = openai.OpenAI(base_url=f"{router}/v1", api_key="not-needed", max_retries=0)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a city as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}},
        temperature=0, max_tokens=200)
    content = r.choices[0].message.content or ""
    parsed = json.loads(content)  # always parses: the decoder allowed nothing else
    console.print(Panel(f"{content}\n\n[dim]parsed: {sorted(parsed)}; population "
                        f"{parsed['population_millions']} within [0, 40][/]",
                        title="structured output: response_format json_schema (constrained "
                              "decoding, llguidance)"), highlight=False)

    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=200)
    calls = r.choices[0].message.tool_calls or []
    lines = [f"{c.function.name}({c.function.arguments})  id {c.id}" for c in calls]
    console.print(Panel("\n".join(lines) + f"\n\n[dim]finish_reason: "
                        f"{r.choices[0].finish_reason}[/]",
                        title="tool call: tools + tool_choice required (the model's chat "
                              "template, mlx-lm's tool parser)"), highlight=False)

    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4,
        temperature=0.9, seed=7, n=3, logprobs=True, top_logprobs=3)
    rows = []
    for choice in r.choices:
        toks = choice.logprobs.content if choice.logprobs else []
        rows.append(f"choice {choice.index}: " + "  ".join(
            f"{t.token!r} {t.logprob:.2f} (top: " + ", ".join(
                f"{a.token!r} {a.logprob:.2f}" for a in t.top_logprobs) + ")" for t in toks[:2]))
    console.print(Panel("\n".join(rows) + f"\n\n[dim]{len(r.choices)} choices from one shared "
                        f"prefill; usage: {r.usage.prompt_tokens} prompt tokens once, "
                        f"{r.usage.completion_tokens} completion tokens in all[/]",
                        title="n = 3 with logprobs / top_logprobs (the first two tokens of each)"),
                  highlight=False)

    manifest = string.Template(EMBED_EXAMPLE.read_text()).safe_substitute(
        MODEL_DIR=str(embed_dir))
    console.print(f"$ kubectl apply -f {EMBED_EXAMPLE.relative_to(REPO_ROOT)}")
    console.print(cp.kubectl("apply", "-f", "-", input=manifest).stdout.strip())
    t0 = time.monotonic()
    cp.kubectl("wait", "--for=condition=Ready", "modeldeployment/embed-demo",
               "--timeout=240s", timeout=260)
    wait_listed(router, "embed-demo", ready=1)
    texts = ["Apple silicon has unified memory.", "M-series chips share RAM with the GPU.",
             "The cat sat on the mat."]
    emb = client.embeddings.create(model="embed-demo", input=texts)
    vectors = [d.embedding for d in emb.data]

    def cos(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(
            sum(x * x for x in a) * sum(y * y for y in b))

    console.print(Panel(
        f"embed-demo Ready in {time.monotonic() - t0:.1f}s; {len(vectors)} inputs → "
        f"{len(vectors[0])}-dimensional unit vectors in one request "
        f"({emb.usage.prompt_tokens} tokens)\ncosine(0, 1) = {cos(vectors[0], vectors[1]):.3f}, "
        f"cosine(0, 2) = {cos(vectors[0], vectors[2]):.3f} [dim](random weights: the numbers "
        f"mean nothing)[/]", title="POST /v1/embeddings: a TextEmbedding ModelDeployment"),
        highlight=False)

    try:
        client.chat.completions.create(model="embed-demo", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
        raise RuntimeError("the router served a chat completion from an embedding model")
    except openai.BadRequestError as e:
        err = (e.body or {}) if isinstance(e.body, dict) else {}
        console.print(f"[dim]a chat request to embed-demo: the router answers 400 "
                      f"{err.get('code')} (param {err.get('param')}): {err.get('message')}[/]",
                      highlight=False)
    # the rest of the demo (canaries, drain, a Mac's death) is about llama-demo alone
    console.print("$ kubectl delete modeldeployment embed-demo")
    console.print(cp.kubectl("delete", "modeldeployment/embed-demo").stdout.strip())
