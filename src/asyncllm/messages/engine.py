"""Messages between the frontend and the engine core: msgspec Structs, the same in thread and process mode.

Wire form (process mode, `engine/core_proc.py`): requests are `[type byte, msgpack payload, *array frames]`;
outputs are `[msgpack EngineCoreOutputs, *array frames]`, or the single frame `ENGINE_CORE_DEAD`. Structs use
`array_like=True, omit_defaults=True, gc=False` as vLLM v1 does; enums are IntEnums.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from asyncllm.lora.request import LoRARequest
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a sequence finished. `str()` gives the OpenAI/vLLM string."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    REPETITION = 3  # `SamplingParams.repetition_detection` (vLLM's FINISHED_REPETITION)

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message to the engine core, and the kind of every busy-loop input.

    EXECUTOR_FAILED is queued inside the engine by the executor's failure callback (a worker died); the engine
    never accepts it from the wire (`CLIENT_REQUEST_TYPES`).
    """

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    EXECUTOR_FAILED = b"\x04"


CLIENT_REQUEST_TYPES = frozenset(
    {
        EngineCoreRequestType.ADD,
        EngineCoreRequestType.ABORT,
        EngineCoreRequestType.UTILITY,
        EngineCoreRequestType.SHUTDOWN,
    }
)
"""Request types a client may send; anything else on the wire is dropped as malformed."""


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request, tokenized and validated by the frontend.

    Fields:
        request_id: the internal id, made by the frontend at submission and unique for the frontend's
            life (`processing.input_processor.make_internal_request_id`); the engine, the client and the
            output processor key the request by it. An n > 1 child's is `f"{index}_{parent's internal id}"`.
        prompt_token_ids: [num_prompt_tokens] token ids.
        sampling_params: validated parameters.
        eos_token_id: the model's EOS id (None: no EOS).
        arrival_time: `time.time()` at submission, seconds.
        priority: lower runs first (priority scheduling).
        external_req_id: the user's request id (not unique: it may be reused or shared; None = `request_id`).
            As vLLM's `EngineCoreRequest.external_req_id`.
        cache_salt: mixed into the hash of the request's first KV cache block, so requests with different
            salts never share prefix-cache blocks (vLLM's `cache_salt`); None = unsalted.
        pooling_params: set for an embedding request (`AsyncLLM.encode`): the engine runs its prefill only and
            answers with the pooled vector (`EngineCoreOutput.pooling_output`); `sampling_params` is then a
            placeholder (`max_tokens=1`) the engine never samples with.
        prompt_embeds: [num_prompt_tokens, hidden_size] float32 numpy array (a zero-copy frame on the wire)
            the first layer takes instead of the embedding rows of `prompt_token_ids`, which are then
            placeholders (zeros, giving the length); None = a token-id prompt.
        lora_request: the LoRA adapter the request runs with (checked by the frontend), or None (base model).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    # Added later: new fields go at the end (array_like wire form).
    external_req_id: str | None = None
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None
    prompt_embeds: Any = None
    lora_request: LoRARequest | None = None


class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of consecutive token positions, as plain lists (no tensors on the wire).

    Fields:
        token_ids: [num_positions][1 + k]: the scored token (sampled, or the prompt token) first, then the
            k most likely token ids in decreasing order.
        logprobs: [num_positions][1 + k] float log-probabilities of those tokens (natural log).
        ranks: [num_positions] rank of the scored token in its distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)

    def head(self, num_positions: int) -> LogprobsLists:
        """The logprobs of the first `num_positions` positions."""
        return LogprobsLists(self.token_ids[:num_positions], self.logprobs[:num_positions], self.ranks[:num_positions])

    @classmethod
    def concat(cls, parts: list[LogprobsLists]) -> LogprobsLists:
        """One `LogprobsLists` of `parts` in order."""
        return cls(
            [ids for p in parts for ids in p.token_ids],
            [lps for p in parts for lps in p.logprobs],
            [r for p in parts for r in p.ranks],
        )


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the engine core."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One timestamped event of a request in the engine core.

    Fields:
        type: QUEUED (added to the waiting queue), SCHEDULED (admitted to the running set: first time or on
            resuming after a preemption), PREEMPTED (its blocks were freed; it waits to be recomputed).
        timestamp: `time.monotonic()` in the engine core, seconds. Only differences between engine
            timestamps mean anything (the frontend may run in another process with another clock origin).
    """

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> EngineCoreEvent:
        """An event stamped now (engine `time.monotonic()`) unless `timestamp` is given."""
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


class SpecDecodeMetrics(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Speculative decoding counters (of one request, or of the engine since start).

    Fields:
        num_drafts: verification steps that had at least one draft token.
        num_draft_tokens: draft tokens proposed and verified.
        num_accepted_tokens: draft tokens the target model accepted.
        num_accepted_tokens_per_pos: [num_speculative_tokens] accepted drafts by position in the draft (0 = first).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodeMetrics:
        return cls(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def copy(self) -> SpecDecodeMetrics:
        return SpecDecodeMetrics(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos)
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens, in [0, 1]; 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification step: `num_accepted` leading drafts of `num_draft_tokens` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine step.

    Fields:
        request_id: the request.
        new_token_ids: tokens sampled this step (usually one; empty for a partial prefill chunk).
        finish_reason: set on the request's last output from the engine.
        stop_reason: the stop token id that ended it, "repetition_detected" for a repetition (None for EOS or
            length).
        num_cached_tokens: prompt tokens served from the prefix cache.
        new_logprobs: logprobs of `new_token_ids` (when the request asked for `logprobs`).
        new_prompt_logprobs: logprobs of prompt tokens 1.. (when it asked for `prompt_logprobs`; sent once,
            with the first sampled token).
        events: the request's engine events since its previous output, oldest first (None: none).
        spec_decode_metrics: the request's speculative decoding counters, on its finished output when the
            engine runs speculative decoding (None otherwise).
        pooling_output: an embedding request's pooled vector ([hidden_size] or [dimensions] floats), on its
            one (finished) output.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    events: list[EngineCoreEvent] | None = None
    spec_decode_metrics: SpecDecodeMetrics | None = None
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Scheduler state after a step.

    Fields:
        num_running_reqs: requests in the running set.
        num_waiting_reqs: requests waiting to be scheduled (incl. those waiting for their grammar).
        num_free_blocks: KV cache blocks not held by any request.
        num_total_blocks: KV cache blocks in all.
        prefix_cache_hit_rate: tokens found in the prefix cache / tokens looked up, since start (each admission
            looks up its tokens: the prompt, plus the outputs of a request resuming after preemption).
        num_preemptions: preemptions since start.
        num_prefix_cache_queries: tokens looked up in the prefix cache since start.
        num_prefix_cache_hits: of those, tokens found cached, since start.
        block_size: tokens per KV cache block.
        kv_cache_bytes: bytes of the KV cache tensors over all workers (reserved at start; resident memory
            grows as blocks are first written, see `worker/kv_cache_sizing.py`).
        engine_index: data-parallel rank of the engine core that published them (0 without DP, and in a sum
            over engines).
        spec_decode: speculative decoding counters since start (None when speculative decoding is off).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Added later: new fields go at the end (array_like wire form).
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    block_size: int = 0
    kv_cache_bytes: int = 0
    engine_index: int = 0
    spec_decode: SpecDecodeMetrics | None = None

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV cache blocks in use, in [0, 1]."""
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Answer to a utility call (e.g. `get_scheduler_stats`). `error` is set when the call raised."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step (or one utility call) sends to the frontend.

    Fields:
        outputs: per-request outputs of the step.
        scheduler_stats: stats after the step.
        timestamp: `time.monotonic()` in the engine when the outputs were made, seconds.
        utility_result: set when this message answers a utility call.
        finished_requests: ids the engine finished or aborted this step (for bookkeeping).
        failed_requests: request id -> error text, for requests that failed inside a live engine (their
            streams raise `EngineGenerateError`; the engine holds no state for them).
        engine_index: data-parallel rank of the engine core that sent them (0 without DP).
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    utility_result: UtilityResult | None = None
    finished_requests: list[str] | None = None
    failed_requests: dict[str, str] | None = None
    engine_index: int = 0


