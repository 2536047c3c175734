"""A steady OpenAI-client load against a local fleet, recording every request's outcome.

Used by the end-to-end tests and the benchmarks (the same code measures both): ``concurrency``
workers, each with its own session key (``X-Session-ID``), send chat completions (streamed, or
not with ``stream=False``) in a loop to the endpoints (round robin: agents, or one router) until
stopped. Every request ends in one
:class:`Outcome`: the HTTP status, the revision that served it (``X-Model-Revision``), and
whether it failed — a non-2xx answer, a connection error, a stream that ended with an error
event or without ``[DONE]``, or a non-streamed answer that is not a ``chat.completion`` — and how (``error_kind``). Nothing is lost: a request in flight when
the generator stops is awaited to its end (at most ``timeout``); ``sent`` counts the requests
started, so ``sent - len(outcomes)`` is what never ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from mlx_fleet.routing.headers import REVISION_HEADER, SESSION_HEADER

__all__ = ["Outcome", "LoadGenerator"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request: ``started``/``ended`` (``time.monotonic()``), ``session``, ``endpoint``,
    ``status`` (0 when no HTTP answer came), ``revision`` (``X-Model-Revision``, "" if none),
    ``failed`` and ``error`` (why, "" when it succeeded), ``first_token``: when the first
    streamed chunk with content arrived (``time.monotonic()``; ``None`` if none did).
    ``error_kind``: "" (succeeded), ``http`` (a non-200 answer), ``stream_error`` (an error
    event in the stream), ``incomplete`` (the stream ended without ``[DONE]`` or an error),
    ``connection`` (refused, reset, closed mid-answer), ``timeout`` (no end within the
    generator's ``timeout``), ``no_endpoint``."""

    started: float
    ended: float
    session: str
    endpoint: str
    status: int
    revision: str
    failed: bool
    error: str = ""
    first_token: float | None = None
    error_kind: str = ""

    @property
    def ttft_seconds(self) -> float | None:
        """Time to first token as the client saw it (seconds), ``None`` without one."""
        return None if self.first_token is None else self.first_token - self.started


class LoadGenerator:
    """``endpoints()``: the agent base URLs to send to now (re-read before every request, so
    a test can follow ``status.endpoints``). ``sessions``: one session key per worker.
    ``timeout``: seconds a request may take in all. ``failure_pause``: seconds a worker waits
    after a failed request before its next one (a client's back-off; 0: none). ``headers``:
    sent with every request besides the session header (e.g. a router's ``Authorization``).
    ``stream``: streamed requests (SSE, the default) or plain JSON answers."""

    def __init__(self, endpoints: Callable[[], Sequence[str]], model: str, *,
                 sessions: Sequence[str], max_tokens: int = 8,
                 timeout: float = 60.0, failure_pause: float = 0.0,
                 headers: Mapping[str, str] | None = None, stream: bool = True) -> None:
        self._endpoints = endpoints
        self.model = model
        self.stream = stream
        self.sessions = list(sessions)
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.failure_pause = failure_pause
        self.headers = dict(headers or {})
        self.sent = 0
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._rr = itertools.count()
        self._http: aiohttp.ClientSession | None = None
        self.first_request = asyncio.Event()
        self._ended = asyncio.Event()

    async def __aenter__(self) -> LoadGenerator:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        self._tasks = [asyncio.create_task(self._worker(s)) for s in self.sessions]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Let every in-flight request finish, then stop."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def wait_for(self, n: int) -> None:
        """Until at least ``n`` more requests have ended (an event per outcome, no polling)."""
        target = len(self.outcomes) + n
        while len(self.outcomes) < target:
            await self._ended.wait()
            self._ended.clear()

    async def _worker(self, session: str) -> None:
        while not self._stop.is_set():
            eps = list(self._endpoints())
            if not eps:
                self._record(Outcome(time.monotonic(), time.monotonic(), session, "", 0, "",
                                     True, "no endpoint", error_kind="no_endpoint"))
                await asyncio.sleep(0.05)
                continue
            endpoint = eps[next(self._rr) % len(eps)]
            outcome = await self.one(endpoint, session)
            self._record(outcome)
            if outcome.failed and self.failure_pause > 0 and not self._stop.is_set():
                await asyncio.sleep(self.failure_pause)

    def _record(self, o: Outcome) -> None:
        self.outcomes.append(o)
        self.first_request.set()
        self._ended.set()

    async def one(self, endpoint: str, session: str) -> Outcome:
        """Send one chat completion and classify its end."""
        assert self._http is not None
        self.sent += 1
        t0 = time.monotonic()
        body = {"model": self.model, "stream": self.stream, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": f"Hello from {session}"}]}
        status, revision = 0, ""
        try:
            async with self._http.post(f"{endpoint}/v1/chat/completions", json=body,
                                       headers={**self.headers, SESSION_HEADER: session}) as r:
                status, revision = r.status, r.headers.get(REVISION_HEADER, "")
                if r.status != 200:
                    text = (await r.text())[:200]
                    return Outcome(t0, time.monotonic(), session, endpoint, status, revision,
                                   True, f"HTTP {status}: {text}", error_kind="http")
                if not self.stream:
                    answer = await r.json()
                    if answer.get("object") != "chat.completion":
                        return Outcome(t0, time.monotonic(), session, endpoint, status, revision,
                                       True, f"not a chat.completion: {str(answer)[:200]}",
                                       error_kind="incomplete")
                    return Outcome(t0, time.monotonic(), session, endpoint, status, revision,
                                   False, "")
                done, first = False, None
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    if b'"error"' in data and "error" in json.loads(data):
                        return Outcome(t0, time.monotonic(), session, endpoint, status,
                                       revision, True, json.loads(data)["error"]["message"],
                                       first, error_kind="stream_error")
                    if first is None and b'"content"' in data and _has_content(data):
                        first = time.monotonic()
                if not done:
                    return Outcome(t0, time.monotonic(), session, endpoint, status, revision,
                                   True, "stream ended without [DONE]", first,
                                   error_kind="incomplete")
                return Outcome(t0, time.monotonic(), session, endpoint, status, revision, False,
                               "", first)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # aiohttp's ServerTimeoutError is both a ClientError and a TimeoutError
            kind = "timeout" if isinstance(e, asyncio.TimeoutError) else "connection"
            return Outcome(t0, time.monotonic(), session, endpoint, status, revision, True,
                           f"{type(e).__name__}: {e}", error_kind=kind)


def _has_content(data: bytes) -> bool:
    """Whether an SSE chunk of a chat completion carries generated text."""
    chunk = json.loads(data)
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())
