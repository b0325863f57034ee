"""The engine-side `Request`: the one object that owns a request's state inside the engine core.

Nobody else keeps a parallel copy: the scheduler, the KV cache manager (by request id) and the stop checks all
read and write this object. Follows vLLM v1's `vllm/v1/request.py`.
"""

from __future__ import annotations

import enum
from typing import Any

from asyncllm.lora.request import LoRARequest
from asyncllm.messages.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
    SpecDecodeMetrics,
)
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.draft_policy import AcceptanceEstimate
from asyncllm.sched.repetition import RepetitionDetector


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after `PREEMPTED` is final."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # its structured-output grammar is compiling; holds no KV blocks (vLLM: WAITING_FOR_FSM)
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_REPETITION = 7  # `SamplingParams.repetition_detection` found a repeated pattern

    @property
    def is_finished(self) -> bool:
        """True for the FINISHED_* statuses."""
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The wire finish reason of a finished status; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}

REPETITION_STOP_REASON = "repetition_detected"  # `stop_reason` of a request finished by repetition (as vLLM)


class Request:
    """One request's engine state.

    Attributes:
        request_id: the internal id (unique; the key everywhere in the engine).
        external_req_id: the user's id (not unique; for logs and messages).
        cache_salt: mixed into the first block hash (prefix-cache isolation), or None.
        lora_request: its LoRA adapter (its id also roots the block hashes), or None.
        prompt_token_ids: [num_prompt_tokens] token ids.
        output_token_ids: tokens sampled so far (kept across preemption and recomputed on resume).
        sampling_params: the request's validated parameters.
        eos_token_id: the model's EOS id, or None.
        arrival_time: `time.time()` at submission, seconds.
        priority: lower runs first (the priority queue; FCFS ignores it).
        num_computed_tokens: tokens whose K/V are in the KV cache (or scheduled to be, once scheduled).
        status: a `RequestStatus`.
        stop_reason: the stop token id that finished it, "repetition_detected" for a repetition, None for EOS,
            length, abort.
        num_preemptions: times this request was preempted.
        num_cached_tokens: tokens served from the prefix cache when first scheduled (-1 before that).
        block_hashes: chained hashes of its full blocks so far (prefix caching), kept across preemption.
        events: engine events not yet sent to the frontend (taken by `take_events`).
        grammar: its `sched.grammar.GrammarState` once its grammar is compiled, else None.
        grammar_future: the compilation it waits for (status WAITING_FOR_GRAMMAR), else None.
        repetition: its `RepetitionDetector` when `repetition_detection` is enabled, else None.
        spec_decode_metrics: its speculative decoding counters (None when speculative decoding is off).
        draft_acceptance: its draft acceptance estimate for the adaptive draft policy (else None).
        pooling_params: set for an embedding request: prefill only, finished with its pooled vector.
        prompt_embeds: [num_prompt_tokens, hidden_size] float32 numpy array for an embeddings prompt (its
            `prompt_token_ids` are placeholders), else None.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        external_req_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id or request_id
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        self.block_hashes: list[bytes] = []
        self.events: list[EngineCoreEvent] = []
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.grammar: Any = None
        self.grammar_future: Any = None
        detection = sampling_params.repetition_detection
        self.repetition = RepetitionDetector(detection) if detection is not None and detection.enabled else None
        self.spec_decode_metrics: SpecDecodeMetrics | None = None
        self.draft_acceptance: AcceptanceEstimate | None = None  # the draft policy's estimate (adaptive only)
        self.pooling_params: PoolingParams | None = None
        self.prompt_embeds: Any = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        """Build the engine state of a request the frontend tokenized and validated."""
        req = cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.priority,
            request.external_req_id,
            request.cache_salt,
            request.lora_request,
        )
        req.pooling_params = request.pooling_params
        req.prompt_embeds = request.prompt_embeds
        return req

    @property
    def skips_prefix_cache(self) -> bool:
        """True when no cached prefix may serve it: its prompt logprobs or its pooled vector need the hidden
        states of every prompt position, and an embeddings prompt has no token ids to hash (as vLLM)."""
        params = self.sampling_params
        return params.prompt_logprobs is not None or self.pooling_params is not None or self.prompt_embeds is not None

    @property
    def lora_int_id(self) -> int | None:
        """Its adapter's id, or None (base model)."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose K/V are not in the cache yet (the rest of a prefill, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Stamp an event (engine `time.monotonic()` unless `timestamp` is given) for the next output."""
        self.events.append(EngineCoreEvent.new_event(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events recorded since the last call (None if there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Record tokens sampled for this request."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def append_until_stop(self, token_ids: list[int], max_model_len: int) -> tuple[list[int], str | None]:
        """Append tokens sampled in one step one at a time, applying the grammar and the stop rules after each,
        so a stop inside a run of accepted draft tokens ends the request at exactly that token.

        Returns:
            The tokens appended (a prefix of `token_ids`), and an error text when the grammar rejected one (the
            request must then fail).
        """
        for num_appended, token_id in enumerate(token_ids, 1):
            self.append_output_token_ids([token_id])
            if self.grammar is not None and not self.grammar.accept([token_id]):
                return token_ids[:num_appended], f"the grammar rejected sampled token {token_ids}"
            if self.check_stop(max_model_len):
                return token_ids[:num_appended], None
        return token_ids, None

    def check_stop(self, max_model_len: int) -> bool:
        """Apply the stop rules after new tokens were appended; set `status` and `stop_reason` if finished.

        Order: a stop token id (stop_reason = the id) or EOS (unless `ignore_eos`; stop_reason None) -> STOP,
        honoured only once at least `min_tokens` tokens precede it (vLLM's min_tokens semantics); then
        a terminated structured-output grammar -> STOP; then `max_tokens` reached -> LENGTH; then prompt +
        output reaching `max_model_len` -> LENGTH; then a repeated tail (`repetition_detection`) -> REPETITION
        (vLLM's order). Call it after each appended token: with speculative decoding a step appends several,
        and the request must end at the first one that stops it.
        Stop strings are the frontend's job.

        Returns:
            True if the request is now finished.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens > params.min_tokens:
            if last in self._stop_token_ids:
                self.stop_reason = last
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
        if self.grammar is not None and self.grammar.is_terminated:  # the grammar accepted EOS: nothing may follow
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        max_tokens = params.max_tokens
        if (max_tokens is not None and self.num_output_tokens >= max_tokens) or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return self._check_repetition()

    def _check_repetition(self) -> bool:
        """Feed the detector the output tokens it has not seen; finish with REPETITION on a repeated tail."""
        detector = self.repetition
        if detector is None:
            return False
        for token_id in self.output_token_ids[detector.num_tokens :]:
            if detector.add_token(token_id):
                self.status = RequestStatus.FINISHED_REPETITION
                self.stop_reason = REPETITION_STOP_REASON
                return True
        return False
