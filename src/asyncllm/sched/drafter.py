"""`Drafter`: the scheduler's speculative-decoding side: which n-gram drafts each decoding request verifies
this step (room left by the token budget, `max_tokens` and `max_model_len`; the draft policy;
`disable_by_batch_size`), and what each verification did to the request's counters and the draft policy.

The scheduler calls `start_request` when a request arrives, `propose` for each running request it schedules,
`observe_verification` when the sampler's result comes back (the scheduler itself takes the rejected drafts back
from `num_computed_tokens`), and the engine core calls `observe_step` with each step's execute time.
Verification itself runs in the worker (`worker/rejection_sampler.py`).
"""

from __future__ import annotations

from asyncllm.engine_config import SpeculativeConfig
from asyncllm.messages.engine import SpecDecodeMetrics
from asyncllm.messages.scheduler import SchedulerOutput
from asyncllm.sched.draft_policy import AcceptanceEstimate, StepCostModel
from asyncllm.sched.ngram_proposer import NgramProposer
from asyncllm.sched.request import Request


class Drafter:
    """N-gram drafts under the draft policy (`sched/draft_policy.py`) and `disable_by_batch_size`.

    Args:
        config: the speculative config (k, n-gram sizes, `disable_by_batch_size`, `adaptive`).
    Attributes:
        stats: the engine's spec-decode counters since start (`SchedulerStats.spec_decode`).
        step_cost: the online step-cost fit (None when `adaptive` is off).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.stats = SpecDecodeMetrics.empty(config.num_speculative_tokens)
        self.step_cost = StepCostModel() if config.adaptive else None

    def start_request(self, req: Request) -> None:
        """Give a new request its spec-decode counters (and its acceptance estimate)."""
        req.spec_decode_metrics = SpecDecodeMetrics.empty(self.config.num_speculative_tokens)
        if self.step_cost is not None:
            req.draft_acceptance = AcceptanceEstimate()

    def propose(self, req: Request, budget: int, max_model_len: int, num_running: int, num_waiting: int) -> list[int]:
        """The n-gram drafts to verify after a decoding request's last token.

        Empty for a prefill chunk, a structured-output or embedding request, when the token budget, `max_tokens`
        or `max_model_len` leave no room, when `num_running + num_waiting` exceeds `disable_by_batch_size`, or when
        the draft policy finds no draft worth its row.

        Args:
            budget: tokens left in this step's budget.
            max_model_len: prompt + output tokens per request at most.
            num_running, num_waiting: the scheduler's queue lengths (`disable_by_batch_size`, draft policy).
        """
        structured = req.sampling_params.structured_outputs is not None
        if req.num_tokens_to_compute != 1 or structured or req.pooling_params is not None:
            return []
        room = min(budget, max_model_len - req.num_tokens) - 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        limit = self.config.disable_by_batch_size
        if room <= 0 or (limit is not None and num_running + num_waiting > limit):
            return []
        estimate = req.draft_acceptance
        if estimate is not None and self.step_cost is not None:
            room = estimate.num_draft_tokens(
                min(room, self.config.num_speculative_tokens), self.step_cost.break_even(num_running)
            )
        drafts = self.proposer.propose(req.all_token_ids, room) if room > 0 else []
        if estimate is not None:
            estimate.note_decode_step(len(drafts))
        return drafts

    def observe_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a verification of `num_drafts` drafts of which the first `num_accepted` were accepted."""
        if req.spec_decode_metrics is not None:
            req.spec_decode_metrics.observe(num_drafts, num_accepted)
        self.stats.observe(num_drafts, num_accepted)
        estimate = req.draft_acceptance
        if estimate is not None:
            estimate.observe(num_drafts, num_accepted)

    def observe_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """Feed the step-cost fit with a step that ran in `seconds`, when every request in it was decoding
        (one new token plus its drafts): prefill chunks cost more per token and would bias the fit."""
        if self.step_cost is None or scheduler_output.scheduled_new_reqs:
            return
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if num_tokens != 1 + len(drafts.get(request_id, ())):
                return
        self.step_cost.observe(scheduler_output.total_num_scheduled_tokens, seconds)
