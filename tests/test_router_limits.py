"""The fleet router's admission (mlx_fleet_router.limits): per-tenant token buckets (requests
and tokens per minute, concurrent requests) with an honest Retry-After, and the bounded
backpressure queue."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_fleet_router.limits import (Admission, QueueConfig, QueueDecision, TenantLimits,
                                     TenantState, admit, backpressure, release)


def admit_n(limits: TenantLimits, state: TenantState, n: int,
            now: float) -> tuple[list[Admission], TenantState]:
    out = []
    for _ in range(n):
        a, state = admit(limits, state, now)
        out.append(a)
    return out, state


def test_no_limits_admit_everything() -> None:
    verdicts, s = admit_n(TenantLimits(), TenantState(), 1000, 0.0)
    assert all(v.admitted for v in verdicts) and s.concurrent == 1000


def test_requests_per_minute_burst_then_refill() -> None:
    lim = TenantLimits(requests_per_minute=60)
    verdicts, s = admit_n(lim, TenantState(), 60, 0.0)   # a full bucket: one minute's worth
    assert all(v.admitted for v in verdicts)
    refused, s2 = admit(lim, s, 0.0)
    assert refused == Admission(False, "RequestsPerMinute", 1) and s2 == s  # takes nothing
    assert not admit(lim, s, 0.99)[0].admitted
    assert admit(lim, s, 1.0)[0].admitted                 # one per second comes back


def test_retry_after_is_when_the_bucket_holds_a_request() -> None:
    lim = TenantLimits(requests_per_minute=2)
    _, s = admit_n(lim, TenantState(), 2, 0.0)
    a, _ = admit(lim, s, 0.0)
    assert a == Admission(False, "RequestsPerMinute", 30)
    a, _ = admit(lim, s, 10.0)
    assert a.retry_after == 20
    assert not admit(lim, s, 29.9)[0].admitted and admit(lim, s, 30.0)[0].admitted


def test_tokens_per_minute_charged_after_the_response() -> None:
    lim = TenantLimits(tokens_per_minute=600)
    a, s = admit(lim, TenantState(), 0.0)
    assert a.admitted                                    # the cost is unknown beforehand
    s = release(lim, s, 1000, 0.0)                       # 400 tokens in debt
    assert s.concurrent == 0
    a, _ = admit(lim, s, 0.0)
    assert a == Admission(False, "TokensPerMinute", 41)  # 400 / 10 per s, then above 0
    assert not admit(lim, s, 40.0)[0].admitted           # exactly 0: not above it
    assert admit(lim, s, 41.0)[0].admitted


def test_concurrent_requests() -> None:
    lim = TenantLimits(max_concurrent=2)
    verdicts, s = admit_n(lim, TenantState(), 3, 0.0)
    assert [v.admitted for v in verdicts] == [True, True, False]
    assert verdicts[2] == Admission(False, "ConcurrentRequests", 1)
    s = release(lim, s, 0, 1.0)
    assert admit(lim, s, 1.0)[0].admitted


def test_several_limits_refusing_name_the_longest_wait() -> None:
    lim = TenantLimits(requests_per_minute=1, max_concurrent=1)
    _, s = admit(lim, TenantState(), 0.0)
    a, _ = admit(lim, s, 0.0)
    assert a == Admission(False, "RequestsPerMinute", 60)


def test_a_clock_that_goes_back_refills_nothing() -> None:
    lim = TenantLimits(requests_per_minute=1)
    _, s = admit(lim, TenantState(), 100.0)
    assert not admit(lim, s, 50.0)[0].admitted


@pytest.mark.parametrize("kw", [dict(requests_per_minute=0), dict(tokens_per_minute=-1),
                                dict(max_concurrent=0)])
def test_limits_reject_nonsense(kw: dict) -> None:
    with pytest.raises(ValueError):
        TenantLimits(**kw)


def test_release_rejects_negative_usage() -> None:
    with pytest.raises(ValueError):
        release(TenantLimits(), TenantState(concurrent=1), -1, 0.0)


@settings(max_examples=100, deadline=None)
@given(rpm=st.integers(1, 600), tpm=st.integers(1, 100_000), burst=st.integers(1, 50),
       usage=st.integers(0, 200_000), t0=st.floats(0, 1e6))
def test_retry_after_is_honest(rpm: int, tpm: int, burst: int, usage: int, t0: float) -> None:
    """After a refusal, the same request is refused a second before its Retry-After (when that
    is more than a second) and admitted at it, if nothing else happens meanwhile."""
    lim = TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm)
    s = TenantState()
    for _ in range(burst):
        a, s = admit(lim, s, t0)
        if a.admitted:
            s = release(lim, s, usage // burst, t0)
    a, _ = admit(lim, s, t0)
    if a.admitted:
        return
    assert a.retry_after >= 1 and a.limit in ("RequestsPerMinute", "TokensPerMinute")
    assert admit(lim, s, t0 + a.retry_after)[0].admitted
    if a.retry_after > 1:
        assert not admit(lim, s, t0 + a.retry_after - 1)[0].admitted


@pytest.mark.parametrize(("saturated", "queued", "enqueued_at", "now", "expected"), [
    (False, 99, None, 0.0, QueueDecision("proceed")),
    (False, 0, 3.0, 5.0, QueueDecision("proceed")),          # a queued request whose Mac freed
    (True, 0, None, 0.0, QueueDecision("queue")),
    (True, 63, None, 0.0, QueueDecision("queue")),
    (True, 64, None, 0.0, QueueDecision("refuse", "QueueFull", 10)),
    (True, 10, 0.0, 9.9, QueueDecision("wait")),
    (True, 10, 0.0, 10.0, QueueDecision("refuse", "QueueTimeout", 10)),
])
def test_backpressure_queue(saturated: bool, queued: int, enqueued_at: float | None,
                            now: float, expected: QueueDecision) -> None:
    assert backpressure(QueueConfig(), saturated=saturated, queued=queued,
                        enqueued_at=enqueued_at, now=now) == expected


def test_backpressure_without_a_queue_refuses_at_once_with_at_least_a_second() -> None:
    cfg = QueueConfig(max_queued=0, max_wait_seconds=0.2)
    assert backpressure(cfg, saturated=True, queued=0, enqueued_at=None, now=0.0) == \
        QueueDecision("refuse", "QueueFull", 1)
    with pytest.raises(ValueError):
        QueueConfig(max_wait_seconds=0)
