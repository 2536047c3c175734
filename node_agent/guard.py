"""The agent's local guard for a canary's candidate: a sliding-window failure detector.

:class:`mlx_fleet.contract.LocalGuard`: "Within the last ``window_seconds``, when the candidate
has at least ``min_failures`` failed requests (errors + serving-core crashes) and they are at
least ``failure_ratio`` of its requests, the agent sends all of the deployment's traffic to the
stable revision and reports ``guard_tripped`` at once."

Pure: standard library and :mod:`mlx_fleet.contract` only; the caller passes ``now`` (seconds
of a monotonic clock) to every call.
"""

from __future__ import annotations

from collections import deque

from mlx_fleet.contract import LocalGuard

__all__ = ["CandidateGuard", "MAX_EVENTS"]

#: Most requests the window remembers. Beyond it the oldest are dropped, so under more than
#: this many candidate requests per window the guard judges the most recent ``MAX_EVENTS``.
MAX_EVENTS = 10_000


class CandidateGuard:
    """Sliding-window state machine for one candidate revision.

    ``record(now, failed)`` for each of the candidate's finished requests (and a failed one for
    each serving-core crash that hits it), then ``check(now)``. A request is in the window while
    ``now - t < window_seconds`` (one exactly ``window_seconds`` old has left it). Once tripped
    the guard stays tripped — ``tripped``, ``reason`` — until :meth:`reset`. A disabled guard
    records nothing and never trips.
    """

    def __init__(self, guard: LocalGuard, candidate: str = "") -> None:
        self._events: deque[tuple[float, bool]] = deque()
        self.reset(guard, candidate)

    def reset(self, guard: LocalGuard, candidate: str | None = None) -> None:
        """Start over with new thresholds (a new split or candidate): forget every request and
        clear a trip. ``candidate`` names the revision in the reason (``None``: keep it)."""
        self._guard = guard
        if candidate is not None:
            self._candidate = candidate
        self._events.clear()
        self._failures = 0
        self._reason = ""

    @property
    def guard(self) -> LocalGuard:
        return self._guard

    @property
    def tripped(self) -> bool:
        return bool(self._reason)

    @property
    def reason(self) -> str:
        """Why the guard tripped (one line with the numbers), ``""`` while it has not."""
        return self._reason

    def record(self, now: float, failed: bool) -> None:
        """One finished candidate request at ``now`` (``failed``: a server-side failure)."""
        if not self._guard.enabled or self._reason:
            return
        if len(self._events) >= MAX_EVENTS:
            self._failures -= self._events.popleft()[1]
        self._events.append((now, failed))
        self._failures += failed

    def check(self, now: float) -> str | None:
        """The trip reason if the guard trips now (only this first time), else ``None``."""
        g = self._guard
        if not g.enabled or self._reason:
            return None
        while self._events and now - self._events[0][0] >= g.window_seconds:
            self._failures -= self._events.popleft()[1]
        failures, requests = self._failures, len(self._events)
        # failures / requests >= ratio is exact at the threshold (7/25 >= 0.28); ratio *
        # requests is not (0.28 * 25 > 7 in floating point).
        if failures < g.min_failures or failures / requests < g.failure_ratio:
            return None
        name = f"candidate {self._candidate}" if self._candidate else "candidate"
        self._reason = (f"{name}: {failures} of {requests} requests failed in the last "
                        f"{g.window_seconds:g}s (threshold {g.min_failures} failures and "
                        f"{g.failure_ratio * 100:g}%)")
        self._events.clear()  # no longer needed: tripped until reset
        self._failures = 0
        return self._reason
