"""What the completion and chat handlers share: the served model, SSE framing, usage, and draining a stream
while watching the HTTP client.

Cancellation: a streaming response's generator closes its `GenerateOutputStream` in `finally`, so a client that
disconnects (Starlette cancels the response task, or the next send fails) aborts its request in the engine. A
non-streaming request is watched with `collect_or_abort`, which aborts it when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request

from asyncllm.entrypoints.openai.errors import APIError, error_body, to_api_error
from asyncllm.entrypoints.openai.protocol import StreamOptions
from asyncllm.entrypoints.openai.responses import UsageInfo
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import RequestOutput
from asyncllm.streams import GenerateOutputStream

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class ServingContext:
    """What the handlers share: the served model's public names and the requests in flight.

    Fields:
        names: accepted `model` values; the first is reported in responses. A request without `model` gets it.
        max_model_len: tokens per sequence at most (prompt + output); None = the model's context length.
        in_flight: ids of the requests being served (graceful shutdown aborts those left after the grace period).
        tool_parser: the registered tool parser for `tool_choice="auto"` (`asyncllm.processing.tool_parsers`).
        lora_modules: LoRA adapters served as models of their own: `model` name -> its `LoRARequest`.
        root: the base model's name or path (model cards' `root`).
        force_include_usage: streams end with a usage chunk whatever `stream_options` says.
        return_tokens_as_token_ids: logprobs name tokens "token_id:N" unless the request says otherwise.
    """

    names: list[str]
    max_model_len: int | None
    tool_parser: str = "hermes"
    in_flight: set[str] = field(default_factory=set)
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    root: str | None = None
    force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False

    def apply_server_defaults(self, request: Any) -> None:
        """Apply the server-wide switches to a completion or chat request: `--enable-force-include-usage` and
        `--return-tokens-as-token-ids` (a request's own `return_tokens_as_token_ids` wins)."""
        if request.return_tokens_as_token_ids is None:
            request.return_tokens_as_token_ids = self.return_tokens_as_token_ids
        if self.force_include_usage and request.stream:
            continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=continuous)

    @property
    def name(self) -> str:
        return self.names[0]

    def check(self, model: str | None) -> str:
        """The name to report for a request that asked for `model`.

        Raises:
            APIError: 400 (code model_not_found, param model) for a name this server does not serve.
        """
        if model is None or model in self.names:
            return self.name
        if model in self.lora_modules:
            return model
        raise APIError(
            f"the model {model!r} does not exist on this server; it serves {self.names + list(self.lora_modules)}",
            HTTPStatus.BAD_REQUEST,
            param="model",
            code="model_not_found",
        )

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request for `model` runs with (None: the base model)."""
        return None if model is None else self.lora_modules.get(model)


# Characters JSON leaves raw inside strings but Python's `str.splitlines` breaks lines at (its other line breaks are
# control characters, which JSON always escapes): written as their JSON escapes, the same JSON value.
_SPLITLINES_SAFE = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: str) -> str:
    """One server-sent event carrying `payload` (a JSON text or `[DONE]`).

    SSE (the WHATWG HTML standard, "Server-sent events") ends lines at CR and LF only, but many Python clients split
    a stream's text with `str.splitlines` (httpx's `iter_lines` / `aiter_lines`, `requests`' `iter_lines` with
    `decode_unicode=True`), which also breaks at U+0085, U+2028 and U+2029: a generated text holding one of them
    reached those clients as two broken lines. So those three are written as JSON escapes (`\\u2028`), which every
    JSON parser reads back as the same character."""
    return f"data: {payload.translate(_SPLITLINES_SAFE)}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(error: BaseException, field_names: dict[str, str] | None = None) -> str:
    """An error event for a stream that already started (the HTTP status is already sent)."""
    api_error = to_api_error(error, field_names)
    return sse(json.dumps(error_body(api_error.message, api_error.err_type, api_error.param, api_error.code)))


class UsageCounter:
    """Token counts of one HTTP request while it streams: prompt tokens per prompt, generated tokens in all."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, output: RequestOutput, prompt_index: int = 0) -> None:
        """Count a DELTA output's new tokens (`prompt_index`: which prompt of the HTTP request it answers)."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def info(self) -> UsageInfo:
        prompt, cached = sum(self.prompt_tokens.values()), sum(self.cached_tokens.values())
        return make_usage(prompt, self.completion_tokens, cached)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    """`usage` with `total_tokens` and, when some prompt tokens came from the prefix cache, their count."""
    details = {"cached_tokens": cached_tokens} if cached_tokens else None
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


async def collect_or_abort(
    streams: list[GenerateOutputStream], request: Request, ctx: ServingContext
) -> list[RequestOutput]:
    """Drain each stream into its final output; abort them all if the HTTP client disconnects first.

    Raises:
        APIError: the client disconnected (reported as 400; nobody reads it).
        EngineDeadError, EngineGenerateError: from a stream.
    """
    collectors = [asyncio.ensure_future(stream.collect()) for stream in streams]
    task = asyncio.gather(*collectors)
    ids = [stream.request_id for stream in streams]
    ctx.in_flight.update(ids)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return list(task.result())
            if await request.is_disconnected():
                raise APIError("the client disconnected")
    finally:
        ctx.in_flight.difference_update(ids)
        # gather() leaves the other streams' tasks running when one raises: cancel and await every one left.
        for collector in collectors:
            collector.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(*collectors, return_exceptions=True)
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await close_streams(streams)


async def close_streams(streams: list[GenerateOutputStream]) -> None:
    """Close every stream (aborting the unfinished ones)."""
    for stream in streams:
        await stream.aclose()


async def merge_streams(streams: list[GenerateOutputStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several streams as they come, each with its stream's position in `streams`.

    One task per stream feeds a queue of `len(streams)` slots, so a slow reader holds outputs back in the
    streams (whose one-slot collectors merge DELTA outputs) rather than in memory here.

    Raises:
        The first error a stream raises (the other streams are left to the caller to close).
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue(len(streams))

    async def pump(index: int, stream: GenerateOutputStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output, None))
        except Exception as error:
            await queue.put((index, None, error))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def stream_events(
    ctx: ServingContext,
    streams: list[GenerateOutputStream],
    to_events: Callable[[int, RequestOutput], list[str]],
    final_events: Callable[[], list[str]],
    field_names: dict[str, str] | None = None,
) -> AsyncIterator[str]:
    """SSE text of one HTTP request: `to_events(stream_index, output)` per engine output (streams merged as
    outputs come), then `final_events()`, then `[DONE]`.

    An error after the first byte becomes an error event before `[DONE]`. Every stream is closed (its request
    aborted if unfinished) however this generator ends, including when the client disconnects.
    """
    ids = [stream.request_id for stream in streams]
    ctx.in_flight.update(ids)
    merged = merge_streams(streams)
    try:
        async for index, output in merged:
            for event in to_events(index, output):
                yield event
        for event in final_events():
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as error:
        yield sse_error(error, field_names)
    finally:
        ctx.in_flight.difference_update(ids)
        await merged.aclose()
        await close_streams(streams)
    yield SSE_DONE


def dump(model: Any) -> str:
    """A response model as compact JSON."""
    text: str = model.model_dump_json()
    return text
