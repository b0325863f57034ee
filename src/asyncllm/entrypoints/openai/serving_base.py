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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request

from asyncllm.entrypoints.openai.errors import APIError, error_body, to_api_error
from asyncllm.entrypoints.openai.responses import UsageInfo
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
    """

    names: list[str]
    max_model_len: int | None
    in_flight: set[str] = field(default_factory=set)

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
        raise APIError(
            f"the model {model!r} does not exist on this server; it serves {self.names}",
            HTTPStatus.BAD_REQUEST,
            param="model",
            code="model_not_found",
        )


def sse(payload: str) -> str:
    """One server-sent event carrying `payload` (a JSON text or `[DONE]`)."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_error(error: BaseException, field_names: dict[str, str] | None = None) -> str:
    """An error event for a stream that already started (the HTTP status is already sent)."""
    api_error = to_api_error(error, field_names)
    return sse(json.dumps(error_body(api_error.message, api_error.err_type, api_error.param, api_error.code)))


class UsageCounter:
    """Token counts of one request while it streams: prompt tokens and generated tokens per choice."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def add(self, output: RequestOutput) -> None:
        """Count a DELTA output's new tokens."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def info(self) -> UsageInfo:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    """`usage` with `total_tokens` and, when some prompt tokens came from the prefix cache, their count."""
    details = {"cached_tokens": cached_tokens} if cached_tokens else None
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


async def collect_or_abort(stream: GenerateOutputStream, request: Request, ctx: ServingContext) -> RequestOutput:
    """Drain `stream` into its final output; abort it if the HTTP client disconnects first.

    Raises:
        APIError: 499-style cancellation is reported as 400 "client disconnected" (nobody reads it).
        EngineDeadError, EngineGenerateError: from the stream.
    """
    task = asyncio.ensure_future(stream.collect())
    ctx.in_flight.add(stream.request_id)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError("the client disconnected")
    finally:
        ctx.in_flight.discard(stream.request_id)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await stream.aclose()


async def stream_events(
    ctx: ServingContext,
    stream: GenerateOutputStream,
    to_events: Callable[[RequestOutput], list[str]],
    final_events: Callable[[], list[str]],
    field_names: dict[str, str] | None = None,
) -> AsyncIterator[str]:
    """SSE text of one request: `to_events(output)` per engine output, then `final_events()`, then `[DONE]`.

    An error after the first byte becomes an error event before `[DONE]`. The stream is closed (the request
    aborted if unfinished) however this generator ends, including when the client disconnects.
    """
    ctx.in_flight.add(stream.request_id)
    try:
        async for output in stream:
            for event in to_events(output):
                yield event
        for event in final_events():
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as error:
        yield sse_error(error, field_names)
    finally:
        ctx.in_flight.discard(stream.request_id)
        await stream.aclose()
    yield SSE_DONE


def dump(model: Any) -> str:
    """A response model as compact JSON."""
    text: str = model.model_dump_json()
    return text
