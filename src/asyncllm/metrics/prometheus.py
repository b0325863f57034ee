"""`PrometheusStatLogger`: engine and request metrics as Prometheus metrics, named like vLLM's under
`asyncllm:` (needs `prometheus-client`: `pip install asyncllm[metrics]`).

Each logger registers into its own `CollectorRegistry` unless one is passed, so two engines in one process
never collide; serve it with `prometheus_client.generate_latest(logger.registry)` or `make_asgi_app`.
Names after vLLM v1's `vllm/v1/metrics/loggers.py` (`vllm:` -> `asyncllm:`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncllm.messages.engine import SchedulerStats, SpecDecodeMetrics
from asyncllm.metrics.loggers import StatLoggerBase
from asyncllm.metrics.stats import IterationStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
ITERATION_TOKEN_BUCKETS: list[float] = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's
TOKEN_BUCKETS = [m * 10**e for e in range(6) for m in (1, 2, 5)]  # 1, 2, 5, 10, ... 500000: vLLM's 1-2-5 steps
N_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 128]


def is_prometheus_available() -> bool:
    """True when `prometheus_client` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class PrometheusStatLogger(StatLoggerBase):
    """Updates gauges, counters and histograms from every step's stats.

    Metrics (label `model_name`): gauges `asyncllm:num_requests_running`, `asyncllm:num_requests_waiting`,
    `asyncllm:kv_cache_usage_perc` (0..1), counters `asyncllm:num_preemptions_total`,
    `asyncllm:prefix_cache_queries_total` and `asyncllm:prefix_cache_hits_total` (tokens), each also labelled
    `engine` (the data-parallel rank whose scheduler published them, "0" without DP); counters
    `asyncllm:prompt_tokens_total`, `asyncllm:generation_tokens_total`, `asyncllm:request_success_total` (label
    `finished_reason`); histograms (seconds) `asyncllm:time_to_first_token_seconds`,
    `asyncllm:inter_token_latency_seconds`, `asyncllm:e2e_request_latency_seconds`,
    `asyncllm:request_queue_time_seconds`. With speculative decoding (registered at its first stats):
    counters `asyncllm:spec_decode_num_drafts_total`, `asyncllm:spec_decode_num_draft_tokens_total`,
    `asyncllm:spec_decode_num_accepted_tokens_total` and `asyncllm:spec_decode_num_accepted_tokens_per_pos_total`
    (label `position`, 0 = first draft token), as vLLM's. vLLM's families too: histograms
    `iteration_tokens_total` (prompt + generation tokens per engine step), `request_prompt_tokens`,
    `request_generation_tokens`, `request_params_n`, `request_params_max_tokens` (per finished request),
    `request_prefill_time_seconds`, `request_decode_time_seconds`, `request_inference_time_seconds` (engine clock:
    first scheduled -> first token -> last token); gauge `cache_config_info` (value 1, the cache settings as
    labels; `log_cache_config`).

    Args:
        model_name: value of the `model_name` label.
        registry: where to register; None makes a new `CollectorRegistry` (`self.registry`).
        prefix: the names' prefix: "asyncllm" (default), or "vllm" for the names vLLM's dashboards read
            (`vllm:num_requests_running`, ...; `EngineArgs(metrics_prefix="vllm")`).
    Raises:
        ImportError: prometheus-client is not installed.
    """

    def __init__(self, model_name: str = "", registry: Any = None, prefix: str = "asyncllm") -> None:
        import prometheus_client as prom

        self.prefix = prefix
        self.registry = prom.CollectorRegistry() if registry is None else registry
        labels = {"model_name": model_name}

        def make(kind: Any, name: str, doc: str, **kw: Any) -> Any:
            names = ["model_name", *kw.pop("extra_labels", [])]
            return kind(f"{prefix}:{name}", doc, names, registry=self.registry, **kw)

        per_engine = {"extra_labels": ["engine"]}
        self._running = make(prom.Gauge, "num_requests_running", "Requests running in the engine.", **per_engine)
        self._waiting = make(prom.Gauge, "num_requests_waiting", "Requests waiting.", **per_engine)
        self._kv_usage = make(prom.Gauge, "kv_cache_usage_perc", "KV cache usage (1 = full).", **per_engine)
        self._prompt_tokens = make(prom.Counter, "prompt_tokens", "Prefill tokens processed.").labels(**labels)
        self._gen_tokens = make(prom.Counter, "generation_tokens", "Generation tokens.").labels(**labels)
        self._preemptions = make(prom.Counter, "num_preemptions", "Preemptions.", **per_engine)
        self._cache_queries = make(prom.Counter, "prefix_cache_queries", "Prefix cache tokens queried.", **per_engine)
        self._cache_hits = make(prom.Counter, "prefix_cache_hits", "Prefix cache tokens hit.", **per_engine)
        self._success = make(prom.Counter, "request_success", "Finished requests.", extra_labels=["finished_reason"])
        self._labels = labels
        self._ttft = make(
            prom.Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS
        ).labels(**labels)
        self._itl = make(
            prom.Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=LATENCY_BUCKETS
        ).labels(**labels)
        self._e2e = make(
            prom.Histogram, "e2e_request_latency_seconds", "Request latency.", buckets=REQUEST_LATENCY_BUCKETS
        ).labels(**labels)
        self._queue = make(
            prom.Histogram, "request_queue_time_seconds", "Time waiting.", buckets=REQUEST_LATENCY_BUCKETS
        ).labels(**labels)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return make(prom.Histogram, name, doc, buckets=buckets).labels(**labels)

        self._iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self._request_prompt = histogram("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self._request_gen = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        self._params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self._params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS
        )
        self._prefill_time = histogram(
            "request_prefill_time_seconds", "Time spent in PREFILL phase.", list(REQUEST_LATENCY_BUCKETS)
        )
        self._decode_time = histogram(
            "request_decode_time_seconds", "Time spent in DECODE phase.", list(REQUEST_LATENCY_BUCKETS)
        )
        self._inference_time = histogram(
            "request_inference_time_seconds", "Time spent in RUNNING phase.", list(REQUEST_LATENCY_BUCKETS)
        )
        self._cache_info_family = (prom.Gauge, f"{prefix}:cache_config_info", "Information of the KV cache config.")
        self._last_totals: dict[int, SchedulerStats] = {}  # by engine rank
        self._per_engine: dict[int, tuple[Any, ...]] = {}
        self._make = make
        self._spec: dict[str, Any] | None = None
        self._last_spec: dict[int, SpecDecodeMetrics] = {}  # by engine rank

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler_stats(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration_stats(iteration_stats)

    def _record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Gauges and counter increments of the engine that published `stats`, touching only what changed (this
        runs once per engine step)."""
        running, waiting, kv_usage, preemptions, queries, hits = self._engine_metrics(stats.engine_index)
        last = self._last_totals.get(stats.engine_index)
        if last is None or stats.num_running_reqs != last.num_running_reqs:
            running.set(stats.num_running_reqs)
        if last is None or stats.num_waiting_reqs != last.num_waiting_reqs:
            waiting.set(stats.num_waiting_reqs)
        if last is None or stats.kv_cache_usage != last.kv_cache_usage:
            kv_usage.set(stats.kv_cache_usage)
        last = last or SchedulerStats()
        for counter, now, before in (
            (preemptions, stats.num_preemptions, last.num_preemptions),
            (queries, stats.num_prefix_cache_queries, last.num_prefix_cache_queries),
            (hits, stats.num_prefix_cache_hits, last.num_prefix_cache_hits),
        ):
            if now > before:
                counter.inc(now - before)
        self._last_totals[stats.engine_index] = stats
        if stats.spec_decode is not None:
            self._record_spec_decode(stats.engine_index, stats.spec_decode)

    def _record_spec_decode(self, engine_index: int, totals: SpecDecodeMetrics) -> None:
        """Add one engine's speculative decoding totals since its previous stats to the counters."""
        import prometheus_client as prom

        if self._spec is None:
            docs = {
                "num_drafts": "Speculative decoding steps with drafts.",
                "num_draft_tokens": "Draft tokens proposed.",
                "num_accepted_tokens": "Draft tokens accepted.",
            }
            self._spec = {key: self._make(prom.Counter, f"spec_decode_{key}", doc) for key, doc in docs.items()}
            self._spec["per_pos"] = self._make(
                prom.Counter,
                "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft.",
                extra_labels=["position"],
            )
        last = self._last_spec.get(engine_index, SpecDecodeMetrics())
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            delta = getattr(totals, key) - getattr(last, key)
            self._spec[key].labels(**self._labels).inc(max(delta, 0))
        last_per_pos = last.num_accepted_tokens_per_pos
        for pos, count in enumerate(totals.num_accepted_tokens_per_pos):
            delta = count - (last_per_pos[pos] if pos < len(last_per_pos) else 0)
            self._spec["per_pos"].labels(position=str(pos), **self._labels).inc(max(delta, 0))
        self._last_spec[engine_index] = totals

    def _engine_metrics(self, engine_index: int) -> tuple[Any, ...]:
        """The labelled children of the per-engine gauges and counters of one engine (made once)."""
        children = self._per_engine.get(engine_index)
        if children is None:
            labels = {"engine": str(engine_index), **self._labels}
            families = (self._running, self._waiting, self._kv_usage, self._preemptions, self._cache_queries)
            children = tuple(family.labels(**labels) for family in (*families, self._cache_hits))
            self._per_engine[engine_index] = children
        return children

    def log_cache_config(self, info: dict[str, str]) -> None:
        """Publish `cache_config_info` (vLLM's): a gauge of value 1 whose labels are the cache settings."""
        kind, name, doc = self._cache_info_family
        kind(name, doc, sorted(info), registry=self.registry).labels(**info).set(1)

    def _record_iteration_stats(self, stats: IterationStats) -> None:
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._gen_tokens.inc(stats.num_generation_tokens)
        if stats.num_prompt_tokens + stats.num_generation_tokens > 0:
            self._iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self._ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self._itl.observe(itl)
        for finished in stats.finished_requests:
            self._success.labels(finished_reason=finished.finish_reason, **self._labels).inc()
            self._e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self._queue.observe(finished.queue_time)
            self._request_prompt.observe(finished.num_prompt_tokens)
            self._request_gen.observe(finished.num_generation_tokens)
            self._params_n.observe(finished.n)
            if finished.max_tokens is not None:
                self._params_max_tokens.observe(finished.max_tokens)
            for phase, seconds in (
                (self._prefill_time, finished.prefill_time),
                (self._decode_time, finished.decode_time),
                (self._inference_time, finished.inference_time),
            ):
                if seconds is not None:
                    phase.observe(max(seconds, 0.0))
