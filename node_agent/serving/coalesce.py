"""Request coalescing (N→1): identical concurrent requests whose output is deterministic share
one generation of the serving core, streamed to every subscriber from its first token.

Two requests are *identical* when :func:`coalesce_key` gives them the same key: the same serving
revision (its :class:`~node_agent.serving.types.ModelInfo`: model id, revision, path, load time
and limits), the same prompt input and the same value of every generation parameter the core is
given (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ... — whatever the caller
passes in ``params``, so a parameter added later takes part without a change here). The prompt
input is the raw prompt text, or the chat messages, exactly as the core receives them: a
revision's tokenizer and chat template are fixed, so equal inputs give equal prompt tokens after
the chat template (inputs that differ but would render to the same tokens are not shared: a
missed share, never a wrong one). The key is taken on the event loop before the request reaches
the MLX thread, so joining costs no tokenization and no round trip to that thread.

Only deterministic requests are shared: greedy ones (``temperature`` 0) and seeded ones (their
sampler draws from keys derived from the seed and the token position, see
:func:`node_agent.serving.sampling.seeded_sampler`). An unseeded sampling request is never
shared: each caller expects its own draw.

:class:`SharedGeneration` is one such generation's fan-out: the core delivers the generation's
events (:class:`~node_agent.serving.types.Chunk` s, then the final chunk or the exception that
ends it) into it as into a request's queue; it keeps them and copies each to every subscriber's
queue. A subscriber that joins mid-stream first gets every event so far, then the live ones. A
subscriber leaving takes only its own queue away; when the last one leaves before the end the
generation is cancelled. Once the generation has ended (or failed to start, or was cancelled) it
is no longer joinable: an identical request after that starts a generation of its own.
:class:`Coalescer` holds the joinable generations by key. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Hashable, Mapping, Sequence

from .errors import StreamBufferOverflow
from .inbox import Inbox

__all__ = ["coalesce_key", "SharedGeneration", "Coalescer"]


def _frozen(value: Any, typed: bool = False) -> Hashable:
    """``value`` as a hashable equal-for-equal value (lists → tuples, dicts → sorted item
    tuples); ``typed``: scalars other than strings carry their type, so that ``1``, ``1.0`` and
    ``True`` differ (a chat template renders them differently). Raises ``TypeError`` for a value
    that is neither hashable nor a list or dict (or dict keys that cannot be ordered).
    No string is copied: hashing the key reuses each string's cached hash."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v, typed) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v, typed)) for k, v in value.items()))
    hash(value)
    return (type(value), value) if typed and not isinstance(value, str) else value


