"""`RequestState`: the frontend state of one in-flight engine request and what it computes from itself alone:
feeding it an engine output (`update`), the `CompletionOutput` / `RequestOutput` it calls for (`make_completion`,
`make_request_output`), and its stats (`update_stats`, `finished_stats`).

`OutputProcessor` (`output_processor.py`) owns the states and the id maps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from asyncllm.messages.engine import EngineCoreOutput, FinishReason, SpecDecodeMetrics
from asyncllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from asyncllm.outputs import CompletionOutput, FinishReasonStr, RequestOutput
from asyncllm.processing.detokenizer import IncrementalDetokenizer
from asyncllm.processing.logprobs import LogprobsProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.sampling_params import RequestOutputKind
from asyncllm.streams import RequestOutputCollector


@dataclass
class RequestState:
    """Frontend state of one in-flight engine request (a whole request, or one child of an n > 1 request).

    Fields:
        request_id: the internal engine request id.
        external_req_id: the user's request id.
        prompt: prompt text (None for token-id prompts).
        prompt_token_ids: [num_prompt_tokens].
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY.
        stream_interval: emit every this many tokens (and at the end).
        detokenizer: owns the generated token ids and text.
        logprobs: owns the sample and prompt logprobs.
        collector: where outputs for the consumer go.
        parent: the n > 1 parent, or None.
        index: the completion index (0 without a parent).
        num_sent_chars: chars of text already put into the collector.
        num_sent_tokens: token ids already put into the collector.
        prompt_logprobs_sent: prompt logprobs were put into the collector (DELTA sends them once).
        num_cached_tokens: prompt tokens served from the prefix cache.
        finish_reason, stop_reason: set when the request finished.
        stats: timing and token counts, for `RequestOutput.metrics` and the stat loggers.
        spec_decode_metrics: the engine's speculative decoding counters of the request, once it finished.
        pooling_output: an embedding request's vector, once the engine sent it.
        max_tokens: the request's resolved `max_tokens` (for the stat loggers).
    """

    request_id: str
    external_req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    stream_interval: int
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    collector: RequestOutputCollector
    parent: ParentRequest | None = None
    index: int = 0
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None
    stats: RequestStateStats | None = None
    spec_decode_metrics: SpecDecodeMetrics | None = None
    pooling_output: list[float] | None = None
    max_tokens: int | None = None

    @property
    def user_level_id(self) -> str:
        """The internal id of the user's request: the parent's for a child, else its own."""
        return self.parent.request_id if self.parent is not None else self.request_id

    def update(self, engine_output: EngineCoreOutput) -> bool:
        """Feed new tokens; returns True when the request finished (engine finish or stop string)."""
        detok = self.detokenizer
        stop_terminated = engine_output.finish_reason == FinishReason.STOP  # EOS or a stop token id
        stop_str = detok.update(engine_output.new_token_ids, engine_output.finished, stop_terminated)
        self.logprobs.update(engine_output.new_logprobs, engine_output.new_prompt_logprobs)
        if engine_output.pooling_output is not None:
            self.pooling_output = engine_output.pooling_output
        if stop_str is not None:
            self.logprobs.truncate(len(detok.token_ids))
            self.finish_reason, self.stop_reason = "stop", stop_str
            return True
        if engine_output.finish_reason is not None:
            self.finish_reason = finish_reason_str(engine_output.finish_reason)
            self.stop_reason = engine_output.stop_reason
            self.spec_decode_metrics = engine_output.spec_decode_metrics
            return True
        return False

    def make_completion(self) -> CompletionOutput | None:
        """The next `CompletionOutput` of a sequence, or None when its kind and interval have nothing to send."""
        finished = self.finish_reason is not None
        detok = self.detokenizer
        num_chars, num_tokens = detok.num_output_chars, len(detok.token_ids)
        if not finished:
            if (
                self.output_kind == RequestOutputKind.FINAL_ONLY
                or num_tokens - self.num_sent_tokens < self.stream_interval
            ):
                return None
            if num_chars == self.num_sent_chars and num_tokens == self.num_sent_tokens:
                return None
        start_char, start_token = (
            (self.num_sent_chars, self.num_sent_tokens) if self.output_kind == RequestOutputKind.DELTA else (0, 0)
        )
        logprobs = self.logprobs.logprobs
        completion = CompletionOutput(
            index=self.index,
            text=detok.output_text_since(start_char),
            token_ids=detok.token_ids[start_token:num_tokens],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs[start_token:num_tokens] if logprobs is not None else None,
            cumulative_logprob=self.logprobs.cumulative_logprob(num_tokens),
        )
        self.num_sent_chars, self.num_sent_tokens = num_chars, num_tokens
        return completion

    def make_request_output(self, completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        """The `RequestOutput` carrying `completions` (one, or an n > 1 parent's); DELTA sends prompt logprobs once."""
        prompt_logprobs = self.logprobs.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA and self.prompt_logprobs_sent:
            prompt_logprobs = None
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(
            request_id=self.external_req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=self.stats.to_metrics() if self.stats is not None else None,
            spec_decode_metrics=self.spec_decode_metrics if finished else None,
        )

    def update_stats(
        self, engine_output: EngineCoreOutput, timestamp: float, iteration_stats: IterationStats | None
    ) -> None:
        """Apply an output's engine events and new tokens to the request's stats (and the step's)."""
        stats = self.stats
        if stats is None:
            return
        if engine_output.events:
            stats.update_from_events(engine_output.events)
        num_new_tokens = len(engine_output.new_token_ids)
        ttft, itl = stats.update_from_tokens(num_new_tokens, timestamp)
        if iteration_stats is None:
            return
        iteration_stats.num_generation_tokens += num_new_tokens
        if ttft is not None:
            iteration_stats.num_prompt_tokens += len(self.prompt_token_ids)
            iteration_stats.time_to_first_tokens.append(ttft)
        if itl is not None:
            iteration_stats.inter_token_latencies.append(itl)

    def finished_stats(self) -> FinishedRequestStats:
        """The stat loggers' record of this request once it ended (finish reason "abort" when none was set)."""
        stats = self.stats or RequestStateStats(arrival_time=time.time())
        prefill, decode, inference = stats.phase_times()
        return FinishedRequestStats(
            finish_reason=self.finish_reason or "abort",
            e2e_latency=max(time.time() - stats.arrival_time, 0.0),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=stats.num_generation_tokens,
            queue_time=stats.queue_time,
            mean_inter_token_latency=stats.mean_inter_token_latency,
            prefill_time=prefill,
            decode_time=decode,
            inference_time=inference,
            n=len(self.parent.child_requests) if self.parent is not None else 1,
            max_tokens=self.max_tokens,
        )


def finish_reason_str(reason: FinishReason) -> FinishReasonStr:
    """The engine's `FinishReason` as the `CompletionOutput.finish_reason` string."""
    names: dict[FinishReason, FinishReasonStr] = {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.ABORT: "abort",
        FinishReason.REPETITION: "repetition",
    }
    return names[reason]
