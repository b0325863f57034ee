"""What tests read of the package's private state (leak checks, routing, engine processes): kept here, beside the
tests that need it, so the package carries no method that only tests call."""

from __future__ import annotations

from asyncllm.engine.dp_client import DPEngineCoreClient
from asyncllm.engine.load_balancer import LoadBalancer
from asyncllm.messages.engine import SchedulerStats
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.utils import request_callables


def tracked_ids(processor: OutputProcessor) -> tuple[int, int, int]:
    """(engine states, n > 1 parents, user ids) the output processor holds: all 0 once nothing is in flight."""
    return len(processor._states), len(processor._parents), len(processor._external_ids)


def has_user_request(processor: OutputProcessor, user_id: str) -> bool:
    """True while a request submitted with the user's id `user_id` is in flight."""
    return user_id in processor._external_ids


def internal_ids_of(processor: OutputProcessor, user_id: str) -> list[str]:
    """The internal ids of the in-flight requests submitted with the user's id `user_id` (empty when none)."""
    return list(processor._external_ids.get(user_id, ()))


def engine_of(client: DPEngineCoreClient, request_id: str) -> int | None:
    """The rank of the engine holding the in-flight internal id `request_id`, or None (unknown or finished)."""
    with client._lb_lock:
        return client._balancer.owner(request_id)


def engine_pids(client: DPEngineCoreClient) -> dict[int, int]:
    """The process id of each engine core (a Ray actor's or an engine process's), by rank."""
    manager = client._manager
    with manager._lock:
        launchers = dict(manager._engines)
    pids = {}
    for rank, launcher in launchers.items():
        pid = getattr(launcher, "pid", None)  # a Ray actor's, else the engine process's
        pids[rank] = int(pid if pid is not None else launcher.process.pid)
    return pids


def latest_stats(balancer: LoadBalancer) -> dict[int, SchedulerStats]:
    """The scheduler stats each engine published last, by rank."""
    return dict(balancer._stats)


def num_registered_callables() -> int:
    """Per-request logits-processor entries held (0 once nothing is in flight)."""
    return len(request_callables._registry)
