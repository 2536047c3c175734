"""Resident-memory estimates from model files (safetensors headers, config.json) and the node
budget: exact against real MLX models and mlx-lm's KV cache, strict against hostile files."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
import safetensors.numpy
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model, save_config, save_model

from mlx_fleet.contract import NodeCapacity
from mlx_fleet.testmodel import make_test_model
from node_agent import memory_estimate as me
from node_agent.memory_estimate import (
    MAX_CONFIG_BYTES, MAX_HEADER_BYTES, MemoryEstimate, ModelFileError, TensorInfo,
    check_quantization, estimate, kv_cache_bytes_per_token, node_budget_bytes,
    node_budget_for, parse_config, parse_safetensors_header, read_config,
    read_safetensors_header, weights_bytes)

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# Real models
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model(tmp_path_factory.mktemp("me") / "tiny", num_layers=3, seed=3)


@pytest.fixture(scope="module")
def quantized(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model quantised by mlx-lm (4-bit affine, group 32), with one layer at 8 bits
    through mlx-lm's per-layer quantisation config, saved as mlx-lm's convert saves it."""
    dest = tmp_path_factory.mktemp("me") / "tiny-q4"
    model, _ = mlx_lm.load(str(tiny))
    config = json.loads((tiny / "config.json").read_text())

    def predicate(path: str, module: Any) -> bool | dict:
        if path == "model.layers.1.mlp.down_proj":
            return {"group_size": 64, "bits": 8}
        return True

    model, qconfig = quantize_model(model, config, group_size=32, bits=4,
                                    quant_predicate=predicate)
    save_model(dest, model)
    save_config(qconfig, dest / "config.json")
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dest / f.name)
    return dest


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def test_tiny_model_weights_are_the_tensors_nbytes(tiny: Path) -> None:
    arrays = mx.load(str(tiny / "model.safetensors"))
    expected = sum(a.nbytes for a in arrays.values())
    st = tiny / "model.safetensors"
    assert weights_bytes(tiny) == expected
    assert expected == st.stat().st_size - 8 - _header_len(st)  # tensors tile the data section

    tensors = read_safetensors_header(st)
    assert set(tensors) == set(arrays)
    for name, a in arrays.items():
        assert tensors[name].shape == tuple(a.shape), name
        assert tensors[name].dtype == "F32", name  # the test model stores float32
        assert tensors[name].nbytes == a.nbytes, name


def test_tiny_model_header_agrees_with_the_reference_parser(tiny: Path) -> None:
    ours = read_safetensors_header(tiny / "model.safetensors")
    with safetensors.safe_open(str(tiny / "model.safetensors"), framework="numpy") as f:
        ref = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
               for k in f.keys()}
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == ref


def test_loaded_model_holds_the_estimated_weights(tiny: Path) -> None:
    model, _ = mlx_lm.load(str(tiny))
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert weights_bytes(tiny) == loaded


