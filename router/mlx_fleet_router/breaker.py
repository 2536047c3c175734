"""The circuit breaker of one Mac: a state record and a pure step.

Phases::

    closed ──error rate, probe failures, refused connection──▶ open
    open ──cooldown elapsed──▶ half-open ──trial succeeds──▶ closed
                                        └──trial fails────▶ open (a new cooldown)

Triggers (defaults from seed 004's "Circuit Breaking": "Timeout: >10s response time; Error
rate: >10% failure rate (30s window); Health check: 3 consecutive failures; Auto-recovery after
60s cooldown"):

* **error rate**: over the last ``window_seconds``, at least ``min_requests`` finished requests
  and failures / requests **>** ``error_ratio``. A request *fails* when the Mac failed it
  (:class:`Finished` with ``ok=False``: a 5xx, a reset, a timeout) or when its response began
  later than ``slow_seconds`` after it was sent; a 4xx (the client's fault, or the agent's own
  429 admission refusal) is ``ok=True`` here.
* **health probes**: ``probe_failures`` consecutive failed health probes (:class:`Probed`).
* **passive ejection**: a refused connection (:class:`Refused`) opens the breaker at once —
  nothing listens there; the Mac is out of the candidate set before its lease expires.

After ``cooldown_seconds`` open, the breaker is half-open: it lets **one** trial through — the
first request or probe sent (:class:`Sent`) — and the trial's outcome decides: success → closed
(a fresh window), failure → open again. A trial whose outcome has not come back within
``slow_seconds`` no longer holds the slot (it counts as lost; another may go).

The window is a ring of ``WINDOW_SLOTS`` time slots (Hystrix's rolling statistics: 10 buckets
per window, ``metrics.rollingStats.numBuckets``), so the state stays small whatever the request
rate; a slot leaves the window as a whole once its start is ``window_seconds`` old.

Pure: standard library only; ``now`` is seconds of a monotonic clock. The router keeps one
:class:`State` per Mac, feeds each event through :func:`step`, asks :func:`admits` before it
sends (the picker does), and exports :func:`phase` (not the stored one: an open breaker past its
cooldown is half-open) as a metric.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from fractions import Fraction

__all__ = ["Phase", "BreakerConfig", "State", "CLOSED", "Finished", "Probed", "Refused",
           "Sent", "Event", "step", "admits", "phase", "WINDOW_SLOTS"]

#: Time slots in the error-rate window (Hystrix's default ``numBuckets``, 10).
WINDOW_SLOTS = 10


class Phase(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds; every default is seed 004's except ``min_requests``.

    ``window_seconds`` (30 s) and ``error_ratio`` (0.10, open when strictly above):
    the error-rate trigger. ``min_requests`` (10): fewer finished requests in the window never
    open it (Hystrix's ``requestVolumeThreshold`` is 20 per 10 s; a Mac serves a few requests a
    second, so 10 per 30 s). ``slow_seconds`` (10 s): a response that began later counts as a
    failure, and a half-open trial older than this stops holding the slot.
    ``probe_failures`` (3): consecutive failed health probes that open it.
    ``cooldown_seconds`` (60 s): open before half-open."""

    window_seconds: float = 30.0
    error_ratio: float = 0.10
    min_requests: int = 10
    slow_seconds: float = 10.0
    probe_failures: int = 3
    cooldown_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not (self.window_seconds > 0 and self.slow_seconds > 0 and self.cooldown_seconds >= 0):
            raise ValueError("window_seconds and slow_seconds must be > 0, cooldown_seconds >= 0")
        if not 0 <= self.error_ratio < 1 or self.min_requests < 1 or self.probe_failures < 1:
            raise ValueError("error_ratio in [0, 1), min_requests >= 1, probe_failures >= 1")


@dataclass(frozen=True, slots=True)
class Slot:
    """Finished requests of one time slot: ``index`` = ``floor(t / (window / WINDOW_SLOTS))``."""

    index: int
    requests: int = 0
    failures: int = 0


