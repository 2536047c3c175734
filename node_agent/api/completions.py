"""``POST /v1/chat/completions`` and ``POST /v1/completions``: route a request to a revision
(the canary split, a standby reload, or a forward to another node), generate on the
:class:`~node_agent.serving.ServingCore`, and answer as JSON or an SSE stream.

``n`` choices answer ``choices`` with ``index`` 0 .. n-1 (streamed: each event carries its
choice's ``index``; with tools, each choice's calls are parsed on their own) and a ``usage``
counting the prompt once and every choice's tokens. With ``logprobs`` each choice carries
OpenAI's ``logprobs`` object (chat: ``content`` entries; legacy: ``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``), streamed per event for its tokens
(:mod:`node_agent.sse`).

The revision is chosen by :func:`.routing.serve_on` (shared with the embeddings route).
Statuses beyond :mod:`.parse`'s 400s and :mod:`.routing`'s: 400 ``unsupported_parameter`` /
``unsupported_value`` when the revision that would serve the request lacks a capability it needs
(tools, structured outputs, logprobs, ``n``), or ``wrong_model_task`` (``param`` ``model``) for a
``TextEmbedding`` model (:func:`.routing.refusal`: :func:`mlx_fleet.capabilities.satisfies` over
the revision's :func:`~node_agent.serving.capabilities.model_capabilities` — the fleet router's
answer, word for word, ``param`` naming the field), 400 ``context_length_exceeded`` /
``prompt_too_large`` / ``invalid_prompt`` (``param`` ``messages`` or ``prompt``), 400 for
``tools`` / ``tool_choice`` / ``response_format`` that cannot be served as asked
(:mod:`.structured`) or whose schema the constrained decoder cannot enforce (``code``
``invalid_schema``, ``param`` ``response_format.json_schema.schema`` or ``tools``, the message
naming the keyword; the same when the grammar's matcher stops on one of its limits
mid-generation, :class:`~node_agent.serving.ConstraintFailed`: then, once a stream's 200 is out,
an error event with that ``type``, ``code`` and ``param``; not counted as a failure of the
revision), 400 ``invalid_value`` naming ``n`` for more choices than the core takes
(``ServingCore.generate``'s ``TooManyChoices``; the capabilities answer first), 404
``model_not_found``, 429 with
``Retry-After`` (seconds), 503 when the model goes away mid-request, the serving core has failed
(``ServingCore.failure``) or a standby revision can't be reloaded (``model_reload_failed``).
Every answer from the point the revision is known carries ``X-Model-Revision``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Literal

from aiohttp import web

from mlx_fleet.capabilities import REQUEST_FIELDS
from mlx_fleet.http_errors import error_response as _error

from ..api_models import (ChatCompletionRequest, CompletionRequest, ErrorDetail, ErrorResponse,
                           SamplingRequest)

from ..api_responses import (AssistantMessage, ChatChoice, ChatCompletion, PromptTokensDetails,
                              TextChoice, TextCompletion, ToolCall, Usage)
from ..serving import (ConstraintFailed, ContextLengthExceeded, GenerationAborted,
                       InvalidConstraint,
                       InvalidPrompt, ModelNotLoaded, Overloaded, PromptTooLarge, ServingCore,
                       StreamBufferOverflow, TooManyChoices, WrongTask)
from ..logprobs_json import ChoiceLogprobsJson
from ..sse import DONE, StreamEncoder, data_event
from .context import HUNG_UP
from .forward import Forwarder
from .parse import parse
from .render import completion_answer, json_answer
from .routing import Outcome, Served, refusal, serve_on, wrong_task
from .structured import OutputPlan, PlanError, plan_output, template_messages
from .tool_calls import ToolCallReader, finish_reason

__all__ = ["Completions", "usage_of"]

Kind = Literal["chat", "text"]


def usage_of(gen: Any) -> Usage:
    """OpenAI's ``usage`` of a finished generation, with
    ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prompt cache)."""
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                 total_tokens=gen.prompt_tokens + gen.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens))


def logprobs_wanted(req: SamplingRequest) -> int | None:
    """How many top log-probabilities per token the request asks for: chat ``top_logprobs``
    (0 when absent) when ``logprobs`` is true, legacy ``logprobs``; ``None``: none asked."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class Completions:
    """The two completion routes over ``core``; ``router()`` returns the agent's
    :class:`~node_agent.traffic.TrafficManager` or None (then the model's only, or most
    recently loaded, revision serves); ``forward`` relays a request routed to another node."""

    def __init__(self, core: ServingCore, *, router: Callable[[], Any],
                 forward: Forwarder) -> None:
        self.core = core
        self.router = router
        self.forward = forward

    def _aborted(self, e: GenerationAborted) -> str:
        """A client's message for ``e``: never the serving core's failure text (it is in
        the log and in /health for a keyed request)."""
        return "this node's serving core failed" if self.core.failure is not None else e.public

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, ChatCompletionRequest)
        if isinstance(req, web.Response):
            return req
        assert isinstance(req, ChatCompletionRequest)
        messages = template_messages(req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await self._complete(request, req, "chat", max_tokens, messages=messages)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, CompletionRequest)
        if isinstance(req, web.Response):
            return req
        assert isinstance(req, CompletionRequest)
        return await self._complete(request, req, "text", req.max_tokens, prompt=req.prompt)

    async def _complete(self, request: web.Request, req: SamplingRequest, kind: Kind,
                        max_tokens: int | None, *, messages: list[dict] | None = None,
                        prompt: str | None = None) -> web.StreamResponse:
        core = self.core
        served = await serve_on(request, core, self.router, self.forward, req.model, req.user)
        if not isinstance(served, Served):
            return served
        info, headers = served.info, served.headers
        refused = refusal(info, request.path, req.model_dump(include=set(REQUEST_FIELDS)),
                          req.model, headers, max_choices=core.max_choices)
        if refused is not None:
            return refused
        outcome = Outcome(served.tm, served.routed)
        prompt_param = "messages" if kind == "chat" else "prompt"
        plan = OutputPlan()
        if isinstance(req, ChatCompletionRequest):
            try:
                plan = plan_output(req, core.tool_format(req.model, info.revision))
            except PlanError as e:
                return _error(400, str(e), param=e.param, code=e.code, headers=headers)
        try:
            gen = await core.generate(req.model, revision=info.revision, prompt=prompt,
                                      messages=messages,
                                      max_tokens=max_tokens, temperature=req.temperature,
                                      top_p=req.top_p, stop=req.stop, seed=req.seed,
                                      tools=plan.tools, grammar=plan.grammar,
                                      grammar_param=plan.grammar_param,
                                      n=req.n, logprobs=logprobs_wanted(req))
        except TooManyChoices as e:
            return _error(400, str(e), param="n", code="invalid_value", headers=headers)
        except ModelNotLoaded:
            return _error(404, f"The model '{req.model}' is not loaded on this node",
                          param="model", code="model_not_found")
        except WrongTask as e:
            return wrong_task(e, headers)
        except Overloaded as e:
            return _error(429, f"Too many requests: {e}", type_="rate_limit_error",
                          code="overloaded",
                          headers={"Retry-After": str(e.retry_after_seconds), **headers})
        except ContextLengthExceeded as e:
            return _error(400, str(e), param=prompt_param,
                          code="context_length_exceeded", headers=headers)
        except PromptTooLarge as e:
            return _error(400, str(e), param=prompt_param,
                          code="prompt_too_large", headers=headers)
        except InvalidPrompt as e:
            return _error(400, str(e), param=prompt_param,
                          code="invalid_prompt", headers=headers)
        except (InvalidConstraint, ConstraintFailed) as e:
            return _error(400, str(e), param=e.param, code="invalid_schema", headers=headers)
        except GenerationAborted as e:
            outcome.done(failed=True)
            return _error(503, self._aborted(e), type_="server_error", code="unavailable",
                          headers=headers)

        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        async with gen:
            if req.stream:
                return await self._stream(request, req, kind, gen, rid, created, headers,
                                          outcome, plan)
            parts: list[list[str]] = [[] for _ in range(gen.n)]
            # each token's log-probabilities encoded as it comes (.render): megabytes with n,
            # max_tokens and top_logprobs, never built or encoded at once on the event loop
            logprobs = ([ChoiceLogprobsJson(kind) for _ in range(gen.n)]
                        if logprobs_wanted(req) is not None else None)
            try:
                while batch := await gen.next_batch():
                    outcome.token(gen.completion_tokens)
                    for chunk in batch:
                        parts[chunk.index].append(chunk.text)
                        if logprobs is not None and chunk.logprobs is not None:
                            logprobs[chunk.index].add(chunk.logprobs)
                    if _client_gone(request):
                        gen.cancel()
                        raise ConnectionResetError("client disconnected")
            except ConstraintFailed as e:   # the client's grammar: not the revision's failure
                return _error(400, str(e), param=e.param, code="invalid_schema",
                              headers=headers)
            except GenerationAborted as e:
                outcome.done(failed=True)
                return _error(503, self._aborted(e), type_="server_error",
                              code="unavailable", headers=headers)
        outcome.done(failed=False)
        texts = ["".join(p) for p in parts]
        usage = usage_of(gen)
        body: ChatCompletion | TextCompletion
        if kind == "chat":
            choices, with_calls = [], []
            for i, text in enumerate(texts):
                calls: list[dict] = []
                content: str | None = text
                if plan.tool_format is not None:   # each choice's calls parsed on their own
                    reader = ToolCallReader(plan.tool_format, plan.tools)
                    pieces = reader.feed(text) + reader.finish()
                    content = "".join(p for k, p in pieces if k == "content")
                    calls = reader.calls
                    content = content if content or not calls else None
                message = AssistantMessage(
                    role="assistant", content=content,
                    tool_calls=[ToolCall.model_validate(c) for c in calls] if calls else None)
                choices.append(ChatChoice(
                    index=i, message=message, logprobs=None,
                    finish_reason=finish_reason(gen.finish_reasons[i], bool(calls))))
                with_calls.append(bool(calls))
            body = ChatCompletion(id=rid, object="chat.completion", created=created,
                                  model=req.model, choices=choices, usage=usage)
            payload = body.model_dump()
            for choice, called in zip(payload["choices"], with_calls):
                if not called:   # tool_calls only when there are some (as OpenAI answers)
                    choice["message"].pop("tool_calls", None)
        else:
            body = TextCompletion(
                id=rid, object="text_completion", created=created, model=req.model,
                choices=[TextChoice(index=i, text=texts[i], logprobs=None,
                                    finish_reason=gen.finish_reasons[i])
                         for i in range(gen.n)],
                usage=usage)
            payload = body.model_dump()
        # joined off the event loop
        return await json_answer(completion_answer, payload, logprobs, headers=headers)

    async def _stream(self, request: web.Request, req: SamplingRequest, kind: Kind,
                      gen: Any, rid: str, created: int, headers: dict[str, str],
                      outcome: Outcome, plan: OutputPlan = OutputPlan()
                      ) -> web.StreamResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        events = StreamEncoder(kind, rid, created, req.model, include_usage,
                               logprobs=logprobs_wanted(req) is not None, n=gen.n)
        try:
            if kind == "chat":
                await resp.write(events.first())
            try:
                # every chunk already waiting goes out in one write (a stream that fell behind
                # catches up in one wake-up); the events are those of one chunk each
                readers = (None if plan.tool_format is None   # one per choice
                           else [ToolCallReader(plan.tool_format, plan.tools)
                                 for _ in range(gen.n)])
                while batch := await gen.next_batch():
                    outcome.token(gen.completion_tokens)
                    data = (events.chunks(batch) if readers is None
                            else _tool_events(events, readers, batch))
                    if data:
                        await resp.write(data)
            except ConstraintFailed as e:   # the client's grammar: not the revision's failure
                err = ErrorResponse(error=ErrorDetail(
                    message=str(e), type="invalid_request_error", param=e.param,
                    code="invalid_schema"))
                await resp.write(data_event(err.model_dump_json().encode()))
                await resp.write_eof()
                return resp
            except GenerationAborted as e:
                slow = isinstance(e, StreamBufferOverflow)
                if not slow:  # a slow client is not a failure of the revision
                    outcome.done(failed=True)
                err = ErrorResponse(error=ErrorDetail(
                    message=self._aborted(e), type="server_error", param=None,
                    code="stream_buffer_overflow" if slow else "unavailable"))
                await resp.write(data_event(err.model_dump_json().encode()))
                await resp.write_eof()
                return resp
            outcome.done(failed=False)
            if include_usage:
                await resp.write(events.usage(usage_of(gen).model_dump()))
            await resp.write(DONE)
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream: stop generating (the caller's `async with`
            # cancels too) and end quietly; the middleware counts it as 499 (not the 200
            # already sent) and logs it.
            gen.cancel()
            request[HUNG_UP] = True
        return resp


def _tool_events(events: StreamEncoder, readers: list[ToolCallReader],
                 batch: list[Any]) -> bytes:
    """The events of ``batch`` when tool calls are parsed (``readers``: one per choice):
    content as it is safe to send (a possible call start held back), each call whole in one
    ``delta.tool_calls`` event, the final chunk's finish reason ``tool_calls`` after calls;
    each event in its chunk's choice, token log-probabilities with the choice's next content
    or final event."""
    out: list[bytes] = []
    for chunk in batch:
        events.note(chunk)
        reader, index = readers[chunk.index], chunk.index
        pieces = reader.feed(chunk.text)
        if chunk.finish_reason is not None:
            pieces += reader.finish()
        for kind, value in pieces:
            if kind == "content":
                out.append(events.chunk(value, None, index))
            else:
                first, calls = value
                out.append(events.tool_calls(calls, first, index))
        if chunk.finish_reason is not None:
            out.append(events.chunk("", finish_reason(chunk.finish_reason,
                                                      bool(reader.calls)), index))
    return b"".join(out)
