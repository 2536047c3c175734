"""The serving core's optimisation switches (:class:`ServingOptions`; the agent's flags for them
are ``node_agent.cli.add_serving_arguments``, which ``benchmarks/serving.py`` shares so that a
benchmark turns each off exactly as an agent would) and their one rendering
(:meth:`ServingOptions.as_record`) that goes into ``/metrics``
(``mlxfleet_agent_serving_option_info``) and the node record in etcd
(``NodeRecord.serving_options``). Documented in ``docs/node-agent.md`` (*Serving options*).
"""

from __future__ import annotations

import dataclasses

from .admission import DEFAULT_POLICY, POLICIES
from .prefill import DEFAULT_PREFILL_BATCH_TOKENS

__all__ = ["ServingOptions", "DEFAULT_STREAM_BUFFER_CHUNKS", "PROMPT_CACHE_ENTRIES"]

#: Most prompt-cache entries per revision (mlx-lm ``LRUPromptCache(max_size=...)``; mlx_lm.server
#: keeps 10 by default). The byte budget is the bound that matters; this one keeps the trie small.
PROMPT_CACHE_ENTRIES = 16
#: Chunks a stream may have waiting for its HTTP handler before it is aborted as a slow reader:
#: 1024 tokens (about 150 KiB of SSE events) beyond what the socket buffers already hold.
DEFAULT_STREAM_BUFFER_CHUNKS = 1024


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """What the serving core may do to go faster, each safe to turn off.

    ``prompt_cache``: reuse prompt prefixes' KV cache across requests (mlx-lm's
    ``LRUPromptCache``, one per revision). ``prompt_cache_bytes``: each revision's byte budget
    for its prompt cache *and* the KV cache of its live batch together (the cache is trimmed to
    budget − live batch after every insertion, as ``mlx_lm.server --prompt-cache-bytes`` does);
    ``None``: the revision's KV reservation (``memory_estimate.kv_cache_bytes(bytes per token,
    max_context_tokens, max_concurrent_sequences)``: what placement reserved for its KV cache).
    ``admission_policy``: ``count`` or ``kv`` (:mod:`node_agent.serving.admission`).
    ``stream_buffer_chunks``: chunks a stream may have waiting for its consumer before it is
    aborted (a slow reader never holds a batch slot or memory without bound).
    ``request_coalescing``: identical concurrent deterministic requests share one generation
    (:mod:`node_agent.serving.coalesce`). ``fast_first_token``: a request that finds its
    revision's batch empty gets its first token from one forward pass before it joins the batch
    (:mod:`node_agent.serving.fastpath`). ``prefill_batch_tokens``: padded prompt tokens one
    prefill pass may take, so that waiting prompts are prefilled together as far as they fit
    (:mod:`node_agent.serving.prefill`); 0: mlx-lm's fixed groups of 8 prompts.
    """

    prompt_cache: bool = True
    prompt_cache_bytes: int | None = None
    admission_policy: str = DEFAULT_POLICY
    stream_buffer_chunks: int = DEFAULT_STREAM_BUFFER_CHUNKS
    request_coalescing: bool = True
    fast_first_token: bool = True
    prefill_batch_tokens: int = DEFAULT_PREFILL_BATCH_TOKENS

    def __post_init__(self) -> None:
        if self.admission_policy not in POLICIES:
            raise ValueError(f"admission_policy must be one of {', '.join(POLICIES)}, got "
                             f"{self.admission_policy!r}")
        if self.prompt_cache_bytes is not None and self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {self.prompt_cache_bytes}")
        if self.prefill_batch_tokens < 0:
            raise ValueError(f"prefill_batch_tokens must be >= 0, got "
                             f"{self.prefill_batch_tokens}")
        if self.stream_buffer_chunks < 1:
            raise ValueError(f"stream_buffer_chunks must be >= 1, got "
                             f"{self.stream_buffer_chunks}")

    def as_record(self) -> dict[str, str]:
        """``{option: value}`` as text, the form of ``/metrics`` and the node record:
        ``prompt_cache`` / ``request_coalescing`` / ``fast_first_token`` ``on``|``off``, ``prompt_cache_bytes`` a
        number of bytes or ``auto`` (the KV reservation), ``admission_policy``,
        ``stream_buffer_chunks``, ``prefill_batch_tokens`` a number of tokens (``0``: mlx-lm's
        fixed groups)."""
        def onoff(b: bool) -> str:
            return "on" if b else "off"
        return {
            "prompt_cache": onoff(self.prompt_cache),
            "prompt_cache_bytes": ("auto" if self.prompt_cache_bytes is None
                                   else str(self.prompt_cache_bytes)),
            "admission_policy": self.admission_policy,
            "stream_buffer_chunks": str(self.stream_buffer_chunks),
            "request_coalescing": onoff(self.request_coalescing),
            "fast_first_token": onoff(self.fast_first_token),
            "prefill_batch_tokens": str(self.prefill_batch_tokens),
        }
