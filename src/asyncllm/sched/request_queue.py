"""Waiting queues of the scheduler: the `RequestQueue` interface, first-come-first-served and priority.

The scheduler only calls the interface's methods. After vLLM v1's `vllm/v1/core/sched/request_queue.py`.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from asyncllm.errors import ConfigError
from asyncllm.sched.request import Request


class RequestQueue(ABC):
    """Requests waiting to be scheduled, in the order they should be admitted."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request according to the policy."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a preempted request back so that it is admitted before the requests it preceded."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit, left in the queue. Raises IndexError if empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit. Raises IndexError if empty."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove these requests (those not queued are ignored)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._queue = deque(request for request in self._queue if id(request) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float]:
    """Sort key of the priority policy: lower priority value first, then earlier arrival (FCFS)."""
    return (request.priority, request.arrival_time)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first; equal priorities in arrival order (then insertion order).

    A preempted request keeps its key, so it goes back ahead of every later arrival of its priority.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in doomed]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))


SCHEDULING_POLICIES = ("fcfs", "priority")


def create_request_queue(policy: str = "fcfs") -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority").

    Raises:
        ConfigError: for an unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ConfigError(f"unknown scheduling policy {policy!r}; choices: {list(SCHEDULING_POLICIES)}")
