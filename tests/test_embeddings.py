"""Embeddings (issue 20 §4): the batching policy and the model-directory profile (pure,
table-tested), the serving core's embedding revisions over the generated embedding model
(a batch equals one input at a time, concurrent requests share forward passes, unit norm,
Matryoshka truncation, bounds), and ``POST /v1/embeddings`` through the official ``openai``
client (float and base64) and raw HTTP (errors naming the field), with property tests of the
request model."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import openai
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlx_fleet.testmodel import make_test_model
from node_agent.api_models import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from node_agent.api_responses import EmbeddingList
from node_agent.serving import (DimensionsNotSupported, GenerationAborted, InputTooLong,
                                InvalidPrompt, ModelLoadError, WrongTask)
from node_agent.serving.embed_batch import BatchPolicy, Decision, decide, fits
from node_agent.serving.embed_profile import (EmbeddingProfile, UnsupportedEmbeddingModel,
                                              check_dimensions, parse_profile, read_profile)
from node_agent.serving.embeddings import truncate
from serving_fixtures import (MODEL_ID, REVISION, Agent, close_agent, make_agent,
                              mlx_thread_held, wait_for)

EMBED = "/v1/embeddings"
EMB_ID = "emb"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "Kubernetes schedules workloads onto nodes; an operator reconciles state.",
         "Good software is simple, tested, and documented."]
TOL = 1e-5


# -- the task in the API: spec.model.task → Assignment.task → the agent's load spec -------------


def test_task_is_carried_from_the_spec_to_the_agent() -> None:
    from mlx_fleet.capabilities import TASKS
    from mlx_fleet.contract import Assignment
    from mlx_fleet_operator.spec import DeploymentSpec, parse_spec, to_assignment
    from node_agent.convergence.state import Spec

    base = {"model": {"source": "/models/emb", "revision": "r1"}}
    assert parse_spec(base).model.task == "TextGeneration"
    spec = parse_spec({"model": {**base["model"], "task": "TextEmbedding"}})
    a = to_assignment(spec, namespace="ns", name="emb")
    assert a.task == "TextEmbedding"
    assert Assignment.from_json(a.to_json()) == a
    assert Spec.of(a).task == "TextEmbedding"
    assert Spec.of(a) != Spec.of(a.model_copy(update={"task": "TextGeneration"}))  # reloads
    # a record written before the field reads as a generation model
    old = json.loads(a.to_json())
    del old["task"]
    assert Assignment.model_validate(old).task == "TextGeneration"
    # one list of tasks: the CRD's enum is the contract's
    field = DeploymentSpec.model_fields["model"].annotation.model_fields["task"]
    assert tuple(field.annotation.__args__) == TASKS
    with pytest.raises(ValueError, match="spec.model.task"):
        parse_spec({"model": {**base["model"], "task": "embed"}})


# -- the batching policy (pure) ---------------------------------------------------------------

P = BatchPolicy(max_inputs=4, max_tokens=40, window_s=0.002)


@pytest.mark.parametrize("lengths, waited, busy, want", [
    ([], 0.0, False, Decision(0)),                       # nothing waits
    ([5], 0.0, True, Decision(0)),                       # a pass runs: only queue
    ([5, 5, 5, 5, 5], 0.0, True, Decision(0)),
    ([5], 0.0, False, Decision(0, 0.002)),               # alone: wait the window for company
    ([5], 0.0015, False, Decision(0, 0.0005)),           # ... what is left of it
    ([5], 0.002, False, Decision(1)),                    # the window is over: run it
    ([5, 6], 0.003, False, Decision(2)),
    ([5, 5, 5, 5], 0.0, False, Decision(4)),             # max_inputs reached: at once
    ([5, 5, 5, 5, 5, 5], 0.0, False, Decision(4)),       # more than fit: a full batch at once
    ([10, 10, 10], 0.0, False, Decision(0, 0.002)),      # a fourth of 10 would fit: wait
    ([10, 10, 11], 0.0, False, Decision(3)),             # 4 x 11 > 40: full, at once
    ([20, 20], 0.0, False, Decision(2)),                 # 2 x 20 = 40: nothing more fits
    ([20, 20, 1], 0.0, False, Decision(2)),              # padded to 20: a third would be 60
    ([1, 30], 0.0, False, Decision(1)),                  # 2 x 30 > 40: the long one waits
    ([50], 0.0, False, Decision(1)),                     # longer than the budget: alone, now
    ([50, 1], 0.0, False, Decision(1)),
])
def test_batch_policy(lengths: list[int], waited: float, busy: bool, want: Decision) -> None:
    got = decide(lengths, waited, busy, P)
    assert got.take == want.take
    if want.wait_s is None:
        assert got.wait_s is None
    else:
        assert got.wait_s == pytest.approx(want.wait_s)


@given(st.lists(st.integers(1, 60), max_size=12), st.integers(1, 8), st.integers(1, 200))
def test_a_batch_never_exceeds_its_bounds(lengths: list[int], max_inputs: int,
                                          max_tokens: int) -> None:
    policy = BatchPolicy(max_inputs, max_tokens)
    n = fits(lengths, policy)
    if not lengths:
        assert n == 0
    else:
        assert 1 <= n <= min(max_inputs, len(lengths))
        assert n == 1 or n * max(lengths[:n]) <= max_tokens
        # the longest head that fits: one more would break a bound
        if n < min(max_inputs, len(lengths)):
            assert (n + 1) * max(lengths[:n + 1]) > max_tokens


def test_batch_policy_refuses_bad_bounds() -> None:
    for bad in ((0, 1, 0.0), (1, 0, 0.0), (1, 1, -1.0)):
        with pytest.raises(ValueError):
            BatchPolicy(*bad)


# -- the profile read from a model directory (pure) ------------------------------------------

CFG = {"hidden_size": 64, "vocab_size": 512}
ST = "sentence_transformers.models."
MODULES = [{"type": ST + "Transformer", "path": ""},
           {"type": ST + "Pooling", "path": "1_Pooling"},
           {"type": ST + "Normalize", "path": "2_Normalize"}]


def pooling(mode: str = "lasttoken", **extra: object) -> dict:
    return {"word_embedding_dimension": 64, "pooling_mode_" + mode: True,
            "pooling_mode_cls_token": mode == "cls_token", **extra}


@pytest.mark.parametrize("config, modules, pool, want", [
    (CFG, None, None, EmbeddingProfile("lasttoken", True, 64, False, (), 512)),  # vLLM default
    (CFG, MODULES, pooling(), EmbeddingProfile("lasttoken", True, 64, False, (), 512)),
    (CFG, MODULES[:2], pooling("mean_tokens"),
     EmbeddingProfile("mean_tokens", False, 64, False, (), 512)),   # no Normalize module
    (CFG, MODULES, pooling("cls_token"), EmbeddingProfile("cls_token", True, 64, False, (), 512)),
    ({**CFG, "is_matryoshka": True}, MODULES, pooling(),
     EmbeddingProfile("lasttoken", True, 64, True, (), 512)),
    ({**CFG, "matryoshka_dimensions": [32, 16, 32]}, None, None,
     EmbeddingProfile("lasttoken", True, 64, True, (16, 32), 512)),
    ({"text_config": CFG}, None, None, EmbeddingProfile("lasttoken", True, 64, False, (), 512)),
])
def test_profile(config: dict, modules: list | None, pool: dict | None,
                 want: EmbeddingProfile) -> None:
    assert parse_profile(config, modules, pool) == want


@pytest.mark.parametrize("config, modules, pool, names", [
    ({"hidden_size": 64}, None, None, "vocab_size"),
    (CFG, MODULES + [{"type": ST + "Dense", "path": "2_Dense"}], pooling(), "Dense"),
    (CFG, MODULES, pooling("max_tokens"), "max_tokens"),
    (CFG, MODULES, {**pooling(), "pooling_mode_mean_tokens": True}, "mean_tokens"),
    (CFG, MODULES, None, "Pooling module"),
    (CFG, MODULES, pooling(word_embedding_dimension=32), "word_embedding_dimension"),
    ({**CFG, "matryoshka_dimensions": [128]}, None, None, "matryoshka_dimensions"),
    ({**CFG, "matryoshka_dimensions": "32"}, None, None, "matryoshka_dimensions"),
])
def test_profile_refuses_what_it_would_not_apply(config: dict, modules: list | None,
                                                 pool: dict | None, names: str) -> None:
    with pytest.raises(UnsupportedEmbeddingModel, match=names):
        parse_profile(config, modules, pool)


def test_profile_pooling_path_stays_inside_the_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    (tmp_path / "modules.json").write_text(json.dumps(
        [MODULES[0], {"type": ST + "Pooling", "path": "../elsewhere"}]))
    with pytest.raises(UnsupportedEmbeddingModel, match="outside"):
        read_profile(tmp_path)


@pytest.mark.parametrize("profile, dims, ok", [
    (EmbeddingProfile(dimensions=64), None, True),
    (EmbeddingProfile(dimensions=64), 64, True),          # the full width: always
    (EmbeddingProfile(dimensions=64), 32, False),         # not trained for truncation
    (EmbeddingProfile(dimensions=64, matryoshka=True), 1, True),
    (EmbeddingProfile(dimensions=64, matryoshka=True), 65, False),
    (EmbeddingProfile(dimensions=64, matryoshka=True, matryoshka_dimensions=(16, 32)), 32, True),
    (EmbeddingProfile(dimensions=64, matryoshka=True, matryoshka_dimensions=(16, 32)), 24, False),
])
def test_dimensions_only_where_the_model_allows(profile: EmbeddingProfile, dims: int | None,
                                                ok: bool) -> None:
    assert (check_dimensions(profile, dims) is None) == ok


def test_truncate_renormalises() -> None:
    v = np.array([[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    out = truncate(v, 2, True)
    np.testing.assert_allclose(out, [[0.6, 0.8], [1.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(truncate(v, 2, False), v[:, :2])
    assert truncate(v, None, True) is v


# -- the generated embedding model and the serving core --------------------------------------


@pytest.fixture(scope="session")
def embed_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("models") / "emb", embedding=True)


def test_generated_embedding_model_is_laid_out_as_qwen3_embedding(embed_model_path: Path) -> None:
    config = json.loads((embed_model_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert config["tie_word_embeddings"] is True and config["is_matryoshka"] is True
    assert read_profile(embed_model_path) == EmbeddingProfile(
        "lasttoken", True, 64, True, (), config["vocab_size"])
    # its tokenizer appends EOS to every text, as Qwen3-Embedding's appends <|endoftext|>
    from mlx_lm.utils import load_tokenizer
    tok = load_tokenizer(embed_model_path)
    assert tok.encode("hello world", add_special_tokens=True)[-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="fault"):
        from mlx_fleet.testmodel import Fault
        make_test_model(embed_model_path.parent / "x", embedding=True, fault=Fault("raise", 1))


@pytest_asyncio.fixture(scope="module")
async def emb_agent(embed_model_path: Path) -> AsyncIterator[Agent]:
    """An agent with the generated generation model (``tiny``) and the embedding model
    (``emb``, 8 inputs a pass)."""
    agent_ = await make_agent(make_test_model(embed_model_path.parent / "tiny-gen"))
    await agent_.core.load_model(EMB_ID, embed_model_path, revision=REVISION,
                                 max_concurrent_sequences=8, max_context_tokens=256,
                                 task="TextEmbedding")
    yield agent_
    await close_agent(agent_)


def forward_passes(core) -> list[int]:
    """Spy on the core's forward passes: the batch sizes, appended as they run."""
    sizes: list[int] = []
    real = core._engine.embed

    def spy(key, batch):
        sizes.append(len(batch))
        return real(key, batch)

    core._engine.embed = spy
    return sizes


