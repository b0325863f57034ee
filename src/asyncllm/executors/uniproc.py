"""`UniProcExecutor`: a single `Worker` in the engine-core process; RPCs are direct method calls."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ConfigError, ExecutorError
from asyncllm.executors.base import Executor
from asyncllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One worker, rank 0, in this process and thread.

    Raises (construction):
        ConfigError: tensor_parallel_size > 1 (use "mp").
    """

    def _init_executor(self) -> None:
        tp = self.config.parallel.tensor_parallel_size
        if tp != 1:
            raise ConfigError(f"tensor_parallel_size={tp} needs distributed_executor_backend='mp'; 'uni' is TP=1")
        self.worker: Worker | None = Worker(self.config, rank=0)

    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` directly (`timeout` is ignored: the call is synchronous).

        Returns:
            [result].
        Raises:
            ExecutorError: the worker raised (chained), or the executor was shut down.
        """
        if self.worker is None:
            raise ExecutorError(f"collective_rpc({method!r}) after shutdown")
        try:
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        except Exception as e:
            raise ExecutorError(f"worker 0 failed in {method}: {e!r}") from e

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
