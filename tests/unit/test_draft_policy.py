"""The adaptive draft policy (`sched/draft_policy.py`, `sched/drafter.py`): the online step-cost fit,
the per-request acceptance estimate, the draft length they give, vLLM's `disable_by_batch_size`, and the
config keys."""

from __future__ import annotations

import random

import pytest

from asyncllm import EngineArgs, SamplingParams
from asyncllm.config import SchedulerConfig, SpeculativeConfig
from asyncllm.errors import ConfigError
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.messages.scheduler import ModelRunnerOutput
from asyncllm.sched.draft_policy import (
    MIN_COST_SAMPLES,
    PROBE_INTERVAL,
    AcceptanceEstimate,
    StepCostModel,
)
from asyncllm.sched.scheduler import Scheduler

EOS = 2
REPEATING = [5, 6, 7, 8] * 4  # every n-gram continues: the proposer always finds k drafts


def test_step_cost_fit_recovers_fixed_and_per_token_cost() -> None:
    model = StepCostModel()
    rng = random.Random(0)
    assert model.break_even(8) == 0.0  # no fit yet: every draft is allowed
    for _ in range(200):
        tokens = rng.randint(1, 40)
        model.observe(tokens, 0.030 + 0.004 * tokens + rng.gauss(0, 0.0005))
    assert model.fixed_s == pytest.approx(0.030, abs=0.002)
    assert model.per_token_s == pytest.approx(0.004, abs=0.0002)
    # break-even acceptance: per_token * rows / (fixed + per_token * rows)
    assert model.break_even(1) == pytest.approx(0.004 / 0.034, abs=0.01)
    assert model.break_even(8) == pytest.approx(0.032 / 0.062, abs=0.02)


def test_step_cost_needs_enough_steps_of_different_sizes() -> None:
    model = StepCostModel()
    for _ in range(MIN_COST_SAMPLES - 1):
        model.observe(4, 0.05)
    model.observe(8, 0.07)
    assert model.per_token_s is not None  # the eighth step, of another size, makes the fit
    assert (model.fixed_s, model.per_token_s) == (pytest.approx(0.03), pytest.approx(0.005))  # the exact line
    for _ in range(500):  # then one size only, slower (the machine got busy): the fit follows, stays finite
        model.observe(6, 0.09)
    assert model.fixed_s is not None
    assert model.fixed_s >= 0.0
    assert model.per_token_s >= 0.0
    assert model.fixed_s + 6 * model.per_token_s == pytest.approx(0.09, abs=0.005)


def test_acceptance_estimate_sets_the_draft_length() -> None:
    estimate = AcceptanceEstimate()
    assert estimate.rate == 0.5
    assert estimate.num_draft_tokens(5, 0.0) == 5  # drafts are free: all of them
    assert estimate.num_draft_tokens(5, 0.3) == 1  # 0.5 > 0.3 >= 0.25
    for _ in range(10):
        estimate.observe(5, 5)  # everything accepted
    assert estimate.rate > 0.95
    assert estimate.num_draft_tokens(5, 0.5) == 5
    for _ in range(20):
        estimate.observe(3, 0)  # the first draft rejected every time
    assert estimate.rate < 0.2
    assert estimate.num_draft_tokens(5, 0.3) == 0


def test_a_request_without_drafts_probes_one_after_the_interval() -> None:
    estimate = AcceptanceEstimate(accepted=0.1, rejected=10.0)
    for _ in range(PROBE_INTERVAL):
        assert estimate.num_draft_tokens(4, 0.5) == 0
        estimate.note_decode_step(0)
    assert estimate.num_draft_tokens(4, 0.5) == 1
    estimate.note_decode_step(1)
    assert estimate.num_draft_tokens(4, 0.5) == 0  # the probe resets the interval


def _scheduler(**spec: object) -> Scheduler:
    config = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2, **spec}
    )
    return Scheduler(SchedulerConfig(8, 256), 64, 4, 256, speculative_config=config)


def _decode_one_step(scheduler: Scheduler, sampled: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Schedule a step and feed back the first token of every request's drafts (or 5) as accepted."""
    so = scheduler.schedule()
    drafts = dict(so.scheduled_spec_decode_tokens)
    tokens = sampled or {rid: [*drafts.get(rid, []), 5] for rid in so.num_scheduled_tokens}
    scheduler.update_from_output(so, ModelRunnerOutput(tokens))
    return drafts


def test_disable_by_batch_size_stops_drafting_above_the_limit() -> None:
    scheduler = _scheduler(disable_by_batch_size=1, adaptive=False)
    scheduler.add_request(EngineCoreRequest("a", REPEATING, SamplingParams(max_tokens=20), EOS))
    _decode_one_step(scheduler, {"a": [5]})  # prefill
    assert _decode_one_step(scheduler)  # one request: drafts
    scheduler.add_request(EngineCoreRequest("b", REPEATING, SamplingParams(max_tokens=20), EOS))
    so = scheduler.schedule()  # two requests (one prefilling): more than 1, so no drafts for "a"
    assert so.scheduled_spec_decode_tokens == {}


def test_the_drafter_feeds_the_cost_fit_with_decode_steps_only() -> None:
    scheduler = _scheduler()
    drafter = scheduler.drafter
    assert drafter is not None
    assert drafter.step_cost is not None
    scheduler.add_request(EngineCoreRequest("a", REPEATING, SamplingParams(max_tokens=40), EOS))
    prefill = scheduler.schedule()
    drafter.observe_step(prefill, 1.0)  # a prefill step: not a sample
    scheduler.update_from_output(prefill, ModelRunnerOutput({"a": [5]}))
    assert drafter.step_cost._num_samples == 0
    decode = scheduler.schedule()
    assert decode.scheduled_spec_decode_tokens  # no fit yet: full drafts
    drafter.observe_step(decode, 0.01)
    assert drafter.step_cost._num_samples == 1


def test_adaptive_drafting_stops_for_a_request_whose_drafts_are_rejected() -> None:
    scheduler = _scheduler()
    drafter = scheduler.drafter
    assert drafter is not None
    assert drafter.step_cost is not None
    for size in range(1, 20):  # a machine where a row costs 40% of the fixed part of a step
        drafter.step_cost.observe(size, 0.025 + 0.01 * size)
    scheduler.add_request(EngineCoreRequest("a", REPEATING, SamplingParams(max_tokens=200), EOS))
    _decode_one_step(scheduler, {"a": [5]})  # prefill: ... 8, 5 continues 6, 7, 8
    num_drafted = []
    for _ in range(40):
        so = scheduler.schedule()
        drafts = so.scheduled_spec_decode_tokens.get("a", [])
        num_drafted.append(len(drafts))
        scheduler.update_from_output(so, ModelRunnerOutput({"a": [9]}))  # every draft rejected (9 is never drafted)
    assert num_drafted[0] == 1  # q = 0.5 > break-even 0.29 > q ** 2: only the first draft pays
    assert sum(num_drafted[10:]) <= 2  # then only the rare probe
    assert scheduler.requests["a"].spec_decode_metrics.num_accepted_tokens == 0


def test_new_speculative_config_keys_are_checked() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_user(base).adaptive is True
    assert (
        SpeculativeConfig.from_user({**base, "adaptive": False, "disable_by_batch_size": 4}).disable_by_batch_size == 4
    )
    for key, bad in (("adaptive", "yes"), ("disable_by_batch_size", 0), ("disable_by_batch_size", 2.5)):
        with pytest.raises(ConfigError, match=key):
            EngineArgs(speculative_config={**base, key: bad}).validate()