async def test_batch_equals_one_at_a_time_and_concurrent_requests_share_passes(
        emb_agent: Agent) -> None:
    core = emb_agent.core
    sizes = forward_passes(core)
    try:
        batch = await core.embed(EMB_ID, texts=TEXTS)
        assert sizes == [len(TEXTS)]          # one request's inputs: one padded pass
        singles = [await core.embed(EMB_ID, texts=[t]) for t in TEXTS]
        assert sizes[1:] == [1] * len(TEXTS)
        one = np.stack([s.vectors[0] for s in singles])
        np.testing.assert_allclose(batch.vectors, one, atol=TOL)
        np.testing.assert_allclose(np.linalg.norm(batch.vectors, axis=1), 1.0, atol=TOL)
        assert batch.prompt_tokens == sum(s.prompt_tokens for s in singles)
        # inputs differ: their vectors do too (the pooling reads each input's own last token)
        assert np.abs(one[0] - one[1]).max() > 1e-3
        # concurrent requests, one input each: padded into shared passes, same vectors
        del sizes[:]
        rs = await asyncio.gather(*(core.embed(EMB_ID, texts=[t]) for t in TEXTS * 2))
        assert sum(sizes) == 2 * len(TEXTS) and len(sizes) < 2 * len(TEXTS)
        labels = {"model": EMB_ID, "revision": REVISION}
        assert emb_agent.registry.get_sample_value(
            "mlxfleet_agent_embedding_batch_inputs_count", labels) == 1 + len(TEXTS) + len(sizes)
        np.testing.assert_allclose(np.stack([r.vectors[0] for r in rs]),
                                   np.concatenate([one, one]), atol=TOL)
        # token ids give what their text gives
        tok = core._tokenizers[(EMB_ID, REVISION)]
        ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
        by_ids = await core.embed(EMB_ID, token_ids=ids)
        np.testing.assert_allclose(by_ids.vectors, batch.vectors, atol=TOL)
    finally:
        del core._engine.embed


