"""The engine core's busy loop, shared by the background-thread client and the engine process.

Each turn: take every queued input (block for the first one only when the core is idle, so an idle engine
burns no CPU), then run one `EngineCore.step()` and emit its outputs. Inputs never run user code: ADD, ABORT
and whitelisted UTILITY calls only.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from asyncllm.engine.protocol import EngineCoreOutputs, EngineCoreRequestType, UtilityCall, UtilityResult
from asyncllm.engine.utility import call_utility_method
from asyncllm.errors import ExecutorError

logger = logging.getLogger(__name__)

EngineInput = tuple[EngineCoreRequestType, Any]
Emit = Callable[[EngineCoreOutputs], None]
EXECUTOR_FAILED = "executor-failed"  # payload of the SHUTDOWN input queued when a worker dies


def wake_on_executor_failure(core: Any, inputs: queue.Queue[EngineInput]) -> None:
    """Make a worker death wake the busy loop (even when idle), which then raises `ExecutorError`."""
    executor = getattr(core, "executor", None)
    if executor is not None:
        executor.register_failure_callback(lambda: inputs.put((EngineCoreRequestType.SHUTDOWN, EXECUTOR_FAILED)))


def run_busy_loop(core: Any, inputs: queue.Queue[EngineInput], emit: Emit) -> None:
    """Serve `inputs` and step `core` until a SHUTDOWN input arrives.

    Args:
        core: an `EngineCore` (or a test double with the same methods); used from this thread only.
        inputs: (request type, payload) pairs: ADD -> EngineCoreRequest, ABORT -> list of ids,
            UTILITY -> UtilityCall, SHUTDOWN -> ignored payload.
        emit: receives every non-empty step output, utility answer and failed-request notice.
    Raises:
        ExecutorError: a worker died (see `wake_on_executor_failure`).
        Whatever `core.step()` raises: the caller declares the engine dead.
    """
    while True:
        block = not core.has_unfinished_requests()
        while True:
            try:
                kind, payload = inputs.get(block=block)
            except queue.Empty:
                break
            if kind is EngineCoreRequestType.SHUTDOWN:
                if payload == EXECUTOR_FAILED:
                    core.executor.check_health()  # raises the executor's own error when it has one
                    raise ExecutorError("a worker died")
                return
            reply = handle_input(core, kind, payload)
            if reply is not None:
                emit(reply)
            block = False
        if core.has_unfinished_requests():
            outputs = core.step()
            if outputs.outputs or outputs.finished_requests or outputs.failed_requests:
                emit(outputs)


def handle_input(core: Any, kind: EngineCoreRequestType, payload: Any) -> EngineCoreOutputs | None:
    """Apply one input to the core; returns what must be sent back (a utility answer, a failed request).

    A request whose ADD raises fails alone (`EngineCoreOutputs.failed_requests`); the engine keeps serving.
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
    return None


def call_utility(core: Any, call: UtilityCall) -> UtilityResult:
    """Run a whitelisted utility method; an exception becomes `UtilityResult.error`."""
    try:
        return UtilityResult(call.call_id, result=call_utility_method(core, call.method, call.args))
    except Exception as e:
        return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
