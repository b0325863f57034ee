"""The `Executor` interface: how the engine core runs the model, wherever the workers live.

Backends: `uni` (one worker in the engine-core process), `mp` (worker processes), `ray` (actors); see docs/executors.md.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from asyncllm.engine_config import EngineConfig
from asyncllm.errors import ExecutorError
from asyncllm.messages.engine import EngineReadyInfo
from asyncllm.messages.rpc import RpcResponse, decode_result
from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
FailureCallback = Callable[[], None]


class Executor(ABC):
    """Runs workers and forwards calls to them.

    Lifecycle: construct (starts workers and loads the model) -> `determine_num_kv_blocks()` ->
    `initialize_kv_cache(n)` -> `execute_model()` per step -> `shutdown()`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []
        self._failed: str | None = None  # why a worker died; set once by `_report_failure`
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model in each."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Call `Worker.<method>(*args, **kwargs)` on every worker.

        Returns:
            One result per worker, by rank; only rank `unique_reply_rank`'s result when it is given.
        Raises:
            ExecutorError: a worker raised, died, or did not answer within `timeout` seconds.
        """

    def determine_num_kv_blocks(self) -> int:
        """KV cache blocks every worker can hold (the minimum over workers)."""
        return int(min(self.collective_rpc("determine_num_kv_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV cache blocks in every worker."""
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))

    def get_kv_cache_bytes(self) -> int:
        """Bytes of the KV cache over all workers (each holds its shard)."""
        return int(sum(self.collective_rpc("get_kv_cache_bytes")))

    def get_ready_info(self, num_blocks: int) -> EngineReadyInfo:
        """Model facts the frontend needs (max_model_len, vocab_size, hidden_size) plus the block count."""
        max_model_len, vocab_size = self.collective_rpc("get_model_info", unique_reply_rank=0)[0]
        hidden_size = self.collective_rpc("get_hidden_size", unique_reply_rank=0)[0]
        return EngineReadyInfo(num_blocks, max_model_len, vocab_size, hidden_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; rank 0's sampled tokens are returned."""
        result: ModelRunnerOutput = self.collective_rpc("execute_model", args=(scheduler_output,), unique_reply_rank=0)[
            0
        ]
        return result

    @staticmethod
    def gather_results(method: str, responses: Iterable[RpcResponse]) -> list[Any]:
        """The one reply gatherer of every RPC executor: decode each rank's result (typed by
        `messages.rpc.RESULT_TYPES`), stop at the first error, and return the results by rank.

        Raises:
            ExecutorError: a worker replied with an error ("worker <rank> failed in <method>: <error>").
        """
        results: dict[int, Any] = {}
        for response in responses:
            if response.error is not None:
                raise ExecutorError(f"worker {response.rank} failed in {method}: {response.error}")
            results[response.rank] = decode_result(method, response.result)
        return [results[rank] for rank in sorted(results)]

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call `callback()` (from any thread) when a worker dies."""
        self._failure_callbacks.append(callback)

    def check_health(self) -> None:
        """Raise `ExecutorError` if a worker died (uniproc: always healthy while its process lives)."""
        if self._failed is not None:
            raise ExecutorError(self._failed)

    def _report_failure(self, reason: str) -> None:
        """Record that a worker died (`check_health` raises from now on) and run the failure callbacks."""
        self._failed = reason
        logger.error("%s", reason)
        for callback in self._failure_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("executor failure callback raised")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and free its resources. Idempotent."""
