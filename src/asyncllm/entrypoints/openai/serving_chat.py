"""`POST /v1/chat/completions`: messages -> the model's chat template -> `AsyncLLM.generate()` -> JSON or SSE.

Streaming follows OpenAI: the first chunk of each choice carries `delta.role="assistant"`, later chunks carry
`delta.content` and/or `delta.tool_calls` pieces (the first piece of a call: `index`, `id`, `type`,
`function.name`, `function.arguments`; later pieces: `index` and more `function.arguments`); the chunk with a
choice's last text carries its `finish_reason` (exactly one per choice); with `stream_options.include_usage` a
last chunk with no choices carries `usage`. Tools and output formats: `serving_chat_tools`.
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
    prompt_logprobs_json,
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
from asyncllm.entrypoints.openai.serving_chat_tools import (
    ChatSetup,
    finish_reason,
    prepare_chat,
    tool_call_bodies,
    tool_call_deltas,
)
from asyncllm.errors import InvalidRequestError
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.processing.tool_calling_stream import PlainStream, ToolCallStream


def field_names(request: ChatCompletionRequest) -> dict[str, str]:
    """Engine field -> chat request field, for error messages."""
    return {"prompt": "messages", "max_tokens": request.max_tokens_field, "logprobs": "top_logprobs"}


async def create_chat_completion(llm: Any, ctx: ServingContext, request: ChatCompletionRequest, raw: Request) -> Any:
    """Serve one chat completion request (streaming or not).

    Raises:
        APIError: unknown model or unsupported field (400), out-of-range field, bad tools / tool_choice /
            response_format, or prompt too long (400, naming the chat field), the engine is dead (503).
    """
    model = ctx.check(request.model)
    ctx.apply_server_defaults(request)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    request_id = make_id("chatcmpl")
    try:
        params = request.to_sampling_params(max_tokens, _num_logprobs(request))
    except InvalidRequestError as error:
        raise to_api_error(error, field_names(request)) from error
    setup = await prepare_chat(llm.get_tokenizer(), request, params, ctx.tool_parser, ctx.max_model_len or 0)
    try:
        stream = llm.generate(
            setup.prompt,
            setup.params,
            request_id=request_id,
            cache_salt=request.cache_salt,
            lora_request=ctx.lora_request(request.model),
        )
    except InvalidRequestError as error:
        raise _api_error(error, request, setup) from error
    if request.stream:
        writer = _ChatStreamWriter(request, request_id, model, setup)
        events = stream_events(ctx, [stream], writer.events, writer.final_events, field_names(request))
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        (final,) = await collect_or_abort([stream], raw, ctx)
    except InvalidRequestError as error:  # a long prompt is tokenized off the loop: validated at the first await
        raise _api_error(error, request, setup) from error
    return JSONResponse(content=_response(request, request_id, model, final, setup).model_dump())


def _api_error(error: InvalidRequestError, request: ChatCompletionRequest, setup: ChatSetup) -> Exception:
    """An engine-side check failure as a 400 naming the chat field (the constraint's source for bad schemas)."""
    api_error = to_api_error(error, field_names(request))
    if "structured_outputs" in str(error) and setup.constraint_field is not None:
        api_error.param = setup.constraint_field
    return api_error


def _num_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogprobs | None:
    if not request.logprobs or completion.logprobs is None:
        return None
    as_ids = bool(request.return_tokens_as_token_ids)
    return to_chat_logprobs(completion.token_ids, completion.logprobs, request.top_logprobs or 0, as_ids)


def _response(
    request: ChatCompletionRequest, request_id: str, model: str, final: RequestOutput, setup: ChatSetup
) -> ChatCompletionResponse:
    usage = final.usage
    assert usage is not None  # collect() always sets it
    choices = []
    for c in final.outputs:
        reader = setup.new_stream()
        reader.feed(c.text, finished=True)
        calls = tool_call_bodies(reader)
        content = request.echoed_text() + reader.content if reader.content or not calls else None
        message = ChatResponseMessage(content=content, tool_calls=calls)
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_logprobs(request, c),
                finish_reason=finish_reason(c.finish_reason, reader),
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=make_usage(usage.num_prompt_tokens, usage.num_generated_tokens, usage.num_cached_tokens),
        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
    )


class _ChatStreamWriter:
    """DELTA `RequestOutput`s of one request -> `chat.completion.chunk` SSE chunks."""

    def __init__(self, request: ChatCompletionRequest, request_id: str, model: str, setup: ChatSetup) -> None:
        self.request = request
        self.request_id = request_id
        self.model = model
        self.setup = setup
        self.usage = UsageCounter()
        self.readers: dict[int, ToolCallStream] = {}  # per choice; present once its role chunk was sent

    def _chunk(self, choice: ChatChunkChoice) -> str:
        usage = self.usage.info() if self.request.continuous_usage_stats else None
        return sse(dump(ChatCompletionChunk(id=self.request_id, model=self.model, choices=[choice], usage=usage)))

    def events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        self.usage.add(output, prompt_index)
        events = []
        for completion in output.outputs:
            reader = self.readers.get(completion.index)
            if reader is None:
                reader = self.readers[completion.index] = self.setup.new_stream()
                echoed = self.request.echoed_text()  # vLLM's `echo`: the continued message's text first
                role = ChatChunkChoice(index=completion.index, delta=DeltaMessage(role="assistant", content=echoed))
                events.append(self._chunk(role))
            delta = reader.feed(completion.text, completion.finished)
            if not delta.content and not delta.calls and not completion.finished and not self.request.logprobs:
                continue
            plain = isinstance(reader, PlainStream)  # plain chat keeps content "" on a text-less chunk
            content = delta.content if delta.content or plain else None
            choice = ChatChunkChoice(
                index=completion.index,
                delta=DeltaMessage(content=content, tool_calls=tool_call_deltas(delta)),
                logprobs=_logprobs(self.request, completion),
                finish_reason=finish_reason(completion.finish_reason, reader),
                stop_reason=completion.stop_reason,
            )
            events.append(self._chunk(choice))
        return events

    def final_events(self) -> list[str]:
        if not self.request.include_usage:
            return []
        chunk = ChatCompletionChunk(id=self.request_id, model=self.model, choices=[], usage=self.usage.info())
        return [sse(dump(chunk))]
