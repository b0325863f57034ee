"""`LoadBalancer` (data parallelism): least load from published stats plus local sends, prefix affinity,
pinning, draining, and bookkeeping from outputs; `sum_scheduler_stats`."""

from __future__ import annotations

import pytest

from asyncllm import SamplingParams
from asyncllm.engine.dp_utility import UTILITY_COMBINERS
from asyncllm.engine.load_balancer import LoadBalancer, affinity_slack
from asyncllm.errors import InvalidRequestError
from asyncllm.messages.engine import EngineCoreOutputs, EngineCoreRequest, SchedulerStats, SpecDecodeMetrics
from asyncllm.metrics.stats import sum_scheduler_stats
from tests.state_probes import latest_stats


def request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, SamplingParams(max_tokens=4))


def balancer(num_engines: int = 2, block_size: int = 4) -> LoadBalancer:
    lb = LoadBalancer(block_size)
    for rank in range(num_engines):
        lb.add_engine(rank)
    return lb


def send(lb: LoadBalancer, r: EngineCoreRequest, pinned: int | None = None) -> int:
    rank = lb.choose(r, pinned)
    lb.track(r, rank)
    return rank


def test_a_burst_without_stats_alternates_between_engines() -> None:
    lb = balancer()
    ranks = [send(lb, request(f"r{i}", [i + 1000, i, i, i])) for i in range(10)]  # distinct first blocks
    assert ranks.count(0) == 5
    assert ranks.count(1) == 5
    assert lb.num_in_flight(0) == 5
    assert lb.load(1) == 5


def test_published_stats_replace_the_local_count() -> None:
    lb = balancer()
    for i in range(4):
        send(lb, request(f"r{i}", [i + 1000] * 4))
    # Engine 0 reports 9 running + waiting (e.g. another step's view); engine 1 reports none left.
    lb.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(7, 2), engine_index=0))
    lb.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(0, 0), engine_index=1, finished_requests=["r1"]))
    assert lb.load(0) == 9
    assert lb.load(1) == 0
    assert lb.owner("r1") is None
    assert lb.owner("r0") == 0
    assert send(lb, request("new", [5000] * 4)) == 1
    assert lb.load(1) == 1  # sent since its last stats


def test_a_shared_prefix_prefers_its_engine_unless_much_busier() -> None:
    lb = balancer(block_size=4)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    first = send(lb, request("a", [*prefix, 9]))
    # The same two blocks go to the same engine while its load stays within the slack.
    for i in range(affinity_slack(0)):
        assert send(lb, request(f"b{i}", [*prefix, 100 + i])) == first
    assert lb.load(first) == affinity_slack(0) + 1
    assert send(lb, request("c", [*prefix, 200])) == 1 - first  # now much busier: the other engine


def test_a_partial_block_is_no_prefix() -> None:
    lb = balancer(block_size=4)
    send(lb, request("a", [1, 2, 3]))
    assert send(lb, request("b", [1, 2, 3])) == 1  # least load, no affinity (no full block shared)


def test_pinning_and_draining() -> None:
    lb = balancer()
    assert send(lb, request("a", [1] * 4), pinned=1) == 1
    assert send(lb, request("b", [2] * 4), pinned=1) == 1
    with pytest.raises(InvalidRequestError, match="data_parallel_rank=7"):
        lb.choose(request("c", [3] * 4), 7)
    lb.stop_accepting(1)
    assert [send(lb, request(f"d{i}", [i + 10] * 4)) for i in range(3)] == [0, 0, 0]
    with pytest.raises(InvalidRequestError, match="data_parallel_rank=1"):
        lb.choose(request("e", [3] * 4), 1)
    assert lb.num_in_flight(1) == 2  # draining keeps its requests tracked
    assert lb.group_by_owner(["a", "d0", "unknown"]) == {1: ["a"], 0: ["d0"]}
    assert lb.remove_engine(1) == ["a", "b"]
    assert lb.owner("a") is None
    assert lb.accepting_ranks == [0]
    lb.stop_accepting(0)
    with pytest.raises(InvalidRequestError, match="no data-parallel engine"):
        lb.choose(request("f", [4] * 4))


def test_failed_requests_are_untracked_and_unknown_engines_ignored() -> None:
    lb = balancer()
    send(lb, request("a", [1] * 4))
    lb.observe(EngineCoreOutputs(failed_requests={"a": "boom"}, engine_index=0))
    assert lb.num_in_flight(0) == 0
    lb.observe(EngineCoreOutputs(scheduler_stats=SchedulerStats(3, 3), engine_index=9))  # a removed engine
    assert 9 not in latest_stats(lb)


def test_sum_scheduler_stats() -> None:
    one = SchedulerStats(1, 2, 10, 20, 0.5, 1, 100, 50, 16, 1000, engine_index=0)
    two = SchedulerStats(3, 0, 5, 20, 0.0, 2, 300, 0, 16, 1000, engine_index=1)
    total = sum_scheduler_stats([one, two])
    assert (total.num_running_reqs, total.num_waiting_reqs, total.num_free_blocks, total.num_total_blocks) == (
        4,
        2,
        15,
        40,
    )
    assert total.prefix_cache_hit_rate == pytest.approx(50 / 400)
    assert (total.num_preemptions, total.kv_cache_bytes, total.block_size, total.engine_index) == (3, 2000, 16, 0)
    assert sum_scheduler_stats([two]) is two
    assert total.spec_decode is None
    spec_one = SchedulerStats(engine_index=0, spec_decode=SpecDecodeMetrics(2, 8, 5, [2, 2, 1, 0]))
    spec_two = SchedulerStats(engine_index=1, spec_decode=SpecDecodeMetrics(1, 2, 1, [1, 0]))
    assert sum_scheduler_stats([spec_one, spec_two]).spec_decode == SpecDecodeMetrics(3, 10, 6, [3, 2, 1, 0])
    assert UTILITY_COMBINERS["reset_prefix_cache"]([True, False]) is False
    assert UTILITY_COMBINERS["collective_rpc"]([[1, 2], [3]]) == [1, 2, 3]
