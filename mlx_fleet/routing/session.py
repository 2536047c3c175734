"""The session key of one request: what the canary split (and the fleet router's affinity)
hashes, so that one conversation keeps to one side and one Mac.

Two functions, one job: :func:`session_key` picks the key by precedence (``X-Session-ID``, else
the OpenAI ``user`` field, else a prompt-prefix key when the caller has one, else a random key);
:func:`prefix_key` derives the prompt-prefix key from a request body's ``messages`` or ``prompt``.

Pure: standard library only.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

__all__ = ["KeySource", "session_key", "prefix_key", "PREFIX_CHARS"]

#: Where a session key came from: the ``X-Session-ID`` header
#: (:data:`~mlx_fleet.routing.headers.SESSION_HEADER`), the OpenAI ``user`` field, the prompt's
#: prefix (:func:`prefix_key`), or a fresh random key (a request that is not sticky).
KeySource = Literal["header", "user", "prefix", "random"]

#: Characters (or tokens) of a completions ``prompt`` that make its prefix key: KubeAI's
#: PrefixHash default ``prefixCharLength`` (100). A raw prompt has no turn boundaries, so a
#: fixed-length head is what stays the same while the prompt grows.
PREFIX_CHARS = 100


def _random_key() -> str:
    return secrets.token_hex(16)


def session_key(header: str | None, user: str | None,
                random_key: Callable[[], str] = _random_key, *,
                prefix: str | None = None) -> tuple[str, KeySource]:
    """The request's session key and where it came from: ``(key, source)``.

    Precedence (issue #5, issue #17 §2): the ``X-Session-ID`` header, else the OpenAI ``user``
    field, else ``prefix`` (the caller's :func:`prefix_key` of the body, when it computed one),
    else ``random_key()`` (a fresh 128-bit hex string by default: such a request is not
    sticky). ``None`` and ``""`` both count as absent.
    """
    if header:
        return header, "header"
    if user:
        return user, "user"
    if prefix:
        return prefix, "prefix"
    return random_key(), "random"


def _digest(kind: bytes, payload: str) -> str:
    return "prefix:" + hashlib.sha256(kind + b"\0" + payload.encode("utf-8", "replace")).hexdigest()


def prefix_key(*, messages: Sequence[Any] | None = None, prompt: Any = None) -> str | None:
    """A session key from the start of a prompt, the same for every turn of one conversation:
    ``"prefix:"`` + 64 hex characters (SHA-256), or None when there is nothing to hash.

    * Chat (``messages``, a list of OpenAI message objects): the leading messages up to and
      including the first ``user`` message — the system (or developer) prompt and the first
      user turn; all of them when there is no ``user`` message. A later turn only appends
      messages, so it keeps the key. Each message counts by its ``role`` and ``content``
      (a string or a list of content parts, compared as canonical JSON); other fields
      (``name``, tool calls) are not part of the key.
    * Completions (``prompt``): a string's first :data:`PREFIX_CHARS` characters; a list of
      token ids' first :data:`PREFIX_CHARS` ids; a list of strings (a batch) by its first
      string.

    ``messages`` wins when both are given. Entries that are not objects, and values that JSON
    can't encode, are hashed by their ``repr`` (a malformed body still gets a stable key; the
    API's validation answers it)."""
    if messages:
        head: list[Any] = []
        for m in messages:
            if isinstance(m, Mapping):
                role = m.get("role")
                head.append([role, m.get("content")])
                if role == "user":
                    break
            else:
                head.append(repr(m))
        return _digest(b"chat", json.dumps(head, sort_keys=True, ensure_ascii=False,
                                           separators=(",", ":"), default=repr))
    if isinstance(prompt, str):
        return _digest(b"prompt", prompt[:PREFIX_CHARS]) if prompt else None
    if isinstance(prompt, Sequence) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return prefix_key(prompt=first)
        if isinstance(first, int) and not isinstance(first, bool):
            return _digest(b"tokens", json.dumps(list(prompt[:PREFIX_CHARS]), default=repr))
        if isinstance(first, Sequence):  # a batch of token lists
            return prefix_key(prompt=list(first))
    return None
