"""Retry on the next Mac, or give up: a pure decision, within a retry budget.

:func:`decide` (config, budget, the attempt's :class:`Outcome`, attempts so far, Macs left,
``now``) → (:class:`Decision`, budget). The rule (issue #17 §3):

* **nothing is retried once a byte went to the client** (``Outcome.bytes_sent``): its response
  has begun; the stream is cut (``BytesSent``);
* before that, retryable: a connection error (refused, unreachable, TLS, connect timeout), a
  connection reset or closed before the response's first byte, a timeout waiting for it, and the
  statuses in :data:`RETRYABLE_STATUSES` — 502, 503, 504, the agent's 429 (its admission
  queue is full; another Mac may have room) and its 404 (the router only sends a model to Macs
  its table says serve it, so a 404 means the Mac dropped the model — drained or unassigned —
  a watch event before the table saw it). Any other status is the answer (``NotRetryable``);
* at most ``max_attempts`` attempts in all (``AttemptsExhausted``), and only while a Mac is left
  to try (``NoMoreMacs``);
* within the **retry budget** (``BudgetExhausted``): over the last ``window_seconds``, the
  retries, this one included, are at most ``min_retries + ratio × requests`` — Finagle's
  ``RetryBudget`` (a ``ttl`` window, ``minRetriesPerSec``, ``percentCanRetry`` = 0.2) and
  Envoy's ``retry_budget`` (``budget_percent`` 20 %, with ``min_retry_concurrency`` as its
  floor). On a sick fleet the router then adds at most a fifth to the load, plus the floor,
  instead of multiplying it by ``max_attempts``.

The budget is a state record of :data:`BUDGET_SLOTS` time slots (the window slides slot by
slot), advanced by :func:`record_request` for each client request and by :func:`decide` for each
retry it allows. Pure: standard library only; ``now`` is seconds of a monotonic clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Literal

__all__ = ["RETRYABLE_STATUSES", "BUDGET_SLOTS", "RetryConfig", "Budget", "Outcome", "Decision",
           "retryable", "record_request", "decide"]

#: Upstream statuses worth another Mac before the first byte: 502/503/504 (a gateway or
#: server failure of that Mac), 429 (the agent's admission is full) and 404 (the Mac no longer
#: serves the model: the routing table is one watch event behind it).
RETRYABLE_STATUSES = frozenset({404, 429, 502, 503, 504})
#: Time slots of the budget's window.
BUDGET_SLOTS = 10


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """``max_attempts`` (3): attempts per request, the first included — the ring owner and two
    more Macs (gRPC's retry policy caps ``maxAttempts`` at 5, gRFC A6). ``window_seconds``
    (10 s, Finagle's ``ttl``), ``ratio`` (0.2: Finagle's ``percentCanRetry``, Envoy's
    ``budget_percent``) and ``min_retries`` (10 per window, i.e. 1/s; Finagle's default floor is
    10/s for RPC services, a Mac serves a few requests a second): the retry budget."""

    max_attempts: int = 3
    window_seconds: float = 10.0
    ratio: float = 0.2
    min_retries: int = 10

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.window_seconds <= 0 or self.ratio < 0 \
                or self.min_retries < 0:
            raise ValueError("max_attempts >= 1, window_seconds > 0, ratio >= 0, "
                             "min_retries >= 0")


@dataclass(frozen=True, slots=True)
class Slot:
    """Requests and retries of one time slot (``index = floor(t / (window / BUDGET_SLOTS))``)."""

    index: int
    requests: int = 0
    retries: int = 0


@dataclass(frozen=True, slots=True)
class Budget:
    """The retry budget's recent history: the slots of the last window, oldest first."""

    slots: tuple[Slot, ...] = ()

    def totals(self, config: RetryConfig, now: float) -> tuple[int, int]:
        """``(requests, retries)`` in the window ending at ``now``."""
        kept = _kept(config, self.slots, now)
        return sum(s.requests for s in kept), sum(s.retries for s in kept)


def _index(config: RetryConfig, t: float) -> int:
    return math.floor(t / (config.window_seconds / BUDGET_SLOTS))


def _kept(config: RetryConfig, slots: tuple[Slot, ...], now: float) -> list[Slot]:
    oldest = _index(config, now) - BUDGET_SLOTS + 1
    return [s for s in slots if s.index >= oldest]


def _add(config: RetryConfig, budget: Budget, now: float, requests: int, retries: int) -> Budget:
    kept = _kept(config, budget.slots, now)
    index = _index(config, now)
    if kept and kept[-1].index == index:
        last = kept[-1]
        kept[-1] = replace(last, requests=last.requests + requests,
                           retries=last.retries + retries)
    else:
        kept.append(Slot(index, requests, retries))
    return Budget(tuple(kept))


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended, as far as a retry cares.

    ``kind``: ``"connect_error"`` (no connection: refused, unreachable, TLS or connect
    timeout), ``"reset"`` (the connection closed or reset before the response's status line),
    ``"timeout"`` (no response start in time), ``"status"`` (the upstream answered ``status``).
    ``bytes_sent``: some of the response already went to the client."""

    kind: Literal["connect_error", "reset", "timeout", "status"]
    status: int | None = None
    bytes_sent: bool = False


Reason = Literal["Retry", "BytesSent", "NotRetryable", "AttemptsExhausted", "NoMoreMacs",
                 "BudgetExhausted"]


@dataclass(frozen=True, slots=True)
class Decision:
    """``retry``: send the request to the next Mac. ``reason``: why (a bounded label for the
    retries metric): ``Retry``, or why not."""

    retry: bool
    reason: Reason


def retryable(outcome: Outcome) -> bool:
    """Could another Mac answer instead? Only before any byte went to the client, for a
    connection error, a reset, a timeout or a status in :data:`RETRYABLE_STATUSES`."""
    if outcome.bytes_sent:
        return False
    if outcome.kind == "status":
        return outcome.status in RETRYABLE_STATUSES
    return True


def record_request(config: RetryConfig, budget: Budget, now: float) -> Budget:
    """The budget after one more client request (its first attempt) at ``now``."""
    return _add(config, budget, now, 1, 0)


def decide(config: RetryConfig, budget: Budget, outcome: Outcome, *, attempts: int,
           macs_left: int, now: float) -> tuple[Decision, Budget]:
    """Retry the request whose attempt number ``attempts`` (1 for the first) ended with
    ``outcome``, with ``macs_left`` untried Macs? Returns the decision and the budget (one more
    retry counted when it says retry). Checks in this order: bytes sent, retryable, attempts,
    Macs left, budget (module docstring)."""
    if outcome.bytes_sent:
        return Decision(False, "BytesSent"), budget
    if not retryable(outcome):
        return Decision(False, "NotRetryable"), budget
    if attempts >= config.max_attempts:
        return Decision(False, "AttemptsExhausted"), budget
    if macs_left < 1:
        return Decision(False, "NoMoreMacs"), budget
    requests, retries = budget.totals(config, now)
    # retries + 1 <= min_retries + ratio × requests, exactly (ratio as its decimal repr)
    if retries + 1 > config.min_retries + Fraction(repr(float(config.ratio))) * requests:
        return Decision(False, "BudgetExhausted"), budget
    return Decision(True, "Retry"), _add(config, budget, now, 0, 1)
