"""The frontend's handle on the engine core: `EngineCoreClient`, and `InprocClient` (core in a thread).

`InprocClient` constructs and runs the `EngineCore` in one background thread, so a step never runs on the
event loop. The thread's busy loop: take every queued input (blocking while the engine is idle, so an idle
engine burns no CPU), run one `step()`, and hand non-empty outputs to the frontend. Utility calls
(e.g. `get_scheduler_stats`) travel through the same input queue and come back as
`EngineCoreOutputs.utility_result`, matched to a future by `call_id`.

If the engine thread raises, the client is dead for good: pending and later `get_output_async()` and
`call_utility_async()` raise `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any

from asyncllm.engine.busy_loop import run_busy_loop, wake_on_executor_failure
from asyncllm.errors import EngineDeadError, EngineGenerateError
from asyncllm.messages.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReadyInfo,
    UtilityCall,
    UtilityResult,
)

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 30.0


class EngineCoreClient(ABC):
    """How the frontend talks to an engine core, wherever it runs.

    Attributes:
        ready_info: KV block count, max model length and vocabulary size reported by the ready engine.
    """

    ready_info: EngineReadyInfo

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Submit a request; returns at once. Raises `EngineDeadError` when the engine is dead."""

    @abstractmethod
    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (unknown ids are ignored); the engine sends no output for them."""

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs:
        """Wait for the next non-empty batch of engine outputs.

        Raises:
            EngineDeadError: the engine died (sticky) or was shut down.
        """

    @abstractmethod
    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Call a utility method (`asyncllm.engine.utility`) inside the engine and return its result.

        Raises:
            EngineDeadError: the engine died (also while waiting).
            EngineGenerateError: the call raised inside a live engine.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and release its resources. Idempotent."""

    @property
    @abstractmethod
    def errored(self) -> bool:
        """True once the engine died (sticky)."""

    def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine died."""
        if self.errored:
            raise EngineDeadError()


class InprocClient(EngineCoreClient):
    """Runs an `EngineCore` in one background thread of this process.

    Args:
        config: the engine configuration; the core is built inside the thread.
        core_factory: builds the core (tests pass a fake); default `asyncllm.engine.core.EngineCore`.
    Raises:
        Whatever the core's constructor raises (e.g. `ModelNotFoundError`), re-raised here.
    """

    def __init__(self, config: EngineConfig, core_factory: Any = None) -> None:
        self._inputs: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._pending_calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards _pending_calls and _dead against the engine thread
        self._dead: BaseException | None = None
        self._closed = False
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run_engine, args=(config, core_factory), name="asyncllm-engine-core", daemon=True
        )
        self._thread.start()
        self._wait_until_ready()

    # ---- frontend side -------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._ensure_alive()
        self._inputs.put((EngineCoreRequestType.ADD, request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed and not self.errored:
            self._inputs.put((EngineCoreRequestType.ABORT, list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        waiter = self._register_waiter()
        while True:
            if self._outputs:
                return self._outputs.popleft()
            self._ensure_alive()
            await waiter.wait()
            waiter.clear()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._ensure_alive()
            self._pending_calls[call_id] = (loop, future)
        self._inputs.put((EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args))))
        return await future

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inputs.put((EngineCoreRequestType.SHUTDOWN, None))
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)
        self._fail_waiters(EngineDeadError("the engine was shut down"))

    def _ensure_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError() from self._dead
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _register_waiter(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._waiter is None or self._waiter[0] is not loop:
            self._waiter = (loop, asyncio.Event())
        return self._waiter[1]

    def _wait_until_ready(self) -> None:
        if not self._ready.wait(READY_TIMEOUT_S):
            self.shutdown()
            raise EngineDeadError(f"the engine core was not ready within {READY_TIMEOUT_S:.0f} s")
        if self._init_error is not None:
            raise self._init_error

    # ---- engine thread -------------------------------------------------------------------------------

    def _run_engine(self, config: EngineConfig, core_factory: Any) -> None:
        try:
            core = self._build_core(config, core_factory)
        except BaseException as e:
            self._init_error = e
            self._closed = True
            self._ready.set()
            return
        self.ready_info = core.ready_info
        wake_on_executor_failure(core, self._inputs)
        self._ready.set()
        try:
            run_busy_loop(core, self._inputs, self._emit)
        except BaseException as e:
            logger.exception("the engine core died")
            self._mark_dead(e)
        finally:
            with contextlib.suppress(Exception):
                core.shutdown()

    @staticmethod
    def _build_core(config: EngineConfig, core_factory: Any) -> Any:
        if core_factory is None:
            from asyncllm.engine.core import EngineCore

            core_factory = EngineCore
        return core_factory(config)

    def _emit(self, outputs: EngineCoreOutputs) -> None:
        """Engine thread -> loop: utility answers resolve their futures, everything else is queued."""
        if outputs.utility_result is not None:
            self._resolve_utility(outputs)
        else:
            self._post(outputs)

    def _post(self, outputs: EngineCoreOutputs) -> None:
        self._outputs.append(outputs)
        self._wake_waiter()

    def _wake_waiter(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                waiter[0].call_soon_threadsafe(waiter[1].set)

    def _resolve_utility(self, outputs: EngineCoreOutputs) -> None:
        result = outputs.utility_result
        if result is None:
            return
        with self._lock:
            loop, future = self._pending_calls.pop(result.call_id, (None, None))
        if loop is None or future is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_utility_result, future, result)

    def _mark_dead(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error
        self._fail_waiters(EngineDeadError())

    def _fail_waiters(self, error: EngineDeadError) -> None:
        with self._lock:
            pending = list(self._pending_calls.values())
            self._pending_calls.clear()
        for loop, future in pending:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_exception, future, error)
        self._wake_waiter()


def _set_utility_result(future: asyncio.Future[Any], result: UtilityResult) -> None:
    if future.done():
        return
    if result.error is not None:
        future.set_exception(EngineGenerateError(f"engine utility call failed: {result.error}"))
    else:
        future.set_result(result.result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
