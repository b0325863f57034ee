"""`POST /v1/chat/completions`: messages -> the model's chat template -> `AsyncLLM.generate()` -> JSON or SSE.

Streaming follows OpenAI: the first chunk of each choice carries `delta.role="assistant"`, later chunks carry
`delta.content`; the chunk with a choice's last text carries its `finish_reason` (exactly one per choice); with
`stream_options.include_usage` a last chunk with no choices carries `usage`.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncllm.entrypoints.openai.errors import to_api_error
from asyncllm.entrypoints.openai.logprobs import to_chat_logprobs
from asyncllm.entrypoints.openai.protocol import ChatCompletionRequest
from asyncllm.entrypoints.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    make_id,
)
from asyncllm.entrypoints.openai.serving_base import (
    ServingContext,
    UsageCounter,
    collect_or_abort,
    dump,
    make_usage,
    sse,
    stream_events,
)
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import CompletionOutput, RequestOutput


def field_names(request: ChatCompletionRequest) -> dict[str, str]:
    """Engine field -> chat request field, for error messages."""
    return {"prompt": "messages", "max_tokens": request.max_tokens_field, "logprobs": "top_logprobs"}


async def create_chat_completion(llm: Any, ctx: ServingContext, request: ChatCompletionRequest, raw: Request) -> Any:
    """Serve one chat completion request (streaming or not).

    Raises:
        APIError: unknown model or unsupported field (400), out-of-range field or prompt too long (400,
            naming the chat field), the engine is dead (503).
    """
    model = ctx.check(request.model)
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    request_id = make_id("chatcmpl")
    try:
        params = request.to_sampling_params(max_tokens, _num_logprobs(request))
        stream = llm.generate(messages, params, request_id=request_id, cache_salt=request.cache_salt)
    except InvalidRequestError as error:
        raise to_api_error(error, field_names(request)) from error
    if request.stream:
        writer = _ChatStreamWriter(request, request_id, model)
        events = stream_events(ctx, [stream], writer.events, writer.final_events, field_names(request))
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        (final,) = await collect_or_abort([stream], raw, ctx)
    except InvalidRequestError as error:  # a long prompt is tokenized off the loop: validated at the first await
        raise to_api_error(error, field_names(request)) from error
    return JSONResponse(content=_response(request, request_id, model, final).model_dump())


def _num_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogprobs | None:
    if not request.logprobs or completion.logprobs is None:
        return None
    return to_chat_logprobs(completion.token_ids, completion.logprobs, request.top_logprobs or 0)


def _response(
    request: ChatCompletionRequest, request_id: str, model: str, final: RequestOutput
) -> ChatCompletionResponse:
    usage = final.usage
    assert usage is not None  # collect() always sets it
    choices = [
        ChatChoice(
            index=c.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=_logprobs(request, c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=make_usage(usage.num_prompt_tokens, usage.num_generated_tokens, usage.num_cached_tokens),
    )


class _ChatStreamWriter:
    """DELTA `RequestOutput`s of one request -> `chat.completion.chunk` SSE chunks."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, model: str) -> None:
        self.request = request
        self.request_id = request_id
        self.model = model
        self.usage = UsageCounter()
        self.started: set[int] = set()  # choices whose role chunk was sent

    def _chunk(self, choice: ChatChunkChoice) -> str:
        usage = self.usage.info() if self.request.continuous_usage_stats else None
        return sse(dump(ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)))

    def events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        self.usage.add(output, prompt_index)
        events = []
        for completion in output.outputs:
            if completion.index not in self.started:
                self.started.add(completion.index)
                role = ChatChunkChoice(index=completion.index, delta=DeltaMessage(role="assistant", content=""))
                events.append(self._chunk(role))
            if not completion.text and not completion.finished and not self.request.logprobs:
                continue
            choice = ChatChunkChoice(
                index=completion.index,
                delta=DeltaMessage(content=completion.text),
                logprobs=_logprobs(self.request, completion),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            events.append(self._chunk(choice))
        return events

    def final_events(self) -> list[str]:
        if not self.request.include_usage:
            return []
        chunk = ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=self.usage.info())
        return [sse(dump(chunk))]