class EngineReadyInfo(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine core reports once it is ready.

    Fields:
        num_kv_blocks: KV cache blocks allocated.
        max_model_len: tokens per sequence at most.
        vocab_size: logits width (valid token ids are [0, vocab_size)).
        hidden_size: the model's hidden size (width of `prompt_embeds` rows and of embeddings); 0 = unknown.
    """

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    hidden_size: int = 0


ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
"""First frame of the message an engine core sends when it dies of an exception (it stops right after); the
second frame is the reason, UTF-8 ("ExceptionType: message")."""

ENGINE_HEARTBEAT = b"ENGINE_HEARTBEAT"
"""The one frame an engine core sends on the client's heartbeat socket while alive (see `engine_timeout`)."""


class UtilityCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Payload of a UTILITY request: call `EngineCore.<method>(*args)` and answer with `UtilityResult(call_id)`.

    Only `EngineCore` methods named in `UTILITY_METHODS` are called; the client refuses any other name before
    sending, and the engine answers one that arrives anyway with an error.
    """

    call_id: int
    method: str
    args: list[Any] = msgspec.field(default_factory=list)


UTILITY_METHODS: dict[str, Any] = {
    "get_scheduler_stats": SchedulerStats,
    "reset_prefix_cache": bool,
    "collective_rpc": list[Any],
    "echo": list[Any],
    "count_request_states": dict[str, int],
    "set_scheduler_paused": bool,
}
"""The `EngineCore` methods a client may call, with the type their result is decoded to on the client."""


class EngineHandshake(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine process's first message: ready (with `ready_info`) or failed to start (with `error`).

    Fields:
        ready_info: KV block count, max model length, vocabulary size; None when start-up failed.
        error: "ExceptionType: message" of the start-up failure.
        error_type: the exception's class name (re-raised as that `asyncllm.errors` class when it is one).
        pid: the engine process id.
        data_parallel_rank: the engine core's data-parallel rank (`ParallelConfig.data_parallel_rank`).
    """

    ready_info: EngineReadyInfo | None = None
    error: str | None = None
    error_type: str | None = None
    pid: int = 0
    data_parallel_rank: int = 0


class EngineLaunch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a launched engine core reads first (process mode: on stdin of `python -m asyncllm.engine.core_proc`).

    Fields:
        config: the `EngineConfig` as msgpack (decoded by the engine with its type).
        input_address, output_address: the client's ROUTER and PULL addresses.
        ipc_dir: the client's private socket directory (removed by the engine if the client's process dies).
        parent_pid: the client's process id (the engine process exits when it is gone).
        parent_is_main_thread: the client started the engine from its main thread (PR_SET_PDEATHSIG is safe).
        core_factory: "pkg.module:callable" building the core from the config (tests); None = `EngineCore`.
    """

    config: msgspec.Raw
    input_address: str
    output_address: str
    ipc_dir: str
    parent_pid: int = 0
    parent_is_main_thread: bool = False
    core_factory: str | None = None
