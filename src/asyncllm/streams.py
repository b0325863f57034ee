"""What `AsyncLLM.generate()` returns: an async stream of `RequestOutput`, backed by a one-slot collector.

The output handler puts outputs into a request's `RequestOutputCollector`; the consumer takes them out.
The collector has a single slot, so a slow consumer never makes memory grow: a new output is merged into
the waiting one completion by completion (by `index`): DELTA completions are appended (text concatenated,
token ids and logprobs extended), CUMULATIVE / FINAL_ONLY completions replace the waiting completion of the
same index. Either way the consumer sees the same final text, and the finished output is never lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import anyio

from asyncllm.errors import StreamBusyError, StreamClosedError, StreamIncompleteError
from asyncllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput, Usage
from asyncllm.sampling_params import RequestOutputKind
from asyncllm.utils.loops import call_soon_in_loop


class RequestOutputCollector:
    """The single slot between the output processor (producer) and one stream's consumer, and the one event that
    consumer waits on: a put wakes this collector's consumer and no one else.

    Used on the event loop's thread only (asyncio or trio).

    Args:
        output_kind: DELTA outputs merge when the consumer lags; other kinds replace.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._aggregate = output_kind == RequestOutputKind.DELTA
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: anyio.Event | None = None  # the consumer's, while it waits
        # An embedding request's result, set by the output processor just before its final output is put.
        self.pooling_output: PoolingRequestOutput | None = None

    def put(self, output: RequestOutput) -> None:
        """Offer an output; merges into an output still waiting (appending DELTA completions, replacing others)."""
        if self._output is None:
            self._output = output
        else:
            merge_outputs(self._output, output, self._aggregate)
        self._wake()

    def put_error(self, error: BaseException) -> None:
        """Deliver an error; `get_nowait()` raises it once the waiting output (if any) was taken."""
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    async def wait(self) -> None:
        """Wait until an output or an error is waiting (at once if one is). One consumer at a time."""
        if self._output is not None or self._error is not None:
            return
        waiter = self._waiter = anyio.Event()
        try:
            await waiter.wait()
        finally:
            if self._waiter is waiter:
                self._waiter = None

    def get_nowait(self) -> RequestOutput | None:
        """Take the waiting output, or None.

        Raises:
            The delivered error, when no output is waiting.
        """
        output = self._output
        if output is not None:
            self._output = None
        elif self._error is not None:
            raise self._error
        return output

    async def get(self) -> RequestOutput:
        """Wait for and take the next output (when another task feeds this collector).

        Raises:
            The delivered error (e.g. `EngineDeadError`), when no output is waiting.
        """
        while (output := self.get_nowait()) is None:
            await self.wait()
        return output


def merge_outputs(into: RequestOutput, new: RequestOutput, aggregate: bool) -> None:
    """Fold `new` (a later output of the same request) into `into`, completion by completion (by index).

    Args:
        aggregate: True for DELTA (append text, token ids and logprobs); False replaces a completion.
    """
    by_index = {c.index: i for i, c in enumerate(into.outputs)}
    for completion in new.outputs:
        i = by_index.get(completion.index)
        if i is None:
            by_index[completion.index] = len(into.outputs)
            into.outputs.append(_copy_completion(completion))
        elif aggregate:
            _append_completion(into.outputs[i], completion)
        else:
            into.outputs[i] = completion
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs
    if new.metrics is not None:
        into.metrics = new.metrics
    if new.usage is not None:
        into.usage = new.usage
    if new.spec_decode_metrics is not None:
        into.spec_decode_metrics = new.spec_decode_metrics


def _copy_completion(completion: CompletionOutput) -> CompletionOutput:
    logprobs = list(completion.logprobs) if completion.logprobs is not None else None
    return dataclasses.replace(completion, token_ids=list(completion.token_ids), logprobs=logprobs)


def _append_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids.extend(new.token_ids)
    if old.logprobs is not None and new.logprobs is not None:
        old.logprobs.extend(new.logprobs)
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason


@dataclasses.dataclass(frozen=True)
class StreamStatistics:
    """A frozen snapshot of one stream (`GenerateOutputStream.statistics()`).

    Fields:
        request_id: the stream's request.
        num_outputs_yielded: `RequestOutput`s handed to the consumer so far.
        finished: the last output (or an error) was handed out.
        closed: `aclose()` / `close()` was called (or the consumer was cancelled).
        reading: a task is waiting in `__anext__` now.
    """

    request_id: str
    num_outputs_yielded: int
    finished: bool
    closed: bool
    reading: bool


