"""asyncllm: an asyncio streaming SDK for LLM inference on CPUs."""

from asyncllm.config import EngineArgs
from asyncllm.errors import (
    AsyncLLMError,
    ConfigError,
    EngineDeadError,
    EngineGenerateError,
    EventLoopError,
    InvalidRequestError,
    StreamBusyError,
    StreamClosedError,
    StreamIncompleteError,
)
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput, Usage
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
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
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StreamBusyError",
    "StreamClosedError",
    "StreamIncompleteError",
    "Usage",
]


def __getattr__(name: str) -> object:
    # AsyncLLM pulls in torch-free frontend code only, but keep `import asyncllm` cheap.
    if name == "AsyncLLM":
        from asyncllm.async_llm import AsyncLLM

        return AsyncLLM
    if name == "GenerateOutputStream":
        from asyncllm.streams import GenerateOutputStream

        return GenerateOutputStream
    raise AttributeError(name)
