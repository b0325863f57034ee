"""Metrics: request metrics from engine events and token timestamps, iteration stats, the logging and the
Prometheus stat loggers (own registries, vLLM-like names)."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
from prometheus_client import generate_latest
from tokenizers import Tokenizer as HFTokenizer

from asyncllm import ConfigError, EngineArgs, RequestOutputKind, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig
from asyncllm.messages.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from asyncllm.metrics.defaults import make_default_stat_loggers
from asyncllm.metrics.loggers import LoggingStatLogger
from asyncllm.metrics.prometheus import PrometheusStatLogger
from asyncllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.streams import RequestOutputCollector

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path).hf


def test_request_state_stats_intervals_use_one_clock_each() -> None:
    stats = RequestStateStats(arrival_time=time.time() - 0.5)
    assert stats.to_metrics().queue_time is None
    stats.update_from_events([EngineCoreEvent(Q, 100.0), EngineCoreEvent(S, 100.25)])
    assert stats.queue_time == pytest.approx(0.25)
    ttft, itl = stats.update_from_tokens(1, 101.0)
    assert ttft is not None
    assert 0.5 <= ttft < 5.0  # frontend wall clock since arrival
    assert itl is None
    stats.update_from_events([EngineCoreEvent(P, 101.5), EngineCoreEvent(S, 102.0)])
    assert stats.update_from_tokens(1, 102.5) == (None, pytest.approx(1.5))
    stats.update_from_tokens(1, 103.0)
    metrics = stats.to_metrics()
    assert metrics.first_scheduled_time == 100.25  # the first SCHEDULED, not the resume
    assert (metrics.first_token_time, metrics.last_token_time) == (101.0, 103.0)
    assert metrics.mean_inter_token_latency == pytest.approx(1.0)
    assert stats.num_preemptions == 1
    assert stats.update_from_tokens(0, 104.0) == (None, None)


def test_output_processor_attaches_metrics_and_fills_iteration_stats(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), arrival_time=time.time())
    processor.add_request(request, "prompt", collector)
    first = IterationStats()
    events = [EngineCoreEvent(Q, 10.0), EngineCoreEvent(S, 10.5)]
    processor.process_outputs([EngineCoreOutput("r", [42], events=events)], 11.0, first)
    out = collector.get_nowait()
    assert out is not None
    assert out.metrics is not None
    assert out.metrics.queue_time == pytest.approx(0.5)
    assert out.metrics.time_to_first_token is not None
    assert out.metrics.mean_inter_token_latency is None
    assert (first.num_prompt_tokens, first.num_generation_tokens, len(first.time_to_first_tokens)) == (3, 1, 1)
    second = IterationStats()
    processor.process_outputs([EngineCoreOutput("r", [43], FinishReason.LENGTH)], 11.2, second)
    out = collector.get_nowait()
    assert out is not None
    assert out.finished
    assert out.metrics is not None
    assert out.metrics.mean_inter_token_latency == pytest.approx(0.2)
    assert out.metrics.last_token_time == 11.2
    assert second.num_prompt_tokens == 0
    assert second.inter_token_latencies == [pytest.approx(0.2)]
    (finished,) = second.finished_requests
    assert (finished.finish_reason, finished.num_generation_tokens, finished.num_prompt_tokens) == ("length", 2, 3)
    assert finished.queue_time == pytest.approx(0.5)


class _Clock:
    """A stand-in for the `time` module whose `monotonic()` moves only when a test advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_logging_stat_logger_logs_once_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()  # a loaded machine cannot stretch a real interval past the first record
    monkeypatch.setattr("asyncllm.metrics.loggers.time", clock)
    stat_logger = LoggingStatLogger(interval=5.0)
    stats = SchedulerStats(2, 1, 25, 100, prefix_cache_hit_rate=0.5, num_preemptions=3)
    with caplog.at_level(logging.INFO, logger="asyncllm.metrics.loggers"):
        clock.now += 4.9
        stat_logger.record(stats, IterationStats(num_prompt_tokens=10, num_generation_tokens=5))
        assert stat_logger.num_lines_logged == 0
        clock.now += 0.2
        stat_logger.record(stats, IterationStats(num_generation_tokens=1))
    assert stat_logger.num_lines_logged == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Running: 2 reqs" in line
    assert "Waiting: 1 reqs" in line
    assert "KV cache usage: 75.0%" in line
    assert "Prefix cache hit rate: 50.0%" in line
    assert "Preemptions: 3" in line
    with pytest.raises(ValueError, match="interval"):
        LoggingStatLogger(interval=0)


