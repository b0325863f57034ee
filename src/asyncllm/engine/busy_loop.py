"""The engine core's busy loop: the one loop every launcher runs (engine process, or a thread of the caller).

Each turn has two halves: `process_input_queue` (take every queued input; block for the first one only when the
core is idle, so an idle engine burns no CPU) and `run_engine_step` (one `step()`, emit its outputs). Inputs
never run user code: ADD, ABORT, UTILITY calls of `EngineCore` methods named in `UTILITY_METHODS`, SHUTDOWN,
and EXECUTOR_FAILED (queued by the executor's failure callback when a worker dies). Follows vLLM v1's
`EngineCoreProc.run_busy_loop` (`_process_input_queue`, `_process_engine_step`).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any, Protocol

from asyncllm.errors import ExecutorError
from asyncllm.messages.engine import (
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

EngineInput = tuple[EngineCoreRequestType, Any]
Emit = Callable[[EngineCoreOutputs], None]


class EngineCoreLike(Protocol):
    """What the busy loop needs of a core (`EngineCore`, or a test double with the same methods)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> EngineCoreOutputs: ...

    def check_health(self) -> None: ...

    def register_failure_callback(self, callback: Callable[[], None]) -> None: ...


class ShutdownRequested(Exception):
    """Internal: a SHUTDOWN input arrived; the busy loop returns."""


def wake_on_executor_failure(core: EngineCoreLike, inputs: queue.Queue[EngineInput]) -> None:
    """Make a worker death queue an EXECUTOR_FAILED input, which wakes the loop (even when idle)."""
    core.register_failure_callback(lambda: inputs.put((EngineCoreRequestType.EXECUTOR_FAILED, None)))


def run_busy_loop(core: EngineCoreLike, inputs: queue.Queue[EngineInput], emit: Emit) -> None:
    """Serve `inputs` and step `core` until a SHUTDOWN input arrives.

    Args:
        core: used from this thread only.
        inputs: (request type, payload) pairs: ADD -> EngineCoreRequest, ABORT -> list of ids,
            UTILITY -> UtilityCall, SHUTDOWN and EXECUTOR_FAILED -> None.
        emit: receives every non-empty step output, utility answer and failed-request notice.
    Raises:
        ExecutorError: a worker died (EXECUTOR_FAILED).
        Whatever `core.step()` raises: the caller declares the engine dead.
    """
    try:
        while True:
            process_input_queue(core, inputs, emit)
            run_engine_step(core, emit)
    except ShutdownRequested:
        return


def process_input_queue(core: EngineCoreLike, inputs: queue.Queue[EngineInput], emit: Emit) -> None:
    """Apply every queued input; waits for one first when the core has nothing to do.

    Raises:
        ShutdownRequested: on SHUTDOWN.
        ExecutorError: on EXECUTOR_FAILED (the executor's own reason when it has one).
    """
    block = not core.has_unfinished_requests()
    while True:
        try:
            kind, payload = inputs.get(block=block)
        except queue.Empty:
            return
        reply = handle_input(core, kind, payload)
        if reply is not None:
            emit(reply)
        block = False


def run_engine_step(core: EngineCoreLike, emit: Emit) -> None:
    """Run one step if there is work and emit its outputs unless empty."""
    if core.has_unfinished_requests():
        outputs = core.step()
        if outputs.outputs or outputs.finished_requests or outputs.failed_requests:
            emit(outputs)


def handle_input(core: EngineCoreLike, kind: EngineCoreRequestType, payload: Any) -> EngineCoreOutputs | None:
    """Apply one input to the core; returns what must be sent back (a utility answer, a failed request).

    A request whose ADD raises fails alone (`EngineCoreOutputs.failed_requests`); the engine keeps serving.
    Raises:
        ShutdownRequested, ExecutorError: see `process_input_queue`.
    """
    if kind is EngineCoreRequestType.ADD:
        try:
            core.add_request(payload)
        except Exception as e:
            logger.exception("request %r failed to start", payload.request_id)
            return EngineCoreOutputs(failed_requests={payload.request_id: f"{type(e).__name__}: {e}"})
    elif kind is EngineCoreRequestType.ABORT:
        core.abort_requests(payload)
    elif kind is EngineCoreRequestType.UTILITY:
        return EngineCoreOutputs(utility_result=call_utility(core, payload))
    elif kind is EngineCoreRequestType.SHUTDOWN:
        raise ShutdownRequested()
    elif kind is EngineCoreRequestType.EXECUTOR_FAILED:
        core.check_health()  # raises the executor's own error when it has one
        raise ExecutorError("a worker died")
    return None


def call_utility(core: object, call: UtilityCall) -> UtilityResult:
    """Run `core.<call.method>(*call.args)` for a method named in `UTILITY_METHODS`; an exception (or an unknown
    method) becomes `UtilityResult.error`."""
    try:
        if call.method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {call.method!r}; known: {sorted(UTILITY_METHODS)}")
        return UtilityResult(call.call_id, result=getattr(core, call.method)(*call.args))
    except Exception as e:
        return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
