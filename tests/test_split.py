"""The canary split (mlx_fleet.routing.split) and the session key it hashes
(mlx_fleet.routing.session): deterministic, sticky, monotone, proportional."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_fleet.contract import SPLIT_BUCKETS, TrafficSplit
from mlx_fleet.routing.session import PREFIX_CHARS, prefix_key, session_key
from mlx_fleet.routing.split import Choice, bucket, choose, is_active

ROOT = Path(__file__).resolve().parents[1]


def _split(weight: int, namespace: str = "team", name: str = "chat") -> TrafficSplit:
    return TrafficSplit(namespace=namespace, name=name, served_model_name="chat",
                        stable_revision="r1", candidate_revision="r2", weight=weight)


def _reference_bucket(deployment: str, key: str) -> int:
    """The documented formula, written out independently of the module."""
    d, k = deployment.encode(), key.encode()
    msg = len(d).to_bytes(8, "big") + d + len(k).to_bytes(8, "big") + k
    return int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") % SPLIT_BUCKETS


KNOWN = [("team/chat", "alice"), ("team/chat", "bob"), ("other/chat", "alice"),
         ("team/chat", ""), ("ns/ünïcode", "séssion-☃")]


@pytest.mark.parametrize(("deployment", "key"), KNOWN)
def test_bucket_is_the_documented_sha256_formula(deployment: str, key: str) -> None:
    assert bucket(deployment, key) == _reference_bucket(deployment, key)


def test_bucket_is_the_same_in_a_fresh_interpreter_with_another_hash_seed() -> None:
    code = ("from mlx_fleet.routing.split import bucket; "
            f"print([bucket(d, k) for d, k in {KNOWN!r}])")
    outs = []
    for seed in ("1", "2"):
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, timeout=60, cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        outs.append(res.stdout.strip())
    expected = str([_reference_bucket(d, k) for d, k in KNOWN])
    assert outs == [expected, expected]


@given(st.text(), st.text())
def test_bucket_in_range_and_stable(deployment: str, key: str) -> None:
    b = bucket(deployment, key)
    assert 0 <= b < SPLIT_BUCKETS
    assert bucket(deployment, key) == b


def test_deployments_split_independently_and_encoding_is_unambiguous() -> None:
    keys = [f"session-{i}" for i in range(5000)]
    same = sum(bucket("team/a", k) == bucket("team/b", k) for k in keys)
    # Without the length prefix ("team/a", "b" + k) and ("team/ab", k) would hash alike.
    glued = sum(bucket("team/a", "b" + k) == bucket("team/ab", k) for k in keys)
    # Independent buckets coincide with probability 1/10 000: ~0.5 expected of 5000.
    assert same <= 5 and glued <= 5


@given(st.text(), st.integers(0, 100), st.integers(0, 100))
def test_monotone_in_weight(key: str, w1: int, w2: int) -> None:
    low, high = sorted((w1, w2))
    if choose(_split(low), key).role == "candidate":
        assert choose(_split(high), key).role == "candidate"
    if choose(_split(high), key).role == "stable":
        assert choose(_split(low), key).role == "stable"


@given(st.text())
def test_weight_0_all_stable_and_100_all_candidate(key: str) -> None:
    assert choose(_split(0), key).role == "stable"
    assert choose(_split(100), key) == Choice("r2", "candidate", bucket("team/chat", key))


@pytest.mark.parametrize("weight", [1, 10, 50, 99])
def test_share_within_one_percent_of_weight(weight: int) -> None:
    n = 100_000
    buckets = [bucket("team/chat", f"session-{i}") for i in range(n)]
    share = sum(b < weight * 100 for b in buckets) / n
    assert abs(share - weight / 100) <= 0.01, share


@pytest.mark.parametrize("remainder", [0, 1, 99])
def test_choice_is_bucket_below_weight_times_100(remainder: int) -> None:
    """A key whose bucket is w × 100 + remainder goes to the candidate from weight w + 1 on."""
    key = next(k for k in (f"k{i}" for i in range(100_000))
               if _reference_bucket("team/chat", k) % 100 == remainder)
    b = _reference_bucket("team/chat", key)
    assert choose(_split(b // 100), key) == Choice("r1", "stable", b)
    assert choose(_split(b // 100 + 1), key) == Choice("r2", "candidate", b)


def test_no_split_or_tripped_guard_goes_stable() -> None:
    assert choose(None, "alice") == Choice("", "stable", None)
    assert choose(_split(100), "alice", guard_tripped=True).revision == "r1"


@pytest.mark.parametrize(("header", "user", "expected"), [
    ("s-1", "u-1", ("s-1", "header")),
    ("s-1", None, ("s-1", "header")),
    (None, "u-1", ("u-1", "user")),
    ("", "u-1", ("u-1", "user")),
    (None, None, ("rnd", "random")),
    ("", "", ("rnd", "random")),
])
def test_session_key_precedence(header: str | None, user: str | None,
                                expected: tuple[str, str]) -> None:
    assert session_key(header, user, random_key=lambda: "rnd") == expected


@pytest.mark.parametrize(("header", "user", "prefix", "expected"), [
    ("s-1", "u-1", "prefix:p", ("s-1", "header")),
    (None, "u-1", "prefix:p", ("u-1", "user")),
    (None, None, "prefix:p", ("prefix:p", "prefix")),
    ("", "", "prefix:p", ("prefix:p", "prefix")),
    (None, None, None, ("rnd", "random")),
    (None, None, "", ("rnd", "random")),
])
def test_session_key_prefix_comes_after_header_and_user(header: str | None, user: str | None,
                                                        prefix: str | None,
                                                        expected: tuple[str, str]) -> None:
    assert session_key(header, user, random_key=lambda: "rnd", prefix=prefix) == expected


def test_session_key_random_default_is_fresh_per_request() -> None:
    (k1, src), (k2, _) = session_key(None, None), session_key(None, None)
    assert src == "random" and k1 and k1 != k2


def _chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


def test_prefix_key_is_the_documented_sha256_of_system_and_first_user_turn() -> None:
    msgs = _chat(("system", "be brief"), ("user", "hi"))
    canon = json.dumps([["system", "be brief"], ["user", "hi"]], sort_keys=True,
                       ensure_ascii=False, separators=(",", ":"))
    assert prefix_key(messages=msgs) == \
        "prefix:" + hashlib.sha256(b"chat\0" + canon.encode()).hexdigest()


def test_prefix_key_stays_while_a_conversation_grows() -> None:
    turn1 = _chat(("system", "be brief"), ("user", "hi"))
    turn2 = turn1 + _chat(("assistant", "hello"), ("user", "tell me more"))
    turn3 = turn2 + _chat(("assistant", "sure"), ("user", "thanks"))
    keys = {prefix_key(messages=m) for m in (turn1, turn2, turn3)}
    assert len(keys) == 1 and None not in keys
    # another conversation (another first turn, or another system prompt) has another key
    assert prefix_key(messages=_chat(("system", "be brief"), ("user", "hey"))) not in keys
    assert prefix_key(messages=_chat(("system", "be long"), ("user", "hi"))) not in keys
    # fields other than role and content don't count
    named = [dict(m, name="alice") for m in turn1]
    assert prefix_key(messages=named) in keys


def test_prefix_key_content_parts_and_odd_messages() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prefix_key(messages=parts) != prefix_key(messages=_chat(("user", "hi")))
    assert prefix_key(messages=parts) == prefix_key(messages=[dict(parts[0])])
    no_user = _chat(("system", "a"), ("assistant", "b"))
    assert prefix_key(messages=no_user) != prefix_key(messages=no_user[:1])  # all of them
    assert prefix_key(messages=["not an object"]).startswith("prefix:")   # still a stable key


@pytest.mark.parametrize(("prompt", "same_as"), [
    ("x" * PREFIX_CHARS + " and then more", "x" * PREFIX_CHARS),
    (["x" * PREFIX_CHARS + "!", "other"], "x" * PREFIX_CHARS),
    (list(range(PREFIX_CHARS + 20)), list(range(PREFIX_CHARS))),
    ([list(range(PREFIX_CHARS + 5)), [1, 2]], list(range(PREFIX_CHARS))),
])
def test_prefix_key_of_a_prompt_is_its_head(prompt, same_as) -> None:
    assert prefix_key(prompt=prompt) == prefix_key(prompt=same_as) is not None
    assert prefix_key(prompt="y" + "x" * PREFIX_CHARS) != prefix_key(prompt="x" * PREFIX_CHARS)
    assert prefix_key(prompt="ab") != prefix_key(prompt=[97, 98])  # text and tokens apart


@pytest.mark.parametrize("body", [dict(), dict(messages=[]), dict(prompt=""), dict(prompt=[]),
                                  dict(prompt=None), dict(prompt=3), dict(prompt=[""])])
def test_prefix_key_none_when_nothing_to_hash(body: dict) -> None:
    assert prefix_key(**body) is None


def test_prefix_key_messages_win_over_prompt() -> None:
    msgs = _chat(("user", "hi"))
    assert prefix_key(messages=msgs, prompt="other") == prefix_key(messages=msgs)


@pytest.mark.parametrize(("split", "active"), [
    (None, False), (_split(0), False), (_split(1), True), (_split(100), True),
    (TrafficSplit(namespace="a", name="b", served_model_name="m", stable_revision="r1",
                  candidate_revision="", weight=50), False),
])
def test_is_active(split: TrafficSplit | None, active: bool) -> None:
    assert is_active(split) is active
