"""`POST /v1/completions`: a `CompletionRequest` -> `AsyncLLM.generate()` -> one JSON body or SSE chunks."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from asyncllm.entrypoints.openai.errors import APIError
from asyncllm.entrypoints.openai.logprobs import to_completion_logprobs
from asyncllm.entrypoints.openai.protocol import CompletionRequest
from asyncllm.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionResponse,
    make_id,
    prompt_logprobs_json,
)
from asyncllm.entrypoints.openai.serving_base import (
    ServingContext,
    UsageCounter,
    close_streams,
    collect_or_abort,
    dump,
    make_usage,
    sse,
    stream_events,
)
from asyncllm.entrypoints.openai.serving_chat_tools import output_constraint
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.processing.input_processor import PromptType
from asyncllm.streams import GenerateOutputStream


def completion_prompts(request: CompletionRequest, tokenizer: Any = None, max_model_len: int = 0) -> list[PromptType]:
    """The request's prompts, as `AsyncLLM.generate()` takes them (a batch gives several); with
    `truncate_prompt_tokens`, each prompt's token ids, cut to their last k (`tokenizer` encodes text prompts).

    Raises:
        APIError: 400 for an empty prompt list, `best_of` other than `n`, or `echo` with `logprobs`.
    """
    prompt = request.prompt
    if request.best_of is not None and request.best_of != request.n:
        raise APIError("best_of is not supported (only best_of == n)", param="best_of")
    if request.echo and request.logprobs is not None:
        raise APIError("echo with logprobs is not supported (prompt logprobs are not sent)", param="echo")
    if not isinstance(prompt, list):
        prompts: list[PromptType] = [prompt]
    elif not prompt:
        raise APIError("prompt is empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [{"prompt_token_ids": prompt}]
    else:
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]
    if request.truncate_prompt_tokens is None:
        return prompts
    keep = max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
    return [{"prompt_token_ids": _token_ids(p, tokenizer)[-keep:]} for p in prompts]


def _token_ids(prompt: PromptType, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        ids: list[int] = tokenizer.encode(prompt)
        return ids
    return list(prompt["prompt_token_ids"])  # type: ignore[call-overload]


async def submit(
    llm: Any,
    prompts: list[PromptType],
    params: Any,
    request_id: str,
    cache_salt: str | None = None,
    lora_request: Any = None,
) -> list[GenerateOutputStream]:
    """`llm.generate()` each prompt (ids `<request_id>-<i>` for a batch); all or none are submitted.

    Raises:
        InvalidRequestError: a prompt or a field is invalid (earlier prompts of the batch are aborted).
    """
    streams: list[GenerateOutputStream] = []
    try:
        for i, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(
                llm.generate(prompt, params, request_id=engine_id, cache_salt=cache_salt, lora_request=lora_request)
            )
    except BaseException:
        await close_streams(streams)
        raise
    return streams


async def create_completion(llm: Any, ctx: ServingContext, request: CompletionRequest, raw: Request) -> Any:
    """Serve one completion request (streaming or not). With a batch of k prompts and `n` completions each,
    choice `index` is `prompt_index * n + completion_index`.

    Raises:
        APIError: unknown model, unsupported field (400).
        InvalidRequestError: out-of-range fields, prompt too long (400 via the error handlers).
        EngineDeadError: the engine is dead (503).
    """
    model = ctx.check(request.model)
    ctx.apply_server_defaults(request)
    tokenizer = llm.get_tokenizer()
    prompts = completion_prompts(request, tokenizer, ctx.max_model_len or 0)
    params = request.to_sampling_params(request.max_tokens, request.logprobs)
    constraint, _ = output_constraint(request)
    if constraint is not None:
        params = msgspec.structs.replace(params, structured_outputs=constraint)
    request_id = make_id("cmpl")
    streams = await submit(llm, prompts, params, request_id, request.cache_salt, ctx.lora_request(request.model))
    if request.stream:
        writer = _CompletionStreamWriter(request, request_id, model, tokenizer)
        events = stream_events(ctx, streams, writer.events, writer.final_events)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await collect_or_abort(streams, raw, ctx)
    return JSONResponse(content=_response(request, request_id, model, finals, tokenizer).model_dump())


def _prompt_text(output: RequestOutput, tokenizer: Any) -> str:
    """The prompt's text for `echo` (token-id prompts are decoded)."""
    if output.prompt is not None:
        return output.prompt
    text: str = tokenizer.decode(output.prompt_token_ids or [], skip_special_tokens=False)
    return text


def _choice(
    request: CompletionRequest,
    completion: CompletionOutput,
    text_offset: int,
    prompt_index: int,
    first_of: RequestOutput | None = None,
    tokenizer: Any = None,
) -> CompletionChoice:
    """One choice; `first_of` is the request's output when this is the choice's first chunk (or the whole
    response): `echo` puts the prompt's text before the text, `return_token_ids` adds the prompt's ids."""
    logprobs = None
    if request.logprobs is not None and completion.logprobs is not None:
        as_ids = bool(request.return_tokens_as_token_ids)
        logprobs = to_completion_logprobs(
            completion.token_ids, completion.logprobs, request.logprobs, text_offset, as_ids
        )
    text = completion.text
    if request.echo and first_of is not None:
        text = _prompt_text(first_of, tokenizer) + text
    return CompletionChoice(
        index=prompt_index * request.n + completion.index,
        text=text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        prompt_token_ids=first_of.prompt_token_ids if request.return_token_ids and first_of is not None else None,
        prompt_logprobs=prompt_logprobs_json(first_of.prompt_logprobs) if first_of is not None else None,
        token_ids=list(completion.token_ids) if request.return_token_ids else None,
    )


def _response(
    request: CompletionRequest, request_id: str, model: str, finals: list[RequestOutput], tokenizer: Any
) -> CompletionResponse:
    usages = [final.usage for final in finals if final.usage is not None]  # collect() always sets it
    return CompletionResponse(
        id=request_id,
        model=model,
        choices=[_choice(request, c, 0, i, final, tokenizer) for i, final in enumerate(finals) for c in final.outputs],
        usage=make_usage(
            sum(u.num_prompt_tokens for u in usages),
            sum(u.num_generated_tokens for u in usages),
            sum(u.num_cached_tokens for u in usages),
        ),
    )


class _CompletionStreamWriter:
    """DELTA `RequestOutput`s of one request -> `text_completion` SSE chunks."""

    def __init__(self, request: CompletionRequest, request_id: str, model: str, tokenizer: Any = None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.model = model
        self.usage = UsageCounter()
        self.text_offsets: dict[int, int] = {}  # choice index -> characters streamed so far

    def events(self, prompt_index: int, output: RequestOutput) -> list[str]:
        self.usage.add(output, prompt_index)
        events = []
        for completion in output.outputs:
            if not completion.text and not completion.finished and self.request.logprobs is None:
                continue
            key = prompt_index * self.request.n + completion.index
            offset = self.text_offsets.get(key, 0)
            first = output if key not in self.text_offsets else None
            choice = _choice(self.request, completion, offset, prompt_index, first, self.tokenizer)
            self.text_offsets[choice.index] = offset + len(completion.text)
            usage = self.usage.info() if self.request.continuous_usage_stats else None
            chunk = CompletionResponse(id=self.request_id, model=self.model, choices=[choice], usage=usage)
            events.append(sse(dump(chunk)))
        return events

    def final_events(self) -> list[str]:
        if not self.request.include_usage:
            return []
        chunk = CompletionResponse(id=self.request_id, model=self.model, choices=[], usage=self.usage.info())
        return [sse(dump(chunk))]
