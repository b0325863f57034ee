"""A user-defined executor, importable by module path (the engine core imports it by "module:Class")."""

from __future__ import annotations

from typing import Any

from asyncllm.executors.uniproc import UniProcExecutor


class TaggedExecutor(UniProcExecutor):
    """The `uni` executor, plus a marker in every model-info reply (proves this class ran in the engine)."""

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        results = super().collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
        if method == "get_model_info" and unique_reply_rank is None:  # a user's call, not the engine's start-up
            return [[*r, "tagged"] for r in results]
        return results


class FaultyForwardExecutor(UniProcExecutor):
    """The `uni` executor whose model forward raises in step `FAIL_AT_STEP` (1-based; warm-up not counted).

    The exception is raised inside the model's `forward` (a one-shot forward pre-hook), as a real fault in a
    kernel would be, so it travels the worker -> executor -> engine core path unchanged.
    """

    FAIL_AT_STEP = 5
    MESSAGE = "injected fault in the model forward"

    def execute_model(self, scheduler_output: Any) -> Any:
        self.num_steps = getattr(self, "num_steps", 0) + 1
        if self.num_steps == self.FAIL_AT_STEP and self.worker is not None:
            self.worker.model_runner.model.register_forward_pre_hook(_raise_fault)
        return super().execute_model(scheduler_output)


def _raise_fault(module: Any, args: Any) -> None:
    raise RuntimeError(f"{FaultyForwardExecutor.MESSAGE} at step {FaultyForwardExecutor.FAIL_AT_STEP}")


class SchedulerFaultExecutor(UniProcExecutor):
    """The `uni` executor, built in the engine's own process (either mode), which injects a fault into the
    scheduler there: `Request.check_stop` raises for the request whose user id is `VICTIM` once it has 3 output
    tokens. Proves that an exception the scheduler raises for one request fails that request alone."""

    VICTIM = "victim"
    MESSAGE = "injected scheduler fault"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from asyncllm.sched.request import Request

        check_stop = Request.check_stop
        if getattr(check_stop, "injected_fault", False):
            return  # a second engine in this process (thread mode): the patch is in place already

        def failing_check_stop(request: Request, max_model_len: int) -> bool:
            if request.external_req_id == SchedulerFaultExecutor.VICTIM and request.num_output_tokens >= 3:
                raise RuntimeError(SchedulerFaultExecutor.MESSAGE)
            return check_stop(request, max_model_len)

        failing_check_stop.injected_fault = True  # type: ignore[attr-defined]
        Request.check_stop = failing_check_stop  # type: ignore[method-assign]
