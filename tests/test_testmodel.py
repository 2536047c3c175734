"""The test-model generator writes a real MLX model that mlx-lm loads like a downloaded one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from mlx_fleet import testmodel
from mlx_fleet.testmodel import MARKER_FILE, Fault, make_test_model

from serving_fixtures import tiny_model_path  # noqa: F401  (session fixture)


def test_loads_with_mlx_lm_and_generates(tiny_model_path: Path) -> None:  # noqa: F811
    model, tokenizer = mlx_lm.load(str(tiny_model_path))
    responses = list(mlx_lm.stream_generate(model, tokenizer, "Hello, world", max_tokens=6))
    assert len(responses) == 6
    assert all(isinstance(r.token, int) for r in responses)
    assert responses[-1].generation_tokens == 6


def test_tokenizer_round_trips_text_and_has_chat_template(tiny_model_path: Path) -> None:  # noqa: F811
    _, tokenizer = mlx_lm.load(str(tiny_model_path))
    for text in ["The quick brown fox jumps over the lazy dog.", "Ünïcode ✓ 42 {x: [1, 2]}\n"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids and tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False)
    assert rendered == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("</s>")}
    assert tokenizer.bos_token == "<s>"


def test_deterministic_for_a_seed_and_different_across_seeds(tmp_path: Path) -> None:
    a = make_test_model(tmp_path / "a", hidden_size=32, num_layers=1, seed=7)
    b = make_test_model(tmp_path / "b", hidden_size=32, num_layers=1, seed=7)
    c = make_test_model(tmp_path / "c", hidden_size=32, num_layers=1, seed=8)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_idempotent_and_regenerates_on_other_parameters(tmp_path: Path) -> None:
    dest = make_test_model(tmp_path / "m", hidden_size=32, num_layers=1)
    weights = dest / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert make_test_model(dest, hidden_size=32, num_layers=1) == dest
    assert weights.stat().st_mtime_ns == stamp
    make_test_model(dest, hidden_size=32, num_layers=2)
    assert weights.stat().st_mtime_ns != stamp
    assert '"num_layers": 2' in (dest / MARKER_FILE).read_text()


def test_incomplete_directory_is_regenerated(tmp_path: Path) -> None:
    dest = make_test_model(tmp_path / "m", hidden_size=32, num_layers=1)
    (dest / "model.safetensors").unlink()
    make_test_model(dest, hidden_size=32, num_layers=1)
    model, _ = mlx_lm.load(str(dest))
    assert model is not None


def test_rejects_inconsistent_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_test_model(tmp_path / "x", hidden_size=30, num_heads=4)
    with pytest.raises(ValueError):
        make_test_model(tmp_path / "x", vocab_size=100)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        testmodel.main(["--help"])
    assert exc.value.code == 0
    assert "mlx_lm.load" in capsys.readouterr().out
    assert testmodel.main([str(tmp_path / "cli"), "--hidden-size", "32", "--num-layers", "1"]) == 0
    assert (tmp_path / "cli" / MARKER_FILE).is_file()
    assert testmodel.main([str(tmp_path / "bad"), "--vocab-size", "10"]) == 2


# -- faulty models ---------------------------------------------------------------------------

FAULT_AFTER = 3


@dataclass
class Served:
    """What one request got from :func:`serve`."""
    tokens: int = 0                      # generated tokens that detokenized fine
    text: str = ""
    error: BaseException | None = None   # what the request failed with, if it did
    finish_reason: str | None = None
    done: bool = False
    detok: Any = field(default=None, repr=False)


def prompts_for(tokenizer: Any) -> list[list[int]]:
    """A chat prompt, raw text prompts ending in different tokens, and a lone special token."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem about the sea."}], add_generation_prompt=True)
    if not isinstance(chat, list):
        chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    texts = ["The quick brown fox", "Numbers: 42", "Ünïcode ✓ step1"]
    return [chat] + [tokenizer.encode(t, add_special_tokens=False) for t in texts] + [
        [tokenizer.bos_token_id]]


