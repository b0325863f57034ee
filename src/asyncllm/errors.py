"""The error vocabulary of asyncllm.

Each class says when it is raised. Users act on two of them: `EngineGenerateError` (one request failed,
the engine keeps serving) and `EngineDeadError` (the engine is gone; sticky, unrecoverable).
"""

from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises on purpose."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """Bad input, raised at submission (`generate()`), before anything reaches the engine.

    Raised for out-of-range sampling parameters, an empty or too long prompt, a token id outside the
    vocabulary, a duplicate in-flight `request_id`, or an unknown `EngineArgs` key. The engine keeps serving.
    """


class ConfigError(AsyncLLMError, ValueError):
    """Bad engine arguments (`EngineArgs`, executor backend, tensor-parallel size that does not divide the model)
    or a missing optional extra (e.g. `asyncllm[ray]`); raised when the engine is built, before it serves."""


class EventLoopError(AsyncLLMError, RuntimeError):
    """An `AsyncLLM` (or one output stream) was used from a second live event loop or a second task at once."""


class ModelNotFoundError(AsyncLLMError, ValueError):
    """A model name or path could not be resolved, fetched or verified (e.g. offline, bad checksum)."""


class EngineGenerateError(AsyncLLMError):
    """One request failed inside the engine; other requests and the engine are unaffected."""


class EngineDeadError(AsyncLLMError):
    """The engine core (or one of its workers) died. Sticky: every later call raises it too."""

    def __init__(self, message: str = "the engine core died; create a new AsyncLLM") -> None:
        super().__init__(message)


class ExecutorError(AsyncLLMError):
    """A worker failed or timed out. Raised inside the engine; users see it as `EngineDeadError`."""


class StreamClosedError(AsyncLLMError):
    """A `GenerateOutputStream` was used after `aclose()`."""


class StreamBusyError(AsyncLLMError, RuntimeError):
    """A second task iterated a `GenerateOutputStream` while another task was waiting on it."""


class StreamIncompleteError(AsyncLLMError):
    """`GenerateOutputStream.collect()` found no finished output (the stream was consumed or closed first)."""
