"""The one loop over engine outputs: detokenize, apply stop strings, logprobs, build `RequestOutput`s.

Runs on the event loop (in whichever waiting stream holds the output-handling turn). Each in-flight engine
request has one `RequestState`, owned here; an n > 1 request also has one `ParentRequest` shared by its
children. State is removed when the request finishes or is aborted, so nothing per request outlives it.

Ids (as vLLM's output processor): states are keyed by internal engine ids (`EngineCoreRequest.request_id`,
unique), so a late output of an aborted request can never reach a new request that reuses its user id;
`_external_ids` maps each user id to the internal ids of its in-flight requests (several when callers share an
id), which is what `abort_requests` reaches; every `RequestOutput` carries the user's id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer

from asyncllm.errors import InvalidRequestError
from asyncllm.messages.engine import EngineCoreOutput, EngineCoreRequest
from asyncllm.metrics.stats import IterationStats, RequestStateStats
from asyncllm.outputs import CompletionOutput, PoolingRequestOutput
from asyncllm.processing.detokenizer import IncrementalDetokenizer
from asyncllm.processing.logprobs import LogprobsProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.processing.request_state import RequestState
from asyncllm.streams import RequestOutputCollector
from asyncllm.utils import request_callables

__all__ = ["OutputProcessor", "OutputProcessorResult", "RequestState"]


@dataclass
class OutputProcessorResult:
    """What the output handler must do after `process_outputs`.

    Fields:
        reqs_to_abort: engine requests finished here by a stop string that the engine still runs.
        num_finished: engine requests finished in this call.
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
        self._states: dict[str, RequestState] = {}  # internal engine id -> state
        self._parents: dict[str, ParentRequest] = {}  # internal parent id -> n > 1 parent
        self._external_ids: dict[str, list[str]] = {}  # user id -> internal ids of its in-flight user requests

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests with frontend state."""
        return len(self._states)

    def user_request_ids(self) -> list[str]:
        """The user's ids of every in-flight request (each once)."""
        return list(self._external_ids)

    def has_request(self, request_id: str) -> bool:
        """True while the internal id `request_id` (a user request or an engine request) is in flight."""
        return request_id in self._states or request_id in self._parents

    def external_id_of(self, request_id: str) -> str:
        """The user's id of the in-flight internal id `request_id` (`request_id` itself when unknown)."""
        state = self._states.get(request_id)
        return state.external_req_id if state is not None else request_id

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        collector: RequestOutputCollector,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        """Start tracking an engine request that is being sent to the engine.

        Args:
            parent: the n > 1 parent when `request` is its child `index`.
        Raises:
            InvalidRequestError: the internal id `request.request_id` is already in flight (a caller's bug:
                internal ids are unique).
        """
        if request.request_id in self._states:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
        params = request.sampling_params
        external_id = parent.external_req_id if parent is not None else request.external_req_id or request.request_id
        self._states[request.request_id] = RequestState(
            request_id=request.request_id,
            external_req_id=external_id,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            output_kind=params.output_kind,
            stream_interval=params.stream_interval,
            detokenizer=IncrementalDetokenizer(self._tokenizer, params),
            logprobs=LogprobsProcessor(
                self._tokenizer if params.detokenize else None, params.logprobs, params.prompt_logprobs
            ),
            collector=collector,
            parent=parent,
            index=index,
            stats=RequestStateStats(arrival_time=request.arrival_time),
            max_tokens=params.max_tokens,
        )
        user_level_id = parent.request_id if parent is not None else request.request_id
        if parent is not None:
            if parent.request_id in self._parents:
                return  # a later child: the parent is registered
            self._parents[parent.request_id] = parent
        self._external_ids.setdefault(external_id, []).append(user_level_id)

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
            iteration_stats: if given, token counts, latencies and finished engine requests (each child of an
                n > 1 request counts) are added to it.
        Returns:
            The engine requests to abort (stop-string hits) and how many finished.
        """
        result = OutputProcessorResult()
        timestamp = time.monotonic() if engine_core_timestamp is None else engine_core_timestamp
        for engine_output in outputs:
            state = self._states.get(engine_output.request_id)
            if state is None:
                continue
            state.num_cached_tokens = engine_output.num_cached_tokens or state.num_cached_tokens
            state.update_stats(engine_output, timestamp, iteration_stats)
            if state.update(engine_output):
                result.num_finished += 1
                self._drop(state)
                if not engine_output.finished:
                    result.reqs_to_abort.append(state.request_id)
                if iteration_stats is not None:
                    iteration_stats.finished_requests.append(state.finished_stats())
            self._emit(state)
        return result

    def abort_requests(self, request_ids: list[str], notify: bool = True, internal: bool = False) -> list[str]:
        """Finish requests with finish_reason "abort" and drop their state.

        Args:
            request_ids: user request ids (each reaches every in-flight request with that id; an n > 1
                request aborts every child); unknown ids are skipped.
            notify: put a final output (finished=True, "abort") into each request's collector.
            internal: `request_ids` are internal ids of user requests (one stream's own request) instead.
        Returns:
            The internal engine request ids that were in flight (to abort in the engine too).
        """
        aborted: list[str] = []
        for request_id in request_ids:
            user_level_ids = [request_id] if internal else list(self._external_ids.get(request_id, ()))
            for user_level_id in user_level_ids:
                aborted.extend(self._abort_one(user_level_id, notify))
        return aborted

    def fail_requests(self, errors: dict[str, BaseException]) -> list[str]:
        """Deliver each error to its request's stream and drop that request's state (one request failed).

        Args:
            errors: internal engine id -> the error its stream raises; unknown ids are skipped.
        Returns:
            The internal ids of the failed requests' n > 1 siblings, dropped here too: abort them in the engine.
        """
        siblings: list[str] = []
        for request_id, error in errors.items():
            state = self._states.get(request_id)
            if state is None:
                continue
            self._drop(state)
            state.collector.put_error(error)
            if state.parent is not None:
                siblings.extend(self._abort_one(state.parent.request_id, notify=False))
        return siblings

    def propagate_error(self, error: BaseException) -> None:
        """Deliver `error` to every in-flight request's stream and drop all state (engine death)."""
        for state in self._states.values():
            state.collector.put_error(error)
        self._states.clear()
        self._parents.clear()
        self._external_ids.clear()

    def _abort_one(self, user_level_id: str, notify: bool) -> list[str]:
        """Abort the user request with internal id `user_level_id` (every child of an n > 1 one)."""
        parent = self._parents.get(user_level_id)
        engine_ids = sorted(parent.unfinished) if parent is not None else [user_level_id]
        aborted = []
        for engine_id in engine_ids:
            state = self._states.get(engine_id)
            if state is None:
                continue
            aborted.append(engine_id)
            self._drop(state)
            if notify:
                state.detokenizer.release()
                state.finish_reason = "abort"
                self._emit(state)
        if parent is not None:
            self._forget_user_request(parent.external_req_id, user_level_id)
            self._parents.pop(user_level_id, None)
        return aborted

    def _drop(self, state: RequestState) -> None:
        del self._states[state.request_id]
        parent = state.parent
        if parent is None:
            self._forget_user_request(state.external_req_id, state.request_id)
            return
        parent.unfinished.discard(state.request_id)
        if parent.finished:
            self._parents.pop(parent.request_id, None)
            self._forget_user_request(parent.external_req_id, parent.request_id)

    def _forget_user_request(self, external_id: str, user_level_id: str) -> None:
        request_callables.forget(user_level_id)  # its logits processors, if it had any
        ids = self._external_ids.get(external_id)
        if ids is not None and user_level_id in ids:
            ids.remove(user_level_id)
            if not ids:
                del self._external_ids[external_id]

    def _emit(self, state: RequestState) -> None:
        """Put the output the request's kind and interval call for (if any) into its collector."""
        completion = state.make_completion()
        if completion is None:
            return
        completions: list[CompletionOutput] | None = [completion]
        finished = completion.finished
        if state.parent is not None:
            completions = state.parent.add_completion(state.request_id, completion)
            finished = state.parent.finished
        if finished and state.pooling_output is not None:  # an embedding request: its result rides beside
            state.collector.pooling_output = PoolingRequestOutput(
                state.external_req_id, state.prompt_token_ids, state.pooling_output, True, state.num_cached_tokens
            )
        if completions is not None:
            state.collector.put(state.make_request_output(completions, finished))