@pytest.mark.parametrize("pooling", ["lasttoken", "mean_tokens", "cls_token"])
async def test_long_batches_run_in_chunks_with_the_same_vectors(emb_agent: Agent,
                                                              pooling: str) -> None:
    """Past mlx-lm's prefill step a pass runs in chunks over a KV cache: the same vectors."""
    import dataclasses

    from node_agent.serving.embedder import embed_batch

    core = emb_agent.core
    res = core._engine.registry.get((EMB_ID, REVISION))
    profile = dataclasses.replace(res.info.embedding, pooling=pooling)
    tok = core._tokenizers[(EMB_ID, REVISION)]
    batch = [tok.encode(t, add_special_tokens=True) for t in TEXTS]
    whole = await core._call(embed_batch, res.model, batch, profile)
    for step in (3, 5, max(map(len, batch)) - 1):
        chunked = await core._call(lambda: embed_batch(res.model, batch, profile,
                                                       step_tokens=step))
        np.testing.assert_allclose(chunked, whole, atol=TOL)


async def test_core_bounds_and_task(emb_agent: Agent) -> None:
    core = emb_agent.core
    r = await core.embed(EMB_ID, texts=TEXTS[:2], dimensions=16)
    assert r.vectors.shape == (2, 16)
    np.testing.assert_allclose(np.linalg.norm(r.vectors, axis=1), 1.0, atol=TOL)
    full = await core.embed(EMB_ID, texts=TEXTS[:2])
    cut = full.vectors[:, :16] / np.linalg.norm(full.vectors[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(r.vectors, cut, atol=TOL)
    with pytest.raises(DimensionsNotSupported):
        await core.embed(EMB_ID, texts=["x"], dimensions=65)
    with pytest.raises(InputTooLong) as e:
        await core.embed(EMB_ID, texts=["short", "word " * 400])
    assert e.value.index == 1 and e.value.max_context_tokens == 256
    with pytest.raises(InvalidPrompt, match="input 1: token id 999999"):
        await core.embed(EMB_ID, token_ids=[[1, 2], [999999]])
    with pytest.raises(WrongTask, match="TextEmbedding"):
        await core.generate(EMB_ID, prompt="hi")
    with pytest.raises(WrongTask, match="TextGeneration"):
        await core.embed(MODEL_ID, texts=["hi"])
    assert core.inflight_requests() == 0     # every refused or served request was released


async def test_cancelled_and_unloaded_requests_leave_nothing_behind(
        emb_agent: Agent, embed_model_path: Path) -> None:
    core = emb_agent.core
    # a request cancelled while its input waits for the MLX thread: the others are served
    async with mlx_thread_held(core, 30):
        gone = asyncio.ensure_future(core.embed(EMB_ID, texts=["a"]))
        kept = asyncio.ensure_future(core.embed(EMB_ID, texts=["b", "c"]))
        await wait_for(lambda: core.inflight_requests(EMB_ID) == 2)
        gone.cancel()
    assert (await kept).vectors.shape == (2, 64)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert core.inflight_requests() == 0
    # a revision unloaded while a request is tokenized for it: the request fails, not hangs
    await core.load_model(EMB_ID, embed_model_path, revision="gone", task="TextEmbedding",
                          max_context_tokens=256)
    # (64 inputs: more than one pass of 8, so at most the first pass runs before the unload)
    async with mlx_thread_held(core, 30):
        orphan = asyncio.ensure_future(core.embed(EMB_ID, revision="gone", texts=["a"] * 64))
        await wait_for(lambda: core.inflight_requests(EMB_ID, "gone") == 1)
        unloading = asyncio.ensure_future(core.unload_model(EMB_ID, "gone"))
        await wait_for(lambda: not core.is_loaded(EMB_ID, "gone"))
    await unloading
    with pytest.raises(GenerationAborted, match="unloaded"):
        await asyncio.wait_for(orphan, 30)
    assert core.inflight_requests() == 0 and not core._embed_queues


async def test_a_cancelled_requests_waiting_inputs_never_reach_a_forward_pass(
        emb_agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs of a request cancelled while they wait behind a running forward pass are dropped
    from the queue: the next pass holds only the other requests' inputs."""
    core = emb_agent.core
    passes: list[int] = []
    real = core._engine.embed

    def counting(key, batch):
        passes.append(len(batch))
        return real(key, batch)

    monkeypatch.setattr(core._engine, "embed", counting)
    async with mlx_thread_held(core, 30):
        first = asyncio.ensure_future(core.embed(EMB_ID, texts=["first"]))
        # its pass has started: it waits for the MLX thread, the queue is busy
        await wait_for(lambda: any(q.busy for q in core._embed_queues.values()))
        gone = asyncio.ensure_future(core.embed(EMB_ID, texts=["gone", "gone too"]))
        kept = asyncio.ensure_future(core.embed(EMB_ID, texts=["kept"]))
        await wait_for(lambda: sum(len(q.items) for q in core._embed_queues.values()) == 3)
        gone.cancel()
    assert (await first).vectors.shape[0] == 1 and (await kept).vectors.shape[0] == 1
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert passes == [1, 1]  # "first", then "kept" alone
    assert core.inflight_requests() == 0


async def test_a_model_that_asks_for_what_is_not_served_does_not_load(
        emb_agent: Agent, embed_model_path: Path, tmp_path: Path) -> None:
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(embed_model_path, bad)
    cfg = json.loads((bad / "1_Pooling" / "config.json").read_text())
    (bad / "1_Pooling" / "config.json").write_text(json.dumps(
        {**cfg, "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError) as e:
        await emb_agent.core.load_model("bad", bad, revision="r1", task="TextEmbedding")
    assert e.value.reason == "UnsupportedEmbeddingModel"
    assert not emb_agent.core.is_loaded("bad")


# -- POST /v1/embeddings ----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def client(emb_agent: Agent) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=emb_agent.base_url, api_key="x", max_retries=0)
    yield c
    await c.close()


async def test_openai_client_float_and_base64(client: openai.AsyncOpenAI,
                                              emb_agent: Agent) -> None:
    want = (await emb_agent.core.embed(EMB_ID, texts=TEXTS)).vectors
    for fmt in ("float", "base64"):
        r = await client.embeddings.create(model=EMB_ID, input=TEXTS, encoding_format=fmt)
        assert r.object == "list" and r.model == EMB_ID
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        # base64 asked for explicitly: the client hands the strings over as they came
        got = np.array([d.embedding if fmt == "float" else
                        np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        for d in r.data], dtype=np.float32)
        np.testing.assert_allclose(got, want, atol=TOL)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=TOL)
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    # the client's default asks for base64 and decodes it; one string is one input
    r = await client.embeddings.create(model=EMB_ID, input=TEXTS[1])
    np.testing.assert_allclose(r.data[0].embedding, want[1], atol=TOL)
    # token ids, one list or several
    r = await client.embeddings.create(model=EMB_ID, input=[[5, 6, 7], [8]])
    assert len(r.data) == 2
    r = await client.embeddings.create(model=EMB_ID, input=[5, 6, 7])
    assert len(r.data) == 1
    r = await client.embeddings.create(model=EMB_ID, input=TEXTS[:2], dimensions=8)
    assert [len(d.embedding) for d in r.data] == [8, 8]


async def test_base64_is_little_endian_float32(emb_agent: Agent) -> None:
    resp = await emb_agent.client.post(EMBED, json={"model": EMB_ID, "input": "hello world",
                                                     "encoding_format": "base64"})
    assert resp.status == 200 and resp.headers["X-Model-Revision"] == REVISION
    body = await resp.json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 4 * 64
    floats = (await (await emb_agent.client.post(EMBED, json={
        "model": EMB_ID, "input": "hello world"})).json())["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"),
                                  np.array(floats, dtype=np.float32))
    EmbeddingList.model_validate(body)        # the response model the OpenAPI document shows
    assert set(body) == {"object", "data", "model", "usage"}
    assert set(body["data"][0]) == {"object", "index", "embedding"}
    assert body["usage"] == {"prompt_tokens": body["usage"]["prompt_tokens"],
                             "total_tokens": body["usage"]["prompt_tokens"]}


async def error_of(resp) -> dict:
    body = await resp.json()
    assert set(body) == {"error"}
    return body["error"]


@pytest.mark.parametrize("body, status, param, code", [
    ({"model": EMB_ID, "input": ""}, 400, "input", "invalid_value"),
    ({"model": EMB_ID, "input": []}, 400, "input", "invalid_value"),
    ({"model": EMB_ID, "input": [[]]}, 400, "input", "invalid_value"),
    ({"model": EMB_ID, "input": ["a", 1]}, 400, "input", "invalid_value"),
    ({"model": EMB_ID, "input": [-1]}, 400, "input", "invalid_value"),
    ({"model": EMB_ID, "input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, 400, "input",
     "invalid_value"),
    ({"model": EMB_ID, "input": "a", "encoding_format": "int8"}, 400, "encoding_format",
     "invalid_value"),
    ({"model": EMB_ID, "input": "a", "dimensions": 0}, 400, "dimensions", "invalid_value"),
    ({"model": EMB_ID, "input": "a", "dimensions": 65}, 400, "dimensions", "invalid_value"),
    ({"model": EMB_ID, "input": "word " * 400}, 400, "input", "context_length_exceeded"),
    ({"model": EMB_ID, "input": [[1], [10**6]]}, 400, "input", "invalid_prompt"),
    ({"model": EMB_ID, "input": ["a" * 2**19, "b" * 2**19 + "c"]}, 400, "input",
     "prompt_too_large"),                                 # over --max-prompt-bytes together
    ({"model": MODEL_ID, "input": "a"}, 400, "model", "wrong_model_task"),
    ({"model": "nope", "input": "a"}, 404, "model", "model_not_found"),
])
async def test_errors_name_the_field(emb_agent: Agent, body: dict, status: int, param: str,
                                     code: str) -> None:
    resp = await emb_agent.client.post(EMBED, json=body)
    assert resp.status == status, await resp.text()
    err = await error_of(resp)
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


async def test_the_model_card_says_what_the_model_serves(emb_agent: Agent) -> None:
    cards = {m["id"]: m for m in (await (await emb_agent.client.get("/v1/models")).json())["data"]}
    assert cards[EMB_ID]["capabilities"]["task"] == "TextEmbedding"
    assert cards[EMB_ID]["capabilities"]["embeddings"] is True
    assert cards[MODEL_ID]["capabilities"]["task"] == "TextGeneration"
    assert cards[MODEL_ID]["capabilities"]["embeddings"] is False


async def test_a_generation_request_to_an_embedding_model_is_400(
        client: openai.AsyncOpenAI) -> None:
    for call in (lambda: client.chat.completions.create(
                     model=EMB_ID, messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.completions.create(model=EMB_ID, prompt="hi")):
        with pytest.raises(openai.BadRequestError) as e:
            await call()
        assert e.value.code == "wrong_model_task" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        await client.embeddings.create(model=MODEL_ID, input="hi")
    assert e.value.code == "wrong_model_task"


# -- the request model's bounds (property tests) ----------------------------------------------

texts_st = st.text(min_size=0, max_size=5)
ids_st = st.integers(min_value=-3, max_value=2**31 + 3)


@settings(max_examples=200, deadline=None)
@given(st.one_of(texts_st, st.lists(texts_st, max_size=4), st.lists(ids_st, max_size=4),
                 st.lists(st.lists(ids_st, max_size=3), max_size=3),
                 st.lists(st.one_of(texts_st, ids_st), max_size=3), st.none(), st.integers()))
def test_input_is_accepted_exactly_in_openais_shapes(value: object) -> None:
    def token(v: object) -> bool:
        return isinstance(v, int) and 0 <= v < 2**31

    if isinstance(value, str):
        ok, want = value != "", [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        ok, want = all(value), value
    elif isinstance(value, list) and value and all(
            isinstance(v, int) for v in value):
        ok, want = all(token(v) for v in value), [value]
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        ok, want = all(v and all(token(t) for t in v) for v in value), value
    else:
        ok, want = False, None
    try:
        req = EmbeddingRequest.model_validate({"model": "m", "input": value})
    except ValidationError as e:
        assert not ok, e
        assert e.errors()[0]["loc"] == ("input",)
    else:
        assert ok and req.input == want


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.integers(-5, 5000), st.floats(allow_nan=False), st.text(max_size=3),
                 st.booleans(), st.none()))
def test_dimensions_is_a_positive_integer(value: object) -> None:
    ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                           and float(value).is_integer() and value >= 1
                           and abs(value) <= 2**53)
    try:
        EmbeddingRequest.model_validate({"model": "m", "input": "x", "dimensions": value})
    except ValidationError:
        assert not ok
    else:
        assert ok


# -- revisions: the canary split and forwarding, as for the chat routes ------------------------

NS, DEP = "default", "emb-dep"


async def _capacity():
    from mlx_fleet.contract import NodeCapacity
    return NodeCapacity(memory_total_bytes=64 * 2**30, memory_available_bytes=48 * 2**30,
                        chip="Apple M3 Max", chip_generation=3, simulated=True)


async def test_canary_split_and_forwarding_of_embeddings(memory_store, keys,
                                                         embed_model_path: Path) -> None:
    """Under a split the embeddings route is routed like chat (X-Model-Revision, the outcome
    counted for the revision that served it), and a candidate held on another node is
    forwarded there pinned."""
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client import CollectorRegistry

    from mlx_fleet.contract import Keys, Role, TrafficSplit
    from mlx_fleet.routing.headers import PIN_HEADER, REVISION_HEADER
    from node_agent.controller import ServedModel
    from node_agent.openai_api import build_app
    from node_agent.registration import Registration
    from node_agent.serving import ServingCore
    from node_agent.traffic import TrafficManager

    other = make_test_model(embed_model_path.parent / "emb-other", embedding=True, seed=1)
    core = ServingCore(registry=CollectorRegistry())
    await core.start()
    started = []
    try:
        for rev, path in (("r1", embed_model_path), ("r2", other)):
            await core.load_model(EMB_ID, path, revision=rev, task="TextEmbedding",
                                  max_context_tokens=256)

        async def node(k: Keys, name: str, served: dict[str, Role]):
            reg = Registration(memory_store, k, node_name=name, address="http://unused",
                               ttl=5, capacity=_capacity)
            await reg.start()
            tm = TrafficManager(memory_store, k, node_name=name, registration=reg,
                                served=lambda: {EMB_ID: ServedModel(NS, DEP, dict(served))},
                                crashes=core.crashes, memory_bytes=core.memory_bytes)
            recorded: list[tuple[str, bool]] = []
            real = tm.record

            def record(routed, **kw) -> None:
                recorded.append((routed.route.revision, kw["failed"]))
                real(routed, **kw)

            tm.record = record  # type: ignore[method-assign]
            await tm.start()
            await asyncio.wait_for(tm.synced.wait(), 30)
            client = TestClient(TestServer(build_app(core, health=lambda: (True, {}),
                                                     registry=core.registry,
                                                     router=lambda: tm), host="127.0.0.1"))
            await client.start_server()
            started.append((reg, tm, client))
            return client, recorded

        back, back_rec = await node(Keys(keys.root + "-back"), "holder",
                                    {"r1": Role.STABLE, "r2": Role.CANDIDATE})
        url = str(back.make_url("")).rstrip("/")
        await memory_store.put(keys.traffic(NS, DEP), TrafficSplit(
            namespace=NS, name=DEP, served_model_name=EMB_ID, stable_revision="r1",
            candidate_revision="r2", weight=100, canary="c", canary_uid="uid-1",
            candidate_endpoints=[url]).to_json())
        front, front_rec = await node(keys, "front", {"r1": Role.STABLE})
        body = {"model": EMB_ID, "input": TEXTS[:2]}

        want = {rev: (await core.embed(EMB_ID, revision=rev, texts=TEXTS[:2])).vectors
                for rev in ("r1", "r2")}
        assert np.abs(want["r1"] - want["r2"]).max() > 1e-3   # two different models
        direct = await back.post(EMBED, json=body)
        assert direct.status == 200 and direct.headers[REVISION_HEADER] == "r1"
        pinned = await back.post(EMBED, json=body, headers={PIN_HEADER: "r2"})
        assert pinned.headers[REVISION_HEADER] == "r2"
        # the split (weight 100) sends it to the candidate, held on the back node: forwarded
        resp = await front.post(EMBED, json=body)
        assert resp.status == 200 and resp.headers[REVISION_HEADER] == "r2"
        got = np.array([d["embedding"] for d in (await resp.json())["data"]], np.float32)
        np.testing.assert_allclose(got, want["r2"], atol=TOL)
        # the serving node counted what it served; the forwarding node nothing
        assert back_rec == [("r1", False), ("r2", False), ("r2", False)]
        assert front_rec == []
    finally:
        for reg, tm, client in reversed(started):
            await client.close()
            await tm.stop()
            await reg.stop()
        await core.close()
