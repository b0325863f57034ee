"""`Scheduler`: token-budget continuous batching with chunked prefill and preemption by recompute.

There are no prefill and decode phases, only requests whose `num_computed_tokens` lags their `num_tokens`.
Each step hands out at most `max_num_batched_tokens` tokens: first to running requests (one token for a decode,
the next chunk for an unfinished prefill), then to waiting requests while fewer than `max_num_seqs` run. A
prompt longer than the budget is therefore split over steps (chunked prefill). When the KV cache runs out of
blocks, the most recently admitted running request is preempted: its blocks are freed and it goes back to
the front of the waiting queue; its output tokens are kept and recomputed with the prompt when it resumes.
With prefix caching, an admitted request starts after its longest cached prefix (`KVCacheManager`).
With the "priority" policy, waiting and running requests are ordered by (priority, arrival time): the worst
running request is the one preempted, and a waiting request of strictly better priority that finds no room
(`max_num_seqs` or blocks) preempts running requests of worse priority before the step is scheduled.
Every request records QUEUED, SCHEDULED and PREEMPTED events (engine monotonic clock) for the frontend.
An exception while scheduling or updating one request fails that request alone (`failed_requests`, its blocks
freed); the engine keeps serving the others.
A structured-output request first waits for its grammar (`StructuredOutputManager`, status WAITING_FOR_GRAMMAR,
no blocks) and is queued once it is compiled; each step's output carries the grammar bitmask of the constrained
requests that sample, and their matchers advance with the sampled tokens.
With speculative decoding (`SpeculativeConfig`), a decoding request also gets the n-gram proposer's draft
tokens scheduled after its last token (KV slots allocated for them); after the step, the drafts the sampler
rejected are taken back from `num_computed_tokens` (their KV slots are overwritten later), and the accepted
tokens are appended one at a time, so a stop rule ends the request at the exact token.
With LoRA (`max_loras`), the running requests use at most `max_loras` distinct adapters: a waiting request whose
adapter would be one too many is passed over (it keeps its place) until a running adapter's requests finish.
Design: vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py, "the unified token budget").
"""

from __future__ import annotations

import bisect
import logging