def coalesce_key(revision: Hashable, prompt: str | None,
                 messages: Sequence[Mapping[str, Any]] | None,
                 params: Mapping[str, Any]) -> Hashable | None:
    """The key under which a request may share a generation, or ``None`` when it must not.

    ``revision``: what identifies the serving revision (the core passes its ``ModelInfo``);
    ``prompt`` / ``messages``: the prompt input as the core receives it (raw text, or the chat
    messages: lists, dicts and scalars); ``params``: every generation parameter by name,
    ``temperature`` (a number, 0 = greedy) and ``seed`` (int or ``None``) among them.

    ``None`` (not shareable) when the output is not deterministic — ``temperature`` > 0 without
    a ``seed`` — or when the prompt or a parameter cannot be compared (not hashable). Otherwise
    a hashable value equal for two requests exactly when their revision, prompt input (its
    scalars of the same type too) and every parameter are equal (``max_tokens`` ``None`` and an
    explicit number differ; so do stop lists in another order: no parameter is second-guessed;
    parameters compare as numbers, ``0 == 0.0``).
    """
    temperature = params.get("temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        return None
    if temperature > 0 and params.get("seed") is None:
        return None
    try:
        what = ("messages", _frozen(messages, typed=True)) if messages is not None else (
            "prompt", prompt)
        frozen = tuple(sorted((str(k), _frozen(v)) for k, v in params.items()))
    except TypeError:
        return None
    return (revision, what, frozen)


def _final(item: Any) -> bool:
    """True for the event that ends a generation: an exception or a chunk with a finish
    reason."""
    return isinstance(item, BaseException) or item.finish_reason is not None


class SharedGeneration:
    """One generation shared by its subscribers (see the module docstring).

    The core delivers the generation's events with :meth:`put_nowait` (it stands in for the
    request's own queue), keeps its request in :attr:`request` (opaque here) and hands
    :meth:`watch` the future of the request's admission on the MLX thread (``(prompt tokens,
    max tokens)``, or the error that refused it). ``cancel()`` cancels the generation in the
    core; ``closed(self)`` is called once, when it is no longer joinable. ``buffer_limit``:
    events a subscriber may have waiting (the core's ``stream_buffer_chunks``); one that falls
    further behind gets :class:`~node_agent.serving.errors.StreamBufferOverflow` and leaves —
    only it: the generation goes on for the others (``overflowed()`` is called for each).
    :meth:`qsize` is always 0, so the core's own buffer check never stops the whole generation.
    """

    def __init__(self, key: Hashable, cancel: Callable[[], None],
                 closed: Callable[["SharedGeneration"], None], buffer_limit: int | None = None,
                 overflowed: Callable[[], None] | None = None) -> None:
        self.key = key
        self.events: list[Any] = []
        self.joinable = True
        self.finished = False
        self.submitted: asyncio.Future | None = None
        self.request: Any = None
        self._queues: list[Inbox] = []
        self._cancel = cancel
        self._closed = closed
        self._limit = buffer_limit
        self._overflowed = overflowed

    @property
    def subscribers(self) -> int:
        """Subscribers that have not left."""
        return len(self._queues)

    def watch(self, submitted: asyncio.Future) -> None:
        """Set :attr:`submitted`; a submission that fails or is cancelled ends the sharing (the
        subscribers awaiting it get its error) and cancels the request in the core."""
        self.submitted = submitted
        submitted.add_done_callback(self._on_submitted)

    def _on_submitted(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:  # (marks the error retrieved)
            self.abandon()

    def abandon(self) -> None:
        """End the sharing and cancel the generation (idempotent; a no-op after its end): its
        request was refused, or could not be handed to the core, or nobody listens any more."""
        if not self.finished:
            self.finished = True
            self._close()
            self._cancel()

    def put_nowait(self, item: Any) -> None:
        """Deliver one event of the generation to every subscriber (and keep it for later
        ones)."""
        if self.finished:
            return
        self.events.append(item)
        final = _final(item)
        for q in list(self._queues):
            if not final and self._limit is not None and q.qsize() >= self._limit:
                q.put_nowait(StreamBufferOverflow(q.qsize()))
                if self._overflowed is not None:
                    self._overflowed()
                self.leave(q)
            else:
                q.put_nowait(item)
        if final:
            self.finished = True
            self._close()

    def qsize(self) -> int:
        """0: the buffer bound is kept per subscriber (see the class docstring)."""
        return 0

    def subscribe(self) -> Inbox:
        """A new subscriber's queue, holding every event so far; later ones follow live."""
        q = Inbox()
        for item in self.events:
            q.put_nowait(item)
        self._queues.append(q)
        return q

    def leave(self, q: Inbox) -> None:
        """The subscriber of ``q`` is gone (idempotent). The last one to leave before the end
        cancels the generation."""
        try:
            self._queues.remove(q)
        except ValueError:
            return
        if not self._queues:
            self.abandon()

    def _close(self) -> None:
        if self.joinable:
            self.joinable = False
            self._closed(self)


class Coalescer:
    """The joinable shared generations, by :func:`coalesce_key`."""

    def __init__(self) -> None:
        self._live: dict[Hashable, SharedGeneration] = {}

    def __len__(self) -> int:
        return len(self._live)

    def get(self, key: Hashable | None) -> SharedGeneration | None:
        """The joinable generation for ``key`` (``None`` for the key ``None``)."""
        return None if key is None else self._live.get(key)

    def lead(self, key: Hashable, cancel: Callable[[], None], buffer_limit: int | None = None,
             overflowed: Callable[[], None] | None = None) -> SharedGeneration:
        """Register a new shared generation for ``key`` (joinable until it ends, replacing
        one registered before); ``cancel`` cancels it in the core; ``buffer_limit`` and
        ``overflowed``: see :class:`SharedGeneration`."""
        shared = SharedGeneration(key, cancel, self._forget, buffer_limit, overflowed)
        self._live[key] = shared
        return shared

    def _forget(self, shared: SharedGeneration) -> None:
        if self._live.get(shared.key) is shared:
            del self._live[shared.key]
