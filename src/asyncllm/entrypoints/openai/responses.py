"""Response bodies of the OpenAI-compatible API (pydantic models), as the OpenAI API reference shapes them,
plus vLLM's `stop_reason` per choice."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


def make_id(prefix: str) -> str:
    """A fresh response id such as `cmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    """Token counts: `prompt_tokens`, `completion_tokens` (over all choices), `total_tokens`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


PromptLogprobsJSON = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs_json(prompt_logprobs: Any) -> PromptLogprobsJSON | None:
    """`RequestOutput.prompt_logprobs` in vLLM's JSON shape: None for the first prompt token, then per token
    `{str(token id): {"logprob", "rank", "decoded_token"}}` (the prompt token first, then the top-k)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


class CompletionChoice(BaseModel):
    """One completion. vLLM's fields: `prompt_logprobs` (with the request's `prompt_logprobs`: None for the first
    prompt token, then `{token id: {"logprob", "rank", "decoded_token"}}` per token; null otherwise),
    `prompt_token_ids` and `token_ids` (with `return_token_ids`). In a stream the prompt's are on a choice's
    first chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A `/v1/completions` body (`object="text_completion"`), and each of its streamed chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallBody(BaseModel):
    """One entry of `message.tool_calls`: `arguments` is JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The answer: `content` is None when the message only carries `tool_calls`."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] | None = None


class _DropNone(BaseModel):
    """Serialized without its None fields: a streamed tool-call delta carries only what it adds (the OpenAI
    client overwrites `type` with whatever a delta says, None included)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A piece of a streamed tool call: the first carries `id`, `type` and `function.name`; later ones carry
    more `function.arguments` for the same `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A non-streaming `/v1/chat/completions` body."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM's, with the request's `prompt_logprobs`


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed `/v1/chat/completions` chunk (`object="chat.completion.chunk"`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One served model (vLLM's card): `root` is the model (name or path) or the LoRA adapter's directory;
    `parent` is the base model's served name for an adapter, else null."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "asyncllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingData(BaseModel):
    """One input's vector: a list of floats, or base64 of its little-endian float32 bytes."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Embeddings usage: prompt tokens only."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    """A `/v1/embeddings` body (`object="list"`)."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
