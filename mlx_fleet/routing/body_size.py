"""The request-size bound of the fleet's OpenAI API, one rule for the node agent and the fleet
router (issue 19): a body larger than :func:`max_body_bytes` is answered 413 before anything
parses it, and a prompt larger than the agent's ``--max-prompt-bytes`` is refused 400 before
anything tokenizes it.

Pure: constants and arithmetic only.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_PROMPT_BYTES", "max_body_bytes"]

#: Default bound of a prompt's UTF-8 bytes (the agent's and the router's ``--max-prompt-bytes``):
#: 1 MiB, aiohttp's default request body limit (``client_max_size``), so nothing the API
#: accepted before is refused by default.
DEFAULT_MAX_PROMPT_BYTES = 2**20


def max_body_bytes(max_prompt_bytes: int) -> int:
    """The largest request body (bytes; aiohttp's ``client_max_size``) for prompts of up to
    ``max_prompt_bytes``: twice that (the prompt plus its JSON escaping and the other fields),
    at least 1 MiB (aiohttp's default)."""
    return max(2**20, 2 * max_prompt_bytes)
