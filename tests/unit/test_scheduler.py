"""Scheduler: token budget, max_num_seqs, chunked prefill, preemption and resumption, stop rules, abort,
priority scheduling, engine events and stats."""

from __future__ import annotations

import pytest

from asyncllm.config import SchedulerConfig
from asyncllm.errors import ConfigError
from asyncllm.messages.engine import EngineCoreEventType, EngineCoreOutputs, EngineCoreRequest, FinishReason
from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.request import Request, RequestStatus
from asyncllm.sched.request_queue import create_request_queue
from asyncllm.sched.scheduler import Scheduler

EOS = 2


def _scheduler(
    num_blocks: int = 100,
    block_size: int = 4,
    max_seqs: int = 8,
    max_tokens: int = 64,
    max_model_len: int = 64,
    policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(max_seqs, max_tokens, policy)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, block_size, max_model_len)


def _request(
    request_id: str, num_prompt_tokens: int, priority: int = 0, arrival_time: float = 0.0, **params: object
) -> EngineCoreRequest:
    params.setdefault("max_tokens", 4)
    token_ids = [10 + i for i in range(num_prompt_tokens)]
    return EngineCoreRequest(
        request_id, token_ids, SamplingParams(**params), EOS, arrival_time=arrival_time, priority=priority
    )


def _sample(scheduler: Scheduler, so: SchedulerOutput, token: int | dict[str, int] = 7) -> ModelRunnerOutput:
    """What a model runner returns: one token for each request whose computed tokens reach its end."""
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        req = scheduler.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            sampled[req_id] = [token if isinstance(token, int) else token[req_id]]
    return ModelRunnerOutput(sampled)


def _step(scheduler: Scheduler, token: int | dict[str, int] = 7) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, _sample(scheduler, so, token))


def _run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        _, out = _step(scheduler, token=100 + step)
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("did not finish")


def test_running_decodes_first_then_waiting_within_token_budget() -> None:
    scheduler = _scheduler(max_tokens=10)
    scheduler.add_request(_request("a", 6))
    so, out = _step(scheduler)
    assert so.num_scheduled_tokens == {"a": 6}
    assert [o.new_token_ids for o in out.outputs] == [[7]]
    scheduler.add_request(_request("b", 6))
    scheduler.add_request(_request("c", 6))
    so = scheduler.schedule()
    # a decodes 1 token, b gets its whole prompt (6), c gets the 3 tokens left of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 6, "c": 3}
    assert so.total_num_scheduled_tokens == 10
    assert [r.req_id for r in so.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b", "c"]
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 6
    out = scheduler.update_from_output(so, _sample(scheduler, so))
    assert sorted(o.request_id for o in out.outputs) == ["a", "b"]  # c's prefill is partial: nothing sampled


def test_chunked_prefill_splits_long_prompt_across_steps() -> None:
    scheduler = _scheduler(max_tokens=8)
    scheduler.add_request(_request("a", 20))
    steps = [_step(scheduler) for _ in range(3)]
    assert [so.num_scheduled_tokens["a"] for so, _ in steps] == [8, 8, 4]
    assert [so.scheduled_cached_reqs[0].num_computed_tokens for so, _ in steps[1:]] == [8, 16]
    assert [[o.new_token_ids for o in out.outputs] for _, out in steps] == [[], [], [[7]]]
    assert scheduler.requests["a"].num_computed_tokens == 20
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 20


def test_long_prefill_token_threshold_caps_each_requests_chunk_not_the_decodes() -> None:
    """vLLM's `long_prefill_token_threshold`: a prompt goes in chunks of at most that many tokens, admitted or
    running, while a decode beside it still gets its token and the rest of the budget goes to the next prompt."""
    config = SchedulerConfig(8, 64, long_prefill_token_threshold=8)
    scheduler = Scheduler(config, 100, 4, 64)
    scheduler.add_request(_request("a", 5))
    so, _ = _step(scheduler)
    assert so.num_scheduled_tokens == {"a": 5}  # shorter than the threshold: whole
    scheduler.add_request(_request("b", 20))
    scheduler.add_request(_request("c", 6))
    steps = [_step(scheduler)[0] for _ in range(3)]
    assert [so.num_scheduled_tokens for so in steps] == [
        {"a": 1, "b": 8, "c": 6},
        {"a": 1, "b": 8, "c": 1},
        {"a": 1, "b": 4, "c": 1},
    ]
    assert scheduler.requests["b"].num_computed_tokens == 20
    uncapped = _scheduler(max_tokens=64)
    uncapped.add_request(_request("b", 20))
    assert uncapped.schedule().num_scheduled_tokens == {"b": 20}


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = _scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 3))
    so, _ = _step(scheduler)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert scheduler.get_stats().num_running_reqs == 2
    assert scheduler.get_stats().num_waiting_reqs == 1


