"""Waiting queues of the scheduler: the `RequestQueue` interface and its first-come-first-served form.

A priority queue (a later issue) implements the same interface; the scheduler only calls these methods.
After vLLM v1's `vllm/v1/core/sched/request_queue.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from asyncllm.errors import InvalidRequestError
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


def create_request_queue(policy: str = "fcfs") -> RequestQueue:
    """The waiting queue for a scheduling policy.

    Raises:
        InvalidRequestError: for an unknown policy (only "fcfs" exists now).
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    raise InvalidRequestError(f"unknown scheduling policy {policy!r}; choices: ['fcfs']")