@pytest.mark.parametrize("prompt_tokens", [1, 255, 256, 257, 600])
def test_kv_cache_matches_what_mlx_lm_allocates(tiny: Path, prompt_tokens: int) -> None:
    """The estimate's KV cache for one sequence of N tokens equals the bytes mlx-lm's KVCache
    holds after a prefill of N tokens (rounded up to its 256-token step)."""
    model, _ = mlx_lm.load(str(tiny))
    cache = make_prompt_cache(model)
    model(mx.array([[7] * prompt_tokens]), cache=cache)
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    allocated = sum(c.nbytes for c in cache)

    got = estimate(tiny, max_context_tokens=prompt_tokens, max_concurrent_sequences=1)
    assert got.kv_cache_bytes == allocated
    config = json.loads((tiny / "config.json").read_text())
    per_token = kv_cache_bytes_per_token(config)
    # float32 model: 2 × layers × kv heads × head dim × 4 bytes
    assert per_token == 2 * 3 * 4 * 16 * 4
    assert allocated == per_token * -(-prompt_tokens // 256) * 256


def test_estimate_sums_weights_and_kv_at_the_limits(tiny: Path) -> None:
    got = estimate(tiny, max_context_tokens=4096, max_concurrent_sequences=8)
    per_token = kv_cache_bytes_per_token(json.loads((tiny / "config.json").read_text()))
    assert got == MemoryEstimate(weights_bytes=weights_bytes(tiny),
                                 kv_cache_bytes=per_token * 4096 * 8,
                                 total_bytes=weights_bytes(tiny) + per_token * 4096 * 8)


@pytest.mark.parametrize("kwargs", [
    {"max_context_tokens": 0, "max_concurrent_sequences": 1},
    {"max_context_tokens": 16, "max_concurrent_sequences": 0},
    {"max_context_tokens": 1.5, "max_concurrent_sequences": 1},
])
def test_estimate_refuses_limits_below_one(tiny: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        estimate(tiny, **kwargs)


def test_quantized_model_weights_are_the_packed_tensors(quantized: Path, tiny: Path) -> None:
    arrays = mx.load(str(quantized / "model.safetensors"))
    tensors = read_safetensors_header(quantized / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "U32"
    assert tensors["model.layers.0.self_attn.q_proj.scales"].shape == (64, 2)  # 64 in / 32
    assert tensors["model.layers.1.mlp.down_proj.weight"].shape == (64, 32)  # 128 in × 8 / 32
    assert weights_bytes(quantized) == sum(a.nbytes for a in arrays.values())
    assert weights_bytes(quantized) < weights_bytes(tiny) / 3  # 4-bit vs float32

    model, _ = mlx_lm.load(str(quantized))  # the files are real: mlx-lm loads them
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == weights_bytes(quantized)
    got = estimate(quantized, max_context_tokens=256, max_concurrent_sequences=2)
    assert got.weights_bytes == weights_bytes(quantized)


def _write_st(path: Path, tensors: dict[str, Any]) -> Path:
    mx.save_safetensors(str(path), tensors)
    return path


def _quant_dir(tmp_path: Path, *, bits_in_config: int, group_in_config: int = 32,
               extra: dict | None = None) -> Path:
    """A hand-made quantised layer: 4-bit affine, group 32, 8 outputs × 64 inputs."""
    w = mx.random.normal((8, 64))
    qw, scales, biases = mx.quantize(w, group_size=32, bits=4)
    assert qw.dtype == mx.uint32 and qw.shape == (8, 8) and scales.shape == (8, 2)
    _write_st(tmp_path / "model.safetensors", {
        "layer.weight": qw, "layer.scales": scales.astype(mx.float16),
        "layer.biases": biases.astype(mx.float16), "norm.weight": mx.ones((64,), mx.float16)})
    config = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 64,
              "quantization": {"group_size": group_in_config, "bits": bits_in_config,
                               **(extra or {})}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_hand_made_quantized_file(tmp_path: Path) -> None:
    d = _quant_dir(tmp_path, bits_in_config=4)
    # 8×8 U32 + 2 × 8×2 F16 + 64 F16
    assert weights_bytes(d) == 8 * 8 * 4 + 2 * 8 * 2 * 2 + 64 * 2
    got = estimate(d, max_context_tokens=1, max_concurrent_sequences=1)
    # 2 × 1 layer × 2 kv heads × 32 head dim × 2 bytes × 256 tokens (one step)
    assert got.kv_cache_bytes == 2 * 1 * 2 * 32 * 2 * 256
    assert got.total_bytes == got.weights_bytes + got.kv_cache_bytes


@pytest.mark.parametrize("bits, group, extra, reason", [
    (8, 32, None, "QuantizationMismatch"),      # config says 8 bits, files hold 4
    (4, 64, None, "QuantizationMismatch"),      # wrong group size
    (4, 64, {"layer": {"group_size": 32, "bits": 4}}, None),  # the per-layer entry wins
    (4, 32, {"layer": {"group_size": 32, "bits": 2}}, "QuantizationMismatch"),
    (0, 32, None, "InvalidConfig"),
    (16, 32, None, "InvalidConfig"),
])
def test_quantization_block_is_checked_against_the_files(
        tmp_path: Path, bits: int, group: int, extra: dict | None, reason: str | None) -> None:
    d = _quant_dir(tmp_path, bits_in_config=bits, group_in_config=group, extra=extra)
    if reason is None:
        assert estimate(d, max_context_tokens=1, max_concurrent_sequences=1).weights_bytes > 0
    else:
        with pytest.raises(ModelFileError) as e:
            estimate(d, max_context_tokens=1, max_concurrent_sequences=1)
        assert e.value.reason == reason


def test_quantized_weight_must_be_packed_u32() -> None:
    tensors = {"l.weight": TensorInfo("F16", (8, 8), 0, 128),
               "l.scales": TensorInfo("F16", (8, 2), 128, 160)}
    with pytest.raises(ModelFileError, match="QuantizationMismatch"):
        check_quantization({"quantization": {"group_size": 32, "bits": 4}}, tensors)
    check_quantization({}, tensors)  # no block: nothing to check


def test_sharded_weights_are_summed(tmp_path: Path) -> None:
    _write_st(tmp_path / "model-00001-of-00002.safetensors", {"a": mx.zeros((10,), mx.float32)})
    _write_st(tmp_path / "model-00002-of-00002.safetensors", {"b": mx.zeros((3, 5), mx.bfloat16)})
    _write_st(tmp_path / "adapters.safetensors", {"c": mx.zeros((1000,), mx.float32)})  # ignored
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # not a weight file
    assert weights_bytes(tmp_path) == 40 + 30


def test_no_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as e:
        weights_bytes(tmp_path)
    assert e.value.reason == "NoWeights"


def test_errors_from_a_file_name_it(tmp_path: Path) -> None:
    (tmp_path / "model-bad.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ModelFileError) as e:
        weights_bytes(tmp_path)
    assert e.value.reason == "MalformedSafetensors"
    assert e.value.message.startswith("model-bad.safetensors: ")


# ---------------------------------------------------------------------------------------------
# Hostile safetensors headers
# ---------------------------------------------------------------------------------------------


def _st(header: Any, data_len: int, *, length: int | None = None) -> bytes:
    """A safetensors file: ``header`` (an object dumped as JSON, or raw bytes), ``data_len``
    zero bytes of data; ``length`` overrides the 8-byte header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + bytes(data_len)


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}

HOSTILE: list[tuple[str, bytes, str]] = [
    ("shorter than the length field", b"\x01\x00\x00", "MalformedSafetensors"),
    ("length larger than the file", _st({"a": F32_2x2}, 16, length=10_000),
     "HeaderBeyondFile"),
    ("length above the cap", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "OversizedHeader"),
    ("length 2**64 - 1", struct.pack("<Q", 2**64 - 1) + b"{}", "OversizedHeader"),
    ("empty header", _st(b"", 0), "MalformedSafetensors"),
    ("not JSON", _st(b"{not json", 0), "MalformedSafetensors"),
    ("JSON array", _st(b"[1, 2]", 0), "MalformedSafetensors"),
    ("JSON string", _st(b'"a"', 0), "MalformedSafetensors"),
    ("not UTF-8", _st(b'{"\xff": 1}', 0), "MalformedSafetensors"),
    ("NaN", _st(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', 4),
     "MalformedSafetensors"),
    ("deeply nested", _st(b"{\"a\":" + b"[" * 100_000 + b"]" * 100_000 + b"}", 0),
     "MalformedSafetensors"),
    ("duplicate tensor", _st(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
                             b' "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', 2),
     "MalformedSafetensors"),
    ("entry not an object", _st({"a": [1, 2]}, 0), "MalformedSafetensors"),
    ("entry lacks offsets", _st({"a": {"dtype": "F32", "shape": [1]}}, 4),
     "MalformedSafetensors"),
    ("metadata not strings", _st({"__metadata__": {"k": 1}}, 0), "MalformedSafetensors"),
    ("bad dtype", _st({"a": {**F32_2x2, "dtype": "F128"}}, 16), "UnknownDtype"),
    ("dtype not a string", _st({"a": {**F32_2x2, "dtype": 4}}, 16), "UnknownDtype"),
    ("negative shape", _st({"a": {**F32_2x2, "shape": [-2, -2]}}, 16), "InvalidShape"),
    ("float shape", _st({"a": {**F32_2x2, "shape": [2.0, 2]}}, 16), "InvalidShape"),
    ("bool shape", _st({"a": {**F32_2x2, "shape": [True, 4]}}, 16), "InvalidShape"),
    ("shape not a list", _st({"a": {**F32_2x2, "shape": 4}}, 16), "InvalidShape"),
    ("offsets inconsistent with dtype × shape", _st({"a": {**F32_2x2, "shape": [2, 3]}}, 16),
     "SizeMismatch"),
    ("huge shape", _st({"a": {**F32_2x2, "shape": [2**62, 2**62, 2**62]}}, 16), "SizeMismatch"),
    ("sub-byte dtype not a whole byte", _st({"a": {"dtype": "F4", "shape": [3],
                                                   "data_offsets": [0, 2]}}, 2), "SizeMismatch"),
    ("offsets out of the file", _st({"a": {**F32_2x2, "data_offsets": [16, 32]}}, 16),
     "InvalidOffsets"),
    ("offsets reversed", _st({"a": {**F32_2x2, "data_offsets": [16, 0]}}, 16), "InvalidOffsets"),
    ("negative offset", _st({"a": {**F32_2x2, "data_offsets": [-16, 0]}}, 16), "InvalidOffsets"),
    ("three offsets", _st({"a": {**F32_2x2, "data_offsets": [0, 8, 16]}}, 16), "InvalidOffsets"),
    ("gap before a tensor", _st({"a": {**F32_2x2, "data_offsets": [4, 20]}}, 20),
     "InvalidOffsets"),
    ("overlapping tensors", _st({"a": F32_2x2, "b": {**F32_2x2, "data_offsets": [8, 24]}}, 24),
     "InvalidOffsets"),
    ("uncovered trailing bytes", _st({"a": F32_2x2}, 17), "InvalidOffsets"),
]


@pytest.mark.parametrize("data, reason", [(d, r) for _, d, r in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])
def test_hostile_headers_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ModelFileError) as e:
        parse_safetensors_header(data)
    assert e.value.reason == reason
    assert str(e.value).startswith(f"{reason}: ") and e.value.message


@pytest.mark.parametrize("data", [d for _, d, _ in HOSTILE], ids=[n for n, _, _ in HOSTILE])
def test_the_reference_parser_refuses_them_too(data: bytes) -> None:
    """Nothing refused here is a file safetensors itself would load (no false refusals of the
    kind this table covers)."""
    with pytest.raises(Exception):  # noqa: B017, PT011  (safetensors raises its own errors)
        safetensors.numpy.load(data)


def test_the_reference_parser_accepts_the_valid_base_case() -> None:
    """Control for the test above: the table's valid base tensor loads in safetensors."""
    loaded = safetensors.numpy.load(_st({"a": F32_2x2}, 16))
    assert loaded["a"].shape == (2, 2)


@pytest.mark.parametrize("name, data, expected", [
    ("empty model", _st({}, 0), {}),
    ("MLX's null metadata", _st({"__metadata__": None, "a": F32_2x2}, 16),
     {"a": TensorInfo("F32", (2, 2), 0, 16)}),
    ("string metadata", _st({"__metadata__": {"format": "mlx"}, "a": F32_2x2}, 16),
     {"a": TensorInfo("F32", (2, 2), 0, 16)}),
    ("tensors out of name order, zero-size and scalar ones", _st({
        "z": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [6, 6]},
        "s": {"dtype": "I64", "shape": [], "data_offsets": [6, 14]}}, 14),
     {"z": TensorInfo("BF16", (3,), 0, 6), "e": TensorInfo("F32", (0, 5), 6, 6),
      "s": TensorInfo("I64", (), 6, 14)}),
    ("sub-byte F4", _st({"a": {"dtype": "F4", "shape": [2, 3, 2], "data_offsets": [0, 6]}}, 6),
     {"a": TensorInfo("F4", (2, 3, 2), 0, 6)}),
    ("padded header", _st(json.dumps({"a": F32_2x2}).encode() + b"    ", 16),
     {"a": TensorInfo("F32", (2, 2), 0, 16)}),
])
def test_valid_headers_parse(name: str, data: bytes, expected: dict) -> None:
    assert parse_safetensors_header(data) == expected


def test_prefix_with_file_size_parses_without_the_data() -> None:
    full = _st({"a": F32_2x2}, 16)
    prefix = full[:len(full) - 16]
    assert parse_safetensors_header(prefix, file_size=len(full)) == {
        "a": TensorInfo("F32", (2, 2), 0, 16)}
    with pytest.raises(ValueError, match="needs the first"):
        parse_safetensors_header(prefix[:-1], file_size=len(full))


def test_every_dtype_size(tmp_path: Path) -> None:
    """The dtype table agrees with what MLX writes for each of its dtypes."""
    dtypes = [mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
              mx.int64, mx.float16, mx.bfloat16, mx.float32, mx.complex64]
    path = _write_st(tmp_path / "all.safetensors",
                     {f"t{i}": mx.zeros((3, 2), d) for i, d in enumerate(dtypes)})
    tensors = read_safetensors_header(path)
    for i, d in enumerate(dtypes):
        t = tensors[f"t{i}"]
        assert me.DTYPE_BITS[t.dtype] == 8 * d.size, (t.dtype, d)
        assert t.nbytes == 6 * d.size


def test_path_wrapper_refuses_before_reading_a_claimed_huge_header(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES) + b"{}")
    with pytest.raises(ModelFileError) as e:
        read_safetensors_header(p)
    assert e.value.reason == "HeaderBeyondFile"
    assert "model.safetensors: " in e.value.message and str(MAX_HEADER_BYTES) in e.value.message


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, reason", [
    (b"{" + b" " * MAX_CONFIG_BYTES + b"}", "OversizedConfig"),
    (b"\xff{}", "MalformedConfig"),
    (b"{num_hidden_layers: 2}", "MalformedConfig"),
    (b"[1, 2]", "MalformedConfig"),
    (b"null", "MalformedConfig"),
    (b"[" * 100_000 + b"]" * 100_000, "MalformedConfig"),
])
def test_bad_configs_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(ModelFileError) as e:
        parse_config(data)
    assert e.value.reason == reason


