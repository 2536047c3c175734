"""Admission at the router: per-tenant token buckets, and the backpressure queue when every Mac is
saturated. Pure decisions over small state records.

**Per-tenant limits** (issue #17 §4; AIBrix's and OpenAI's RPM/TPM): a tenant (named by its API
key in the key file, never by request input) may have

* ``requests_per_minute`` — a token bucket of that capacity, refilled continuously at
  capacity / 60 per second; each admitted request takes 1;
* ``tokens_per_minute`` — likewise, charged *after* the response with its usage (prompt +
  completion tokens, :func:`release`); a request is admitted while the level is above 0, so one
  large response can leave it in debt, and the tenant waits until it is paid back;
* ``max_concurrent`` — requests admitted and not yet released.

A full bucket holds one minute's worth: a tenant idle for a minute may send that minute's quota
at once (the token bucket's burst, as Envoy's local rate limit ``max_tokens``). A refusal names
the limit and a ``Retry-After`` in whole seconds, at least 1 (RFC 9110 §10.2.3 delay-seconds):
when the bucket will hold what the request needs; 1 for the concurrency limit (a request may
finish any moment). A refused request takes nothing.

**Backpressure** (:func:`backpressure`): when every candidate Mac is at its admission limit
(:attr:`~mlx_fleet_router.picker.Pick.saturated`), the request waits in a bounded queue — at
most ``max_queued`` requests, each at most ``max_wait_seconds`` — and is then refused with 429
and a ``Retry-After`` of ``ceil(max_wait_seconds)``: by then every request queued now has left
the queue.

Pure: standard library only; ``now`` is seconds of a monotonic clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["TenantLimits", "Bucket", "TenantState", "Admission", "admit", "release",
           "QueueConfig", "QueueDecision", "backpressure"]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits; None: no such limit. Each given one is >= 1 (ValueError)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket's ``level`` (tokens; negative while in debt) as of ``updated`` (s)."""

    level: float
    updated: float


def _level(bucket: Bucket | None, per_minute: int, now: float) -> float:
    """The level at ``now``: refilled at ``per_minute / 60`` per second, capped at
    ``per_minute``; an unused bucket (None) is full. A ``now`` before ``updated`` (a clock
    that went back) refills nothing."""
    if bucket is None:
        return float(per_minute)
    return min(float(per_minute),
               bucket.level + max(0.0, now - bucket.updated) * per_minute / 60.0)


#: Floating-point slack (tokens) of the bucket comparisons: a level that a refill brought to
#: 0.9999999999 of the one request it waited for admits it.
_SLACK = 1e-9


def _wait(level: float, need: float, per_minute: int) -> int:
    """Whole seconds (>= 1) until a bucket at ``level`` holds at least ``need``."""
    return max(1, math.ceil((need - level) * 60.0 / per_minute - _SLACK))


def _wait_above(level: float, per_minute: int) -> int:
    """Whole seconds (>= 1) until a bucket at ``level`` <= 0 is above 0."""
    return math.floor(-level * 60.0 / per_minute + _SLACK) + 1


@dataclass(frozen=True, slots=True)
class TenantState:
    """One tenant's buckets (None: never used, full) and its requests in progress."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    concurrent: int = 0


Limit = Literal["", "RequestsPerMinute", "TokensPerMinute", "ConcurrentRequests"]


@dataclass(frozen=True, slots=True)
class Admission:
    """``admitted``; else ``limit`` names the limit that refused (a bounded metric label) and
    ``retry_after`` the seconds for the ``Retry-After`` header (0 when admitted). Several
    limits refusing at once: the one with the longest wait."""

    admitted: bool
    limit: Limit = ""
    retry_after: int = 0


def admit(limits: TenantLimits, state: TenantState, now: float) -> tuple[Admission, TenantState]:
    """Admit one request of the tenant at ``now``? Returns the verdict and the tenant's state:
    on admission one request taken from the requests bucket and one more in progress; on a
    refusal the state unchanged."""
    refusals: list[tuple[int, Limit]] = []
    rpm, tpm, conc = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    req_level = _level(state.requests, rpm, now) if rpm is not None else 0.0
    if rpm is not None and req_level < 1.0 - _SLACK:
        refusals.append((_wait(req_level, 1.0, rpm), "RequestsPerMinute"))
    if tpm is not None:
        tok_level = _level(state.tokens, tpm, now)
        if tok_level <= _SLACK:
            refusals.append((_wait_above(tok_level, tpm), "TokensPerMinute"))
    if conc is not None and state.concurrent >= conc:
        refusals.append((1, "ConcurrentRequests"))
    if refusals:
        wait, limit = max(refusals, key=lambda r: r[0])
        return Admission(False, limit, wait), state
    requests = Bucket(req_level - 1.0, now) if rpm is not None else state.requests
    return Admission(True), replace(state, requests=requests, concurrent=state.concurrent + 1)


def release(limits: TenantLimits, state: TenantState, tokens: int, now: float) -> TenantState:
    """An admitted request finished at ``now`` with ``tokens`` of usage (prompt + completion,
    0 when the response had none): one fewer in progress, the tokens charged to the
    tokens-per-minute bucket."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    bucket = state.tokens
    if limits.tokens_per_minute is not None:
        bucket = Bucket(_level(state.tokens, limits.tokens_per_minute, now) - tokens, now)
    return replace(state, tokens=bucket, concurrent=max(0, state.concurrent - 1))


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """``max_queued`` (64): requests waiting at once, per deployment and router process.
    ``max_wait_seconds`` (10 s): the longest one waits — seed 004 counts a response slower than
    10 s as a failure, so waiting longer serves nobody."""

    max_queued: int = 64
    max_wait_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.max_queued < 0 or self.max_wait_seconds <= 0:
            raise ValueError("max_queued >= 0 and max_wait_seconds > 0")


@dataclass(frozen=True, slots=True)
class QueueDecision:
    """``action``: ``"proceed"`` (a Mac has room: send it), ``"queue"`` (join the queue),
    ``"wait"`` (stay queued), ``"refuse"`` (429). ``reason`` for a refusal: ``QueueFull`` or
    ``QueueTimeout``; ``retry_after``: seconds, >= 1 on a refusal, else 0."""

    action: Literal["proceed", "queue", "wait", "refuse"]
    reason: Literal["", "QueueFull", "QueueTimeout"] = ""
    retry_after: int = 0


def backpressure(config: QueueConfig, *, saturated: bool, queued: int,
                 enqueued_at: float | None, now: float) -> QueueDecision:
    """What one request does while the fleet may be saturated. ``saturated``: every candidate
    is at its admission limit (the picker's verdict, now). ``queued``: requests in the queue
    now, not counting this one. ``enqueued_at``: when this request joined the queue, None if
    it has not. Ask again on every change of the Macs' in-flight counts, and at the
    deadline."""
    if not saturated:
        return QueueDecision("proceed")
    retry_after = max(1, math.ceil(config.max_wait_seconds))
    if enqueued_at is None:
        if queued >= config.max_queued:
            return QueueDecision("refuse", "QueueFull", retry_after)
        return QueueDecision("queue")
    if now - enqueued_at >= config.max_wait_seconds:
        return QueueDecision("refuse", "QueueTimeout", retry_after)
    return QueueDecision("wait")
