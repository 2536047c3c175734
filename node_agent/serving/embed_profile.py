"""How an embedding model turns hidden states into one vector, read from its model directory.

A model deployed with ``spec.model.task: TextEmbedding`` is a decoder served by mlx-lm's own
model code (e.g. the Qwen3-Embedding family, architecture ``qwen3``): the serving core runs the
model body (``model.model(ids)``: the final-normed hidden states, ``(batch, tokens, hidden)``)
and pools them. Library decision: mlx-lm itself, not mlx-embeddings — mlx-embeddings 0.1.0
imports ``mlx_vlm`` when imported, which pulls datasets, opencv-python, mlx-audio and fastapi
into the agent; the decoder families it would serve are mlx-lm's model classes anyway.

What the directory says (:func:`parse_profile`, from the files Qwen3-Embedding ships; its
``config.json`` is a plain ``Qwen3ForCausalLM`` and says nothing about embeddings):

* ``modules.json`` and ``1_Pooling/config.json`` (the sentence-transformers layout):
  ``sentence_transformers.models.Transformer`` → ``Pooling`` (``pooling_mode_lasttoken``,
  ``pooling_mode_mean_tokens`` or ``pooling_mode_cls_token``) → ``Normalize`` (L2). Qwen3-
  Embedding: last token, normalised (its reference ``last_token_pool`` + ``F.normalize``,
  github.com/QwenLM/Qwen3-Embedding README). Any other module (``Dense``, ...) or pooling mode
  is refused at load (``UnsupportedEmbeddingModel``) rather than skipped.
* No ``modules.json``: last-token pooling and L2 normalisation, vLLM's default pooler for
  ``--task embed`` on a decoder (docs.vllm.ai, "Pooling Models").
* Matryoshka (``dimensions`` in a request): ``config.json``'s ``is_matryoshka: true`` (any
  width up to the hidden size) or ``matryoshka_dimensions: [..]`` (only those), vLLM's
  convention (its "Matryoshka Embeddings" docs; ``--hf-overrides '{"is_matryoshka": true}'``
  for Qwen3-Embedding). Without either, ``dimensions`` is refused.

Pure: plain data in, :class:`EmbeddingProfile` out (:func:`read_profile` only reads the three
small JSON files).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EmbeddingProfile", "POOLING_MODES", "parse_profile", "read_profile",
           "UnsupportedEmbeddingModel", "check_dimensions", "MAX_PROFILE_FILE_BYTES"]

#: Pooling modes served (sentence-transformers ``pooling_mode_*`` names): the hidden state of
#: the last input token, the mean over the input's tokens, or the first token's.
POOLING_MODES = ("lasttoken", "mean_tokens", "cls_token")
#: Largest ``modules.json`` / pooling config read (bytes); a larger one is refused.
MAX_PROFILE_FILE_BYTES = 64 * 1024

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


class UnsupportedEmbeddingModel(ValueError):
    """The model directory asks for an embedding recipe this server does not implement (the
    message names the file and the value)."""


@dataclass(frozen=True)
class EmbeddingProfile:
    """``pooling``: one of :data:`POOLING_MODES`; ``normalize``: L2-normalise the pooled vector;
    ``dimensions``: the vector's width (the hidden size); ``matryoshka``: ``dimensions`` may be
    lowered per request; ``matryoshka_dimensions``: the only widths allowed (empty: any from 1
    to ``dimensions``); ``vocab_size``: token ids a request may send are below it."""

    pooling: str = "lasttoken"
    normalize: bool = True
    dimensions: int = 0
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    vocab_size: int = 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_profile(config: dict[str, Any], modules: list[Any] | None,
                  pooling: dict[str, Any] | None) -> EmbeddingProfile:
    """The profile of a model from its ``config.json`` (``hidden_size``, ``vocab_size``,
    ``is_matryoshka``, ``matryoshka_dimensions``; a multimodal ``text_config`` is looked in too),
    its ``modules.json`` (``None``: absent) and its pooling module's ``config.json`` (``None``:
    absent or no Pooling module). Raises :class:`UnsupportedEmbeddingModel`."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def field(name: str) -> Any:
        return config[name] if name in config else text.get(name)

    hidden, vocab = field("hidden_size"), field("vocab_size")
    if not (_is_int(hidden) and hidden > 0 and _is_int(vocab) and vocab > 0):
        raise UnsupportedEmbeddingModel(
            "config.json: hidden_size and vocab_size must be positive integers")
    dims = field("matryoshka_dimensions")
    if dims is not None and not (isinstance(dims, list) and dims
                                 and all(_is_int(d) and 0 < d <= hidden for d in dims)):
        raise UnsupportedEmbeddingModel(
            f"config.json: matryoshka_dimensions must be a list of widths from 1 to {hidden}")
    matryoshka = bool(dims) or field("is_matryoshka") is True
    mode, normalize = "lasttoken", True
    if modules is not None:
        types = [m.get("type") if isinstance(m, dict) else None for m in modules]
        unknown = [t for t in types if t not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
        if unknown:
            raise UnsupportedEmbeddingModel(
                f"modules.json: module {unknown[0]!r} is not supported (served: Transformer, "
                "Pooling, Normalize)")
        normalize = _NORMALIZE in types
        if _POOLING in types:
            if pooling is None:
                raise UnsupportedEmbeddingModel("modules.json names a Pooling module without "
                                                "its config.json")
            on = [k.removeprefix("pooling_mode_") for k, v in pooling.items()
                  if k.startswith("pooling_mode_") and v is True]
            if len(on) != 1 or on[0] not in POOLING_MODES:
                raise UnsupportedEmbeddingModel(
                    f"pooling config: pooling modes {on or 'none'} are not supported (one of "
                    f"{', '.join('pooling_mode_' + m for m in POOLING_MODES)})")
            mode = on[0]
            width = pooling.get("word_embedding_dimension", hidden)
            if width != hidden:
                raise UnsupportedEmbeddingModel(
                    f"pooling config: word_embedding_dimension {width!r} is not the model's "
                    f"hidden_size {hidden}")
    return EmbeddingProfile(pooling=mode, normalize=normalize, dimensions=hidden,
                            matryoshka=matryoshka,
                            matryoshka_dimensions=tuple(sorted(set(dims or ()))),
                            vocab_size=vocab)


def _read_json(path: Path) -> Any:
    with open(path, "rb") as f:
        data = f.read(MAX_PROFILE_FILE_BYTES + 1)
    if len(data) > MAX_PROFILE_FILE_BYTES:
        raise UnsupportedEmbeddingModel(f"{path.name} is larger than {MAX_PROFILE_FILE_BYTES} "
                                        "bytes")
    try:
        return json.loads(data)
    except ValueError as e:
        raise UnsupportedEmbeddingModel(f"{path.name} is not valid JSON ({e})") from None


def read_profile(model_dir: str | os.PathLike) -> EmbeddingProfile:
    """:func:`parse_profile` of the files in ``model_dir`` (``config.json``, and when present
    ``modules.json`` and the Pooling module's ``config.json`` under its ``path``). Raises
    :class:`UnsupportedEmbeddingModel`, ``OSError``."""
    root = Path(model_dir)
    config = _read_json(root / "config.json")
    if not isinstance(config, dict):
        raise UnsupportedEmbeddingModel("config.json is not an object")
    modules = pooling = None
    if (root / "modules.json").is_file():
        modules = _read_json(root / "modules.json")
        if not isinstance(modules, list):
            raise UnsupportedEmbeddingModel("modules.json is not a list")
        for m in modules:
            if isinstance(m, dict) and m.get("type") == _POOLING:
                sub = str(m.get("path", ""))
                target = (root / sub).resolve()
                if sub.startswith("/") or ".." in Path(sub).parts or root.resolve() not in (
                        target, *target.parents):
                    raise UnsupportedEmbeddingModel(f"modules.json: path {sub!r} is outside "
                                                    "the model directory")
                if (target / "config.json").is_file():
                    pooling = _read_json(target / "config.json")
                    if not isinstance(pooling, dict):
                        raise UnsupportedEmbeddingModel("the pooling config is not an object")
    return parse_profile(config, modules, pooling)


def check_dimensions(profile: EmbeddingProfile, dimensions: int | None) -> str | None:
    """Why a request's ``dimensions`` cannot be served by ``profile`` (a client message), or
    None when it can (``None`` and the full width always can)."""
    if dimensions is None or dimensions == profile.dimensions:
        return None
    if not profile.matryoshka:
        return (f"this model does not support the dimensions parameter (it was not trained "
                f"for Matryoshka truncation); its embeddings have {profile.dimensions} "
                "dimensions")
    if profile.matryoshka_dimensions and dimensions not in profile.matryoshka_dimensions:
        return (f"dimensions must be one of {list(profile.matryoshka_dimensions)} for this "
                "model")
    if not 1 <= dimensions <= profile.dimensions:
        return f"dimensions must be from 1 to {profile.dimensions} for this model"
    return None
