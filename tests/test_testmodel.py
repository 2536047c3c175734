"""The test-model generator writes a real MLX model that mlx-lm loads like a downloaded one."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest

from mlx_fleet import testmodel
from mlx_fleet.testmodel import MARKER_FILE, make_test_model

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