@dataclass(frozen=True, slots=True)
class State:
    """One Mac's breaker. ``phase`` as stored (an open one whose cooldown elapsed is half-open:
    :func:`phase`); ``since``: when that phase began (s); ``reason``: why it last opened
    (``ErrorRate``, ``HealthProbes``, ``ConnectionRefused``, ``TrialFailed``; a bounded label
    set), ``""`` before; ``window``: the closed phase's recent requests; ``probe_failures``:
    consecutive failed probes; ``trial_since``: when the half-open trial was sent, None while
    none is out."""

    phase: Phase = Phase.CLOSED
    since: float = 0.0
    reason: str = ""
    window: tuple[Slot, ...] = ()
    probe_failures: int = 0
    trial_since: float | None = None


#: A Mac never seen failing.
CLOSED = State()


@dataclass(frozen=True, slots=True)
class Finished:
    """A request to the Mac got its answer's start (status line) or failed before it.
    ``ok``: False when the Mac failed it (5xx, reset, timeout); ``seconds``: from sending to
    the response's start."""

    ok: bool
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Probed:
    """A health probe of the Mac finished; ``ok``: it answered healthy."""

    ok: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """A connection to the Mac was refused (nothing listens): passive ejection."""


@dataclass(frozen=True, slots=True)
class Sent:
    """A request or probe is being sent to the Mac (in half-open, it takes the trial slot)."""


Event = Finished | Probed | Refused | Sent


def phase(config: BreakerConfig, state: State, now: float) -> Phase:
    """The phase at ``now``: an open breaker whose cooldown has elapsed is half-open."""
    if state.phase is Phase.OPEN and now - state.since >= config.cooldown_seconds:
        return Phase.HALF_OPEN
    return state.phase


def admits(config: BreakerConfig, state: State, now: float) -> bool:
    """May a request go to this Mac now? Closed: yes. Open: no. Half-open: yes while no
    trial is out (or the one out is older than ``slow_seconds``)."""
    p = phase(config, state, now)
    if p is Phase.CLOSED:
        return True
    if p is Phase.OPEN:
        return False
    return state.trial_since is None or now - state.trial_since >= config.slow_seconds


def _open(now: float, reason: str) -> State:
    return State(phase=Phase.OPEN, since=now, reason=reason)


def _closed(now: float, reason: str) -> State:
    return State(phase=Phase.CLOSED, since=now, reason=reason)


def _record(config: BreakerConfig, window: tuple[Slot, ...], now: float,
            failed: bool) -> tuple[Slot, ...]:
    width = config.window_seconds / WINDOW_SLOTS
    index = math.floor(now / width)
    oldest = math.floor((now - config.window_seconds) / width) + 1
    kept = [s for s in window if s.index >= oldest]
    if kept and kept[-1].index == index:
        last = kept[-1]
        kept[-1] = replace(last, requests=last.requests + 1, failures=last.failures + failed)
    else:
        kept.append(Slot(index, 1, int(failed)))
    return tuple(kept)


def step(config: BreakerConfig, state: State, event: Event, now: float) -> State:
    """The breaker after ``event`` at ``now`` (module docstring). Never raises."""
    p = phase(config, state, now)
    if p is Phase.HALF_OPEN and state.phase is Phase.OPEN:
        state = State(phase=Phase.HALF_OPEN, since=state.since + config.cooldown_seconds,
                      reason=state.reason)
    if isinstance(event, Refused):
        return _open(now, "ConnectionRefused")
    if isinstance(event, Sent):
        if p is Phase.HALF_OPEN and admits(config, state, now):
            return replace(state, trial_since=now)
        return state
    if p is Phase.OPEN:
        return state
    if isinstance(event, Probed):
        if p is Phase.HALF_OPEN:
            return _closed(now, state.reason) if event.ok else _open(now, "TrialFailed")
        n = 0 if event.ok else state.probe_failures + 1
        if n >= config.probe_failures:
            return _open(now, "HealthProbes")
        return replace(state, probe_failures=n)
    failed = not event.ok or event.seconds > config.slow_seconds
    if p is Phase.HALF_OPEN:
        return _open(now, "TrialFailed") if failed else _closed(now, state.reason)
    window = _record(config, state.window, now, failed)
    requests = sum(s.requests for s in window)
    failures = sum(s.failures for s in window)
    # failures / requests > ratio, exactly (the ratio as its decimal repr: 0.1 is 1/10)
    ratio = Fraction(repr(config.error_ratio))
    if requests >= config.min_requests and failures > ratio * requests:
        return _open(now, "ErrorRate")
    return replace(state, window=window)

