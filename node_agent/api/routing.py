"""Which revision serves a request, for every model route (chat, completions, embeddings): the
canary split or the revision pin, a standby reload, or a forward to the node that serves the
revision; then the request's model/revision labels and its ``X-Model-Revision`` header.
:class:`Outcome` times a request for the per-revision statistics under a split.

:func:`refusal` answers a request the revision cannot serve (its capabilities), as the fleet
router does.

Statuses: 404 ``model_not_found``, 429 ``overloaded`` with ``Retry-After`` (a standby reload
has too many waiting), 503 ``unavailable`` (the serving core failed) or
``model_reload_failed`` (a standby revision can't be reloaded).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from mlx_fleet.capabilities import WRONG_MODEL_TASK, required_capabilities, satisfies
from mlx_fleet.http_errors import error_response as _error
from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER, SESSION_HEADER

from ..serving import (ModelInfo, ModelLoadError, ModelNotLoaded, Overloaded, ServingCore,
                       WrongTask)
from ..serving.capabilities import model_capabilities
from .context import FLEET_INTERNAL, MODEL, REVISION
from .forward import Forwarder

__all__ = ["Served", "Outcome", "serve_on", "not_found", "refusal", "wrong_task"]


@dataclass(frozen=True)
class Served:
    """The revision here that serves a request: its ``info``, the agent's traffic manager
    ``tm`` and the ``routed`` decision (None without a traffic manager), and ``headers`` every
    answer from now on carries (``X-Model-Revision``)."""

    info: ModelInfo
    tm: Any
    routed: Any
    headers: dict[str, str]


def not_found(model: str) -> web.Response:
    """404 ``model_not_found`` for ``model``."""
    return _error(404, f"The model '{model}' does not exist or is not loaded on this node",
                  param="model", code="model_not_found")


def refusal(info: ModelInfo, path: str, fields: Mapping[str, Any], model: str,
            headers: dict[str, str], *, max_choices: int | None = None) -> web.Response | None:
    """The 400 for a request to ``path`` (``fields``: its body's
    :data:`~mlx_fleet.capabilities.REQUEST_FIELDS`) that revision ``info`` cannot serve —
    :func:`mlx_fleet.capabilities.satisfies` over its
    :func:`~node_agent.serving.capabilities.model_capabilities`, the fleet router's answer word
    for word (``wrong_model_task`` for a model of the other task, ``unsupported_parameter`` /
    ``unsupported_value`` for a capability it lacks) — or None when it can. ``max_choices``:
    the core's bound on ``n`` (its ``max_choices``, ``--max-choices``)."""
    missing = satisfies(model_capabilities(info, max_choices=max_choices),
                        required_capabilities(path, fields))
    if missing is None:
        return None
    return _error(400, missing.message(model), param=missing.param, code=missing.code,
                  headers=headers)


def wrong_task(e: WrongTask, headers: dict[str, str]) -> web.Response:
    """400 ``wrong_model_task`` naming ``model``: the serving core refused a request for
    another task than the model's (``spec.model.task``); the same answer as :func:`refusal`'s."""
    return _error(400, str(e), param="model", code=WRONG_MODEL_TASK, headers=headers)


async def serve_on(request: web.Request, core: ServingCore, router: Callable[[], Any],
                   forward: Forwarder, model: str, user: str | None
                   ) -> Served | web.StreamResponse:
    """Route ``request`` for ``model`` (session key: the ``X-Session-ID`` header, else
    ``user``): the revision here that serves it (loaded first if it was on standby; labels the
    request with the model and revision), or the answer to send instead — an error, or the
    forwarded request's answer when another node serves the routed revision. A forward that
    the other node answers 404 (it no longer holds the revision) is served here by the stable
    side of the split instead."""
    if core.failure is not None:
        return _error(503, "this node cannot serve: its serving core failed",
                      type_="server_error", code="unavailable")
    tm = router()
    routed = None
    revision: str | None = None
    if tm is not None:
        pinned = request.headers.get(PIN_HEADER, "") if request.get(FLEET_INTERNAL) else ""
        routed = tm.route(model, session_header=request.headers.get(SESSION_HEADER),
                          user=user, pinned=pinned)
        if routed is None:
            return not_found(model)
        if routed.route.forward:
            relayed = await forward(request, routed, await request.read())
            if relayed is not None:
                return relayed
            # the candidate's node no longer serves it: its canary has just ended (the split
            # goes before the candidate unloads, but this node may not have seen it yet)
            routed = tm.route(model, session_header=request.headers.get(SESSION_HEADER),
                              user=user, stable=True)
            if routed is None:
                return not_found(model)
        revision = routed.route.revision
        if routed.standby:  # unloaded while idle: reload it (once), then serve
            try:
                await tm.ensure_loaded(model, revision)
            except Overloaded as e:
                return _error(429, f"Too many requests: {e}", type_="rate_limit_error",
                              code="overloaded",
                              headers={"Retry-After": str(e.retry_after_seconds),
                                       REVISION_HEADER: revision})
            except ModelNotLoaded:
                return not_found(model)
            except ModelLoadError as e:
                return _error(503, f"revision {revision} of model '{model}' was "
                              f"unloaded while idle and could not be reloaded ({e.reason})",
                              type_="server_error",
                              code="model_reload_failed",
                              headers={REVISION_HEADER: revision})
        tm.touch(model, revision)
    try:
        info = core.model_info(model, revision)
    except ModelNotLoaded:
        return not_found(model)
    # labelled only now that the model is known to be loaded (bounded label values)
    request[MODEL] = model
    request[REVISION] = info.revision
    return Served(info, tm, routed, {REVISION_HEADER: info.revision})


class Outcome:
    """Times one request for the per-revision statistics (only when it is under a split):
    end-to-end latency, time to first token, decode time of its tokens; :meth:`done` reports it
    once. A request that never reaches :meth:`done` (the client hung up) is not counted."""

    __slots__ = ("tm", "routed", "t0", "first", "last", "tokens", "reported")

    def __init__(self, tm: Any, routed: Any) -> None:
        self.tm, self.routed = tm, routed
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.reported = False

    def token(self, completion_tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens = completion_tokens

    def done(self, *, failed: bool) -> None:
        if self.reported or self.tm is None or self.routed is None:
            return
        self.reported = True
        now = time.perf_counter()
        self.tm.record(self.routed, latency_s=now - self.t0,
                       ttft_s=None if self.first is None else self.first - self.t0,
                       completion_tokens=self.tokens,
                       decode_seconds=None if self.first is None or self.last is None
                       else self.last - self.first, failed=failed)
