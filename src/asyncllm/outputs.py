"""What a stream yields: `RequestOutput` with one `CompletionOutput` per sequence (shape follows vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReasonStr = Literal["stop", "length", "abort"]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Fields:
        index: position of this completion among the request's completions (0 when n == 1).
        text: generated text (all of it, or the new part for DELTA streams).
        token_ids: generated token ids (all, or the new ones for DELTA streams).
        finish_reason: "stop" (EOS, stop string or stop token), "length" (max_tokens or max_model_len),
            "abort" (cancelled), or None while the sequence is still running.
        stop_reason: the stop string or stop token id that ended the sequence; None for EOS or otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One item of a `GenerateOutputStream`.

    Fields:
        request_id: the id given to (or made by) `generate()`.
        prompt: the prompt text (rendered chat template for chat prompts; None for token-id prompts).
        prompt_token_ids: the prompt as token ids.
        outputs: the completions.
        finished: True on the last output of the request, and only there.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: the request's timing so far (see `RequestMetrics` for clocks); None if not tracked.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class RequestMetrics:
    """Timing of one request, in seconds; each field is None until known.

    Clocks: `arrival_time` is the frontend's `time.time()` (wall clock); `first_scheduled_time`,
    `first_token_time` and `last_token_time` are the engine core's `time.monotonic()` (compare them only
    with each other). Intervals: `time_to_first_token` is frontend wall-clock time from arrival to the first
    token's processing; `queue_time` (first scheduled minus queued) and `mean_inter_token_latency` ((last -
    first token time) / (tokens - 1)) are engine-clock intervals.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    time_to_first_token: float | None = None
    mean_inter_token_latency: float | None = None
    queue_time: float | None = None
