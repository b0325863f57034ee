"""How `AsyncLLM` submits requests: its public methods (`async_llm.py`) check the engine and the event loop, then
hand the prompt here.

`RequestSubmitter` makes a request's stream (processing the prompt at once, or, for a long prompt, in a worker
thread when the stream is first awaited), registers the request and its n > 1 children with the output processor,
sends them to the engine-core client, and aborts a stream's request when the stream is closed unfinished (by the
internal id, so a later request reusing the user's id is never touched). `encode()`'s requests are processed,
submitted and awaited here too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncllm.errors import InvalidRequestError, StreamIncompleteError
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.output_handler import OutputHandler
from asyncllm.outputs import PoolingRequestOutput, RequestOutput
from asyncllm.pooling_params import PoolingParams
from asyncllm.processing.input_processor import (
    InputProcessor,
    PromptType,
    RequestOptions,
    make_internal_request_id,
    validate_request_id,
)
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.streams import GenerateOutputStream, RequestOutputCollector
from asyncllm.utils import request_callables
from asyncllm.utils.threads import run_in_daemon_thread

if TYPE_CHECKING:
    from asyncllm.engine.client import EngineCoreClient

LONG_PROMPT_CHARS = 4096  # longer prompts are tokenized in a worker thread (cost: benchmarks/analysis.md)

NextOutput = Callable[[RequestOutputCollector], Awaitable[RequestOutput]]
Hold = Callable[[], Awaitable[None]]  # returns once a paused AsyncLLM resumes (`pausing.PauseGate.wait_resumed`)


class RequestSubmitter:
    """The request path of one `AsyncLLM`, from a processed prompt to the engine.

    Args:
        input_processor: tokenizes and validates prompts into `EngineCoreRequest`s.
        output_processor: tracks every in-flight request's frontend state.
        client: the engine-core client requests are sent with.
        handler: the output handler (engine state, aborts in the engine).
    """

    def __init__(
        self,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        client: EngineCoreClient,
        handler: OutputHandler,
    ) -> None:
        self._input_processor = input_processor
        self._output_processor = output_processor
        self._client = client
        self._handler = handler

    def stream_now(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        options: RequestOptions,
        next_output: NextOutput,
        loop: Any,
        hold: Hold | None = None,
    ) -> GenerateOutputStream:
        """Process the prompt here (bad input raises here), submit it, and return its stream (`generate()`).

        With `hold` (generation is paused), the processed request is submitted when the stream is first awaited,
        after `hold()` returns.

        Raises:
            InvalidRequestError: bad input (nothing reaches the engine), naming the field.
            EngineDeadError: the engine died or was shut down.
        """
        prompt_text, request = self._input_processor.process(prompt, sampling_params, options)
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        abort = self.stream_aborter(request.request_id)
        if hold is None:
            self.submit(prompt_text, request, collector, options.data_parallel_rank)
            return GenerateOutputStream(request.external_req_id or "", collector, abort, next_output, loop)

        async def submit_when_resumed() -> None:
            await hold()
            self._handler.ensure_running()
            self.submit(prompt_text, request, collector, options.data_parallel_rank)

        external_id = request.external_req_id or ""
        return GenerateOutputStream(external_id, collector, abort, next_output, loop, start=submit_when_resumed)

    def stream_later(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        options: RequestOptions,
        next_output: NextOutput,
        loop: Any,
        hold: Hold | None = None,
    ) -> GenerateOutputStream:
        """A stream whose prompt is processed in a worker thread, and submitted, when it is first awaited (a long
        prompt: the event loop never stalls on tokenizing it); its input errors raise from that first await.

        Raises:
            InvalidRequestError: a bad `request_id` (here); bad input (from the stream's first await).
        """
        external_id = validate_request_id(options.request_id)
        internal_id = make_internal_request_id(external_id)
        params = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams()
        kind = params.output_kind
        collector = RequestOutputCollector(kind)

        async def submit_off_the_loop() -> None:
            if hold is not None:
                await hold()
            process = functools.partial(self._input_processor.process, internal_id=internal_id)
            resolved = dataclasses.replace(options, request_id=external_id)
            processed = await run_in_daemon_thread(process, prompt, sampling_params, resolved, name="asyncllm-tokenize")
            self._handler.ensure_running()
            self.submit(processed.prompt, processed.request, collector, options.data_parallel_rank)

        abort = self.stream_aborter(internal_id)
        return GenerateOutputStream(external_id, collector, abort, next_output, loop, start=submit_off_the_loop)

    def submit(
        self,
        prompt_text: str | None,
        request: EngineCoreRequest,
        collector: RequestOutputCollector,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Register a processed request (and its n>1 children) with the output processor and send it.

        Raises:
            InvalidRequestError: the internal id is already in flight (cannot happen: internal ids are unique).
            EngineDeadError: the engine died.
        """
        parent = ParentRequest(request) if request.sampling_params.n > 1 else None
        engine_requests = parent.child_requests if parent is not None else [request]
        for engine_id in [request.request_id, *(r.request_id for r in engine_requests)]:
            if self._output_processor.has_request(engine_id):
                raise InvalidRequestError(f"internal request id {engine_id!r} is already in flight")
        for index, engine_request in enumerate(engine_requests):
            self._output_processor.add_request(engine_request, prompt_text, collector, parent, index)
        try:
            for engine_request in engine_requests:
                self._client.add_request(engine_request, data_parallel_rank)
        except BaseException:
            self.abort_closed_stream(request.request_id)  # children already sent are aborted in the engine
            raise

    async def encode(
        self,
        prompts: Sequence[PromptType],
        params: PoolingParams,
        request_id: str | None,
        priority: int,
        single: bool,
        data_parallel_rank: int | None,
        next_output: NextOutput,
    ) -> list[PoolingRequestOutput]:
        """`encode()`'s work: one engine request per prompt (every prompt processed before any is sent; in a
        worker thread when one is long), submitted, then each one's pooled vector, in the prompts' order. On any
        error or cancellation, the requests already sent are aborted.

        Raises:
            InvalidRequestError: a bad prompt or pooling parameters, naming the field.
            StreamIncompleteError: a request was aborted before its vector was made.
            EngineGenerateError, EngineDeadError: a request failed in the engine, or the engine died.
        """
        process_all = functools.partial(self.encode_requests, prompts, params, request_id, priority, single)
        if any(is_long_prompt(p) for p in prompts):
            requests = await run_in_daemon_thread(process_all, name="asyncllm-tokenize")
        else:
            requests = process_all()
        submitted: list[tuple[EngineCoreRequest, RequestOutputCollector]] = []
        try:
            for request in requests:
                collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
                self.submit(None, request, collector, data_parallel_rank)
                submitted.append((request, collector))
            return [await await_pooling(next_output, request, collector) for request, collector in submitted]
        except BaseException:
            for request, _ in submitted:  # no-op for the finished ones
                self.abort_closed_stream(request.request_id)
            raise

    def encode_requests(
        self,
        prompts: Sequence[PromptType],
        params: PoolingParams,
        request_id: str | None,
        priority: int,
        single: bool,
    ) -> list[EngineCoreRequest]:
        """`encode()`'s engine requests, one per prompt (a list's prompts get `f"{request_id}-{i}"`).

        Raises:
            InvalidRequestError: a bad prompt or pooling parameters, naming the field.
        """
        ids = [request_id] if single or request_id is None else [f"{request_id}-{i}" for i in range(len(prompts))]
        ids = ids * len(prompts) if len(ids) == 1 else ids
        return [
            self._input_processor.process(p, None, RequestOptions(rid, priority), pooling_params=params).request
            for p, rid in zip(prompts, ids, strict=True)
        ]

    def abort_closed_stream(self, internal_id: str) -> None:
        """Called (on the loop thread) when a stream is closed or dropped unfinished: no output is sent. By the
        internal id: a later request reusing the user's id is not touched."""
        aborted = self._output_processor.abort_requests([internal_id], notify=False, internal=True)
        self._handler.abort_in_engine(aborted)
        request_callables.forget(internal_id)  # a stream closed before it was submitted (held by a pause)

    def stream_aborter(self, internal_id: str) -> Callable[[str], None]:
        """The stream's abort callback: it is called with the user's id, and aborts by `internal_id`."""
        return lambda _user_id: self.abort_closed_stream(internal_id)


async def await_pooling(
    next_output: NextOutput, request: EngineCoreRequest, collector: RequestOutputCollector
) -> PoolingRequestOutput:
    """Wait for an embedding request's final output; its vector.

    Raises:
        StreamIncompleteError: the request ended without a vector (aborted).
    """
    output = await next_output(collector)
    if collector.pooling_output is None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        raise StreamIncompleteError(
            f"embedding request {request.external_req_id!r} ended without a vector (finish_reason {reason!r})"
        )
    return collector.pooling_output


def is_long_prompt(prompt: PromptType) -> bool:
    """True for text, or chat messages, over `LONG_PROMPT_CHARS` characters: tokenized off the event loop, since
    tokenizing grows with the text and would stall every other stream (`benchmarks/loop_stall.py`; the
    measurements: `benchmarks/analysis.md`, "Long prompts")."""
    if isinstance(prompt, str):
        return len(prompt) > LONG_PROMPT_CHARS
    if isinstance(prompt, list):
        return sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict)) > LONG_PROMPT_CHARS
    return False
