"""The node agent's MLX serving core (see :mod:`node_agent.serving.core` for how it works).

Modules, one job each: :mod:`.errors` (exceptions), :mod:`.types` (ModelInfo, Chunk),
:mod:`.options` (the serving switches behind the agent's flags),
:mod:`.generation` (a request and its streaming handle), :mod:`.inbox` (a consumer's waiting
events), :mod:`.admission` (queue limits and
Retry-After, pure),
:mod:`.detokenize` (tokens → text and stop strings), :mod:`.sampling` (samplers, and the seeds
of a request's ``n`` choices), :mod:`.logprobs` (per-token log-probabilities, gathered for the
requests that ask),
:mod:`.registry` (the resident revisions' thread-side state), :mod:`.engine` (the MLX thread's
work on them), :mod:`.loading` (loads in chunks between decode steps: pacing, chunk planning),
:mod:`.preload` (the loaders imported and frozen out of the collector's reach),
:mod:`.coalesce` (identical concurrent requests share one generation: key, fan-out),
:mod:`.worker` (the parked MLX threads), :mod:`.core` (:class:`ServingCore`: its state,
observability, generation and admission), :mod:`.revisions` (its loading, unloading and
draining of revisions), :mod:`.channel` (its command channel to the MLX thread),
:mod:`.step_loop` (the MLX thread's step loop), :mod:`.capabilities` (what a loaded revision
serves: tool parser, constrained decoding, logprobs, ``n``, embeddings; the switches each feature
flips), :mod:`.grammar` (a request's output constraint as an llguidance grammar, pure),
:mod:`.constrain` (that grammar compiled and applied to one sequence of the batch),
:mod:`.embeddings` (its embedding requests and their batch queues), :mod:`.embed_batch` (when a
forward pass of embeddings runs, pure), :mod:`.embed_profile` (how an embedding model pools, from
its directory), :mod:`.embedder` (the forward pass and pooling on the MLX thread).
"""

from .core import DEFAULT_MAX_CHOICES, ServingCore
from .embeddings import DimensionsNotSupported, Embeddings, InputTooLong
from .errors import (ConstraintFailed, ContextLengthExceeded, GenerationAborted,
                     InvalidConstraint, InvalidPrompt, ModelLoadError, ModelNotLoaded, Overloaded,
                     StreamBufferOverflow, TooManyChoices, WrongTask)
from .generation import Generation
from .loading import LoadPacing
from .options import ServingOptions
from .tokenize import DEFAULT_MAX_PROMPT_BYTES, PromptTooLarge
from .types import Chunk, LoadProgress, MemoryUsage, ModelInfo, ToolFormat

__all__ = [
    "ModelLoadError", "Overloaded", "ModelNotLoaded", "ContextLengthExceeded", "InvalidPrompt",
    "GenerationAborted", "StreamBufferOverflow", "MemoryUsage", "ModelInfo", "Chunk",
    "Generation", "ServingCore", "LoadPacing", "LoadProgress", "ServingOptions",
    "PromptTooLarge", "DEFAULT_MAX_PROMPT_BYTES", "InvalidConstraint", "ToolFormat",
    "WrongTask", "Embeddings", "InputTooLong", "DimensionsNotSupported",
    "TooManyChoices", "DEFAULT_MAX_CHOICES", "ConstraintFailed",
]
