"""The fleet router's retry decision (mlx_fleet_router.retry): what is retried, never after a
byte went to the client, bounded attempts, and the retry budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet_router.retry import (RETRYABLE_STATUSES, Budget, Decision, Outcome, RetryConfig,
                                    decide, record_request, retryable)

CFG = RetryConfig()


def test_defaults() -> None:
    assert (CFG.max_attempts, CFG.window_seconds, CFG.ratio, CFG.min_retries) == (3, 10.0, 0.2,
                                                                                  10)
    assert RETRYABLE_STATUSES == {404, 429, 502, 503, 504}


@pytest.mark.parametrize(("outcome", "expected"), [
    (Outcome("connect_error"), "Retry"),
    (Outcome("reset"), "Retry"),
    (Outcome("timeout"), "Retry"),
    (Outcome("status", 502), "Retry"),
    (Outcome("status", 503), "Retry"),
    (Outcome("status", 504), "Retry"),
    (Outcome("status", 429), "Retry"),      # the agent's admission is full
    (Outcome("status", 500), "NotRetryable"),
    (Outcome("status", 200), "NotRetryable"),
    (Outcome("status", 400), "NotRetryable"),
    (Outcome("status", 404), "Retry"),     # the Mac dropped the model: table a step behind
    (Outcome("status", 503, bytes_sent=True), "BytesSent"),
    (Outcome("reset", bytes_sent=True), "BytesSent"),   # a stream cut mid-body
    (Outcome("timeout", bytes_sent=True), "BytesSent"),
])
def test_what_is_retried(outcome: Outcome, expected: str) -> None:
    d, budget = decide(CFG, Budget(), outcome, attempts=1, macs_left=2, now=0.0)
    assert d == Decision(expected == "Retry", expected)
    assert retryable(outcome) == (expected == "Retry")
    assert budget.totals(CFG, 0.0) == (0, 1 if d.retry else 0)


@pytest.mark.parametrize(("attempts", "macs_left", "expected"), [
    (1, 1, "Retry"), (2, 1, "Retry"), (3, 5, "AttemptsExhausted"), (1, 0, "NoMoreMacs"),
    (3, 0, "AttemptsExhausted"),
])
def test_attempts_and_macs_bound_it(attempts: int, macs_left: int, expected: str) -> None:
    d, _ = decide(CFG, Budget(), Outcome("status", 503), attempts=attempts,
                  macs_left=macs_left, now=0.0)
    assert d.reason == expected


def _retries_allowed(budget: Budget, now: float, config: RetryConfig = CFG) -> int:
    n = 0
    while True:
        d, budget = decide(config, budget, Outcome("connect_error"), attempts=1, macs_left=1,
                           now=now)
        if not d.retry:
            assert d.reason == "BudgetExhausted"
            return n
        n += 1


@pytest.mark.parametrize(("requests", "allowed"), [(0, 10), (4, 10), (5, 11), (100, 30),
                                                   (1000, 210)])
def test_budget_is_the_floor_plus_a_fifth_of_recent_requests(requests: int,
                                                             allowed: int) -> None:
    b = Budget()
    for i in range(requests):
        b = record_request(CFG, b, i * 5.0 / max(requests, 1))  # within 5 s
    assert b.totals(CFG, 5.0) == (requests, 0)
    assert _retries_allowed(b, 5.0) == allowed


def test_the_budget_window_slides() -> None:
    b = Budget()
    for _ in range(10):
        _, b = decide(CFG, b, Outcome("reset"), attempts=1, macs_left=1, now=0.0)
    assert _retries_allowed(b, 9.9) == 0                # the 10 retries are still in the window
    assert b.totals(CFG, 10.0) == (0, 0)                # their slot left it
    assert _retries_allowed(b, 10.0) == 10
    assert len(b.slots) == 1


def test_config_rejects_nonsense() -> None:
    for kw in (dict(max_attempts=0), dict(window_seconds=0), dict(ratio=-0.1),
               dict(min_retries=-1)):
        with pytest.raises(ValueError):
            RetryConfig(**kw)


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.floats(0, 0.5), st.booleans()), max_size=300),
       ratio=st.sampled_from([0.0, 0.1, 0.2, 0.5]), floor=st.integers(0, 5))
def test_retries_never_exceed_the_budget_in_any_window(events: list[tuple[float, bool]],
                                                       ratio: float, floor: int) -> None:
    """Whatever the mix of requests and retry attempts, the retries allowed in each window (the
    slotted one the budget uses) stay within floor + ratio × requests there."""
    cfg = RetryConfig(ratio=ratio, min_retries=floor)
    b, now = Budget(), 0.0
    log: list[tuple[float, str]] = []
    width = cfg.window_seconds / 10
    for dt, is_request in events:
        now += dt
        if is_request:
            b = record_request(cfg, b, now)
            log.append((now, "request"))
        else:
            d, b = decide(cfg, b, Outcome("status", 503), attempts=1, macs_left=1, now=now)
            if d.retry:
                log.append((now, "retry"))
        oldest = int(now / width) - 9
        inside = [kind for t, kind in log if int(t / width) >= oldest]
        assert inside.count("retry") <= floor + ratio * inside.count("request") + 1e-9
        assert b.totals(cfg, now) == (inside.count("request"), inside.count("retry"))
