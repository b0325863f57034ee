"""The one loop over engine outputs: detokenize, apply stop strings, build `RequestOutput`s per output kind.

Runs on the event loop (in the output handler task). Each in-flight request has one `RequestState`, owned
here; it is removed when the request finishes or is aborted, so nothing per request outlives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer

from asyncllm.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from asyncllm.errors import InvalidRequestError
from asyncllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from asyncllm.outputs import CompletionOutput, FinishReasonStr, RequestOutput
from asyncllm.processing.detokenizer import IncrementalDetokenizer
from asyncllm.sampling_params import RequestOutputKind
from asyncllm.streams import RequestOutputCollector


@dataclass
class RequestState:
    """Frontend state of one in-flight request.

    Fields:
        request_id: the request.
        prompt: prompt text (None for token-id prompts).
        prompt_token_ids: [num_prompt_tokens].
        output_kind: CUMULATIVE, DELTA or FINAL_ONLY.
        detokenizer: owns the generated token ids and text.
        collector: where outputs for the consumer go.
        num_sent_chars: chars of text already put into the collector.
        num_sent_tokens: token ids already put into the collector.
        num_cached_tokens: prompt tokens served from the prefix cache.
        finish_reason, stop_reason: set when the request finished.
        stats: timing and token counts, for `RequestOutput.metrics` and the stat loggers.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    detokenizer: IncrementalDetokenizer
    collector: RequestOutputCollector
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None
    stats: RequestStateStats | None = None


@dataclass
class OutputProcessorResult:
    """What the output handler must do after `process_outputs`.

    Fields:
        reqs_to_abort: requests finished here by a stop string that the engine still runs.
        num_finished: requests finished in this call.
    """

    reqs_to_abort: list[str] = field(default_factory=list)
    num_finished: int = 0


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s in each request's collector.

    Args:
        tokenizer: the model's `tokenizers.Tokenizer`, for detokenization.
    """

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    @property
    def num_unfinished_requests(self) -> int:
        """Requests with frontend state."""
        return len(self._states)

    def has_request(self, request_id: str) -> bool:
        """True while `request_id` is in flight."""
        return request_id in self._states

    def add_request(self, request: EngineCoreRequest, prompt: str | None, collector: RequestOutputCollector) -> None:
        """Start tracking a request that is being sent to the engine.

        Raises:
            InvalidRequestError: `request.request_id` is already in flight.
        """
        if request.request_id in self._states:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
        params = request.sampling_params
        self._states[request.request_id] = RequestState(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            detokenizer=IncrementalDetokenizer(self._tokenizer, params),
            collector=collector,
            stats=RequestStateStats(arrival_time=request.arrival_time),
        )

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorResult:
        """Apply one batch of engine outputs. Outputs for unknown (aborted) requests are ignored.

        Args:
            outputs: one engine step's outputs (or a chunk of them).
            engine_core_timestamp: `EngineCoreOutputs.timestamp` (engine `time.monotonic()`, seconds); None
                uses this process's `time.monotonic()`.
            iteration_stats: if given, token counts, latencies and finished requests are added to it.
        Returns:
            The requests to abort in the engine (stop-string hits) and how many finished.
        """
        result = OutputProcessorResult()
        timestamp = time.monotonic() if engine_core_timestamp is None else engine_core_timestamp
        for engine_output in outputs:
            state = self._states.get(engine_output.request_id)
            if state is None:
                continue
            state.num_cached_tokens = engine_output.num_cached_tokens or state.num_cached_tokens
            _update_stats(state, engine_output, timestamp, iteration_stats)
            if self._update_state(state, engine_output):
                result.num_finished += 1
                del self._states[state.request_id]
                if not engine_output.finished:
                    result.reqs_to_abort.append(state.request_id)
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(_finished_stats(state))
            self._emit(state)
        return result

    def abort_requests(self, request_ids: list[str], notify: bool = True) -> list[str]:
        """Finish requests with finish_reason "abort" and drop their state.

        Args:
            request_ids: requests to abort; unknown ids are skipped.
            notify: put a final output (finished=True, "abort") into each request's collector.
        Returns:
            The ids that were in flight (to abort in the engine too).
        """
        aborted = []
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is None:
                continue
            aborted.append(request_id)
            if notify:
                state.detokenizer.release()
                state.finish_reason = "abort"
                self._emit(state)
        return aborted

    def propagate_error(self, error: BaseException) -> None:
        """Deliver `error` to every in-flight request's stream and drop all state (engine death)."""
        for state in self._states.values():
            state.collector.put_error(error)
        self._states.clear()

    def _update_state(self, state: RequestState, engine_output: EngineCoreOutput) -> bool:
        """Feed new tokens; returns True when the request finished (engine finish or stop string)."""
        detok = state.detokenizer
        stop_str = detok.update(engine_output.new_token_ids, engine_output.finished)
        if stop_str is not None:
            state.finish_reason, state.stop_reason = "stop", stop_str
            return True
        if engine_output.finish_reason is not None:
            state.finish_reason = _finish_reason_str(engine_output.finish_reason)
            state.stop_reason = engine_output.stop_reason
            return True
        return False

    def _emit(self, state: RequestState) -> None:
        """Put the output the request's kind calls for (if any) into its collector."""
        output = _make_output(state)
        if output is not None:
            state.collector.put(output)


def _make_output(state: RequestState) -> RequestOutput | None:
    """Build the next `RequestOutput` of a request, or None when its kind has nothing to send."""
    finished = state.finish_reason is not None
    detok = state.detokenizer
    num_chars, num_tokens = detok.num_output_chars, len(detok.token_ids)
    if not finished:
        nothing_new = num_chars == state.num_sent_chars and num_tokens == state.num_sent_tokens
        if nothing_new or state.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
    if state.output_kind == RequestOutputKind.DELTA:
        text, token_ids = detok.output_text_since(state.num_sent_chars), detok.token_ids[state.num_sent_tokens :]
    else:
        text, token_ids = detok.output_text, list(detok.token_ids)
    state.num_sent_chars, state.num_sent_tokens = num_chars, num_tokens
    completion = CompletionOutput(0, text, token_ids, state.finish_reason, state.stop_reason)
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        num_cached_tokens=state.num_cached_tokens,
        metrics=state.stats.to_metrics() if state.stats is not None else None,
    )


def _update_stats(
    state: RequestState, engine_output: EngineCoreOutput, timestamp: float, iteration_stats: IterationStats | None
) -> None:
    """Apply an output's engine events and new tokens to the request's stats (and the step's)."""
    stats = state.stats
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
        iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
        iteration_stats.time_to_first_tokens.append(ttft)
    if itl is not None:
        iteration_stats.inter_token_latencies.append(itl)


def _finished_stats(state: RequestState) -> FinishedRequestStats:
    stats = state.stats or RequestStateStats(arrival_time=time.time())
    return FinishedRequestStats(
        finish_reason=state.finish_reason or "abort",
        e2e_latency=max(time.time() - stats.arrival_time, 0.0),
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=stats.num_generation_tokens,
        queue_time=stats.queue_time,
        mean_inter_token_latency=stats.mean_inter_token_latency,
    )


def _finish_reason_str(reason: FinishReason) -> FinishReasonStr:
    names: dict[FinishReason, FinishReasonStr] = {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.ABORT: "abort",
    }
    return names[reason]
