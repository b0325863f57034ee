"""Stat loggers: the `StatLoggerBase` interface and the periodic `LoggingStatLogger`.

The output handler calls `record()` once per batch of engine outputs with the engine's `SchedulerStats` and
the frontend's `IterationStats`. After vLLM v1's `vllm/v1/metrics/loggers.py`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from asyncllm.messages.engine import SchedulerStats
from asyncllm.metrics.stats import IterationStats, sum_scheduler_stats

logger = logging.getLogger(__name__)


class StatLoggerBase(ABC):
    """Receives every step's stats on the event loop thread; must be quick (no I/O but logging).

    vLLM's interface too: a subclass passed to `AsyncLLM.from_engine_args(args, stat_loggers=[MyLogger])` as a
    class (a factory) is built as `MyLogger(config, engine_index)` and added to the default loggers; `log()` runs
    on `await llm.do_log_stats()`, `log_engine_initialized()` once the engine is up.
    """

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Take one step's stats (either may be None)."""

    def log(self) -> None:  # noqa: B027  # optional hook, as vLLM's
        """Write what has been recorded (`AsyncLLM.do_log_stats()`); nothing by default."""

    def log_engine_initialized(self) -> None:  # noqa: B027  # optional hook, as vLLM's
        """Called once the engine is up; nothing by default."""


class LoggingStatLogger(StatLoggerBase):
    """Logs throughput, queue, KV cache and prefix cache stats at INFO every `interval` seconds.

    The line is written from `record()` once `interval` seconds (frontend `time.monotonic()`) have passed
    since the last one, so an idle engine logs nothing. With data parallelism the counts are summed over the
    engines' latest stats.

    Args:
        interval: seconds between two log lines (> 0).
    Raises:
        ValueError: interval <= 0.
    """

    def __init__(self, interval: float = 5.0) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval!r} must be > 0 seconds")
        self.interval = interval
        self._last_log_time = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_scheduler_stats: dict[int, SchedulerStats] = {}  # by engine rank (data parallelism)
        self.num_lines_logged = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self._last_scheduler_stats[scheduler_stats.engine_index] = scheduler_stats
        now = time.monotonic()
        if now - self._last_log_time >= self.interval:
            self._log(now - self._last_log_time)
            self._last_log_time = now

    def log(self) -> None:
        """Write the stats line now (vLLM's `do_log_stats`), and start a new interval."""
        now = time.monotonic()
        self._log(max(now - self._last_log_time, 1e-9))
        self._last_log_time = now

    def _log(self, elapsed: float) -> None:
        stats = sum_scheduler_stats(list(self._last_scheduler_stats.values()))
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._num_prompt_tokens / elapsed,
            self._num_generation_tokens / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            stats.prefix_cache_hit_rate * 100,
            stats.num_preemptions,
        )
        if stats.spec_decode is not None:
            spec = stats.spec_decode
            logger.info(
                "Speculative decoding: acceptance rate %.1f%%, %d draft tokens in %d drafts, accepted per position %s",
                spec.acceptance_rate * 100,
                spec.num_draft_tokens,
                spec.num_drafts,
                spec.num_accepted_tokens_per_pos,
            )
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self.num_lines_logged += 1


class AggregatedLoggingStatLogger(LoggingStatLogger):
    """vLLM's name for the stats line over every data-parallel engine: asyncllm's `LoggingStatLogger` already sums
    the engines' latest stats. Built as vLLM builds it: `AggregatedLoggingStatLogger(config, engine_indexes)`.

    Args:
        config: the engine configuration (its `observability.stats_log_interval`).
        engine_indexes: the engines' ranks (accepted for vLLM's signature; every engine's stats are summed).
    """

    def __init__(self, config: Any, engine_indexes: list[int] | None = None) -> None:
        super().__init__(config.observability.stats_log_interval)
        self.engine_indexes = list(engine_indexes or [0])


class PerEngineStatLoggerAdapter(StatLoggerBase):
    """vLLM's adapter: one logger per data-parallel engine, built by `factory(config, engine_index)`; each step's
    stats go to the logger of the engine that sent them (`SchedulerStats.engine_index`; engine 0 when a step has
    no scheduler stats).

    Args:
        config: the engine configuration, passed to `factory`.
        engine_indexes: the engines' ranks.
        factory: a logger class (or any callable) taking `(config, engine_index)`.
    """

    def __init__(self, config: Any, engine_indexes: list[int], factory: Any) -> None:
        self.per_engine: dict[int, StatLoggerBase] = {index: factory(config, index) for index in engine_indexes}

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        index = scheduler_stats.engine_index if scheduler_stats is not None else 0
        target = self.per_engine.get(index)
        if target is not None:
            target.record(scheduler_stats, iteration_stats)

    def log(self) -> None:
        for stat_logger in self.per_engine.values():
            stat_logger.log()

    def log_engine_initialized(self) -> None:
        for stat_logger in self.per_engine.values():
            stat_logger.log_engine_initialized()
