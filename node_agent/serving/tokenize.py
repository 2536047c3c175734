"""Prompt → token ids, off the MLX thread (issue 19: nothing slow on the MLX thread that a
client controls).

:func:`prompt_bytes` is the size a request's prompt is bounded by before anything tokenizes it
(``ServingCore(max_prompt_bytes=...)``, the agent's ``--max-prompt-bytes``); :func:`tokenize`
renders the chat template (Jinja, Python) and encodes (Hugging Face ``tokenizers``, Rust, which
releases the GIL while it encodes) in the core's tokenizer pool, so a megabyte prompt costs the
MLX thread nothing and the event loop nothing. The engine then only checks the context limit and
queues the ids.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from mlx_fleet.routing.body_size import DEFAULT_MAX_PROMPT_BYTES

from .errors import InvalidPrompt

__all__ = ["prompt_bytes", "tokenize", "tokenize_inputs", "DEFAULT_MAX_PROMPT_BYTES", "PromptTooLarge",
           "default_tokenizer_threads", "limit_tokenizer_parallelism"]

log = logging.getLogger(__name__)

#: Longest template error message passed on to the client (a template's own
#: ``raise_exception("...")`` is meant for it; anything longer is cut).
_MAX_TEMPLATE_MESSAGE = 200


def default_tokenizer_threads(cpu_count: int | None) -> int:
    """Threads of the core's tokenizer pool: a quarter of the cores, 1 to 4 (a 2-core host
    keeps a core for the MLX thread; a 16-core Mac tokenizes 4 prompts at once)."""
    return max(1, min(4, (cpu_count or 1) // 4))


def limit_tokenizer_parallelism(environ: MutableMapping[str, str]) -> None:
    """``TOKENIZERS_PARALLELISM=false`` unless the environment says otherwise (Hugging Face
    ``tokenizers`` reads it at every call): each prompt is then encoded on its pool thread
    alone, instead of spreading over every core with Rayon and taking them from the MLX
    thread. Measured on the 2-core development box (``benchmarks/prompt_stall.py``'s 1 MB chat
    prompt): 0.64 s with the longest pause of a 1 ms ticker 38 ms, against 6.3 s and 368 ms
    with parallelism on."""
    environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class PromptTooLarge(InvalidPrompt):
    """The prompt is larger than the core's byte bound (refused before tokenizing).
    ``size`` and ``limit`` in bytes."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the prompt is {size} bytes, more than this server's limit of "
                         f"{limit} bytes (--max-prompt-bytes)")
        self.size, self.limit = size, limit


def prompt_bytes(prompt: str | None, messages: list[dict] | None) -> int:
    """UTF-8 bytes of ``prompt``, or of every message's role and text content."""
    if prompt is not None:
        return len(prompt.encode("utf-8", "surrogatepass"))
    total = 0
    for m in messages or ():
        for v in m.values():
            if isinstance(v, str):
                total += len(v.encode("utf-8", "surrogatepass"))
    return total


def tokenize(tokenizer: Any, prompt: str | None, messages: list[dict] | None,
             tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``prompt`` (raw text, no special tokens added) or of ``messages`` rendered
    with the tokenizer's chat template plus a generation prompt (and ``tools``, OpenAI function
    tools, passed to the template as ``tools=`` when given: the template renders them); a
    prompt that tokenizes to nothing becomes the BOS token when there is one.

    Raises :class:`InvalidPrompt`: the message names the problem without internal detail — a
    template's own error text (``raise_exception``, e.g. "roles must alternate") is kept, any
    other exception is named by its type only (the log has the rest)."""
    try:
        if messages is not None:
            extra = {"tools": tools} if tools else {}
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
            if not isinstance(ids, list):  # some transformers versions return an encoding
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - templates/tokenizers raise many kinds
        raise InvalidPrompt(_public_reason(e)) from e
    ids = [int(i) for i in ids]
    if not ids:
        if tokenizer.bos_token_id is None:
            raise InvalidPrompt("the prompt is empty")
        ids = [int(tokenizer.bos_token_id)]
    return ids


def tokenize_inputs(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each of ``texts`` (embedding inputs) with the tokenizer's own special tokens
    (``add_special_tokens=True``): an embedding model's tokenizer adds what it was trained with
    — Qwen3-Embedding's post-processor appends ``<|endoftext|>``, the token its last-token
    pooling reads. An input that tokenizes to nothing becomes the BOS token when there is one.
    Raises :class:`InvalidPrompt` (naming the input's index)."""
    out = []
    for i, text in enumerate(texts):
        try:
            ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]
        except Exception as e:  # noqa: BLE001 - tokenizers raise many kinds
            raise InvalidPrompt(f"input {i}: {_public_reason(e)}") from e
        if not ids:
            if tokenizer.bos_token_id is None:
                raise InvalidPrompt(f"input {i} is empty")
            ids = [int(tokenizer.bos_token_id)]
        out.append(ids)
    return out


def _public_reason(e: Exception) -> str:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers depends on jinja2
        TemplateError = ()  # type: ignore[assignment,misc]
    if isinstance(e, TemplateError) and type(e).__name__ == "TemplateError" and str(e):
        # raise_exception() in a chat template raises the base TemplateError with its message
        text = str(e)[:_MAX_TEMPLATE_MESSAGE]
        return f"the chat template refused the messages: {text}"
    log.info("tokenizing a prompt failed: %s", type(e).__name__)
    return f"cannot tokenize the prompt ({type(e).__name__})"
