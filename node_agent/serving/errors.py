"""The serving core's exceptions: what callers of :class:`~node_agent.serving.ServingCore` catch."""

from __future__ import annotations

from mlx_fleet.capabilities import Capability, Missing, Need

__all__ = ["LOAD_FAILURE_TEXT", "ModelLoadError", "Overloaded", "ModelNotLoaded", "ContextLengthExceeded",
           "InvalidPrompt", "GenerationAborted", "StreamBufferOverflow", "WrongTask",
           "ConstraintFailed"]


#: :attr:`ModelLoadError.reason` of a load that an unload of the same revision called off.
LOAD_CANCELLED = "Cancelled"


#: What an assignment report (so a resource's status and events) says for a load that failed
#: with these reasons, instead of the message, which may carry a local path or an exception's
#: text (issue 19: statuses name the problem without internal detail); the agent logs the
#: message. Other reasons' messages are written for the status already.
LOAD_FAILURE_TEXT = {
    "LoadFailed": "loading the model failed (the agent's log has the error)",
    "CoreFailed": "the serving core has failed (the agent's log has the error)",
    "ModelNotFound": "no model (config.json) in the model directory",
}


class ModelLoadError(Exception):
    """Loading a model failed. ``reason``: CamelCase (``ModelNotFound``, ``LoadFailed``,
    ``NotStarted``, ``CoreFailed`` once the MLX thread has failed, ``Cancelled`` when an
    unload of the revision called the load off); ``message``: human-readable detail (for the
    log); :attr:`public`: what a status may say."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    @property
    def public(self) -> str:
        """The message for a report: :data:`LOAD_FAILURE_TEXT` of the reason, else
        ``message``."""
        return LOAD_FAILURE_TEXT.get(self.reason, self.message)


class Overloaded(Exception):
    """Admission is full; retry after ``retry_after_seconds`` (whole seconds, >= 1).
    ``waiting``: the requests waiting ahead of the refused one (see
    :mod:`node_agent.serving.admission`)."""

    def __init__(self, message: str, retry_after_seconds: int = 1, waiting: int = 0) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds
        self.waiting = waiting


class ModelNotLoaded(LookupError):
    """The requested model id (or the requested ``revision`` of it, when one was named) is not
    loaded on this agent, or is draining. ``model_id`` and ``revision`` (``None`` when the
    request named none) say what was asked for."""

    def __init__(self, model_id: str, revision: str | None = None) -> None:
        what = f"model {model_id!r}" if revision is None else (
            f"revision {revision!r} of model {model_id!r}")
        super().__init__(f"{what} is not loaded on this agent")
        self.model_id = model_id
        self.revision = revision


class ContextLengthExceeded(ValueError):
    """``prompt_tokens + max_tokens`` exceeds the model's ``max_context_tokens``."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context_tokens: int) -> None:
        super().__init__(
            f"this model's maximum context length is {max_context_tokens} tokens; the request "
            f"has {prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens")
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context_tokens = max_context_tokens


class InvalidPrompt(ValueError):
    """The prompt or messages cannot be turned into tokens (e.g. the chat template fails)."""


class TooManyChoices(ValueError):
    """A request asks for more choices (``n``) than the agent allows (``--max-choices``) or than
    its revision's batch holds (``max_concurrent_sequences``: its ``n`` sequences run
    together). ``limit``: the smaller of the two."""

    def __init__(self, n: int, limit: int) -> None:
        super().__init__(f"n: at most {limit} choices per request on this model, got {n}")
        self.n = n
        self.limit = limit


class InvalidConstraint(ValueError):
    """A request's output constraint cannot be enforced: its JSON schema uses a keyword the
    grammar compiler does not implement, a ``pattern`` it cannot compile, etc. ``param``: the
    request field it came from (``response_format.json_schema.schema``, ``tools``);
    ``str(e)``: the compiler's reason (no internal detail)."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


class GenerationAborted(RuntimeError):
    """A running generation ended abnormally (model unloaded, core closed, MLX error).

    ``str(e)`` may carry an internal exception's text (for logs and in-process callers);
    ``public``: what a client may be told (the HTTP API's error message), the same unless
    given."""

    def __init__(self, message: str = "", *, public: str | None = None) -> None:
        super().__init__(message)
        self.public = public if public is not None else message


class StreamBufferOverflow(GenerationAborted):
    """The consumer of a generation fell behind by more chunks than its buffer holds
    (``ServingOptions.stream_buffer_chunks``): the generation was stopped and left the batch, so
    a slow reader never holds a batch slot or memory without bound. ``buffered``: the chunks
    that were waiting."""

    def __init__(self, buffered: int) -> None:
        super().__init__(f"the client read the stream too slowly: {buffered} generated chunks "
                         "were waiting for it, so the generation was stopped")
        self.buffered = buffered


class ConstraintFailed(GenerationAborted):
    """A constrained sequence's grammar matcher could not go on mid-generation: llguidance
    stopped on a limit of the client's grammar (its lexer or parser bounds, e.g. a schema whose
    grammar grows past the Earley items allowed per token), so the request ends rather than
    answer output that may not match it. A fault of the request's grammar, not of the revision:
    the HTTP API answers 400 ``invalid_schema`` (an error event once a stream's 200 is out) and
    does not count it in the revision's statistics. ``param``: the request field the grammar
    came from (``response_format.json_schema.schema``, ``tools``); ``reason``: the matcher's
    error without internal detail (:func:`~node_agent.serving.constrain.public_grammar_error`).
    A :class:`GenerationAborted`, so callers that only know that still end the generation."""

    def __init__(self, param: str, reason: str) -> None:
        message = f"{param}: constrained decoding could not follow the grammar: {reason}"
        super().__init__(message, public=message)
        self.param = param
        self.reason = reason


class WrongTask(ValueError):
    """The request is for another task than the one the model is served for (a generation
    request to a ``TextEmbedding`` model, an embeddings request to a ``TextGeneration`` one).
    ``model_id`` and ``task`` (the model's) say which; the message is
    :class:`mlx_fleet.capabilities.Missing`'s, the fleet router's and the API's own words."""

    def __init__(self, model_id: str, task: str, needs: Capability) -> None:
        super().__init__(Missing(Need(needs, "model"), None, task).message(model_id))  # type: ignore[arg-type]
        self.model_id = model_id
        self.task = task
