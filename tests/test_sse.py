"""The SSE encoder (node_agent/sse.py) against the per-token dict encoding it replaces: every
event must parse (json.loads) to the same object, byte for byte the same as
``json.dumps(event, separators=(",", ":"))``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from node_agent.serving.types import Chunk
from node_agent.sse import DONE, StreamEncoder, choice_part, data_event

RID, CREATED = "chatcmpl-0123abcd", 1_763_900_000


def reference_event(kind: str, model: str, include_usage: bool, choices: list[dict],
                    usage: dict | None = None) -> bytes:
    """The event as the API built it before node_agent.sse: a dict per token, json.dumps."""
    body: dict[str, Any] = {"id": RID, "object": "chat.completion.chunk" if kind == "chat"
                            else "text_completion", "created": CREATED, "model": model,
                            "choices": choices}
    if include_usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def reference_choice(kind: str, text: str, finish: str | None, first: bool = False) -> dict:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {
            "content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


TEXTS = [
    ("plain", "hello"),
    ("empty", ""),
    ("non-ASCII", "grüße, 日本語 🙂"),
    ("JSON escapes", 'a "quoted" \\ back\\slash\nnew\tline \x00\x1f \u2028'),
    ("looks like SSE", "data: [DONE]\n\n"),
]
CASES = [(kind, usage, finish, name, text)
         for kind in ("chat", "text") for usage in (False, True)
         for finish in (None, "stop", "length") for name, text in TEXTS]


@pytest.mark.parametrize("kind,include_usage,finish,name,text", CASES,
                         ids=[f"{k}-usage{u}-{f}-{n}" for k, u, f, n, _ in CASES])
def test_chunk_event_is_the_reference_event(kind: str, include_usage: bool, finish: str | None,
                                            name: str, text: str) -> None:
    model = 'tiny-ü"model'
    enc = StreamEncoder(kind, RID, CREATED, model, include_usage)  # type: ignore[arg-type]
    got = enc.chunk(text, finish)
    want = reference_event(kind, model, include_usage,
                           [reference_choice(kind, text, finish)])
    assert got == want
    assert got.startswith(b"data: ") and got.endswith(b"\n\n")
    assert json.loads(got[len(b"data: "):]) == json.loads(want[len(b"data: "):])


@pytest.mark.parametrize("include_usage", [False, True])
def test_first_chat_event_has_the_role(include_usage: bool) -> None:
    enc = StreamEncoder("chat", RID, CREATED, "tiny", include_usage)
    got = json.loads(enc.first()[len(b"data: "):])
    assert got["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]
    assert enc.first() == reference_event("chat", "tiny", include_usage,
                                          [reference_choice("chat", "", None, first=True)])
    assert ("usage" in got) is include_usage


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_usage_event(kind: str) -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 4}}
    enc = StreamEncoder(kind, RID, CREATED, "tiny", True)  # type: ignore[arg-type]
    assert enc.usage(usage) == reference_event(kind, "tiny", True, [], usage)


def test_chunks_are_the_events_of_those_with_something_to_send() -> None:
    enc = StreamEncoder("chat", RID, CREATED, "tiny", False)
    batch = [Chunk("a", 1), Chunk("", 2), Chunk("ü", 3), Chunk("", 4, "length")]
    assert enc.chunks(batch) == (enc.chunk("a", None) + enc.chunk("ü", None)
                                 + enc.chunk("", "length"))
    assert enc.chunks([Chunk("", 1)]) == b""
    assert enc.chunks([]) == b""


def test_a_chunk_is_encoded_once_for_all_streams() -> None:
    """Coalesced subscribers (other ids, same chunks) share the encoding of the choices."""
    a = StreamEncoder("chat", "chatcmpl-a", CREATED, "tiny", True)
    b = StreamEncoder("chat", "chatcmpl-b", CREATED, "tiny", True)
    chunk = Chunk("shared text", 5)
    before = choice_part.cache_info()
    ea, eb = a.chunks([chunk]), b.chunks([chunk])
    after = choice_part.cache_info()
    assert after.hits - before.hits >= 1
    assert ea.replace(b"chatcmpl-a", b"chatcmpl-b") == eb
    assert json.loads(ea[6:])["id"] == "chatcmpl-a" and json.loads(eb[6:])["id"] == "chatcmpl-b"


def test_done_and_data_event() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert data_event(b'{"error":{}}') == b'data: {"error":{}}\n\n'


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        StreamEncoder("embedding", RID, CREATED, "tiny", False)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_logprobs_events_equal_the_dict_encoding(kind: str, include_usage: bool) -> None:
    """Events with log-probabilities (entries encoded as they are noted, a held token's going
    out with its choice's next event, legacy text offsets running on across events) are byte
    for byte json.dumps of the dict built from all of an event's entries at once."""
    from node_agent.api_responses import chat_logprobs, completion_logprobs
    from node_agent.serving.logprobs import TokenLogprob, TopLogprob

    def entry(i: int, text: str) -> TokenLogprob:
        return TokenLogprob(token_id=i, text=text, bytes=tuple(text.encode()),
                            logprob=-0.5 * i,
                            top=(TopLogprob(text=text, bytes=tuple(text.encode()),
                                            logprob=-0.5 * i),
                                 TopLogprob(text="é\"", bytes=(195, 169, 34), logprob=-9999.0)))

    texts = ["Hel", "", "lo é", "\n", "!"]      # the second token's text is held back
    enc = StreamEncoder(kind, RID, CREATED, "m", include_usage, logprobs=True, n=2)
    chunks = [Chunk(t, i + 1, "stop" if i == len(texts) - 1 else None, 1, entry(i, t))
              for i, t in enumerate(texts)]
    got = enc.chunks(chunks)
    want, pending, offset = [], [], 0
    for c in chunks:
        pending.append(c.logprobs)
        if not c.text and c.finish_reason is None:
            continue
        lp = (chat_logprobs(pending) if kind == "chat"
              else completion_logprobs(pending, offset))
        offset += sum(len(e.text) for e in pending)
        pending = []
        choice = reference_choice(kind, c.text, c.finish_reason)
        choice.update(index=1, logprobs=lp)
        want.append(reference_event(kind, "m", include_usage, [choice]))
    assert got == b"".join(want)


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("logprobs", [False, True])
def test_every_event_has_the_documented_chunk_shape(kind: str, include_usage: bool, n: int,
                                                    logprobs: bool) -> None:
    """The encoder writes its events by hand (speed); the response models of
    node_agent/api_responses.py document them (the OpenAPI document): every kind of event must
    validate against its model, which forbids extra fields — the two cannot drift apart."""
    from node_agent.api_responses import ChatCompletionChunk, TextCompletionChunk
    from node_agent.serving.logprobs import TokenLogprob, TopLogprob

    shape = ChatCompletionChunk if kind == "chat" else TextCompletionChunk
    enc = StreamEncoder(kind, RID, CREATED, "m", include_usage, logprobs=logprobs, n=n)
    entry = (TokenLogprob(7, "hé", tuple("hé".encode()), -0.25,
                          (TopLogprob("hé", tuple("hé".encode()), -0.25),
                           TopLogprob("ho", tuple(b"ho"), -1.5))) if logprobs else None)
    events = [enc.first()] if kind == "chat" else []
    for i in range(n):
        events.append(enc.chunks([Chunk("hé", 1, None, i, entry), Chunk("", 2, None, i, entry),
                                  Chunk(" là", 3, "length", i, entry)]))
    if kind == "chat":
        events.append(enc.tool_calls([{"id": "call_1", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}], 0))
    if include_usage:
        events.append(enc.usage({"prompt_tokens": 3, "completion_tokens": 3 * n,
                                 "total_tokens": 3 + 3 * n,
                                 "prompt_tokens_details": {"cached_tokens": 0}}))
    bodies = [e.removeprefix(b"data: ") for blob in events
              for e in blob.split(b"\n\n") if e]
    assert len(bodies) >= n * 2
    for body in bodies:
        chunk = shape.model_validate_json(body)
        assert (chunk.usage is not None) == (not chunk.choices)  # usage only on the last event
        if logprobs and chunk.choices and chunk.choices[0].finish_reason is None and (
                kind == "text" or chunk.choices[0].delta.content):
            assert chunk.choices[0].logprobs is not None
