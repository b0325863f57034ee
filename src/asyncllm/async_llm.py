"""`AsyncLLM`: the async front door (asyncio or trio, through anyio). Submit prompts, stream `RequestOutput`s,
abort, shut down.

Data flow: `generate()` -> InputProcessor (tokenize + validate, synchronously) -> OutputProcessor state +
EngineCoreClient.add_request -> engine core (its own process by default, or a background thread) -> the output
handler (run by whichever waiting stream holds the turn: no background task, so it works on any backend) ->
OutputProcessor -> each request's collector -> its `GenerateOutputStream`.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import sniffio

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.client import EngineCoreClient
from asyncllm.errors import EngineDeadError, EngineGenerateError, EventLoopError, InvalidRequestError
from asyncllm.messages.engine import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from asyncllm.metrics.loggers import LoggingStatLogger, StatLoggerBase
from asyncllm.metrics.prometheus import PrometheusStatLogger, is_prometheus_available
from asyncllm.metrics.stats import IterationStats
from asyncllm.outputs import RequestOutput
from asyncllm.processing.input_processor import InputProcessor, PromptType
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.processing.tool_calling import ToolChoice, plan_chat
from asyncllm.sampling_params import SamplingParams
from asyncllm.streams import GenerateOutputStream, Notifier, RequestOutputCollector
from asyncllm.utils.loops import LoopBinding, current_loop

logger = logging.getLogger(__name__)
LONG_PROMPT_CHARS = 4096  # longer prompts are tokenized in a worker thread (~5 ms of tokenizing and more)


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
        self._notifier = Notifier()  # wakes streams waiting for outputs (and for the output-handling turn)
        self._handling = False  # a task is reading and processing engine outputs for every stream
        self._pending_batches: deque[EngineCoreOutputs] = deque()  # received, not yet processed (in order)
        self._loop_binding = LoopBinding("this AsyncLLM")
        self._dead: BaseException | None = None
        self._shut_down = False
        # Stops the engine if this object is collected or the interpreter exits without shutdown().
        self._finalizer = weakref.finalize(self, client.shutdown)

    @classmethod
    def create(cls, args: EngineArgs, stat_loggers: list[StatLoggerBase] | None = None) -> StartingAsyncLLM:
        """Start an engine without blocking the event loop: `llm = await AsyncLLM.create(args)`, or
        `async with AsyncLLM.create(args) as llm:` (shuts it down on exit).

        Everything `from_engine_args` does (model resolution and first-time download, tokenizer loading, the
        engine's start-up and handshake) runs in a worker thread (`anyio.to_thread`). Cancelling the await
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
            ConfigError: bad engine arguments.
            ModelNotFoundError: the model cannot be resolved.
            EngineDeadError: the engine process failed to start (the message carries the engine's error).
        """
        from asyncllm.model.tokenizer import Tokenizer

        config = args.create_engine_config()
        tokenizer = Tokenizer.load(config.model.model_path)
        llm = cls(config, tokenizer, EngineCoreClient(config), stat_loggers)
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
        """Submit one prompt; returns its output stream at once.

        A short prompt is tokenized and validated here, so bad input raises here. A long one (text or chat
        content over `LONG_PROMPT_CHARS` characters) is tokenized in a worker thread when the stream is first
        awaited, so the event loop never stalls on it (vLLM's `generate` validates at its first iteration too);
        its errors then raise from that first await.

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
            EventLoopError: another event loop, running in another thread, uses this AsyncLLM.
        """
        self._ensure_running()
        loop = self._bind_to_current_loop()
        if loop is not None and is_long_prompt(prompt):
            request_id = request_id if request_id is not None else uuid.uuid4().hex
            params = sampling_params if isinstance(sampling_params, SamplingParams) else SamplingParams()
            kind = params.output_kind
            collector = RequestOutputCollector(kind, self._notifier)

            async def submit_off_the_loop() -> None:
                process = self._input_processor.process
                processed = await anyio.to_thread.run_sync(process, prompt, sampling_params, request_id, priority)
                self._ensure_running()
                self._submit(processed.prompt, processed.request, collector)

            return GenerateOutputStream(
                request_id, collector, self._abort_closed_stream, self._next_output, loop, start=submit_off_the_loop
            )
        prompt_text, request = self._input_processor.process(prompt, sampling_params, request_id, priority)
        collector = RequestOutputCollector(request.sampling_params.output_kind, self._notifier)
        self._submit(prompt_text, request, collector)
        return GenerateOutputStream(request.request_id, collector, self._abort_closed_stream, self._next_output, loop)

    def _submit(self, prompt_text: str | None, request: EngineCoreRequest, collector: RequestOutputCollector) -> None:
        """Register a processed request (and its n>1 children) with the output processor and send it.

        Raises:
            InvalidRequestError: a duplicate in-flight request id (nothing is sent).
            EngineDeadError: the engine died.
        """
        self._process_received_outputs_now()
        parent = ParentRequest(request) if request.sampling_params.n > 1 else None
        engine_requests = parent.child_requests if parent is not None else [request]
        for engine_id in [request.request_id, *(r.request_id for r in engine_requests)]:
            if self._output_processor.has_request(engine_id):
                raise InvalidRequestError(f"request_id {engine_id!r} is already in flight")
        for index, engine_request in enumerate(engine_requests):
            self._output_processor.add_request(engine_request, prompt_text, collector, parent, index)
        try:
            for engine_request in engine_requests:
                self._client.add_request(engine_request)
        except BaseException:
            self._abort_closed_stream(request.request_id)  # children already sent are aborted in the engine
            raise

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
        self._abort_in_engine(self._output_processor.abort_requests(ids))
        self._notifier.notify()

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The engine scheduler's current counts (running, waiting, free and total KV blocks).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: SchedulerStats = await self._client.call_utility_async("get_scheduler_stats")
        return stats

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix in the engine (e.g. after changing weights, or for fair benchmarks).

        Returns:
            True when reset; False (nothing changed) while requests are running and hold KV cache blocks.
        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        reset: bool = await self._client.call_utility_async("reset_prefix_cache")
        return reset

    async def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (vLLM's API: the workers' own reply deadline, seconds)
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
        self._output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        await anyio.to_thread.run_sync(self._finalizer)

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

    def _bind_to_current_loop(self) -> Any:
        """Bind to the running event loop (None outside one); per-loop state is dropped when a previous loop ended.

        Raises:
            EventLoopError: another event loop, running in another thread, uses this AsyncLLM.
        """
        try:
            loop = current_loop()
        except sniffio.AsyncLibraryNotFoundError:
            return None
        if self._loop_binding.bind():
            self._notifier.reset()
            self._handling = False
        return loop

    async def _next_output(self, collector: RequestOutputCollector) -> RequestOutput:
        """Wait for `collector`'s next output. The output handler runs inside the waiting tasks: one at a time
        takes the turn to read a batch of engine outputs and hand them to every collector; the others wait."""
        self._bind_to_current_loop()
        while (output := collector.get_nowait()) is None:
            if not self.is_running:  # an untracked stream of a dead engine would otherwise spin here
                self._client.check_health()  # the engine's own death reason, or "shut down"
                self._ensure_running()
            if self._handling:
                await self._notifier.wait()
                continue
            # Holding the turn, this task waits on the engine's socket; anything put into its own collector
            # meanwhile (an abort's final output, a close, an error) ends that wait, as the engine may send
            # nothing more. Only the wait is cut short: processing a received batch is shielded.
            with anyio.CancelScope() as wait_scope:
                collector.wake_reader = wait_scope.cancel
                try:
                    await self._handle_engine_outputs()
                finally:
                    collector.wake_reader = None
        return output

    async def _handle_engine_outputs(self) -> None:
        """The one loop's body: engine outputs -> output processor -> collectors; stop-string hits -> aborts.

        Reading may be cancelled (nothing is lost: a batch is taken from the socket without awaiting); processing
        a batch is shielded, so a cancelled consumer never drops other requests' outputs.
        """
        self._handling = True
        try:
            try:
                outputs = await self._client.get_output_async()
            except (anyio.get_cancelled_exc_class(), EventLoopError):
                raise
            except BaseException as e:
                self._on_output_handler_error(e)
                return
            self._pending_batches.append(outputs)
            self._take_received_outputs()  # every batch already here: a lagging consumer's outputs merge
            with anyio.CancelScope(shield=True):
                while self._pending_batches:
                    self._process_batch_now(self._pending_batches.popleft())
                    await anyio.lowlevel.checkpoint()  # let other tasks run between engine steps
        finally:
            self._handling = False
            self._notifier.notify()

    def _on_output_handler_error(self, error: BaseException) -> None:
        if not self._shut_down:
            logger.error("the output handler stopped: %r", error)
            self._dead = error
        self._output_processor.propagate_error(error if isinstance(error, EngineDeadError) else EngineDeadError())

    def _take_received_outputs(self) -> None:
        """Queue every engine output the client has received (none while another task is reading)."""
        self._pending_batches.extend(self._client.get_outputs_nowait())

    def _process_received_outputs_now(self) -> None:
        """Before a new request is registered: process every received output, so that late outputs of an aborted
        request can never be taken for those of a new request that reuses its id."""
        self._take_received_outputs()
        while self._pending_batches:
            self._process_batch_now(self._pending_batches.popleft())

    def _process_batch_now(self, outputs: EngineCoreOutputs) -> None:
        """One engine step's outputs -> collectors (synchronously); stop-string hits -> engine aborts."""
        if outputs.failed_requests:
            failed = outputs.failed_requests.items()
            self._output_processor.fail_requests({i: EngineGenerateError(f"request {i!r}: {e}") for i, e in failed})
        iteration_stats = IterationStats() if self.stat_loggers else None
        result = self._output_processor.process_outputs(outputs.outputs, outputs.timestamp, iteration_stats)
        self._abort_in_engine(result.reqs_to_abort)
        self._record_stats(outputs, iteration_stats)

    def _record_stats(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None) -> None:
        if outputs.utility_result is not None and not outputs.outputs:
            return
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(outputs.scheduler_stats, iteration_stats)
            except Exception:  # a broken logger must not stop the output handler
                logger.exception("stat logger %r failed", stat_logger)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        if request_ids and not self.errored and not self._shut_down:
            self._client.abort_requests(request_ids)

    def _abort_closed_stream(self, request_id: str) -> None:
        """Called (on the loop thread) when a stream is closed or dropped unfinished: no output is sent."""
        self._abort_in_engine(self._output_processor.abort_requests([request_id], notify=False))


class StartingAsyncLLM:
    """What `AsyncLLM.create()` returns: await it for the `AsyncLLM`, or use it in `async with` (which also
    shuts the engine down on exit). Awaitable once. Works on asyncio and trio."""

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
        """Start in a worker thread; a cancelled await returns at once and the engine is stopped once it is up
        (the thread cannot be interrupted)."""
        lock = threading.Lock()
        state: dict[str, Any] = {"abandoned": False, "llm": None}

        def start() -> AsyncLLM:
            llm = self._start()
            with lock:
                abandoned = state["abandoned"]
                state["llm"] = llm
            if abandoned:
                llm._finalizer()
            return llm

        try:
            return await anyio.to_thread.run_sync(start, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            with lock:
                state["abandoned"] = True
                llm = state["llm"]
            if llm is not None:  # it finished just as we were cancelled: stop it here (shutdown blocks)
                threading.Thread(target=llm._finalizer, name="asyncllm-abandoned-start", daemon=True).start()
            raise


def is_long_prompt(prompt: PromptType) -> bool:
    """True for text, or chat messages, over `LONG_PROMPT_CHARS` characters: tokenized off the event loop.

    32k characters of English take ~45 ms to tokenize on this project's 2-core CPU (`benchmarks/loop_stall.py`).
    """
    if isinstance(prompt, str):
        return len(prompt) > LONG_PROMPT_CHARS
    if isinstance(prompt, list):
        return sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict)) > LONG_PROMPT_CHARS
    return False


def make_default_stat_loggers(config: EngineConfig) -> list[StatLoggerBase]:
    """A `LoggingStatLogger` when `log_stats` is on, and a `PrometheusStatLogger` (own registry, label
    model_name = the model) when prometheus-client is installed."""
    loggers: list[StatLoggerBase] = []
    if config.observability.log_stats:
        loggers.append(LoggingStatLogger(config.observability.stats_log_interval))
    if is_prometheus_available():
        loggers.append(PrometheusStatLogger(model_name=config.model.model))
    return loggers
