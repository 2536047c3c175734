"""A revision's resident-memory estimate from its files, and a node's memory budget.

The estimate of one revision (issue: "A revision's resident bytes are estimated from its files
(safetensors headers: dtype, shapes, quantisation) plus KV cache per token ×
maxContextTokens × maxConcurrentSequences")::

    total_bytes = weights_bytes + kv_cache_bytes
    weights_bytes  = Σ over the tensors of model*.safetensors of (end - begin)   # headers only
    kv_cache_bytes = kv_cache_bytes_per_token(config.json)
                     × round_up(max_context_tokens, KV_CACHE_STEP_TOKENS)
                     × max_concurrent_sequences

Weights are exactly the bytes the tensors occupy on disk, which is what MLX holds once they are
loaded: quantised weights are already packed in the files (``U32`` words plus ``scales`` and
``biases``), so a 4-bit model is counted at its packed size without knowing the scheme. The
``"quantization"`` block of ``config.json`` is checked against the packed shapes so that a
revision whose files and config disagree is refused before it is loaded. Only the safetensors
*headers* are read (the first ``8 + N`` bytes of each file), never the tensor data.

Security: every file is untrusted input ("oversized or malformed safetensors headers and
config.json ... are refused with a clear reason before anything is loaded"). Headers larger than
:data:`MAX_HEADER_BYTES`, configs larger than :data:`MAX_CONFIG_BYTES`, bad UTF-8, bad JSON,
unknown dtypes, negative shapes and offsets that disagree with dtype × shape or with the file
size raise :class:`ModelFileError` with a CamelCase ``reason`` and a message naming the file and
the numbers.

The node budget (:func:`node_budget_bytes`) is what the agent lets resident models take: the
watermark share of unified memory (the node's ``--memory-watermark``, default seed 004's "Total
memory watermark: 80%"), capped by the GPU wired-memory limit when one is configured (macOS
``iogpu.wired_limit_mb`` caps what the GPU may wire; 0 reports the OS default, see
:class:`mlx_fleet.contract.NodeCapacity`).

Pure: standard library and :mod:`mlx_fleet.contract` only. The parsers work on ``bytes``
(:func:`parse_safetensors_header`, :func:`parse_config`); thin wrappers read a path's first
bytes (:func:`read_safetensors_header`, :func:`read_config`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

from mlx_fleet.contract import WATERMARK, NodeCapacity
from mlx_fleet.contract import node_budget_bytes as contract_node_budget_bytes

__all__ = [
    "DEFAULT_KV_DTYPE_BYTES", "DEFAULT_WATERMARK", "DTYPE_BITS", "KV_CACHE_STEP_TOKENS",
    "MAX_CONFIG_BYTES", "MAX_HEADER_BYTES", "WEIGHTS_GLOB", "MemoryEstimate", "ModelFileError",
    "TensorInfo", "check_quantization", "estimate", "kv_cache_bytes", "kv_cache_bytes_per_token",
    "model_tensors", "node_budget_bytes", "node_budget_for", "parse_config",
    "parse_safetensors_header", "read_config", "read_safetensors_header", "weights_bytes",
]

#: Largest safetensors header accepted, in bytes (the JSON after the 8-byte length). The same
#: limit as the safetensors reference implementation (``MAX_HEADER_SIZE = 100_000_000``, error
#: ``HeaderTooLarge``), so every file it accepts is accepted here; real headers are far smaller
#: (about 100 bytes per tensor).
MAX_HEADER_BYTES = 100_000_000

#: Largest ``config.json`` accepted, in bytes (1 MiB). Real configs are a few KiB; a
#: mixed-precision MLX config with a per-layer quantisation entry for every linear layer of a
#: large model stays well under 100 KiB.
MAX_CONFIG_BYTES = 1 << 20

#: The weight files mlx-lm loads: ``mlx_lm.utils.load_model`` globs ``model*.safetensors`` in
#: the model directory (``model.safetensors`` or ``model-00001-of-00004.safetensors`` ...).
WEIGHTS_GLOB = "model*.safetensors"

#: mlx-lm's ``KVCache`` grows its key and value buffers in steps of this many tokens
#: (``mlx_lm.models.cache.KVCache.step = 256``), so a sequence of ``n`` tokens holds
#: ``round_up(n, 256)`` tokens of cache.
KV_CACHE_STEP_TOKENS = 256

#: Bytes per KV-cache element when ``config.json`` names no dtype (``torch_dtype``/``dtype``):
#: 2, the float16/bfloat16 that released checkpoints are published in.
DEFAULT_KV_DTYPE_BYTES = 2

#: The default share of unified memory resident models may take (seed 004: "Total memory
#: watermark: 80%"); a node's own is ``NodeCapacity.memory_watermark`` (``--memory-watermark``),
#: which the operator's placement reads from the node record.
DEFAULT_WATERMARK = WATERMARK

#: Bits per element of the 22 dtypes the safetensors format defines (the reference
#: implementation's ``Dtype`` enum: ``BOOL U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ
#: F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64 C64`` and the sub-byte ``F4 F6_E2M3
#: F6_E3M2``, whose tensors must fill whole bytes). MLX writes ``C64`` for complex64.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

_KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ModelFileError(Exception):
    """A model file is refused. ``reason``: CamelCase machine reason, for an
    :class:`~mlx_fleet.contract.AssignmentReport`'s ``reason``; ``message``: human text naming
    the file (where known) and the offending numbers.

    Reasons: ``MalformedSafetensors`` (too short, not UTF-8, not a JSON object, an entry that is
    not a tensor description), ``OversizedHeader`` (length above :data:`MAX_HEADER_BYTES`),
    ``HeaderBeyondFile`` (the header length runs past the end of the file), ``UnknownDtype``,
    ``InvalidShape``, ``InvalidOffsets`` (not ``[begin, end]``, beyond the file, gaps, overlaps or
    uncovered trailing bytes), ``SizeMismatch`` (``end - begin`` is not dtype × shape),
    ``NoWeights`` (no ``model*.safetensors``), ``MissingConfig``, ``OversizedConfig``,
    ``MalformedConfig`` (not UTF-8 or not a JSON object), ``InvalidConfig`` (a field the
    estimate needs is missing or not a positive integer), ``QuantizationMismatch`` (the packed
    shapes disagree with the ``quantization`` block).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors header. ``dtype``: a :data:`DTYPE_BITS` key; ``shape``:
    dimensions (elements); ``begin``/``end``: byte offsets into the data section (after the
    header), ``end`` exclusive."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (``end - begin``, checked equal to dtype × shape)."""
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A revision's estimated resident bytes: ``weights_bytes`` (its tensors),
    ``kv_cache_bytes`` (KV cache at the serving limits) and ``total_bytes`` (their sum)."""

    weights_bytes: int
    kv_cache_bytes: int
    total_bytes: int


# ---------------------------------------------------------------------------------------------
# safetensors headers
# ---------------------------------------------------------------------------------------------


def _malformed(msg: str) -> ModelFileError:
    return ModelFileError("MalformedSafetensors", msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _malformed(f"the header names {k!r} twice")
        out[k] = v
    return out


def _refuse_constant(name: str) -> Any:
    raise _malformed(f"the header contains the non-JSON number {name}")


def _header_length(data: bytes) -> int:
    if len(data) < 8:
        raise _malformed(f"the file is {len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise ModelFileError("OversizedHeader",
                             f"the header length is {n} bytes, above the limit of "
                             f"{MAX_HEADER_BYTES} bytes")
    return n


def parse_safetensors_header(data: bytes, *, file_size: int | None = None
                             ) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header; returns ``{tensor name: TensorInfo}``.

    ``data``: the file's bytes from its start — the whole file, or at least its first
    ``8 + N`` bytes where N is the little-endian u64 header length. ``file_size``: the file's
    size in bytes (default ``len(data)``), against which the header length and the offsets are
    checked. ``__metadata__`` (a string-to-string map, or ``null`` as MLX writes it) is
    validated and not returned.

    The checks follow the safetensors reference implementation: N ≤ :data:`MAX_HEADER_BYTES`,
    ``8 + N ≤ file_size``, the header is UTF-8 JSON starting with ``{`` (no duplicate names,
    no ``NaN``/``Infinity``), each entry has ``dtype`` ∈ :data:`DTYPE_BITS`, ``shape`` a list of
    non-negative integers and ``data_offsets`` ``[begin, end]`` with ``end - begin`` equal to
    elements × dtype bits ÷ 8, and the tensors tile the data section (``file_size - 8 - N``
    bytes) exactly, without gaps, overlaps or trailing bytes.

    Raises :class:`ModelFileError` (reasons in its docstring); ``ValueError`` when ``data`` is
    shorter than the ``8 + N`` bytes that ``file_size`` says the file has (a caller's error).
    """
    n = _header_length(data)
    size = len(data) if file_size is None else file_size
    if 8 + n > size:
        raise ModelFileError("HeaderBeyondFile",
                             f"the header length is {n} bytes but the file has only "
                             f"{max(size - 8, 0)} bytes after the 8-byte length")
    if len(data) < 8 + n:
        raise ValueError(f"data holds {len(data)} bytes; the header needs the first {8 + n}")
    raw = data[8:8 + n]
    if not raw.startswith(b"{"):
        raise _malformed("the header does not start with '{' (not a JSON object)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _malformed(f"the header is not valid UTF-8 (byte {e.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_refuse_duplicates,
                            parse_constant=_refuse_constant)
    except ModelFileError:
        raise
    except RecursionError:
        raise _malformed("the header's JSON is nested too deeply") from None
    except ValueError as e:
        raise _malformed(f"the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise _malformed("the header is not a JSON object")

    data_len = size - 8 - n
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(
            isinstance(v, str) for v in meta.values())):
        raise _malformed("__metadata__ is not a map of strings")
    tensors = {name: _tensor_info(name, entry, data_len) for name, entry in header.items()}

    position = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end, kv[0])):
        if t.begin != position:
            what = "overlaps the previous tensor" if t.begin < position else "leaves a gap"
            raise ModelFileError("InvalidOffsets",
                                 f"tensor {name!r} starts at byte {t.begin} of the data section "
                                 f"and {what} (the previous tensor ends at byte {position})")
        position = t.end
    if position != data_len:
        raise ModelFileError("InvalidOffsets",
                             f"the tensors cover {position} bytes but the data section has "
                             f"{data_len} bytes (uncovered trailing bytes)")
    return tensors


