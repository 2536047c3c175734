"""The parts of the node agent's OpenAI-compatible HTTP API; :mod:`node_agent.openai_api` wires
them into one aiohttp app.

* :mod:`.context` — per-request keys and the constant metric label,
* :mod:`.middleware` — authentication and the errors middleware (OpenAI error shape, request
  counts),
* :mod:`.parse` — request bodies validated into :mod:`node_agent.api_models` or a 400,
* :mod:`.forward` — relaying a request to the node that serves its revision,
* :mod:`.routing` — which revision serves a request (split, pin, standby reload, forward),
  shared by every model route,
* :mod:`.completions` — ``/v1/chat/completions`` and ``/v1/completions``,
* :mod:`.structured` — what ``tools`` / ``tool_choice`` / ``response_format`` ask of the core
  (pure),
* :mod:`.tool_calls` — tool calls read out of an answer, whole or streamed (pure),
* :mod:`.embeddings` — ``/v1/embeddings``.
"""