def test_preempts_most_recent_request_and_resumes_it_with_its_output() -> None:
    # 4 blocks of 4 tokens; a and b have 7-token prompts (2 blocks each, 1 free slot each).
    scheduler = _scheduler(num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(_request("a", 7, max_tokens=5))
    scheduler.add_request(_request("b", 7, max_tokens=5))
    _step(scheduler, token=1)  # prefill both: tokens 8 of each
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    so, _ = _step(scheduler, token=3)  # decode: both fit in their second blocks
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    so = scheduler.schedule()  # a needs a third block: b (admitted last) is preempted
    assert so.num_scheduled_tokens == {"a": 1}
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [1, 3]
    assert scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [b]
    scheduler.update_from_output(so, _sample(scheduler, so, token=4))
    while "a" in scheduler.requests:
        _step(scheduler, token=5)
    so = scheduler.schedule()  # b resumes as a new request: prompt + its 2 outputs are recomputed
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.output_token_ids == [1, 3]
    assert so.num_scheduled_tokens == {"b": 9}
    assert len(new.block_ids) == 3


def test_request_preempts_itself_when_alone_out_of_blocks_then_resumes() -> None:
    scheduler = _scheduler(num_blocks=3, block_size=4, max_model_len=12)
    scheduler.add_request(_request("a", 4, max_tokens=8))
    scheduler.add_request(_request("b", 4, max_tokens=8))
    tokens = _run_to_completion(scheduler)
    assert {k: len(v) for k, v in tokens.items()} == {"a": 8, "b": 8}
    assert scheduler.num_preemptions >= 1
    assert scheduler.kv_cache_manager.num_free_blocks == 3


def test_many_requests_under_pressure_all_finish_and_free_all_blocks() -> None:
    scheduler = _scheduler(num_blocks=8, block_size=4, max_seqs=6, max_tokens=12, max_model_len=32)
    for i in range(12):
        scheduler.add_request(_request(f"r{i}", 3 + 2 * i % 13, max_tokens=4 + i))
    tokens = _run_to_completion(scheduler)
    assert {k: len(v) for k, v in tokens.items()} == {f"r{i}": 4 + i for i in range(12)}
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert scheduler.requests == {}


def test_finished_ids_reach_workers_in_next_schedule_and_frontend_in_outputs() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 3, max_tokens=1))
    _, out = _step(scheduler)
    assert out.outputs[0].finish_reason == FinishReason.LENGTH
    assert out.finished_requests == ["a"]
    assert scheduler.kv_cache_manager.num_free_blocks == 100
    assert scheduler.has_finished_requests()
    assert not scheduler.has_unfinished_requests()
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a"]
    assert so.total_num_scheduled_tokens == 0
    assert scheduler.schedule().finished_req_ids == []


def _finish(token_ids: list[int], prompt: int = 3, max_model_len: int = 64, **params: object) -> tuple:
    scheduler = _scheduler(max_model_len=max_model_len)
    scheduler.add_request(_request("a", prompt, **params))
    emitted: list[int] = []
    for token in token_ids:
        _, out = _step(scheduler, token=token)
        (o,) = out.outputs
        emitted += o.new_token_ids
        if o.finished:
            return emitted, o.finish_reason, o.stop_reason
    raise AssertionError("not finished")


def test_eos_stops_with_no_stop_reason() -> None:
    assert _finish([5, EOS, 6], max_tokens=10) == ([5, EOS], FinishReason.STOP, None)


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    assert _finish([EOS, EOS, EOS], max_tokens=3, ignore_eos=True) == ([EOS, EOS, EOS], FinishReason.LENGTH, None)


def test_stop_token_id_is_the_stop_reason() -> None:
    assert _finish([5, 9, 6], max_tokens=10, stop_token_ids=[9]) == ([5, 9], FinishReason.STOP, 9)


def test_stop_token_id_wins_over_ignore_eos() -> None:
    assert _finish([5, EOS], max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]) == ([5, EOS], FinishReason.STOP, EOS)


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    # Two tokens must precede a stop: EOS and 9 at positions 1 and 2 are ignored, 9 at position 3 stops.
    result = _finish([EOS, 9, 9], max_tokens=10, min_tokens=2, stop_token_ids=[9])
    assert result == ([EOS, 9, 9], FinishReason.STOP, 9)