def _tensor_info(name: str, entry: Any, data_len: int) -> TensorInfo:
    if not name:
        raise _malformed("a tensor has an empty name")
    if not isinstance(entry, dict):
        raise _malformed(f"tensor {name!r} is not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise _malformed(f"tensor {name!r} lacks {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ModelFileError("UnknownDtype", f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ModelFileError("InvalidShape", f"tensor {name!r} has shape {shape!r}; a shape is "
                                             "a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            _is_int(o) and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        raise ModelFileError("InvalidOffsets", f"tensor {name!r} has data_offsets {offsets!r}; "
                                               "expected [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_len:
        raise ModelFileError("InvalidOffsets", f"tensor {name!r} ends at byte {end}, past the "
                                               f"data section's {data_len} bytes")
    bits = DTYPE_BITS[dtype]
    limit = 8 * data_len  # bits available; a larger product can never match the offsets
    elements = 0 if 0 in shape else 1
    for d in shape:
        elements *= d
        if elements * bits > limit:
            raise ModelFileError("SizeMismatch",
                                 f"tensor {name!r} ({dtype} {shape}) is larger than the "
                                 f"data section's {data_len} bytes")
    if (elements * bits) % 8 or (elements * bits) // 8 != end - begin:
        raise ModelFileError("SizeMismatch",
                             f"tensor {name!r} ({dtype} {shape}) needs {elements * bits / 8:g} "
                             f"bytes but its data_offsets span {end - begin}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """:func:`parse_safetensors_header` of the file at ``path``, reading only its first
    ``8 + N`` bytes (the length is checked against the cap and the file size before the header
    is read). Messages name the file. Raises :class:`ModelFileError`, ``OSError``."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        try:
            n = _header_length(head)
            if 8 + n > size:  # refuse before reading (and allocating) N bytes
                return parse_safetensors_header(head, file_size=size)
            return parse_safetensors_header(head + f.read(n), file_size=size)
        except ModelFileError as e:
            raise ModelFileError(e.reason, f"{path.name}: {e.message}") from None


def model_tensors(model_dir: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of the weight files (:data:`WEIGHTS_GLOB`) in ``model_dir``, read from the
    headers; a name in several shards keeps the last shard's entry (in file-name order), as
    mlx-lm's ``weights.update`` does. Raises :class:`ModelFileError` (``NoWeights`` when there
    is no weight file), ``OSError``."""
    files = sorted(p for p in Path(model_dir).glob(WEIGHTS_GLOB) if p.is_file())
    if not files:
        raise ModelFileError("NoWeights", f"no {WEIGHTS_GLOB} file in the model directory")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        tensors.update(read_safetensors_header(file))
    return tensors


def weights_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the model's weights: the sum of the tensors' sizes over the weight files of
    ``model_dir`` (:func:`model_tensors`), from the headers only. Raises
    :class:`ModelFileError`, ``OSError``."""
    return sum(t.nbytes for t in model_tensors(model_dir).values())


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------


def parse_config(data: bytes) -> dict[str, Any]:
    """Parse ``config.json`` bytes into a dict. Raises :class:`ModelFileError`:
    ``OversizedConfig`` above :data:`MAX_CONFIG_BYTES`, ``MalformedConfig`` when not UTF-8 JSON
    or not an object."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ModelFileError("OversizedConfig", f"config.json is larger than the limit of "
                                                f"{MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelFileError("MalformedConfig",
                             f"config.json is not valid UTF-8 (byte {e.start})") from None
    except RecursionError:
        raise ModelFileError("MalformedConfig", "config.json is nested too deeply") from None
    except ValueError as e:
        raise ModelFileError("MalformedConfig", f"config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelFileError("MalformedConfig", "config.json is not a JSON object")
    return config


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """:func:`parse_config` of ``model_dir/config.json``, reading at most
    :data:`MAX_CONFIG_BYTES` + 1 bytes. Raises :class:`ModelFileError` (also ``MissingConfig``),
    ``OSError``."""
    path = Path(model_dir) / "config.json"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ModelFileError("MissingConfig", "no config.json in the model directory") from None
    return parse_config(data)


def _field(config: dict[str, Any], name: str) -> Any:
    """``config[name]``, else the multimodal ``text_config[name]``; None when absent."""
    value = config.get(name)
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get(name)
    return value


def _positive(config: dict[str, Any], name: str, *, required: bool = True) -> int | None:
    value = _field(config, name)
    if value is None and not required:
        return None
    if not _is_int(value) or value <= 0:
        raise ModelFileError("InvalidConfig", f"config.json: {name} is {value!r}; expected a "
                                              "positive integer")
    return value


def kv_cache_bytes_per_token(config: dict[str, Any]) -> int:
    """Bytes of KV cache one token of one sequence holds, from ``config.json``::

        2 (K and V) × num_hidden_layers × num_key_value_heads × head_dim × dtype bytes

    Source: mlx-lm's ``KVCache`` (``mlx_lm/models/cache.py``), one per layer, allocates keys
    and values of shape ``(batch, n_kv_heads, tokens, head_dim)`` in the activations' dtype.
    Defaults as mlx-lm's model args: ``num_key_value_heads`` = ``num_attention_heads`` (no
    grouped-query attention), ``head_dim`` = ``hidden_size // num_attention_heads``. dtype bytes:
    ``torch_dtype`` (or ``dtype``) ``float32`` → 4, ``float16``/``bfloat16`` → 2, otherwise
    :data:`DEFAULT_KV_DTYPE_BYTES`. A field missing at the top level is looked up in
    ``text_config`` (multimodal configs). Standard attention only: sliding-window and
    latent-attention caches are smaller, so this is an upper bound for them.

    Raises :class:`ModelFileError` ``InvalidConfig`` when a needed field is missing or not a
    positive integer.
    """
    layers = _positive(config, "num_hidden_layers")
    head_dim = _positive(config, "head_dim", required=False)
    kv_heads = _positive(config, "num_key_value_heads", required=False)
    if head_dim is None or kv_heads is None:
        heads = _positive(config, "num_attention_heads")
        if kv_heads is None:
            kv_heads = heads
        if head_dim is None:
            hidden = _positive(config, "hidden_size")
            head_dim = hidden // heads
            if head_dim <= 0:
                raise ModelFileError("InvalidConfig",
                                     f"config.json: hidden_size {hidden} is smaller than "
                                     f"num_attention_heads {heads}")
    dtype = _field(config, "torch_dtype") or _field(config, "dtype")
    dtype_bytes = _KV_DTYPE_BYTES.get(dtype, DEFAULT_KV_DTYPE_BYTES) if isinstance(
        dtype, str) else DEFAULT_KV_DTYPE_BYTES
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_cache_bytes(bytes_per_token: int, tokens: int, sequences: int = 1) -> int:
    """KV-cache bytes of ``sequences`` sequences of ``tokens`` tokens each::

        bytes_per_token × round_up(tokens, KV_CACHE_STEP_TOKENS) × sequences

    ``bytes_per_token``: :func:`kv_cache_bytes_per_token`; the rounding is mlx-lm's ``KVCache``
    growing in steps of :data:`KV_CACHE_STEP_TOKENS`. The one formula behind a revision's
    estimate (:func:`estimate`), the serving core's default prompt-cache budget and its
    KV-aware admission (:mod:`node_agent.serving.admission`). 0 tokens hold 0 bytes."""
    step = KV_CACHE_STEP_TOKENS
    return bytes_per_token * (-(-max(0, tokens) // step) * step) * sequences


def check_quantization(config: dict[str, Any], tensors: dict[str, TensorInfo]) -> None:
    """Check the ``"quantization"`` block of ``config.json`` against the packed tensors.

    mlx-lm quantises a layer into ``<layer>.weight`` (``U32``, ``in_features × bits ÷ 32``
    words per row), ``<layer>.scales`` and, in the affine mode, ``<layer>.biases`` (one per
    ``group_size`` inputs), with ``{"group_size", "bits"}`` from the block, or from the block's
    per-layer entry ``"<layer>": {...}`` where one exists (``mlx_lm.utils.load_model``). For
    every ``<layer>.scales`` this checks ``weight.shape[-1] × 32 == scales.shape[-1] ×
    group_size × bits``, equal leading dimensions, and ``biases`` shaped like ``scales``. No
    block: nothing to check. Raises :class:`ModelFileError` ``InvalidConfig`` for a block
    without positive integer ``group_size``/``bits`` (bits ≤ 8), ``QuantizationMismatch`` when
    the tensors disagree.
    """
    block = config.get("quantization")
    if block is None:
        return
    if not isinstance(block, dict):
        raise ModelFileError("InvalidConfig", "config.json: quantization is not an object")
    default = _quant_params(block, "quantization")
    for name, scales in tensors.items():
        if not name.endswith(".scales"):
            continue
        layer = name[:-len(".scales")]
        params = default
        if isinstance(block.get(layer), dict):
            params = _quant_params(block[layer], f"quantization.{layer}")
        weight = tensors.get(f"{layer}.weight")
        if weight is None:
            continue
        group_size, bits = params
        biases = tensors.get(f"{layer}.biases")
        ok = (weight.dtype == "U32" and len(weight.shape) >= 1
              and weight.shape[:-1] == scales.shape[:-1]
              and weight.shape[-1] * 32 == scales.shape[-1] * group_size * bits
              and (biases is None or biases.shape == scales.shape))
        if not ok:
            raise ModelFileError(
                "QuantizationMismatch",
                f"{layer}: weight {weight.dtype} {list(weight.shape)}, scales "
                f"{list(scales.shape)}"
                + (f", biases {list(biases.shape)}" if biases is not None else "")
                + f" do not match group_size {group_size}, bits {bits} (expected U32 weights "
                  "with shape[-1] × 32 = scales.shape[-1] × group_size × bits)")


def _quant_params(block: dict[str, Any], where: str) -> tuple[int, int]:
    group_size, bits = block.get("group_size"), block.get("bits")
    if not (_is_int(group_size) and group_size > 0 and _is_int(bits) and 0 < bits <= 8):
        raise ModelFileError("InvalidConfig",
                             f"config.json: {where} has group_size {group_size!r}, bits "
                             f"{bits!r}; expected positive integers, bits at most 8")
    return group_size, bits


# ---------------------------------------------------------------------------------------------
# The estimate and the budget
# ---------------------------------------------------------------------------------------------


def estimate(model_dir: str | os.PathLike, *, max_context_tokens: int,
             max_concurrent_sequences: int) -> MemoryEstimate:
    """A revision's resident-bytes estimate from the files in ``model_dir``.

    ``weights_bytes``: :func:`weights_bytes`; ``kv_cache_bytes``:
    :func:`kv_cache_bytes_per_token` × ``max_context_tokens`` rounded up to
    :data:`KV_CACHE_STEP_TOKENS` × ``max_concurrent_sequences`` (tokens and sequences as in
    :class:`mlx_fleet.contract.ServingParams`). ``config.json`` and every header are validated
    first (:func:`read_config`, :func:`model_tensors`, :func:`check_quantization`).

    Raises :class:`ModelFileError`, ``OSError``, ``ValueError`` for a limit below 1.
    """
    for name, value in (("max_context_tokens", max_context_tokens),
                        ("max_concurrent_sequences", max_concurrent_sequences)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    config = read_config(model_dir)
    per_token = kv_cache_bytes_per_token(config)
    tensors = model_tensors(model_dir)
    check_quantization(config, tensors)
    weights = sum(t.nbytes for t in tensors.values())
    kv = kv_cache_bytes(per_token, max_context_tokens, max_concurrent_sequences)
    return MemoryEstimate(weights_bytes=weights, kv_cache_bytes=kv, total_bytes=weights + kv)


def node_budget_for(capacity: NodeCapacity, watermark: float | None = None) -> int:
    """:func:`node_budget_bytes` of a node's :class:`~mlx_fleet.contract.NodeCapacity`, with
    ``watermark`` instead of the node's own (``capacity.memory_watermark``) when given."""
    if watermark is None:
        return capacity.budget_bytes()
    return node_budget_bytes(capacity.memory_total_bytes, capacity.wired_limit_bytes, watermark)


#: One definition for agent and operator alike (placement uses it too): see
#: :func:`mlx_fleet.contract.node_budget_bytes`.
node_budget_bytes = contract_node_budget_bytes
