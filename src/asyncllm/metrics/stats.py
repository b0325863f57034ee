"""Stats records the frontend builds from engine outputs: per request and per engine step (iteration); and
several engines' `SchedulerStats` as one (`sum_scheduler_stats`: data parallelism's utility result and the
logging stat logger's line).

Clocks (the engine core may run in another process, so clocks are never mixed inside one interval):
- `arrival_time` and time to first token use the frontend's wall clock, `time.time()`.
- Engine events (QUEUED, SCHEDULED, PREEMPTED) and token times use the engine core's `time.monotonic()`
  (event timestamps and `EngineCoreOutputs.timestamp`); only their differences mean anything.
After vLLM v1's `vllm/v1/metrics/stats.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncllm.messages.engine import EngineCoreEvent, EngineCoreEventType, SchedulerStats, SpecDecodeMetrics
from asyncllm.outputs import RequestMetrics


@dataclass
class RequestStateStats:
    """What the frontend accumulates for one in-flight request.

    Fields:
        arrival_time: frontend `time.time()` at `generate()`, seconds.
        queued_ts: engine monotonic time of the QUEUED event, seconds.
        first_scheduled_ts: engine monotonic time of the first SCHEDULED event, seconds.
        first_token_ts, last_token_ts: engine monotonic time of the step outputs that carried the first and
            the latest token, seconds.
        first_token_latency: frontend `time.time()` when the first token was processed minus `arrival_time`.
        num_generation_tokens: tokens received so far.
        num_preemptions: PREEMPTED events received.
    """

    arrival_time: float
    queued_ts: float | None = None
    first_scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    first_token_latency: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    def update_from_events(self, events: list[EngineCoreEvent]) -> None:
        """Apply the engine events of one output."""
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                self.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if self.first_scheduled_ts is None:
                    self.first_scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preemptions += 1

    def update_from_tokens(self, num_new_tokens: int, engine_timestamp: float) -> tuple[float | None, float | None]:
        """Count new tokens that arrived in an engine output stamped `engine_timestamp`.

        Returns:
            (time to first token, inter-token latency), seconds: the first is set when these are the request's
            first tokens, the second for later ones; None otherwise.
        """
        if num_new_tokens == 0:
            return None, None
        ttft = itl = None
        if self.num_generation_tokens == 0:
            self.first_token_latency = ttft = max(time.time() - self.arrival_time, 0.0)
            self.first_token_ts = engine_timestamp
        elif self.last_token_ts is not None:
            itl = engine_timestamp - self.last_token_ts
        self.last_token_ts = engine_timestamp
        self.num_generation_tokens += num_new_tokens
        return ttft, itl

    @property
    def queue_time(self) -> float | None:
        """Engine seconds from QUEUED to the first SCHEDULED; None until both are known."""
        if self.queued_ts is None or self.first_scheduled_ts is None:
            return None
        return self.first_scheduled_ts - self.queued_ts

    @property
    def mean_inter_token_latency(self) -> float | None:
        """Engine seconds between the first and the latest token over the gaps; None before two tokens."""
        if self.first_token_ts is None or self.last_token_ts is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_ts - self.first_token_ts) / (self.num_generation_tokens - 1)

    def phase_times(self) -> tuple[float | None, float | None, float | None]:
        """(prefill, decode, inference) engine seconds: first scheduled -> first token -> last token; None where
        a timestamp is missing (vLLM's `request_{prefill,decode,inference}_time_seconds`)."""
        scheduled, first, last = self.first_scheduled_ts, self.first_token_ts, self.last_token_ts
        prefill = first - scheduled if scheduled is not None and first is not None else None
        decode = last - first if first is not None and last is not None else None
        inference = last - scheduled if scheduled is not None and last is not None else None
        return prefill, decode, inference

    def to_metrics(self) -> RequestMetrics:
        """A snapshot for `RequestOutput.metrics`."""
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_ts,
            first_token_time=self.first_token_ts,
            last_token_time=self.last_token_ts,
            time_to_first_token=self.first_token_latency,
            mean_inter_token_latency=self.mean_inter_token_latency,
            queue_time=self.queue_time,
        )


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request, for histograms and counters.

    Fields:
        finish_reason: "stop", "length" or "abort".
        e2e_latency: frontend `time.time()` at finish minus arrival, seconds.
        num_prompt_tokens, num_generation_tokens: tokens.
        queue_time: engine seconds waiting before first scheduled (None if unknown).
        mean_inter_token_latency: engine seconds (None with fewer than two tokens).
        prefill_time: engine seconds from first scheduled to the first token (None if unknown).
        decode_time: engine seconds from the first token to the last.
        inference_time: engine seconds from first scheduled to the last token (prefill + decode).
        n: completions of the user's request (`SamplingParams.n`).
        max_tokens: the request's `max_tokens` (resolved), None if unknown.
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None
    mean_inter_token_latency: float | None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    n: int = 1
    max_tokens: int | None = None


@dataclass
class IterationStats:
    """What one batch of engine outputs (one engine step) did, as seen by the frontend.

    Fields:
        num_prompt_tokens: prompt tokens of requests that got their first token in this batch.
        num_generation_tokens: tokens generated in this batch.
        time_to_first_tokens: seconds, one per request that got its first token (frontend wall clock).
        inter_token_latencies: seconds, one per request that got a later token (engine clock).
        finished_requests: requests that finished in this batch.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


def sum_scheduler_stats(per_engine: list[SchedulerStats]) -> SchedulerStats:
    """The engines' stats as one engine's: counts, blocks, bytes and counters summed; the prefix-cache hit rate
    recomputed from the summed counters; `block_size` of the first; `engine_index` 0. One engine's stats are
    returned as they are; none give zeros."""
    if len(per_engine) == 1:
        return per_engine[0]
    queries = sum(s.num_prefix_cache_queries for s in per_engine)
    hits = sum(s.num_prefix_cache_hits for s in per_engine)
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in per_engine),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in per_engine),
        num_free_blocks=sum(s.num_free_blocks for s in per_engine),
        num_total_blocks=sum(s.num_total_blocks for s in per_engine),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=sum(s.num_preemptions for s in per_engine),
        num_prefix_cache_queries=queries,
        num_prefix_cache_hits=hits,
        block_size=per_engine[0].block_size if per_engine else 0,
        kv_cache_bytes=sum(s.kv_cache_bytes for s in per_engine),
        spec_decode=sum_spec_decode([s.spec_decode for s in per_engine if s.spec_decode is not None]),
    )


def sum_spec_decode(per_engine: list[SpecDecodeMetrics]) -> SpecDecodeMetrics | None:
    """The engines' speculative decoding counters summed (per draft position too); None when none has them."""
    if not per_engine:
        return None
    width = max(len(m.num_accepted_tokens_per_pos) for m in per_engine)
    per_pos = [
        sum(m.num_accepted_tokens_per_pos[i] for m in per_engine if i < len(m.num_accepted_tokens_per_pos))
        for i in range(width)
    ]
    return SpecDecodeMetrics(
        num_drafts=sum(m.num_drafts for m in per_engine),
        num_draft_tokens=sum(m.num_draft_tokens for m in per_engine),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in per_engine),
        num_accepted_tokens_per_pos=per_pos,
    )
