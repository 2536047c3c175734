"""Import the model-loading libraries once and take their objects out of the garbage
collector's reach, so that unloading a model doesn't pause every model's decoding.

Unloading a model must run a full ``gc.collect()`` (:meth:`Engine.unload`): mlx-lm models hold
reference cycles, and their weights are freed only when the collector breaks them. A full
collection walks every tracked object of the process, and after ``mlx_lm`` and ``transformers``
are imported those are several hundred thousand, all immortal in practice (modules, classes,
functions, tables). ``gc.freeze()`` (Python >= 3.7; the technique Instagram described for
forked web servers) moves every object tracked now into a permanent generation that collections
skip. Measured on the development machine (2 shared cores): the collection of an unload went
from 50-180 ms to about 0.5 ms, with the model's memory freed all the same (MLX active memory 0
after it).

Call :func:`preload_and_freeze` once per process, before any model is loaded: whatever is alive
at that moment is never collected afterwards (a model resident then would leak its cycles).
The agent process does it at start (:func:`node_agent.main.run`).
"""

from __future__ import annotations

import gc

__all__ = ["preload_and_freeze"]


def preload_and_freeze() -> int:
    """Import what loading a model imports (``mlx_lm`` with its loaders, model classes and
    BatchGenerator, ``transformers``' tokenizers), collect, then ``gc.freeze()``. Returns the
    number of objects frozen (``gc.get_freeze_count()``)."""
    import mlx.core  # noqa: F401
    import mlx_lm.generate  # noqa: F401
    import mlx_lm.models.cache  # noqa: F401
    import mlx_lm.models.llama  # noqa: F401
    import mlx_lm.sample_utils  # noqa: F401
    import mlx_lm.tokenizer_utils  # noqa: F401
    import mlx_lm.utils  # noqa: F401
    import transformers  # noqa: F401
    from transformers import PreTrainedTokenizerFast  # noqa: F401  (its lazy import)

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
