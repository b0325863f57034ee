"""`AsyncLLM`: the asyncio front door. Submit prompts, stream `RequestOutput`s, abort, shut down.

Data flow: `generate()` -> InputProcessor (tokenize + validate, synchronously) -> OutputProcessor state +
EngineCoreClient.add_request -> engine core (its own process by default, or a background thread) -> the output
handler task (one per AsyncLLM, on the running loop) -> OutputProcessor -> each request's collector -> its
`GenerateOutputStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import threading
import weakref
from collections.abc import Generator, Mapping, Sequence
from types import TracebackType
from typing import Any

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.client import EngineCoreClient, make_client
from asyncllm.engine.protocol import EngineCoreOutputs, SchedulerStats
from asyncllm.errors import EngineDeadError, EngineGenerateError, InvalidRequestError
from asyncllm.metrics.loggers import LoggingStatLogger, StatLoggerBase
from asyncllm.metrics.prometheus import PrometheusStatLogger, is_prometheus_available
from asyncllm.metrics.stats import IterationStats
from asyncllm.outputs import RequestOutput
from asyncllm.processing.input_processor import InputProcessor, PromptType
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.processing.tool_calling import ToolChoice, plan_chat
from asyncllm.sampling_params import SamplingParams
from asyncllm.streams import GenerateOutputStream, RequestOutputCollector

logger = logging.getLogger(__name__)
OUTPUT_CHUNK_SIZE = 256  # engine outputs processed between yields to the event loop


class AsyncLLM:
    """Streaming LLM inference on an engine core.

    Build inside a coroutine with `llm = await AsyncLLM.create(EngineArgs(...))` or `async with
    AsyncLLM.create(EngineArgs(...)) as llm:` (start-up runs in a worker thread: the event loop keeps
    running); from synchronous code with `AsyncLLM.from_engine_args(...)` (blocks). Use as `async with llm:`
    or call `shutdown()`.

    Args:
        config: the engine configuration (for reference).
        tokenizer: `asyncllm.model.tokenizer.Tokenizer` of the model.
        client: a ready engine-core client.
        stat_loggers: receive every step's stats; None = the defaults (`make_default_stat_loggers`).
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        client: EngineCoreClient,
        stat_loggers: list[StatLoggerBase] | None = None,
    ) -> None:
        self.config = config
        self.stat_loggers = make_default_stat_loggers(config) if stat_loggers is None else list(stat_loggers)
        self._tokenizer = tokenizer
        self._client = client
        info = client.ready_info
        self._input_processor = InputProcessor(tokenizer, info.max_model_len, info.vocab_size)
        self._output_processor = OutputProcessor(tokenizer.hf)
        self._output_handler: asyncio.Task[None] | None = None
        self._background_tasks: set[asyncio.Task[Any]] = set()
        self._dead: BaseException | None = None
        self._shut_down = False
        # Stops the engine if this object is collected or the interpreter exits without shutdown().
        self._finalizer = weakref.finalize(self, client.shutdown)

    @classmethod
    def create(cls, args: EngineArgs, stat_loggers: list[StatLoggerBase] | None = None) -> StartingAsyncLLM:
        """Start an engine without blocking the event loop: `llm = await AsyncLLM.create(args)`, or
        `async with AsyncLLM.create(args) as llm:` (shuts it down on exit).

        Everything `from_engine_args` does (model resolution and first-time download, tokenizer loading, the
        engine's start-up and handshake) runs in a worker thread (`asyncio.to_thread`). Cancelling the await
        cannot interrupt that thread: the engine it starts is shut down as soon as it is up.

        Args and Raises: as `from_engine_args` (raised by the await).
        """
        return StartingAsyncLLM(cls, args, stat_loggers)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLoggerBase] | None = None) -> AsyncLLM:
        """Resolve the model, load its tokenizer, and start the engine core (blocks until it is ready).

        Blocks the calling thread for the whole start-up (seconds); inside a coroutine use `await
        AsyncLLM.create(args)` instead.

        Args:
            args: the engine arguments.
            stat_loggers: receive every step's stats; None = the defaults (`make_default_stat_loggers`).
        Raises:
            InvalidRequestError: bad engine arguments.
            ModelNotFoundError: the model cannot be resolved.
            EngineDeadError: the engine process failed to start (the message carries the engine's error).
        """
        from asyncllm.model.tokenizer import Tokenizer

        config = args.create_engine_config()
        tokenizer = Tokenizer.load(config.model.model_path)
        llm = cls(config, tokenizer, make_client(config), stat_loggers)
        _freeze_startup_heap()
        return llm

    # ---- properties ---------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the engine died (sticky)."""
        return self._dead is not None or self._client.errored

    @property
    def is_running(self) -> bool:
        """True while the engine serves requests (not shut down, not dead)."""
        return not self._shut_down and not self.errored

    @property
    def prometheus_registry(self) -> Any:
        """The `CollectorRegistry` of the first `PrometheusStatLogger` in `stat_loggers`, or None."""
        for stat_logger in self.stat_loggers:
            if isinstance(stat_logger, PrometheusStatLogger):
                return stat_logger.registry
        return None

    def get_tokenizer(self) -> Any:
        """The model's `asyncllm.model.tokenizer.Tokenizer`."""
        return self._tokenizer

    def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine died or was shut down."""
        self._ensure_running()

    # ---- requests -----------------------------------------------------------------------------------

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> GenerateOutputStream:
        """Submit one prompt; returns its output stream at once (tokenization happens here).

        Args:
            prompt: text, `{"prompt_token_ids": [...]}`, or chat messages `[{"role", "content"}, ...]`.
            sampling_params: None means `SamplingParams()`; with `n > 1` the n completions share this stream
                (see `asyncllm.processing.parallel_sampling`).
            request_id: unique among in-flight requests; None makes one.
            priority: lower runs first with `scheduling_policy="priority"` (ignored by "fcfs").
        Returns:
            A `GenerateOutputStream` of `RequestOutput`s; the last has `finished=True`.
        Raises:
            InvalidRequestError: bad input or a duplicate in-flight request id (nothing reaches the engine).
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        prompt_text, request = self._input_processor.process(prompt, sampling_params, request_id, priority)
        parent = ParentRequest(request) if request.sampling_params.n > 1 else None
        engine_requests = parent.child_requests if parent is not None else [request]
        for engine_id in [request.request_id, *(r.request_id for r in engine_requests)]:
            if self._output_processor.has_request(engine_id):
                raise InvalidRequestError(f"request_id {engine_id!r} is already in flight")
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        for index, engine_request in enumerate(engine_requests):
            self._output_processor.add_request(engine_request, prompt_text, collector, parent, index)
        try:
            for engine_request in engine_requests:
                self._client.add_request(engine_request)
        except BaseException:
            self._abort_closed_stream(request.request_id)  # children already sent are aborted in the engine
            raise
        loop = _running_loop()
        if loop is not None:
            self._ensure_output_handler()
        return GenerateOutputStream(
            request.request_id, collector, self._abort_closed_stream, self._ensure_output_handler, loop
        )

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        tool_parser: str = "hermes",
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Run one chat turn to the end, with optional tool calling (OpenAI's `tools` / `tool_choice`).

        See `asyncllm.processing.tool_calling`: "required" or `{"type": "function", "function": {"name": ...}}`
        force a call valid for the tool's parameter schema (structured outputs); "auto" parses the model's own
        calls with `tool_parser`; "none" offers no tools.
        Returns:
            The final `RequestOutput`; each completion carries `tool_calls` (None when it called no tool).
        Raises:
            InvalidRequestError: bad messages, tools, tool_choice or parameters (nothing reaches the engine).
            EngineGenerateError, EngineDeadError: as `generate()`'s stream.
        """
        plan = plan_chat(
            self._tokenizer, messages, sampling_params, tools, tool_choice, parallel_tool_calls, tool_parser
        )
        output = await self.generate(plan.prompt, plan.sampling_params, request_id, priority).collect()
        return plan.finish(output)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; each open stream then ends with a final output (finish_reason "abort").

        Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = self._output_processor.abort_requests(ids)
        await self._abort_in_engine(aborted)

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The engine scheduler's current counts (running, waiting, free and total KV blocks).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: SchedulerStats = await self._client.call_utility_async("get_scheduler_stats")
        return stats

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every worker, inside the engine.

        Arguments and results cross the process boundary as msgpack (plain values, numpy arrays, tensors).
        Returns:
            One result per worker, by rank.
        Raises:
            EngineGenerateError: the call failed in a worker (the engine keeps serving).
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        client = self._client
        results: list[Any] = await client.call_utility_async("collective_rpc", method, list(args), kwargs, timeout)
        return results

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the output handler and the engine. Open streams raise `EngineDeadError`. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        handler, self._output_handler = self._output_handler, None
        if handler is not None and not handler.done() and handler.get_loop() is _running_loop():
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        self._output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        await asyncio.to_thread(self._finalizer)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self.errored:
            raise EngineDeadError() from (self._dead or None)
        if self._shut_down:
            raise EngineDeadError("the engine was shut down")

    def _ensure_output_handler(self) -> None:
        """Start the output handler on the running loop, unless it already runs there."""
        loop = _running_loop()
        if loop is None or self._shut_down or self.errored:
            return
        handler = self._output_handler
        if handler is None or handler.done() or handler.get_loop() is not loop:
            coroutine = _run_output_handler(self._client, weakref.ref(self))
            self._output_handler = loop.create_task(coroutine, name="asyncllm-output-handler")

    def _on_output_handler_error(self, error: BaseException) -> None:
        if not self._shut_down:
            logger.error("the output handler stopped: %r", error)
            self._dead = error
        self._output_processor.propagate_error(error if isinstance(error, EngineDeadError) else EngineDeadError())

    async def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.failed_requests:
            failed = outputs.failed_requests.items()
            self._output_processor.fail_requests({i: EngineGenerateError(f"request {i!r}: {e}") for i, e in failed})
        items = outputs.outputs
        iteration_stats = IterationStats() if self.stat_loggers else None
        for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
            chunk = items[start : start + OUTPUT_CHUNK_SIZE]
            result = self._output_processor.process_outputs(chunk, outputs.timestamp, iteration_stats)
            await self._abort_in_engine(result.reqs_to_abort)
            await asyncio.sleep(0)  # let other coroutines run between chunks (and between engine steps)
        self._record_stats(outputs, iteration_stats)

    def _record_stats(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None) -> None:
        if outputs.utility_result is not None and not outputs.outputs:
            return
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(outputs.scheduler_stats, iteration_stats)
            except Exception:  # a broken logger must not stop the output handler
                logger.exception("stat logger %r failed", stat_logger)

    async def _abort_in_engine(self, request_ids: list[str]) -> None:
        if request_ids and not self.errored and not self._shut_down:
            await self._client.abort_requests_async(request_ids)

    def _abort_closed_stream(self, request_id: str) -> None:
        """Called (on the loop thread) when a stream is closed or dropped unfinished: no output is sent."""
        aborted = self._output_processor.abort_requests([request_id], notify=False)
        if not aborted:
            return
        loop = _running_loop()
        if loop is None:
            return
        task = loop.create_task(self._abort_in_engine(aborted))
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)


class StartingAsyncLLM:
    """What `AsyncLLM.create()` returns: await it for the `AsyncLLM`, or use it in `async with` (which also
    shuts the engine down on exit). Awaitable once."""

    def __init__(self, cls: type[AsyncLLM], args: EngineArgs, stat_loggers: list[StatLoggerBase] | None = None) -> None:
        self._start = functools.partial(cls.from_engine_args, args, stat_loggers)
        self._llm: AsyncLLM | None = None

    def __await__(self) -> Generator[Any, None, AsyncLLM]:
        return self._start_in_thread().__await__()

    async def __aenter__(self) -> AsyncLLM:
        self._llm = await self._start_in_thread()
        return self._llm

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._llm is not None:
            await self._llm.shutdown()

    async def _start_in_thread(self) -> AsyncLLM:
        future = asyncio.get_running_loop().run_in_executor(None, self._start)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_shut_down_abandoned)  # the thread cannot be interrupted: stop what it starts
            raise


def _shut_down_abandoned(future: asyncio.Future[AsyncLLM]) -> None:
    """Stop an engine whose `create()` was cancelled while it started (in a thread: shutdown blocks)."""
    if future.cancelled() or future.exception() is not None:
        return
    llm = future.result()
    threading.Thread(target=llm._finalizer, name="asyncllm-abandoned-start", daemon=True).start()


async def _run_output_handler(client: EngineCoreClient, llm_ref: weakref.ref[AsyncLLM]) -> None:
    """The one loop: engine outputs -> output processor -> collectors; stop-string hits -> engine aborts.

    It holds the `AsyncLLM` only weakly while it waits for outputs, so a dropped `AsyncLLM` is collected and its
    finalizer stops the engine (then `get_output_async()` raises and this task ends).
    """
    try:
        while True:
            outputs = await client.get_output_async()
            llm = llm_ref()
            if llm is None:
                return
            await llm._process_engine_outputs(outputs)
            del llm
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        llm = llm_ref()
        if llm is not None:
            llm._on_output_handler_error(e)


def make_default_stat_loggers(config: EngineConfig) -> list[StatLoggerBase]:
    """A `LoggingStatLogger` when `log_stats` is on, and a `PrometheusStatLogger` (own registry, label
    model_name = the model) when prometheus-client is installed."""
    loggers: list[StatLoggerBase] = []
    if config.observability.log_stats:
        loggers.append(LoggingStatLogger(config.observability.stats_log_interval))
    if is_prometheus_available():
        loggers.append(PrometheusStatLogger(model_name=config.model.model))
    return loggers


def _freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, the model, the tokenizer) out of the collector's reach.

    With torch imported, a full (generation 2) collection scans ~170k objects and holds the GIL for 60-90 ms
    on a 2-core CPU, stalling the event loop and the engine thread alike. Frozen objects are never scanned
    again (they are still freed by reference counting). vLLM does the same after start-up; see `gc.freeze`
    in the CPython documentation.
    """
    gc.collect()
    gc.freeze()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