def test_max_tokens_gives_length() -> None:
    assert _finish([5, 6, 7, 8], max_tokens=3) == ([5, 6, 7], FinishReason.LENGTH, None)


def test_max_model_len_gives_length() -> None:
    assert _finish([5, 6, 7, 8], prompt=6, max_model_len=8, max_tokens=None) == ([5, 6], FinishReason.LENGTH, None)


def test_abort_frees_blocks_without_output() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 9))
    scheduler.add_request(_request("b", 9))
    _step(scheduler)
    scheduler.add_request(_request("c", 9))
    scheduler.finish_requests(["a", "c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 100 - 3
    assert len(scheduler.waiting) == 0
    assert [r.request_id for r in scheduler.running] == ["b"]
    so, out = _step(scheduler)
    assert so.finished_req_ids == ["a", "c"]
    assert [o.request_id for o in out.outputs] == ["b"]
    assert out.finished_requests == ["a", "c"]


def test_abort_during_step_drops_sampled_token() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 3))
    so = scheduler.schedule()
    sampled = _sample(scheduler, so)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = scheduler.update_from_output(so, sampled)
    assert out.outputs == []
    assert scheduler.kv_cache_manager.num_free_blocks == 100


def test_max_model_len_must_fit_in_cache() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        _scheduler(num_blocks=3, block_size=4, max_model_len=13)


def _finish_order(scheduler: Scheduler) -> list[str]:
    order = []
    for step in range(1000):
        if not scheduler.has_unfinished_requests():
            return order
        _, out = _step(scheduler, token=100 + step)
        order += [o.request_id for o in out.outputs if o.finished]
    raise AssertionError("did not finish")


def test_priority_late_better_request_runs_before_waiting_worse_ones() -> None:
    scheduler = _scheduler(max_seqs=1, policy="priority")
    for i, name in enumerate(["w0", "w1", "w2"]):
        scheduler.add_request(_request(name, 3, priority=5, arrival_time=float(i), max_tokens=3))
    _step(scheduler)  # w0 runs
    scheduler.add_request(_request("late", 3, priority=1, arrival_time=10.0, max_tokens=3))
    order = _finish_order(scheduler)
    assert order.index("late") < order.index("w1") < order.index("w2")
    assert order[0] == "late"  # it preempted w0 (max_num_seqs=1)
    assert scheduler.num_preemptions == 1
    assert scheduler.kv_cache_manager.num_free_blocks == 100


def test_priority_equal_priorities_are_fcfs_and_never_preempt_each_other() -> None:
    scheduler = _scheduler(max_seqs=1, policy="priority")
    for i, name in enumerate(["a", "b", "c"]):
        scheduler.add_request(_request(name, 3, priority=2, arrival_time=float(i), max_tokens=3))
    assert _finish_order(scheduler) == ["a", "b", "c"]
    assert scheduler.num_preemptions == 0


def test_priority_preempts_worst_running_request_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two 7-token prompts fill 4; the better one keeps running when blocks run out.
    scheduler = _scheduler(num_blocks=6, block_size=4, max_model_len=24, policy="priority")
    scheduler.add_request(_request("worse", 7, priority=3, arrival_time=0.0, max_tokens=12))
    scheduler.add_request(_request("better", 7, priority=1, arrival_time=1.0, max_tokens=12))
    _step(scheduler)
    assert [req.request_id for req in scheduler.running] == ["better", "worse"]
    while scheduler.num_preemptions == 0:
        _step(scheduler)
    assert scheduler.requests["worse"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["better"].status == RequestStatus.RUNNING
    assert _finish_order(scheduler) == ["better", "worse"]


def test_fcfs_ignores_priority() -> None:
    scheduler = _scheduler(max_seqs=1)
    scheduler.add_request(_request("first", 3, priority=9, max_tokens=2))
    scheduler.add_request(_request("second", 3, priority=0, max_tokens=2))
    assert _finish_order(scheduler) == ["first", "second"]


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ConfigError, match="scheduling policy"):
        _scheduler(policy="lifo")


