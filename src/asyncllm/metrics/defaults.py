"""The stat loggers an `AsyncLLM` gets when the caller passes none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncllm.engine_config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.metrics.loggers import LoggingStatLogger, PerEngineStatLoggerAdapter, StatLoggerBase
from asyncllm.metrics.prometheus import PrometheusStatLogger, is_prometheus_available


def make_default_stat_loggers(config: EngineConfig) -> list[StatLoggerBase]:
    """A `LoggingStatLogger` when `log_stats` is on, and a `PrometheusStatLogger` (own registry, label
    model_name = the model) when prometheus-client is installed."""
    loggers: list[StatLoggerBase] = []
    if config.observability.log_stats:
        loggers.append(LoggingStatLogger(config.observability.stats_log_interval))
    if is_prometheus_available():
        loggers.append(PrometheusStatLogger(model_name=config.model.model, prefix=config.observability.metrics_prefix))
    return loggers


def resolve_stat_loggers(config: EngineConfig, given: Sequence[Any] | None) -> list[StatLoggerBase]:
    """The AsyncLLM's stat loggers from its `stat_loggers` argument.

    None: the defaults. Logger instances: exactly those (the defaults are replaced; asyncllm's way). Classes or
    other factories (vLLM's way): each built as `factory(config, 0)` and added after the defaults; with data
    parallelism, one per engine behind a `PerEngineStatLoggerAdapter` (each gets its engine's stats, as vLLM's).
    Then each logger's `log_engine_initialized()` runs.

    Raises:
        ConfigError: instances and factories mixed, or an entry that is neither.
    """
    if given is None:
        return make_default_stat_loggers(config)
    instances = [g for g in given if isinstance(g, StatLoggerBase)]
    factories = [g for g in given if not isinstance(g, StatLoggerBase) and callable(g)]
    if len(instances) + len(factories) != len(given):
        raise ConfigError("stat_loggers entries must be StatLoggerBase instances or logger classes (factories)")
    if instances and factories:
        raise ConfigError(
            "stat_loggers mixes logger instances (which replace the defaults) and logger classes (added to the "
            "defaults, as vLLM's); give one kind"
        )
    if instances:
        return instances
    ranks = list(range(config.parallel.data_parallel_size))
    added = [
        factory(config, 0) if len(ranks) == 1 else PerEngineStatLoggerAdapter(config, ranks, factory)
        for factory in factories
    ]
    loggers = make_default_stat_loggers(config) + added
    for stat_logger in loggers:
        stat_logger.log_engine_initialized()
    return loggers