from asyncllm.engine_config import SchedulerConfig, SpeculativeConfig
from asyncllm.messages.engine import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from asyncllm.messages.scheduler import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from asyncllm.sched.drafter import Drafter
from asyncllm.sched.grammar import StructuredOutputManager
from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.request_queue import create_request_queue, priority_key
from asyncllm.sched.step_output import new_request_data, pooling_output, sampled_output

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides which tokens of which requests run each step, and applies the sampled tokens.

    Args:
        config: `max_num_seqs`, `max_num_batched_tokens` and `scheduling_policy`.
        num_kv_blocks: blocks in the KV cache.
        block_size: tokens per block.
        max_model_len: prompt + output tokens per request at most; must fit in the cache
            (`num_kv_blocks * block_size >= max_model_len`) or a lone request could never finish.
        enable_prefix_caching: reuse cached full blocks of shared prefixes.
        kv_cache_bytes: bytes of the KV cache over all workers (reported in the stats only).
        structured_output_manager: compiles grammars and keeps matchers; None rejects constrained requests.
        speculative_config: n-gram speculative decoding, or None (off).
        max_loras: distinct LoRA adapters among the running requests at most; None = LoRA off.
    Raises:
        ValueError: if `max_model_len` does not fit in the KV cache.
        ConfigError: unknown scheduling policy.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = False,
        kv_cache_bytes: int = 0,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        if num_kv_blocks * block_size < max_model_len:
            raise ValueError(f"{num_kv_blocks} blocks of {block_size} tokens cannot hold max_model_len={max_model_len}")
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.policy = config.scheduling_policy
        self.waiting = create_request_queue(self.policy)
        # FCFS: admission order; priority: sorted by (priority, arrival). The last one is preempted first.
        self.running: list[Request] = []
        self._finished_req_ids: list[str] = []  # for the workers, in the next SchedulerOutput
        self._finished_req_ids_to_report: list[str] = []  # for the frontend, in the next EngineCoreOutputs
        self.num_preemptions = 0
        self.structured_output_manager = structured_output_manager
        self._failed_requests: dict[str, str] = {}  # for the frontend: requests whose grammar failed to compile
        self.paused = False  # nothing is scheduled while True (`EngineCore.set_scheduler_paused`)
        self.drafter = Drafter(speculative_config) if speculative_config is not None else None
        self.max_loras = max_loras

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the frontend validated.

        Raises:
            ValueError: a LoRA request to a scheduler without `max_loras` (the engine core refuses it first).
        """
        if request.lora_request is not None and self.max_loras is None:
            raise ValueError("this engine runs without LoRA (EngineArgs(enable_lora=True))")
        req = Request.from_engine_core_request(request)
        if self.drafter is not None:
            self.drafter.start_request(req)
        manager = self.structured_output_manager
        if req.sampling_params.structured_outputs is not None:
            if manager is None:
                raise ValueError("this engine has no structured output manager")
            manager.submit(req)  # queued by `_queue_grammar_ready` once compiled
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[req.request_id] = req
        req.record_event(EngineCoreEventType.QUEUED)
        if req.status == RequestStatus.WAITING:
            self.waiting.add_request(req)

    def has_unfinished_requests(self) -> bool:
        """True while a step has requests to run; False while paused (`paused`: nothing is scheduled, so the busy
        loop waits for input instead of spinning)."""
        if self.paused:
            return False
        return bool(self.running) or bool(self.waiting) or self.num_waiting_for_grammar > 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while requests hold KV cache blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens: running requests first, then waiting ones, within the budgets.

        Advances each scheduled request's `num_computed_tokens` by its scheduled tokens (the output carries
        the values from before the step).
        """
        self._queue_grammar_ready()
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        if self.paused:  # vLLM's pause "keep": requests stay where they are, holding their blocks, until resumed
            return output
        budget = self.config.max_num_batched_tokens
        if self.policy == "priority":
            self._preempt_for_priority(budget)
        budget, num_preempted = self._schedule_running(output, budget)
        if num_preempted == 0:
            self._schedule_waiting(output, budget)
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        if self.structured_output_manager is not None:  # rows of the constrained requests that sample now
            sampling = [
                req for i in output.num_scheduled_tokens if (req := self.requests[i]).num_tokens_to_compute <= 0
            ]
            output.grammar_bitmask = self.structured_output_manager.make_bitmask(sampling)
        return output

    def _queue_grammar_ready(self) -> None:
        """Queue the requests whose grammar finished compiling; fail those whose grammar did not compile."""
        if self.structured_output_manager is None or not self.structured_output_manager.pending:
            return
        ready, failed = self.structured_output_manager.take_ready()
        for req in ready:
            req.status = RequestStatus.WAITING
            self.waiting.add_request(req)
        for req, error in failed.items():
            req.status = RequestStatus.FINISHED_ABORTED
            self._failed_requests[req.request_id] = error
            del self.requests[req.request_id]

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, int]:
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_tokens = self._prefill_cap(min(req.num_tokens_to_compute, budget))
            try:
                drafts, new_block_ids = self._allocate_with_drafts(req, num_tokens, budget)
                while new_block_ids is None:
                    victim = self.running.pop()  # never scheduled yet this step: it sits at or after `index`
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is req:
                        break
                    new_block_ids = self.kv_cache_manager.allocate_slots(req, num_tokens)
            except Exception as e:  # this request alone fails; `index` now points at the next one
                self._fail_request(req, e)
                continue
            if new_block_ids is None:
                break
            output.scheduled_cached_reqs.append(
                CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            )
            if drafts:
                output.scheduled_spec_decode_tokens[req.request_id] = drafts
                num_tokens += len(drafts)
            output.num_scheduled_tokens[req.request_id] = num_tokens
            budget -= num_tokens
            index += 1
        return budget, num_preempted

    def _prefill_cap(self, num_tokens: int) -> int:
        """`num_tokens` of one request in this step, at most `long_prefill_token_threshold` when that is set."""
        threshold = self.config.long_prefill_token_threshold
        return min(num_tokens, threshold) if threshold > 0 else num_tokens

    def _allocate_with_drafts(self, req: Request, num_tokens: int, budget: int) -> tuple[list[int], list[int] | None]:
        """KV slots for `num_tokens` plus this step's n-gram drafts (`Drafter.propose`), without the drafts when
        they do not fit.

        Returns:
            (drafts kept, new block ids or None when not even `num_tokens` fit).
        """
        drafts: list[int] = []
        if self.drafter is not None:
            drafts = self.drafter.propose(req, budget, self.max_model_len, len(self.running), len(self.waiting))
        new_block_ids = self.kv_cache_manager.allocate_slots(req, num_tokens + len(drafts))
        if new_block_ids is None and drafts:  # no room for the drafts: run the plain decode instead
            drafts = []
            new_block_ids = self.kv_cache_manager.allocate_slots(req, num_tokens)
        return drafts, new_block_ids

    def _preempt_for_priority(self, budget: int) -> None:
        """Preempt running requests of worse priority while the best waiting one has no room to start."""
        while self.waiting and self.running:
            candidate, victim = self.waiting.peek_request(), self.running[-1]
            if victim.priority <= candidate.priority:
                return
            num_blocks = -(-min(candidate.num_tokens_to_compute, budget) // self.block_size)
            has_room = len(self.running) < self.config.max_num_seqs
            if has_room and num_blocks <= self.kv_cache_manager.num_free_blocks:
                return
            self._preempt(self.running.pop())

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        manager = self.kv_cache_manager
        running_loras = {req.lora_int_id for req in self.running} - {None}
        passed_over: list[Request] = []  # adapter limit reached: they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek_request()
            lora_id = req.lora_int_id
            if lora_id is not None and lora_id not in running_loras and len(running_loras) >= (self.max_loras or 0):
                passed_over.append(self.waiting.pop_request())
                continue
            try:
                computed_blocks = manager.get_computed_blocks(req)
                num_cached = len(computed_blocks) * self.block_size
                num_tokens = self._prefill_cap(min(req.num_tokens - num_cached, budget))
                if manager.allocate_slots(req, num_tokens, computed_blocks) is None:
                    break
            except Exception as e:  # this request alone fails
                self._fail_request(req, e)
                continue
            self.waiting.pop_request()
            if lora_id is not None:
                running_loras.add(lora_id)
            manager.record_prefix_cache_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self._add_running(req)
            req.status = RequestStatus.RUNNING
            req.record_event(EngineCoreEventType.SCHEDULED)
            output.scheduled_new_reqs.append(new_request_data(req, self.kv_cache_manager.get_block_ids(req.request_id)))
            output.num_scheduled_tokens[req.request_id] = num_tokens
            budget -= num_tokens
        for req in reversed(passed_over):
            self.waiting.prepend_request(req)

    def _add_running(self, req: Request) -> None:
        if self.policy == "priority":
            bisect.insort(self.running, req, key=priority_key)
        else:
            self.running.append(req)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and queue it first; it is recomputed from scratch when resumed."""
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.record_event(EngineCoreEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    # ---- applying a step's results, ending requests ----------------------------------------------------

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
        failed = model_runner_output.failed_requests
        for req_id, token_ids in model_runner_output.sampled_token_ids.items():
            req = self.requests.get(req_id)
            if req is None or not token_ids or req_id not in scheduler_output.num_scheduled_tokens:
                continue  # aborted while the step ran
            if req_id in failed:  # the worker could not sample it (its logits processor raised)
                self._fail_request(req, failed[req_id])
                continue
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
        if drafts:  # take the rejected drafts back (their KV slots are overwritten later) and count them
            num_accepted = len(token_ids) - 1
            req.num_computed_tokens -= len(drafts) - num_accepted
            if self.drafter is not None:
                self.drafter.observe_verification(req, len(drafts), num_accepted)
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
