"""The engine-administration half of `AsyncLLM`'s public API, as its base class: health, scheduler stats (summed
and per engine), data-parallel size and scaling, prefix-cache reset, and RPCs to every worker. Each call goes to
the engine core through the client's typed utility calls (`UTILITY_METHODS`). Requests are `AsyncLLM`'s
(`async_llm.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.engine.dp_client import DPEngineCoreClient
from asyncllm.errors import ConfigError
from asyncllm.messages.engine import SchedulerStats

if TYPE_CHECKING:
    from asyncllm.engine.client import EngineCoreClient
    from asyncllm.output_handler import OutputHandler


class EngineAdmin:
    """Health, stats, scaling and maintenance calls of an `AsyncLLM`; its client and output handler are set by
    `AsyncLLM.__init__`."""

    _client: EngineCoreClient
    _handler: OutputHandler

    def check_health(self) -> None:
        """Raises `EngineDeadError` if the engine died or was shut down."""
        self._ensure_running()

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The engine scheduler's current counts (running, waiting, free and total KV blocks); with data
        parallelism, summed over the engines (`get_scheduler_stats_per_engine` gives each).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: SchedulerStats = await self._client.call_utility_async("get_scheduler_stats")
        return stats

    async def get_scheduler_stats_per_engine(self) -> dict[int, SchedulerStats]:
        """Each engine core's scheduler counts, by data-parallel rank (`{0: ...}` without data parallelism).

        Raises:
            EngineDeadError: the engine died or was shut down.
        """
        self._ensure_running()
        stats: dict[int, SchedulerStats] = await self._client.call_utility_per_engine_async("get_scheduler_stats")
        return stats

    @property
    def data_parallel_size(self) -> int:
        """Engine cores serving (or draining) now."""
        client = self._client
        return client.data_parallel_size if isinstance(client, DPEngineCoreClient) else 1

    async def scale_data_parallel(self, num_engines: int) -> None:
        """Grow or shrink to `num_engines` engine cores while serving (docs/data_parallel.md): new engines take
        the lowest free ranks; removed ones (the highest ranks) first drain (their in-flight requests finish
        normally, no new request goes to them), then stop. Remaining ranks keep their numbers.

        Raises:
            ConfigError: `num_engines` < 1, a scaling already under way, or an AsyncLLM started with
                `data_parallel_size=1` (it has a single-engine client; start with 2 or more to scale).
            EngineDeadError: the engine died, or a new engine failed to start.
        """
        self._ensure_running()
        if not isinstance(self._client, DPEngineCoreClient):
            raise ConfigError("scale_data_parallel needs an AsyncLLM started with data_parallel_size >= 2")
        await self._client.scale_data_parallel(num_engines)

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
        timeout: float | None = None,  # vLLM's API: the workers' own reply deadline, seconds
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

    def _ensure_running(self) -> None:
        self._handler.ensure_running()
