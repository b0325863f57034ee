"""asyncllm: an asyncio streaming SDK for LLM inference on CPUs."""

from asyncllm.config import AsyncEngineArgs, EngineArgs
from asyncllm.errors import (
    AsyncLLMError,
    ConfigError,
    EngineDeadError,
    EngineGenerateError,
    EventLoopError,
    InvalidRequestError,
    ModelNotFoundError,
    StreamBusyError,
    StreamClosedError,
    StreamIncompleteError,
)
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput, ToolCall, Usage
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams
from asyncllm.structured_outputs.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMError",
    "CompletionOutput",
    "ConfigError",
    "EngineArgs",
    "EngineDeadError",
    "EngineGenerateError",
    "EventLoopError",
    "GenerateOutputStream",
    "InvalidRequestError",
    "LoRARequest",
    "Logprob",
    "ModelNotFoundError",
    "PoolingParams",
    "PoolingRequestOutput",
    "RepetitionDetectionParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StreamBusyError",
    "StreamClosedError",
    "StreamIncompleteError",
    "StructuredOutputsParams",
    "ToolCall",
    "Usage",
    "__version__",
]


def _read_version() -> str:
    """The installed distribution's version; from a source checkout without metadata, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncllm")
    except PackageNotFoundError:
        import pathlib
        import re

        pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.MULTILINE)  # tomllib needs Python 3.11
        if match is None:
            raise RuntimeError("asyncllm has no package metadata and pyproject.toml names no version") from None
        return match[1]


__version__ = _read_version()


def __getattr__(name: str) -> object:
    # AsyncLLM pulls in torch-free frontend code only, but keep `import asyncllm` cheap.
    if name == "AsyncLLM":
        from asyncllm.async_llm import AsyncLLM

        return AsyncLLM
    if name == "LLM":
        from asyncllm.llm import LLM

        return LLM
    if name == "GenerateOutputStream":
        from asyncllm.streams import GenerateOutputStream

        return GenerateOutputStream
    raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily imported names (AsyncLLM, LLM, GenerateOutputStream) appear for tab completion too.
    return sorted(set(globals()) | set(__all__))