def _sample(logger: PrometheusStatLogger, name: str, **labels: str) -> float | None:
    return logger.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_prometheus_logger_counts_from_totals_and_observes_latencies() -> None:
    one, two = PrometheusStatLogger("m"), PrometheusStatLogger("m")  # separate registries: no collision
    assert one.registry is not two.registry
    one.record(SchedulerStats(3, 2, 10, 40, 0.25, 1, 100, 25), None)
    one.record(SchedulerStats(1, 0, 40, 40, 0.3, 2, 200, 60), None)
    finished = FinishedRequestStats("stop", 1.5, 10, 4, 0.1, 0.02)
    iteration = IterationStats(10, 4, [0.3], [0.02, 0.03], [finished])
    one.record(None, iteration)
    assert _sample(one, "asyncllm:num_requests_running", engine="0") == 1
    assert _sample(one, "asyncllm:num_requests_waiting", engine="0") == 0
    assert _sample(one, "asyncllm:kv_cache_usage_perc", engine="0") == 0.0
    assert _sample(one, "asyncllm:num_preemptions_total", engine="0") == 2
    assert _sample(one, "asyncllm:prefix_cache_queries_total", engine="0") == 200
    assert _sample(one, "asyncllm:prefix_cache_hits_total", engine="0") == 60
    assert _sample(one, "asyncllm:prompt_tokens_total") == 10
    assert _sample(one, "asyncllm:generation_tokens_total") == 4
    assert _sample(one, "asyncllm:request_success_total", finished_reason="stop") == 1
    assert _sample(one, "asyncllm:time_to_first_token_seconds_count") == 1
    assert _sample(one, "asyncllm:time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert _sample(one, "asyncllm:inter_token_latency_seconds_count") == 2
    assert _sample(one, "asyncllm:e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert _sample(one, "asyncllm:request_queue_time_seconds_count") == 1
    assert _sample(two, "asyncllm:prompt_tokens_total") == 0
    assert b"asyncllm:time_to_first_token_seconds_bucket" in generate_latest(one.registry)


def test_prometheus_logger_labels_scheduler_metrics_by_engine() -> None:
    """Data parallelism: each engine's gauges and counters are kept apart by the `engine` label."""
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(3, 1, 10, 40, 0.0, 1, 100, 25, engine_index=0), None)
    logger.record(SchedulerStats(5, 0, 20, 40, 0.0, 4, 300, 30, engine_index=1), None)
    logger.record(SchedulerStats(2, 0, 10, 40, 0.0, 2, 150, 40, engine_index=0), None)
    assert _sample(logger, "asyncllm:num_requests_running", engine="0") == 2
    assert _sample(logger, "asyncllm:num_requests_running", engine="1") == 5
    assert _sample(logger, "asyncllm:num_preemptions_total", engine="0") == 2
    assert _sample(logger, "asyncllm:num_preemptions_total", engine="1") == 4
    assert _sample(logger, "asyncllm:prefix_cache_hits_total", engine="0") == 40
    assert _sample(logger, "asyncllm:prefix_cache_hits_total", engine="1") == 30


def _config(**kw: object) -> EngineConfig:
    args = EngineArgs(model="m", **kw)  # type: ignore[arg-type]
    args.validate()
    return EngineConfig(
        ModelConfig("m", "m"),
        CacheConfig(),
        SchedulerConfig(),
        ParallelConfig(),
        ObservabilityConfig(args.log_stats, args.stats_log_interval),
    )


def test_default_stat_loggers_follow_log_stats() -> None:
    quiet = make_default_stat_loggers(_config())
    assert [type(x) for x in quiet] == [PrometheusStatLogger]  # prometheus-client is installed in dev
    chatty = make_default_stat_loggers(_config(log_stats=True, stats_log_interval=2.0))
    assert [type(x) for x in chatty] == [LoggingStatLogger, PrometheusStatLogger]
    assert isinstance(chatty[0], LoggingStatLogger)
    assert chatty[0].interval == 2.0


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [("scheduling_policy", "lifo", "scheduling_policy"), ("stats_log_interval", 0, "stats_log_interval")],
)
def test_engine_args_reject_bad_scheduler_and_stats_options(key: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineArgs(**{key: value}).validate()  # type: ignore[arg-type]


def test_events_and_new_stats_fields_survive_the_msgpack_wire_form() -> None:
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r", [5], events=[EngineCoreEvent(Q, 1.5), EngineCoreEvent(S, 2.0)])],
        scheduler_stats=SchedulerStats(1, 2, 3, 4, 0.25, 7, 40, 10),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded.outputs[0].events == [EngineCoreEvent(Q, 1.5), EngineCoreEvent(S, 2.0)]
    assert decoded.scheduler_stats == SchedulerStats(1, 2, 3, 4, 0.25, 7, 40, 10)
    # The older 4-field array form still decodes: new fields were added at the end with defaults.
    old = msgspec.msgpack.decode(msgspec.msgpack.encode([1, 2, 3, 4]), type=SchedulerStats)
    assert (old.num_total_blocks, old.num_preemptions, old.prefix_cache_hit_rate) == (4, 0, 0.0)
