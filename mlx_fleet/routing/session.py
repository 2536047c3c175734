"""The session key of one request: what the canary split (and the fleet router's affinity)
hashes, so that one conversation keeps to one side and one Mac.

Pure: standard library only.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Literal

__all__ = ["KeySource", "session_key"]

#: Where a session key came from: the ``X-Session-ID`` header
#: (:data:`~mlx_fleet.routing.headers.SESSION_HEADER`), the OpenAI ``user`` field, or a fresh
#: random key (a request that is not sticky).
KeySource = Literal["header", "user", "random"]


def _random_key() -> str:
    return secrets.token_hex(16)


def session_key(header: str | None, user: str | None,
                random_key: Callable[[], str] = _random_key) -> tuple[str, KeySource]:
    """The request's session key and where it came from: ``(key, source)``.

    Precedence (issue #5): the ``X-Session-ID`` header, else the OpenAI ``user`` field, else
    ``random_key()`` (a fresh 128-bit hex string by default: such a request is not sticky).
    ``None`` and ``""`` both count as absent.
    """
    if header:
        return header, "header"
    if user:
        return user, "user"
    return random_key(), "random"
