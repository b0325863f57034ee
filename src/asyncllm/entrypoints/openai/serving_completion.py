"""`POST /v1/completions`: a `CompletionRequest` -> `AsyncLLM.generate()` -> one JSON body or SSE chunks."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncllm.entrypoints.openai.errors import APIError
from asyncllm.entrypoints.openai.logprobs import to_completion_logprobs
from asyncllm.entrypoints.openai.protocol import CompletionRequest
from asyncllm.entrypoints.openai.responses import CompletionChoice, CompletionResponse, make_id
from asyncllm.entrypoints.openai.serving_base import (
    ServingContext,
    UsageCounter,
    collect_or_abort,
    dump,
    make_usage,
    sse,
    stream_events,
)
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.processing.input_processor import PromptType


def completion_prompt(request: CompletionRequest) -> PromptType:
    """The one prompt of the request, as `AsyncLLM.generate()` takes it.

    Raises:
        APIError: 400 for a batch of several prompts (not supported) or an unsupported field.
    """
    prompt = request.prompt
    if request.best_of is not None and request.best_of != request.n:
        raise APIError("best_of is not supported (only best_of == n)", param="best_of")
    if isinstance(prompt, list):
        if not prompt:
            raise APIError("prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return {"prompt_token_ids": prompt}
        if len(prompt) > 1:
            raise APIError("prompt: a batch of several prompts is not supported; send one per request", param="prompt")
        single = prompt[0]
        return single if isinstance(single, str) else {"prompt_token_ids": single}
    return prompt


async def create_completion(llm: Any, ctx: ServingContext, request: CompletionRequest, raw: Request) -> Any:
    """Serve one completion request (streaming or not).

    Raises:
        APIError: unknown model, unsupported field (400).
        InvalidRequestError: out-of-range fields, prompt too long (400 via the error handlers).
        EngineDeadError: the engine is dead (503).
    """
    model = ctx.check(request.model)
    prompt = completion_prompt(request)
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    request_id = make_id("cmpl")
    stream = llm.generate(prompt, params, request_id=request_id)
    if request.stream:
        writer = _CompletionStreamWriter(request, request_id, model)
        events = stream_events(ctx, stream, writer.events, writer.final_events)
        return StreamingResponse(events, media_type="text/event-stream")
    final = await collect_or_abort(stream, raw, ctx)
    return JSONResponse(content=_response(request, request_id, model, final).model_dump())


def _choice(request: CompletionRequest, completion: CompletionOutput, text_offset: int) -> CompletionChoice:
    logprobs = None
    if request.logprobs is not None and completion.logprobs is not None:
        logprobs = to_completion_logprobs(completion.token_ids, completion.logprobs, request.logprobs, text_offset)
    return CompletionChoice(
        index=completion.index,
        text=completion.text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


def _response(request: CompletionRequest, request_id: str, model: str, final: RequestOutput) -> CompletionResponse:
    usage = final.usage
    assert usage is not None  # collect() always sets it
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[_choice(request, c, 0) for c in final.outputs],
        usage=make_usage(usage.num_prompt_tokens, usage.num_generated_tokens, usage.num_cached_tokens),
    )


class _CompletionStreamWriter:
    """DELTA `RequestOutput`s of one request -> `text_completion` SSE chunks."""

    def __init__(self, request: CompletionRequest, request_id: str, model: str) -> None:
        self.request = request
        self.request_id = request_id
        self.model = model
        self.usage = UsageCounter()
        self.text_offsets = [0] * request.n

    def events(self, output: RequestOutput) -> list[str]:
        self.usage.add(output)
        events = []
        for completion in output.outputs:
            if not completion.text and not completion.finished and self.request.logprobs is None:
                continue
            choice = _choice(self.request, completion, self.text_offsets[completion.index])
            self.text_offsets[completion.index] += len(completion.text)
            usage = self.usage.info() if self.request.continuous_usage_stats else None
            chunk = CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)
            events.append(sse(dump(chunk)))
        return events

    def final_events(self) -> list[str]:
        if not self.request.include_usage:
            return []
        chunk = CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=self.usage.info())
        return [sse(dump(chunk))]
