"""One generation request: its core-internal :class:`Request` record and the caller's
:class:`Generation` handle that streams its chunks."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable, Sequence

from .inbox import Inbox
from .types import Chunk, ModelKey

__all__ = ["Request", "Generation"]


class Request:
    """A generation request; the fields below ``# thread`` are touched only on the MLX thread.
    ``out`` receives its events (``put_nowait``): an :class:`~node_agent.serving.inbox.Inbox`,
    or the
    :class:`~node_agent.serving.coalesce.SharedGeneration` that fans them out."""

    _ids = itertools.count(1)

    def __init__(self, key: ModelKey, prompt: str | None, messages: list[dict] | None,
                 max_tokens: int | None, temperature: float, top_p: float,
                 stop: Sequence[str], seed: int | None, out: Any,
                 loop: asyncio.AbstractEventLoop, *, tools: list[dict] | None = None,
                 grammar: str | None = None, grammar_param: str = "grammar",
                 logprobs: int | None = None, index: int = 0) -> None:
        self.rid = next(self._ids)
        self.key = key
        self.model_id, self.revision = key
        self.prompt = prompt
        self.messages = messages
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.stop = [s for s in stop if s]
        self.seed = seed
        self.tools = tools             # function tools for the chat template (None: none)
        self.grammar = grammar         # output constraint (node_agent.serving.grammar) or None
        self.grammar_param = grammar_param   # the request field the grammar came from
        self.out = out
        self.loop = loop
        # top log-probabilities wanted per token (None: none; 0: the sampled token's only)
        self.logprobs = logprobs
        self.index = index             # the choice this sequence is, of a request for n
        # every sequence of a request for n choices, this one included (None: n = 1); they
        # share one tokenization and one prefill (Engine.submit / Engine.step)
        self.group: list["Request"] | None = None
        self.submitted = time.perf_counter()
        self.finished = False          # loop side: final event delivered or cancelled
        # loop side, before submission: the prompt's ids (tokenized in the core's pool)
        self.prompt_ids: list[int] | None = None
        # loop side, before submission: the compiled grammar (node_agent.serving.constrain)
        self.constraint: Any = None
        # thread
        self.tokens: list[int] = []
        self.uid: int | None = None
        self.detok: Any = None
        self.held = ""                 # text held back because it may begin a stop string
        self.n_generated = 0
        self.cached_tokens = 0         # prompt tokens reused from the prompt cache (at insert)
        self.kv_bytes = 0              # KV-cache estimate at max_tokens (admission)
        self.last_token_at: float | None = None
        self.done = False


class Generation:
    """An admitted request: async-iterate it for :class:`Chunk` s.

    ``model_id`` and ``revision``: the revision serving it; ``prompt_tokens``: prompt length in
    tokens; ``completion_tokens``: generated so far; ``finish_reason`` once finished;
    :attr:`cached_tokens`: prompt tokens served from the prompt cache. Iteration
    raises :class:`~node_agent.serving.GenerationAborted` when the revision is unloaded or the
    core closes mid-generation. Cancelling the consuming task, calling :meth:`cancel`, or leaving
    ``async with`` before the end removes the sequence from the batch.

    ``out``: where this handle reads its events, when not ``req.out`` — a subscriber of a shared
    generation (:mod:`node_agent.serving.coalesce`): it gets an :attr:`id` of its own, and
    ``cancel`` then stands for leaving the shared generation.

    A request for ``n`` choices (``req.group``: its ``n`` sequences, one inbox) is one handle:
    its chunks carry their choice's ``index``; :attr:`completion_tokens` counts every choice's
    tokens, :attr:`finish_reasons` holds each choice's (``finish_reason`` is choice 0's), and it
    ends once every choice has; cancelling it cancels them all.
    """

    def __init__(self, cancel: Callable[[Request], None], req: Request, prompt_tokens: int,
                 max_tokens: int, *, out: Inbox | None = None) -> None:
        self._cancel_request = cancel
        self._req = req
        self._reqs = req.group or [req]
        self._out = req.out if out is None else out
        self.id = req.rid if out is None else next(Request._ids)
        self.model_id = req.model_id
        self.revision = req.revision
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self._tokens = [0] * len(self._reqs)       # per choice
        self.finish_reasons: list[str | None] = [None] * len(self._reqs)
        self._ended = False
        self._error: BaseException | None = None   # an error after chunks (next_batch)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Chunk:
        if self._error is not None:
            self._raise_error()
        if self._ended:
            raise StopAsyncIteration
        item = await self._get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._took(item)
        return item

    async def next_batch(self) -> list[Chunk]:
        """The next chunks, in order: waits for one, then takes every chunk already waiting
        (up to and including the last one), so that a consumer that fell behind catches up in
        one wake-up (one write of a stream instead of one per chunk). ``[]`` once the
        generation has ended. An error that follows chunks is raised by the call after the one
        that returns them (nothing is lost). Same errors and cancellation as iterating."""
        if self._error is not None:
            self._raise_error()
        if self._ended:
            return []
        try:
            items = await self._out.get_all()
        except BaseException:
            self.cancel()
            raise
        out: list[Chunk] = []
        for item in items:
            if isinstance(item, BaseException):
                if out:
                    self._error = item
                    return out
                self._ended = True
                raise item
            out.append(item)
            self._took(item)
            if self._ended:
                break
        return out

    async def _get(self) -> Any:
        try:
            return await self._out.get()
        except BaseException:
            self.cancel()
            raise

    @property
    def n(self) -> int:
        """How many choices this request generates."""
        return len(self._reqs)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, over all choices."""
        return sum(self._tokens)

    @property
    def finish_reason(self) -> str | None:
        """Choice 0's finish reason (``None`` until it finished)."""
        return self.finish_reasons[0]

    def _took(self, item: Chunk) -> None:
        self._tokens[item.index] = item.completion_tokens
        if item.finish_reason is not None:
            self.finish_reasons[item.index] = item.finish_reason
            if all(r is not None for r in self.finish_reasons):
                self._ended = True

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        self._ended = True
        assert error is not None
        raise error

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV cache came from the prompt cache instead of a prefill (OpenAI's
        ``usage.prompt_tokens_details.cached_tokens``); final once the first chunk arrived (set
        on the MLX thread when the request joins the batch, before its first token is sent)."""
        return self._req.cached_tokens

    def cancel(self) -> None:
        """Stop generating (idempotent; a no-op after the end)."""
        self._ended = True
        for req in self._reqs:
            self._cancel_request(req)

    async def __aenter__(self) -> "Generation":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