def serve(path: Path, *, max_tokens: int, temperature: float, seed: int = 0,
          top_p: float = 0.0) -> list[Served]:
    """Serve :func:`prompts_for` as one continuous batch the way the node agent does: mlx-lm's
    BatchGenerator (EOS as stop tokens, one sampler per request) and, per request, the
    tokenizer's streaming detokenizer (add_token / finalize / last_segment); an exception while
    post-processing a token fails that request only, which is then removed from the batch."""
    model, tokenizer = mlx_lm.load(str(path))
    mx.random.seed(seed)
    sampler = make_sampler(temperature, top_p=top_p)
    prompts = prompts_for(tokenizer)
    generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                               completion_batch_size=8, prefill_batch_size=8)
    try:
        uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts),
                                samplers=[sampler] * len(prompts))
        served = {uid: Served(detok=tokenizer.detokenizer) for uid in uids}
        for _ in range(max_tokens + 8):  # bounded: prefill step(s) + one step per token
            if all(s.done for s in served.values()):
                break
            _, responses = generator.next()
            for r in responses:
                s = served[r.uid]
                if s.done:
                    continue
                try:
                    if r.finish_reason == "stop":
                        s.detok.finalize()
                    else:
                        s.detok.add_token(r.token)
                        if r.finish_reason is not None:
                            s.detok.finalize()
                    s.text += s.detok.last_segment
                except Exception as e:  # noqa: BLE001 - the request fails, the batch goes on
                    s.error, s.done = e, True
                    if r.finish_reason is None:
                        generator.remove([r.uid])
                    continue
                s.tokens += 1
                if r.finish_reason is not None:
                    s.finish_reason, s.done = r.finish_reason, True
        assert all(s.done for s in served.values()), "generation did not end"
        return [served[uid] for uid in uids]
    finally:
        generator.close()


@pytest.fixture(scope="module")
def faulty_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("models") / "faulty", hidden_size=32,
                           num_layers=2, fault=Fault(kind="raise", after_tokens=FAULT_AFTER))


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 0.0), (1.0, 0.0), (2.0, 0.0),
                                                    (1.0, 0.9)])
def test_faulty_model_fails_every_request_after_exactly_n_tokens(
        faulty_model_path: Path, temperature: float, top_p: float) -> None:
    for seed in (0, 1):
        results = serve(faulty_model_path, max_tokens=FAULT_AFTER + 10,
                        temperature=temperature, top_p=top_p, seed=seed)
        for r in results:
            assert isinstance(r.error, TypeError), r
            assert r.tokens == FAULT_AFTER, r
            assert r.text == "step1 step2 step3"


def test_faulty_model_does_not_fail_within_n_tokens(faulty_model_path: Path) -> None:
    for r in serve(faulty_model_path, max_tokens=FAULT_AFTER, temperature=1.0):
        assert r.error is None and r.tokens == FAULT_AFTER and r.finish_reason == "length", r


def test_fault_after_zero_tokens_fails_on_the_first_token(tmp_path: Path) -> None:
    path = make_test_model(tmp_path / "f0", hidden_size=32, num_layers=1,
                           fault=Fault("raise", after_tokens=0))
    for r in serve(path, max_tokens=4, temperature=1.0):
        assert isinstance(r.error, TypeError) and r.tokens == 0 and r.text == "", r


def test_long_fault_chain_beyond_hidden_size(tmp_path: Path) -> None:
    n = 40  # more chain states than the 32 features: random codes instead of one-hot ones
    path = make_test_model(tmp_path / "f40", hidden_size=32, num_layers=1,
                           fault=Fault("raise", after_tokens=n))
    for r in serve(path, max_tokens=n + 5, temperature=1.0):
        assert isinstance(r.error, TypeError) and r.tokens == n, r
        assert r.text == " ".join(f"step{k}" for k in range(1, n + 1))
    with pytest.raises(ValueError, match="hidden_size"):
        make_test_model(tmp_path / "too-long", hidden_size=8, num_heads=2, num_layers=1,
                        fault=Fault("raise", after_tokens=1000))
    assert not (tmp_path / "too-long").exists()  # refused before writing anything


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_healthy_model_generates_past_n_tokens(tiny_model_path: Path,  # noqa: F811
                                               temperature: float) -> None:
    for r in serve(tiny_model_path, max_tokens=FAULT_AFTER + 8, temperature=temperature):
        assert r.error is None, r
        # sampling may pick EOS (its logit is 0, like an average token's) and stop early
        assert r.tokens == FAULT_AFTER + 8 or (temperature and r.finish_reason == "stop"), r


