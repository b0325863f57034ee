"""The second half of a scheduler step, as `Scheduler`'s base class: apply the sampled tokens and pooled vectors
(stop rules per appended token, verified drafts), finish, fail and free requests, and build the
`EngineCoreOutputs` for the frontend (with the scheduler's stats). Choosing the step's tokens is `Scheduler`'s
(`sched/scheduler.py`).
"""

from __future__ import annotations

import logging

from asyncllm.config import SchedulerConfig
from asyncllm.messages.engine import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput
from asyncllm.sched.drafts import apply_verification
from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.request_queue import RequestQueue
from asyncllm.sched.step_output import pooling_output, sampled_output
from asyncllm.spec_decode.drafter import Drafter
from asyncllm.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger("asyncllm.sched.scheduler")  # one logger for the whole scheduler, named as before


class SchedulerUpdate:
    """Applies a step's results and ends requests; `Scheduler` adds the choice of each step's tokens.

    The state below is set by `Scheduler.__init__`; both halves share it.
    """

    config: SchedulerConfig
    max_model_len: int
    block_size: int
    kv_cache_bytes: int
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: RequestQueue
    running: list[Request]
    num_preemptions: int
    structured_output_manager: StructuredOutputManager | None
    drafter: Drafter | None
    _finished_req_ids: list[str]
    _finished_req_ids_to_report: list[str]
    _failed_requests: dict[str, str]

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort): free their blocks; no output is emitted for them.

        Unknown or already finished ids are ignored.
        """
        reqs = [self.requests[i] for i in request_ids if i in self.requests]
        doomed = {id(req) for req in reqs}
        self.running = [req for req in self.running if id(req) not in doomed]
        self.waiting.remove_requests(reqs)
        if self.structured_output_manager is not None:
            self.structured_output_manager.discard([req.request_id for req in reqs])
        for req in reqs:
            req.status = status
            self._free_request(req)

    @property
    def num_waiting_for_grammar(self) -> int:
        manager = self.structured_output_manager
        return len(manager.pending) if manager is not None else 0

    def has_finished_requests(self) -> bool:
        """True while finished or aborted requests are waiting to be reported to the workers."""
        return bool(self._finished_req_ids)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + self.num_waiting_for_grammar,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_total_blocks,
            prefix_cache_hit_rate=self.kv_cache_manager.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions,
            num_prefix_cache_queries=self.kv_cache_manager.num_prefix_cache_queries,
            num_prefix_cache_hits=self.kv_cache_manager.num_prefix_cache_hits,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            spec_decode=self.drafter.stats.copy() if self.drafter is not None else None,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, apply the stop rules, and free finished requests.

        Returns:
            One `EngineCoreOutput` per request that sampled a token (with its finish reason if it finished);
            `finished_requests` lists the ids finished this step or aborted since the last step.
        """
        outputs: list[EngineCoreOutput] = []
        for req_id, token_ids in model_runner_output.sampled_token_ids.items():
            req = self.requests.get(req_id)
            if req is None or not token_ids or req_id not in scheduler_output.num_scheduled_tokens:
                continue  # aborted while the step ran
            try:
                output = self._update_request(req, token_ids, scheduler_output, model_runner_output)
            except Exception as e:  # this request alone fails
                self._fail_request(req, e)
                continue
            if output is not None:
                outputs.append(output)
        outputs.extend(self._finish_pooling(scheduler_output, model_runner_output))
        self.running = [req for req in self.running if not req.is_finished]
        return EngineCoreOutputs(
            outputs=outputs,
            scheduler_stats=self.get_stats(),
            finished_requests=self._take_finished_to_report(),
            failed_requests=self._take_failed(),
        )

    def _update_request(
        self,
        req: Request,
        token_ids: list[int],
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> EngineCoreOutput | None:
        """Apply one request's verified drafts, sampled tokens and stop rules (checked per appended token, so a
        stop inside an accepted run ends the request there); its output (None when it failed)."""
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req.request_id)
        if drafts:
            apply_verification(self.drafter, req, len(drafts), len(token_ids) - 1)
        token_ids, error = req.append_until_stop(token_ids, self.max_model_len)
        if error is not None:
            self._fail_request(req, error)
            return None
        if req.is_finished:
            self._free_request(req)
        return sampled_output(req, token_ids, model_runner_output)

    def _finish_pooling(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Finish the embedding requests whose prefill ended this step (STOP), freeing their blocks; one output
        each, carrying the pooled vector."""
        outputs = []
        for req_id, vector in model_runner_output.pooler_output.items():
            req = self.requests.get(req_id)
            if req is None or req_id not in scheduler_output.num_scheduled_tokens:
                continue  # aborted while the step ran
            req.status = RequestStatus.FINISHED_STOPPED
            self._free_request(req)
            outputs.append(pooling_output(req, vector))
        return outputs

    def make_empty_outputs(self) -> EngineCoreOutputs:
        """The outputs of a step that ran nothing (still reports aborted and failed ids, and stats)."""
        return EngineCoreOutputs(
            scheduler_stats=self.get_stats(),
            finished_requests=self._take_finished_to_report(),
            failed_requests=self._take_failed(),
        )

    def _take_failed(self) -> dict[str, str] | None:
        failed, self._failed_requests = self._failed_requests, {}
        return failed or None

    def _fail_request(self, req: Request, error: str | Exception) -> None:
        """End a request the engine cannot continue, wherever it is (waiting, running, or just finished): it
        fails alone (`failed_requests`, no output; its stream raises `EngineGenerateError`), its blocks are
        freed, and the engine keeps serving the others."""
        if isinstance(error, Exception):
            logger.exception("request %r (%s) failed in the scheduler", req.external_req_id, req.request_id)
            error = f"{type(error).__name__}: {error}"
        self._failed_requests[req.request_id] = error
        if req.request_id in self.requests:
            req.status = RequestStatus.FINISHED_ABORTED
            self.running = [r for r in self.running if r is not req]
            self.waiting.remove_requests([req])
            if self.structured_output_manager is not None:
                self.structured_output_manager.discard([req.request_id])
            self._free_request(req)
        if req.request_id in self._finished_req_ids_to_report:
            self._finished_req_ids_to_report.remove(req.request_id)  # reported as failed, not as finished

    def _take_finished_to_report(self) -> list[str] | None:
        ids, self._finished_req_ids_to_report = self._finished_req_ids_to_report, []
        return ids or None

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._finished_req_ids.append(req.request_id)
        self._finished_req_ids_to_report.append(req.request_id)