def test_config_at_the_cap_is_accepted() -> None:
    data = b"{" + b" " * (MAX_CONFIG_BYTES - 2) + b"}"
    assert len(data) == MAX_CONFIG_BYTES and parse_config(data) == {}


def test_read_config(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as e:
        read_config(tmp_path)
    assert e.value.reason == "MissingConfig"
    (tmp_path / "config.json").write_bytes(b"{" + b" " * MAX_CONFIG_BYTES * 2 + b"}")
    with pytest.raises(ModelFileError) as e:
        read_config(tmp_path)
    assert e.value.reason == "OversizedConfig"
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    assert read_config(tmp_path) == {"num_hidden_layers": 2}


# ---------------------------------------------------------------------------------------------
# KV cache per token
# ---------------------------------------------------------------------------------------------

LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config, expected", [
    # GQA, head_dim from hidden_size // heads: Llama 3 8B's well-known 128 KiB per token
    (LLAMA3_8B, 2 * 32 * 8 * 128 * 2),
    # explicit head_dim that is not hidden_size // heads (Gemma-style 3072 / 16 = 192 ≠ 256)
    ({"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
      "hidden_size": 3072, "head_dim": 256}, 2 * 28 * 16 * 256 * 2),
    # no num_key_value_heads: as many as attention heads (multi-head attention)
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 2 * 2 * 4 * 16 * 2),
    # head_dim and kv heads given: attention heads and hidden size are not needed
    ({"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64}, 2 * 2 * 2 * 64 * 2),
    # null head_dim (some configs write it): derived
    ({**LLAMA3_8B, "head_dim": None}, 2 * 32 * 8 * 128 * 2),
    # dtypes: float32 4 bytes, float16 2, unknown and missing 2
    ({**LLAMA3_8B, "torch_dtype": "float32"}, 2 * 32 * 8 * 128 * 4),
    ({**LLAMA3_8B, "torch_dtype": "float16"}, 2 * 32 * 8 * 128 * 2),
    ({**LLAMA3_8B, "torch_dtype": None, "dtype": "float32"}, 2 * 32 * 8 * 128 * 4),
    ({**LLAMA3_8B, "torch_dtype": "int8"}, 2 * 32 * 8 * 128 * 2),
    ({k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}, 2 * 32 * 8 * 128 * 2),
    # multimodal: the text model's fields under text_config
    ({"model_type": "x", "text_config": LLAMA3_8B}, 2 * 32 * 8 * 128 * 2),
])
def test_kv_cache_bytes_per_token(config: dict, expected: int) -> None:
    assert kv_cache_bytes_per_token(config) == expected