def test_faulty_model_is_data_only_and_tokenizes_text_like_the_healthy_one(
        faulty_model_path: Path, tmp_path: Path) -> None:
    healthy = make_test_model(tmp_path / "healthy", hidden_size=32, num_layers=2)
    assert not [p for p in faulty_model_path.rglob("*") if p.suffix not in (".json",
                                                                              ".safetensors")]
    config = json.loads((faulty_model_path / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == "llama"
    assert config["vocab_size"] == json.loads(
        (healthy / "config.json").read_text())["vocab_size"] + FAULT_AFTER + 2
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (faulty_model_path / name).read_bytes() == (healthy / name).read_bytes(), name
    _, faulty_tok = mlx_lm.load(str(faulty_model_path))
    _, healthy_tok = mlx_lm.load(str(healthy))
    for text in ["The quick brown fox step1 step2", "Ünïcode ✓ 42 {x: [1, 2]}\n",
                 "<|user|>\nHi</s>", "step1step2 <|mlx-fleet-fault-filler|>"]:
        assert faulty_tok.encode(text) == healthy_tok.encode(text), text
    assert json.loads((faulty_model_path / MARKER_FILE).read_text())["fault"] == {
        "kind": "raise", "after_tokens": FAULT_AFTER}
    assert "fault" not in json.loads((healthy / MARKER_FILE).read_text())


def test_fault_switches_regenerate_and_healthy_stays_byte_identical(tmp_path: Path) -> None:
    reference = make_test_model(tmp_path / "reference", hidden_size=32, num_layers=1)
    dest = make_test_model(tmp_path / "m", hidden_size=32, num_layers=1,
                           fault=Fault("raise", after_tokens=2))
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    assert make_test_model(dest, hidden_size=32, num_layers=1,
                           fault=Fault("raise", after_tokens=2)) == dest
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp  # idempotent
    make_test_model(dest, hidden_size=32, num_layers=1, fault=None)
    for f in reference.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name


def test_fault_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        Fault(kind="stall", after_tokens=1)
    for bad in (-1, testmodel.MAX_FAULT_AFTER_TOKENS + 1, 1.5, True):
        with pytest.raises(ValueError, match="after_tokens"):
            Fault(kind="raise", after_tokens=bad)  # type: ignore[arg-type]


def test_cli_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        testmodel.main(["--help"])
    help_text = capsys.readouterr().out
    assert "--fault {raise}" in help_text and "--fault-after-tokens N" in help_text
    small = ["--hidden-size", "32", "--num-layers", "1"]
    assert testmodel.main([str(tmp_path / "f"), *small, "--fault", "raise",
                           "--fault-after-tokens", "2"]) == 0
    marker = json.loads((tmp_path / "f" / MARKER_FILE).read_text())
    assert marker["fault"] == {"kind": "raise", "after_tokens": 2}
    assert testmodel.main([str(tmp_path / "f0"), *small, "--fault", "raise"]) == 0
    assert json.loads((tmp_path / "f0" / MARKER_FILE).read_text())["fault"]["after_tokens"] == 0
    capsys.readouterr()
    assert testmodel.main([str(tmp_path / "x"), *small, "--fault-after-tokens", "2"]) == 2
    assert testmodel.main([str(tmp_path / "x"), *small, "--fault", "raise",
                           "--fault-after-tokens", "-1"]) == 2
    assert "after_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        testmodel.main([str(tmp_path / "x"), "--fault", "stall"])
    assert exc.value.code == 2


def test_cli_embedding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--hidden-size", "32", "--num-layers", "1"]
    assert testmodel.main([str(tmp_path / "e"), *small, "--embedding"]) == 0
    assert json.loads((tmp_path / "e" / MARKER_FILE).read_text())["embedding"] is True
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["hidden_size"] == 32
    assert (tmp_path / "e" / "1_Pooling" / "config.json").is_file()
    # a generation model's marker has no such key (it is what it always was)
    assert testmodel.main([str(tmp_path / "g"), *small]) == 0
    assert "embedding" not in json.loads((tmp_path / "g" / MARKER_FILE).read_text())
    capsys.readouterr()
    assert testmodel.main([str(tmp_path / "x"), *small, "--embedding", "--fault", "raise"]) == 2
    assert "embedding" in capsys.readouterr().err