class GenerateOutputStream:
    """Async iterator over one request's `RequestOutput`s; the last one has `finished=True` and `usage` set.
    Works on asyncio and trio (anyio). One task at a time may iterate it.

    What aborts an unfinished request in the engine: `aclose()` or its sync twin `close()`, leaving `async with
    llm.generate(...) as stream:` (however the block is left), cancelling the task (or the cancel scope) that
    awaits the next output, and `AsyncLLM.abort(request_id)` - always, at once. Leaving `async for` with `break`
    cannot be seen by Python: it aborts only when the stream object is garbage-collected, which is at once if
    nothing else refers to it (`async for out in llm.generate(...)`) and not while a variable still holds it
    (`stream = llm.generate(...)`).

    Args:
        request_id: the request this stream belongs to.
        collector: where the output processor puts this request's outputs.
        abort: `abort(request_id)`, called on the loop's thread to abort the request; must not raise.
        next_output: `await next_output(collector)` waits for the collector's next output (AsyncLLM drives the
            engine outputs meanwhile); default `collector.get`.
        loop: the event loop (`utils.loops.current_loop()`) the request was submitted on; a garbage-collection
            abort is scheduled on it.
        start: awaited once, at the first `__anext__`, before waiting for outputs (submits a long prompt after
            tokenizing it off the loop); its errors raise from that first `__anext__`.
    Raises (from iteration):
        StreamClosedError: used after `aclose()`.
        StreamBusyError: another task is iterating it at the same time.
        EngineDeadError: the engine died.
        EngineGenerateError: this request failed in the engine.
    """

    def __init__(
        self,
        request_id: str,
        collector: RequestOutputCollector,
        abort: Callable[[str], None],
        next_output: Callable[[RequestOutputCollector], Awaitable[RequestOutput]] | None = None,
        loop: Any = None,
        start: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.request_id = request_id
        self._start = start
        self._collector = collector
        self._abort = abort
        self._next_output = next_output or RequestOutputCollector.get
        self._loop = loop
        self._finished = False  # the finished output was handed out, or an error was raised
        self._num_yielded = 0  # outputs handed to the consumer
        self._num_tokens: dict[int, int] = {}  # completion index -> tokens generated so far (for `usage`)
        self._closed = False
        self._reading = False

    @property
    def finished(self) -> bool:
        """True once the last output (or an error) was handed to the consumer."""
        return self._finished

    @property
    def closed(self) -> bool:
        """True after `aclose()` / `close()`."""
        return self._closed

    def statistics(self) -> StreamStatistics:
        """A frozen snapshot of this stream's state."""
        return StreamStatistics(self.request_id, self._num_yielded, self._finished, self._closed, self._reading)

    def __aiter__(self) -> GenerateOutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StreamClosedError(f"the output stream of request {self.request_id!r} is closed")
        if self._finished:
            raise StopAsyncIteration
        if self._reading:
            raise StreamBusyError(
                f"the output stream of request {self.request_id!r} is already iterated by another task"
            )
        self._reading = True
        try:
            if self._start is not None:
                start, self._start = self._start, None
                await start()
            output = await self._next_output(self._collector)
        except BaseException as e:
            if isinstance(e, anyio.get_cancelled_exc_class()):
                self._close_and_abort()
            else:
                self._finished = True
            raise
        finally:
            self._reading = False
        self._count_tokens(output)
        if output.finished:
            self._finished = True
            output.usage = Usage(
                num_prompt_tokens=len(output.prompt_token_ids),
                num_generated_tokens=sum(self._num_tokens.values()),
                num_cached_tokens=output.num_cached_tokens,
            )
        self._num_yielded += 1
        return output

    def _count_tokens(self, output: RequestOutput) -> None:
        """Track each completion's generated token count (DELTA outputs carry only the new tokens)."""
        delta = self._collector.output_kind == RequestOutputKind.DELTA
        for completion in output.outputs:
            before = self._num_tokens.get(completion.index, 0) if delta else 0
            self._num_tokens[completion.index] = before + len(completion.token_ids)

    async def collect(self) -> RequestOutput:
        """Drain the stream into the request's final output.

        Works for every output kind: DELTA completions are concatenated, others replace by index. The result
        holds every completion (index order) with full text, token ids, logprobs and finish reasons, the prompt
        logprobs, and `usage`.

        Raises:
            StreamIncompleteError: the stream was partly consumed or closed before, or ended without a
                finished output, so only a partial result exists.
            EngineDeadError, EngineGenerateError: as iteration does.
        """
        if self._num_yielded:
            raise StreamIncompleteError(f"the output stream of request {self.request_id!r} was partly consumed")
        result: RequestOutput | None = None
        aggregate = self._collector.output_kind == RequestOutputKind.DELTA
        if not self._closed:
            async for output in self:
                if result is None:
                    result = dataclasses.replace(output, outputs=[])
                merge_outputs(result, output, aggregate)
        if result is None or not result.finished:
            raise StreamIncompleteError(f"the output stream of request {self.request_id!r} ended unfinished")
        return result

    async def aclose(self) -> None:
        """Close the stream; aborts the request in the engine if it is not finished. Idempotent."""
        self.close()

    def close(self) -> None:
        """Sync twin of `aclose()` (call it on the event loop's thread). Idempotent.

        A task waiting for this stream's next output meanwhile raises `StreamClosedError` at once.
        """
        if self._reading and not self._closed:
            self._collector.put_error(StreamClosedError(f"the output stream of request {self.request_id!r} was closed"))
        self._close_and_abort()

    async def __aenter__(self) -> GenerateOutputStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _close_and_abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)

    def __del__(self) -> None:
        # Dropped unfinished (e.g. `break` out of `async for`): abort on the request's loop, from any thread.
        if self._closed or self._finished or self._loop is None:
            return
        self._closed = self._finished = True
        call_soon_in_loop(self._loop, self._abort, self.request_id)