def test_events_queued_scheduled_preempted_travel_with_the_next_output() -> None:
    scheduler = _scheduler(num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(_request("a", 7, max_tokens=5))
    scheduler.add_request(_request("b", 7, max_tokens=5))
    _, out = _step(scheduler, token=1)
    events = {o.request_id: [e.type for e in o.events or []] for o in out.outputs}
    assert events == {"a": [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]} | {
        "b": [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    }
    first = next(o for o in out.outputs if o.request_id == "a").events or []
    assert first[0].timestamp <= first[1].timestamp
    _, out = _step(scheduler, token=3)
    assert all(o.events is None for o in out.outputs)
    b_events = []
    while "b" in scheduler.requests:
        _, out = _step(scheduler, token=4)
        b_events += [e.type for o in out.outputs if o.request_id == "b" for e in o.events or []]
    assert b_events == [EngineCoreEventType.PREEMPTED, EngineCoreEventType.SCHEDULED]
    assert scheduler.get_stats().num_preemptions == 1


def test_chunked_prefill_sends_events_with_the_first_token() -> None:
    scheduler = _scheduler(max_tokens=4)
    scheduler.add_request(_request("a", 10, max_tokens=2))
    _, out = _step(scheduler)
    assert out.outputs == []
    _, out = _step(scheduler)
    _, out = _step(scheduler)
    (output,) = out.outputs
    assert [e.type for e in output.events or []] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]


def test_priority_arrival_preempts_worse_running_request_for_blocks() -> None:
    # 5 blocks of 4 tokens: "low" (15-token prompt) holds 4; "high" needs 2 for its 5-token prompt.
    scheduler = _scheduler(num_blocks=5, block_size=4, max_model_len=20, policy="priority")
    scheduler.add_request(_request("low", 15, priority=4, arrival_time=0.0, max_tokens=4))
    _step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    scheduler.add_request(_request("high", 5, priority=0, arrival_time=1.0, max_tokens=2))
    so, _ = _step(scheduler)
    assert so.num_scheduled_tokens == {"high": 5}
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
    assert _finish_order(scheduler) == ["high", "low"]
    assert scheduler.kv_cache_manager.num_free_blocks == 5


def test_priority_arrival_does_not_preempt_when_there_is_room() -> None:
    scheduler = _scheduler(max_seqs=2, policy="priority")
    scheduler.add_request(_request("low", 3, priority=4, max_tokens=3))
    _step(scheduler)
    scheduler.add_request(_request("high", 3, priority=0, arrival_time=1.0, max_tokens=3))
    so, _ = _step(scheduler)
    assert so.num_scheduled_tokens == {"low": 1, "high": 3}
    assert scheduler.num_preemptions == 0


def test_priority_queue_orders_by_priority_then_arrival_and_removes() -> None:
    queue = create_request_queue("priority")
    reqs = {
        name: Request.from_engine_core_request(_request(name, 2, priority=prio, arrival_time=arrival))
        for name, prio, arrival in [("a", 2, 0.0), ("b", 1, 3.0), ("c", 1, 1.0), ("d", 0, 9.0)]
    }
    for req in reqs.values():
        queue.add_request(req)
    assert [r.request_id for r in queue] == ["d", "c", "b", "a"]
    assert queue.peek_request() is reqs["d"]
    queue.remove_requests([reqs["c"], reqs["d"]])
    assert queue.pop_request() is reqs["b"]
    queue.prepend_request(reqs["b"])  # a preempted request keeps its place by key
    assert [r.request_id for r in queue] == ["b", "a"]
    assert len(queue) == 2
    queue.remove_requests(list(reqs.values()))
    assert not queue
    with pytest.raises(IndexError):
        queue.peek_request()


@pytest.mark.parametrize("where", ["get_computed_blocks", "allocate_slots", "check_stop"])
def test_an_exception_for_one_request_fails_it_alone(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Issue 12: whatever the scheduler raises for one request fails that request (failed_requests, blocks freed);
    the others are scheduled and finish as if it had never been there."""
    scheduler = _scheduler()
    scheduler.add_request(_request("a", 6))
    scheduler.add_request(_request("victim", 6))
    scheduler.add_request(_request("b", 6))
    target = scheduler.kv_cache_manager if where != "check_stop" else Request
    original = getattr(target, where)

    def faulty(*args: object) -> object:
        req = next(a for a in args if isinstance(a, Request))
        if req.request_id == "victim" and (where != "check_stop" or req.num_output_tokens >= 2):
            raise RuntimeError(f"injected fault in {where}")
        return original(*args)

    monkeypatch.setattr(target, where, faulty)
    failed: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        _, outputs = _step(scheduler)
        failed.update(outputs.failed_requests or {})
        for out in outputs.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert list(failed) == ["victim"]
    assert f"RuntimeError: injected fault in {where}" in failed["victim"]
    assert tokens["a"] == tokens["b"] == [7, 7, 7, 7]
    assert "victim" not in scheduler.requests
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_total_blocks