@pytest.mark.parametrize("config, field", [
    ({"num_attention_heads": 32, "hidden_size": 4096}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_hidden_layers": 0}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_hidden_layers": True}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_hidden_layers": "32"}, "num_hidden_layers"),
    ({**LLAMA3_8B, "num_key_value_heads": -8}, "num_key_value_heads"),
    ({"num_hidden_layers": 2, "hidden_size": 64}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 4}, "hidden_size"),
    ({**LLAMA3_8B, "head_dim": 1.5}, "head_dim"),
])
def test_kv_cache_config_errors_name_the_field(config: dict, field: str) -> None:
    with pytest.raises(ModelFileError) as e:
        kv_cache_bytes_per_token(config)
    assert e.value.reason == "InvalidConfig" and field in e.value.message


# ---------------------------------------------------------------------------------------------
# Node budget
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("total, wired, watermark, expected", [
    (64 * GiB, 0, 0.8, int(64 * GiB * 4 // 5)),            # no wired limit: the watermark
    (64 * GiB, 40 * GiB, 0.8, 40 * GiB),                   # the wired limit is lower
    (64 * GiB, 60 * GiB, 0.8, int(64 * GiB * 4 // 5)),     # the watermark is lower
    (64 * GiB, 48 * GiB, 0.75, 48 * GiB),                  # equal
    (64 * GiB, 0, 1.0, 64 * GiB),
    (64 * GiB, 0, 1, 64 * GiB),
    (100, 0, 0.29, 29),                                    # exact: 100 × 0.29 in float is 28.99…
    (10, 0, 0.8, 8),
    (9, 0, 0.8, 7),                                        # floored: 7.2
    (0, 0, 0.8, 0),
    (64 * GiB, 1, 0.8, 1),
])
def test_node_budget(total: int, wired: int, watermark: float, expected: int) -> None:
    assert node_budget_bytes(total, wired, watermark) == expected


def test_node_budget_default_watermark_is_80_percent() -> None:
    assert me.DEFAULT_WATERMARK == 0.8
    assert node_budget_bytes(100 * GiB, 0) == 80 * GiB


def test_node_budget_for_a_capacity() -> None:
    cap = NodeCapacity(memory_total_bytes=128 * GiB, memory_available_bytes=100 * GiB,
                       wired_limit_bytes=96 * GiB, chip="Apple M3 Max", chip_generation=3)
    assert node_budget_for(cap) == 96 * GiB
    assert node_budget_for(cap, 0.5) == 64 * GiB
    own = cap.model_copy(update={"memory_watermark": 0.25})  # the agent's --memory-watermark
    assert node_budget_for(own) == 32 * GiB and node_budget_for(own, 0.5) == 64 * GiB


@pytest.mark.parametrize("total, wired, watermark", [
    (-1, 0, 0.8), (10, -1, 0.8), (10, 0, 0.0), (10, 0, 1.5), (10, 0, -0.8), (10, 0, True),
    (10.0, 0, 0.8), (10, 0, float("nan")),
])
def test_node_budget_refuses_bad_input(total: Any, wired: Any, watermark: Any) -> None:
    with pytest.raises(ValueError):
        node_budget_bytes(total, wired, watermark)
