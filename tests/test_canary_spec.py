"""Canary spec parsing: defaults, the camelCase schema, durations, errors naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_fleet.contract import LocalGuard
from mlx_fleet_operator.canary_spec import (DEFAULT_STEPS, CanarySpecError, parse_canary_spec,
                                            parse_duration, to_local_guard)

MINIMAL = {"targetRef": {"name": "llm"}, "candidate": {"revision": "v2"}}


def test_defaults_are_the_issue_thresholds():
    s = parse_canary_spec(MINIMAL)
    assert s.target_ref.name == "llm"
    assert (s.candidate.revision, s.candidate.source, s.candidate.memory_bytes) == (
        "v2", None, None)
    assert [st.set_weight for st in s.steps] == [1, 10, 50, 100]
    assert all(st.pause is None for st in s.steps)
    a = s.analysis
    assert (a.interval_seconds, a.min_requests, a.failure_limit) == (10.0, 20, 1)
    c = a.checks
    assert (c.error_rate.enabled, c.error_rate.max_ratio, c.error_rate.floor,
            c.error_rate.max_absolute) == (True, 2.0, 0.01, None)
    assert (c.latency_p95.max_ratio, c.latency_p95.max_seconds) == (1.5, None)
    assert (c.ttft_p95.max_ratio, c.ttft_p95.max_seconds) == (1.5, None)
    assert (c.tokens_per_second.min_ratio, c.tokens_per_second.min_absolute) == (0.67, None)
    assert c.memory_growth.max_per_hour == 0.2
    assert c.crash_rate.max_per_request == 0.001
    assert to_local_guard(s) == LocalGuard()  # the contract's defaults


@pytest.mark.parametrize("steps", [None, []])
def test_omitted_or_empty_steps_take_the_default(steps):
    spec = {**MINIMAL} if steps is None else {**MINIMAL, "steps": steps}
    assert parse_canary_spec(spec).steps == DEFAULT_STEPS


def test_every_field_maps_from_camel_case():
    s = parse_canary_spec({
        "targetRef": {"name": "llm", "unknownKey": 1},
        "candidate": {"revision": "v2.1_rc-1", "source": "hf://org/repo", "memory": "2Gi"},
        "steps": [{"setWeight": 5}, {"pause": {"duration": "1m30s"}}, {"setWeight": 5},
                  {"pause": {}}, {"setWeight": 100}],
        "analysis": {
            "interval": "30s", "minRequests": 50, "failureLimit": 3,
            "checks": {
                "errorRate": {"enabled": False, "maxRatio": 3, "floor": 0.02, "max": 0.05},
                "latencyP95": {"maxRatio": 2, "maxSeconds": 4.5},
                "ttftP95": {"maxRatio": 1.2, "maxSeconds": 0.8},
                "tokensPerSecond": {"minRatio": 0.5, "min": 12},
                "memoryGrowth": {"maxPerHour": 0.1},
                "crashRate": {"max": 0.01},
            },
            "localGuard": {"enabled": False, "window": "500ms", "minFailures": 5,
                           "failureRatio": 0.25},
        },
        "somethingNew": True,
    })
    assert (s.candidate.source, s.candidate.memory_bytes) == ("hf://org/repo", 2 * 1024 ** 3)
    assert [(st.set_weight, st.pause and st.pause.duration_seconds) for st in s.steps] == [
        (5, None), (None, 90.0), (5, None), (None, None), (100, None)]
    assert s.steps[3].pause is not None  # a pause without duration: wait for a promote
    a, c = s.analysis, s.analysis.checks
    assert (a.interval_seconds, a.min_requests, a.failure_limit) == (30.0, 50, 3)
    assert (c.error_rate.enabled, c.error_rate.max_ratio, c.error_rate.floor,
            c.error_rate.max_absolute) == (False, 3.0, 0.02, 0.05)
    assert (c.latency_p95.max_ratio, c.latency_p95.max_seconds) == (2.0, 4.5)
    assert (c.ttft_p95.max_ratio, c.ttft_p95.max_seconds) == (1.2, 0.8)
    assert (c.tokens_per_second.min_ratio, c.tokens_per_second.min_absolute) == (0.5, 12.0)
    assert (c.memory_growth.max_per_hour, c.crash_rate.max_per_request) == (0.1, 0.01)
    assert to_local_guard(s) == LocalGuard(enabled=False, window_seconds=0.5, min_failures=5,
                                           failure_ratio=0.25)
    assert to_local_guard(s.analysis.local_guard) == to_local_guard(s)


@pytest.mark.parametrize("text,seconds", [
    ("500ms", 0.5), ("10s", 10.0), ("5m", 300.0), ("1h", 3600.0), ("1m30s", 90.0),
    ("1.5h", 5400.0), (".25s", 0.25), ("1h2m3s4ms", 3723.004)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10", "0s", "0ms", "-1s", "+1s", "1d", "1 s", "s", "1.s2",
                                  "1h 2m", "10S", 10, None, 1.5])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@given(st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(["ms", "s", "m", "h"])),
                min_size=1, max_size=4))
def test_parse_duration_sums_its_parts(parts):
    seconds = sum(n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)
    text = "".join(f"{n}{u}" for n, u in parts)
    if seconds == 0:
        with pytest.raises(ValueError):
            parse_duration(text)
    else:
        assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("patch,field", [
    ({"targetRef": None}, "spec.targetRef"),
    ({"targetRef": {"name": ""}}, "spec.targetRef.name"),
    ({"candidate": {}}, "spec.candidate.revision"),
    ({"candidate": {"revision": "v 2"}}, "spec.candidate.revision"),
    ({"candidate": {"revision": "v" * 129}}, "spec.candidate.revision"),
    ({"candidate": {"revision": "v2", "source": "relative/path"}}, "spec.candidate.source"),
    ({"candidate": {"revision": "v2", "memory": "0"}}, "spec.candidate.memory"),
    ({"candidate": {"revision": "v2", "memory": "lots"}}, "spec.candidate.memory"),
    ({"steps": [{"setWeight": 101}]}, "spec.steps[0].setWeight"),
    ({"steps": [{"setWeight": 1}, {"setWeight": -1}]}, "spec.steps[1].setWeight"),
    ({"steps": [{"setWeight": 1}, {"pause": {"duration": "soon"}}]},
     "spec.steps[1].pause.duration"),
    ({"steps": [{"setWeight": 1}, {}]}, "spec.steps[1]: must have exactly one key"),
    ({"steps": [{"setWeight": 1, "pause": {}}]}, "spec.steps[0]: must have exactly one key"),
    ({"steps": [{"setWeight": 1}] * 33}, "spec.steps: "),
    ({"analysis": {"interval": "10"}}, "spec.analysis.interval"),
    ({"analysis": {"minRequests": 0}}, "spec.analysis.minRequests"),
    ({"analysis": {"failureLimit": 0}}, "spec.analysis.failureLimit"),
    ({"analysis": {"checks": {"errorRate": {"max": 1.5}}}}, "spec.analysis.checks.errorRate.max"),
    ({"analysis": {"checks": {"errorRate": {"maxRatio": 0}}}},
     "spec.analysis.checks.errorRate.maxRatio"),
    ({"analysis": {"checks": {"latencyP95": {"maxSeconds": -1}}}},
     "spec.analysis.checks.latencyP95.maxSeconds"),
    ({"analysis": {"checks": {"ttftP95": {"maxRatio": "x"}}}},
     "spec.analysis.checks.ttftP95.maxRatio"),
    ({"analysis": {"checks": {"tokensPerSecond": {"min": 0}}}},
     "spec.analysis.checks.tokensPerSecond.min"),
    ({"analysis": {"checks": {"memoryGrowth": {"maxPerHour": 0}}}},
     "spec.analysis.checks.memoryGrowth.maxPerHour"),
    ({"analysis": {"checks": {"crashRate": {"max": 2}}}}, "spec.analysis.checks.crashRate.max"),
    ({"analysis": {"localGuard": {"window": "0s"}}}, "spec.analysis.localGuard.window"),
    ({"analysis": {"localGuard": {"failureRatio": 0}}}, "spec.analysis.localGuard.failureRatio"),
    ({"analysis": {"localGuard": {"minFailures": 0}}}, "spec.analysis.localGuard.minFailures"),
])
def test_errors_name_the_field(patch, field):
    with pytest.raises(CanarySpecError, match="invalid Canary spec") as e:
        parse_canary_spec({**MINIMAL, **patch})
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_all_problems_are_reported_at_once():
    with pytest.raises(CanarySpecError) as e:
        parse_canary_spec({"candidate": {"revision": "v2", "memory": "0"},
                           "analysis": {"interval": "x"}})
    for field in ("spec.targetRef:", "spec.candidate.memory:", "spec.analysis.interval:"):
        assert field in str(e.value)


def test_decreasing_weight_names_the_step_even_across_pauses():
    with pytest.raises(CanarySpecError) as e:
        parse_canary_spec({**MINIMAL, "steps": [{"setWeight": 10}, {"pause": {}},
                                                {"setWeight": 5}]})
    assert "spec.steps[2].setWeight: 5 is below the previous setWeight 10" in str(e.value)


@given(st.lists(st.integers(0, 100), min_size=1, max_size=32))
def test_weights_must_be_non_decreasing(weights):
    spec = {**MINIMAL, "steps": [{"setWeight": w} for w in weights]}
    first_drop = next((i for i in range(1, len(weights)) if weights[i] < weights[i - 1]), None)
    if first_drop is None:
        assert [s.set_weight for s in parse_canary_spec(spec).steps] == weights
    else:
        with pytest.raises(CanarySpecError, match=rf"spec\.steps\[{first_drop}\]\.setWeight"):
            parse_canary_spec(spec)
