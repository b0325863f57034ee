"""vLLM's metrics API on asyncllm: the metrics reader (`vllm.v1.metrics.reader`'s Counter / Gauge / Histogram /
Vector), vLLM's `vllm:` names as an option, stat loggers given as classes (added to the defaults) and
`do_log_stats()`."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from asyncllm import ConfigError
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig
from asyncllm.messages.engine import SchedulerStats, SpecDecodeMetrics
from asyncllm.metrics.defaults import resolve_stat_loggers
from asyncllm.metrics.loggers import (
    AggregatedLoggingStatLogger,
    LoggingStatLogger,
    PerEngineStatLoggerAdapter,
    StatLoggerBase,
)
from asyncllm.metrics.prometheus import PrometheusStatLogger
from asyncllm.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot
from asyncllm.metrics.stats import FinishedRequestStats, IterationStats


def config(prefix: str = "asyncllm", log_stats: bool = False) -> EngineConfig:
    observability = ObservabilityConfig(log_stats=log_stats, metrics_prefix=prefix)  # type: ignore[arg-type]
    return EngineConfig(ModelConfig("m", "m"), CacheConfig(), SchedulerConfig(), ParallelConfig(), observability)


def fed_logger(prefix: str) -> PrometheusStatLogger:
    stat_logger = PrometheusStatLogger("m", prefix=prefix)
    spec = SpecDecodeMetrics(
        num_drafts=3, num_draft_tokens=6, num_accepted_tokens=4, num_accepted_tokens_per_pos=[3, 1]
    )
    stat_logger.record(SchedulerStats(2, 1, 10, 40, 0.0, 1, 100, 25, spec_decode=spec), None)
    finished = FinishedRequestStats("stop", 1.5, 10, 4, 0.1, 0.02)
    stat_logger.record(None, IterationStats(10, 4, [0.3], [0.02, 0.03], [finished]))
    return stat_logger


@pytest.mark.parametrize("prefix", ["asyncllm", "vllm"])
def test_the_reader_returns_counters_gauges_histograms_and_the_per_position_vector(prefix: str) -> None:
    metrics = {
        (m.name, tuple(sorted(m.labels.items()))): m for m in get_metrics_snapshot(fed_logger(prefix).registry, prefix)
    }
    assert all(name.startswith(f"{prefix}:") for name, _ in metrics)
    running = metrics[(f"{prefix}:num_requests_running", (("engine", "0"), ("model_name", "m")))]
    assert isinstance(running, Gauge)
    assert running.value == 2
    generated = metrics[(f"{prefix}:generation_tokens", (("model_name", "m"),))]
    assert isinstance(generated, Counter)
    assert generated.value == 4
    ttft = metrics[(f"{prefix}:time_to_first_token_seconds", (("model_name", "m"),))]
    assert isinstance(ttft, Histogram)
    assert (ttft.count, ttft.sum, ttft.buckets["+Inf"]) == (1, pytest.approx(0.3), 1)
    per_position = [m for m in metrics.values() if isinstance(m, Vector)]
    assert [v.values for v in per_position] == [[3, 1]]
    assert per_position[0].name == f"{prefix}:spec_decode_num_accepted_tokens_per_pos"
    assert get_metrics_snapshot(fed_logger(prefix).registry, "other") == []


def test_metrics_prefix_vllm_names_the_default_prometheus_metrics_as_vllm_does() -> None:
    (prometheus,) = [s for s in resolve_stat_loggers(config("vllm"), None) if isinstance(s, PrometheusStatLogger)]
    assert prometheus.prefix == "vllm"
    prometheus.record(SchedulerStats(2, 1, 10, 40), None)
    assert prometheus.registry.get_sample_value("vllm:num_requests_running", {"model_name": "m", "engine": "0"}) == 2


class CountingLogger(StatLoggerBase):
    """A vLLM-style logger: built from (config, engine_index), records, logs on demand."""

    def __init__(self, vllm_config: EngineConfig, engine_index: int = 0) -> None:
        self.config, self.engine_index = vllm_config, engine_index
        self.records = self.logs = self.initialized = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:  # vLLM's shape
        self.records += 1

    def log(self) -> None:
        self.logs += 1

    def log_engine_initialized(self) -> None:
        self.initialized += 1


def test_stat_logger_classes_are_added_to_the_defaults_instances_replace_them() -> None:
    cfg = config(log_stats=True)
    loggers = resolve_stat_loggers(cfg, [CountingLogger])
    assert [type(s) for s in loggers] == [LoggingStatLogger, PrometheusStatLogger, CountingLogger]
    added = loggers[-1]
    assert isinstance(added, CountingLogger)
    assert (added.config, added.engine_index, added.initialized) == (cfg, 0, 1)
    mine = CountingLogger(cfg)
    assert resolve_stat_loggers(cfg, [mine]) == [mine]
    with pytest.raises(ConfigError, match="mixes"):
        resolve_stat_loggers(cfg, [mine, CountingLogger])


def test_logging_stat_logger_logs_at_once_on_log(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger(interval=3600)
    stat_logger.record(SchedulerStats(2, 1, 25, 100), IterationStats(num_prompt_tokens=10, num_generation_tokens=5))
    with caplog.at_level(logging.INFO, logger="asyncllm.metrics.loggers"):
        stat_logger.log()
    assert stat_logger.num_lines_logged == 1
    assert "Running: 2 reqs" in caplog.text


def test_vllms_request_families_are_observed_per_finished_request_and_step() -> None:
    stat_logger = PrometheusStatLogger("m", prefix="vllm")
    finished = FinishedRequestStats(
        "length", 2.0, 7, 5, 0.1, 0.02, prefill_time=0.4, decode_time=1.2, inference_time=1.6, n=3, max_tokens=5
    )
    stat_logger.record(None, IterationStats(7, 5, [0.3], [], [finished]))
    stat_logger.log_cache_config({"block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True"})

    def value(name: str, **labels: str) -> float | None:
        return stat_logger.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("vllm:iteration_tokens_total_count") == 1
    assert value("vllm:iteration_tokens_total_sum") == 12
    assert value("vllm:request_prompt_tokens_sum") == 7
    assert value("vllm:request_generation_tokens_sum") == 5
    assert value("vllm:request_params_n_sum") == 3
    assert value("vllm:request_params_max_tokens_sum") == 5
    assert value("vllm:request_prefill_time_seconds_sum") == pytest.approx(0.4)
    assert value("vllm:request_decode_time_seconds_sum") == pytest.approx(1.2)
    assert value("vllm:request_inference_time_seconds_sum") == pytest.approx(1.6)
    info = stat_logger.registry.get_sample_value(
        "vllm:cache_config_info", {"block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True"}
    )
    assert info == 1


def test_data_parallel_factories_get_one_logger_per_engine_fed_its_own_stats() -> None:
    cfg = dataclasses.replace(config(), parallel=ParallelConfig(data_parallel_size=2))
    (adapter,) = [s for s in resolve_stat_loggers(cfg, [CountingLogger]) if isinstance(s, PerEngineStatLoggerAdapter)]
    assert sorted(adapter.per_engine) == [0, 1]
    adapter.record(SchedulerStats(1, 0, 10, 40, engine_index=1), IterationStats(num_generation_tokens=2))
    adapter.record(SchedulerStats(1, 0, 10, 40, engine_index=1), None)
    adapter.record(SchedulerStats(1, 0, 10, 40, engine_index=0), None)
    counts = {index: s.records for index, s in adapter.per_engine.items()}  # type: ignore[attr-defined]
    assert counts == {0: 1, 1: 2}
    assert [s.engine_index for s in adapter.per_engine.values()] == [0, 1]  # type: ignore[attr-defined]
    assert all(s.initialized == 1 for s in adapter.per_engine.values())  # type: ignore[attr-defined]


def test_aggregated_logging_stat_logger_takes_vllms_arguments() -> None:
    stat_logger = AggregatedLoggingStatLogger(config(), [0, 1])
    assert stat_logger.engine_indexes == [0, 1]
    assert stat_logger.interval == 5.0
