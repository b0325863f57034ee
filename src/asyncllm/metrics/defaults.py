"""The stat loggers an `AsyncLLM` gets when the caller passes none."""

from __future__ import annotations

from asyncllm.engine_config import EngineConfig
from asyncllm.metrics.loggers import LoggingStatLogger, StatLoggerBase
from asyncllm.metrics.prometheus import PrometheusStatLogger, is_prometheus_available


def make_default_stat_loggers(config: EngineConfig) -> list[StatLoggerBase]:
    """A `LoggingStatLogger` when `log_stats` is on, and a `PrometheusStatLogger` (own registry, label
    model_name = the model) when prometheus-client is installed."""
    loggers: list[StatLoggerBase] = []
    if config.observability.log_stats:
        loggers.append(LoggingStatLogger(config.observability.stats_log_interval))
    if is_prometheus_available():
        loggers.append(PrometheusStatLogger(model_name=config.model.model))
    return loggers
