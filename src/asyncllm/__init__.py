"""asyncllm: an asyncio streaming SDK for LLM inference on CPUs."""

from asyncllm.config import EngineArgs
from asyncllm.errors import (
    AsyncLLMError,
    EngineDeadError,
    EngineGenerateError,
    InvalidRequestError,
    StreamClosedError,
    StreamIncompleteError,
)
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput, ToolCall, Usage
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.structured_outputs.params import StructuredOutputsParams

__all__ = [
    "AsyncLLM",
    "AsyncLLMError",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineGenerateError",
    "GenerateOutputStream",
    "InvalidRequestError",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StreamClosedError",
    "StreamIncompleteError",
    "StructuredOutputsParams",
    "ToolCall",
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
