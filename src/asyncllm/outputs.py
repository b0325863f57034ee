"""What a stream yields: `RequestOutput` with one `CompletionOutput` per sequence (shape follows vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncllm.messages.engine import SpecDecodeMetrics

FinishReasonStr = Literal["stop", "length", "abort", "repetition"]


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Fields:
        logprob: natural-log probability under the model's raw distribution (before temperature, penalties
            and masks).
        rank: 1 + the number of tokens with a higher logprob at that position (1 = most likely).
        decoded_token: the token decoded on its own (a lone byte-fallback token decodes to U+FFFD).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token: top-k plus the sampled token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made (`AsyncLLM.chat` with `tools`), in OpenAI's terms.

    Fields:
        id: unique id ("call_..."), to quote as `tool_call_id` in the tool's result message.
        name: the function's name.
        arguments: the arguments as JSON text (an object).
        type: always "function".
    """

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_message_dict(self) -> dict[str, object]:
        """The OpenAI `tool_calls` entry of an assistant message."""
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Fields:
        index: position of this completion among the request's completions (0..n-1).
        text: generated text (all of it, or the new part for DELTA streams).
        token_ids: generated token ids (all, or the new ones for DELTA streams).
        finish_reason: "stop" (EOS, stop string or stop token), "length" (max_tokens or max_model_len),
            "abort" (cancelled), "repetition" (`SamplingParams.repetition_detection` found a repeated tail), or
            None while the sequence is still running.
        stop_reason: the stop string or stop token id that ended the sequence, "repetition_detected" for
            "repetition"; None for EOS or otherwise.
        logprobs: with `SamplingParams.logprobs=k`, one dict per entry of `token_ids` (the same slice),
            `{token_id: Logprob}` with the k most likely tokens plus the sampled one; else None.
        cumulative_logprob: sum of the sampled tokens' logprobs over all tokens generated so far (also in
            DELTA outputs), with `logprobs` set; else None.
        tool_calls: the parsed tool calls (`AsyncLLM.chat` with `tools`); `text` is then the content without
            the tool-call markup ("" for forced calls). None when no tools were given or none was called.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request.

    Fields:
        num_prompt_tokens: prompt tokens.
        num_generated_tokens: tokens generated over all completions.
        num_cached_tokens: prompt tokens served from the prefix cache.
    """

    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """One item of a `GenerateOutputStream`.

    Fields:
        request_id: the id given to (or made by) `generate()`.
        prompt: the prompt text (rendered chat template for chat prompts; None for token-id prompts).
        prompt_token_ids: the prompt as token ids.
        outputs: the completions this output carries. With n > 1, CUMULATIVE and DELTA outputs carry the
            completions that changed (tagged by `index`); the FINAL_ONLY output and `collect()` carry all n.
        finished: True on the last output of the request, and only there.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: with `SamplingParams.prompt_logprobs=k`, one entry per prompt token (None first);
            in DELTA streams only in the first output that has them.
        usage: token counts; set on the finished output (streamed or from `GenerateOutputStream.collect()`).
        metrics: the request's timing so far (see `RequestMetrics` for clocks); None if not tracked.
        spec_decode_metrics: on the finished output, when the engine runs speculative decoding: the request's
            draft steps, draft tokens, accepted tokens and accepted tokens per draft position
            (`SpecDecodeMetrics`; with n > 1, those of the completion that finished last); else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    usage: Usage | None = None
    metrics: RequestMetrics | None = None
    spec_decode_metrics: SpecDecodeMetrics | None = None


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


@dataclass
class PoolingRequestOutput:
    """The result of one `AsyncLLM.encode()` prompt (vLLM's `PoolingRequestOutput`, with the vector as a list).

    Fields:
        request_id: the id given to (or made by) `encode()`.
        prompt_token_ids: the prompt as token ids.
        embedding: [hidden_size] floats, or [dimensions] with `PoolingParams.dimensions`; norm 1 when
            `PoolingParams.normalize` (the default).
        finished: always True (an embedding is produced whole).
        num_cached_tokens: prompt tokens served from the prefix cache (always 0: pooling skips it).
    """

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    finished: bool = True
    num_cached_tokens: int = 0
