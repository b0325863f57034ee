"""`LoadBalancer`: picks the data-parallel engine core for each new request, and tracks which one holds it.

Load of an engine = running + waiting requests from the scheduler stats it last published (they arrive with
every step's outputs) + the requests this client sent it since that publication (the stats lag by one step, and
a burst of submissions sees no new stats at all). A new request goes to the least-loaded engine that accepts
new work, except that a prompt sharing at least one full KV cache block with an earlier prompt prefers the
engine that served that prefix (its prefix cache holds those blocks) unless that engine's load exceeds the
least load by more than `affinity_slack(least)` requests. Ties go to the engine with fewer of this client's
requests in flight, then to the lowest rank. The prefix index keeps the chained hashes of prompt blocks, as the
engine's prefix cache does (`sched/block_pool.py`), in a bounded LRU map.

The selection follows the idea of vLLM v1's `DPLBAsyncMPClient.get_core_engine_for_request` (the engines'
published request counts plus the client's own sends since); the prefix affinity is our own addition.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from asyncllm.errors import InvalidRequestError
from asyncllm.messages.engine import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

MAX_PREFIX_ENTRIES = 65536  # block hashes remembered (LRU); ~10 MB at most
MIN_AFFINITY_SLACK = 4  # requests


def affinity_slack(least_load: int) -> int:
    """How many requests more than the least-loaded engine a prefix-affine engine may have and still be chosen:
    max(4, a quarter of the least load)."""
    return max(MIN_AFFINITY_SLACK, least_load // 4)


class LoadBalancer:
    """Chooses engines by load and prefix affinity; knows the rank holding each in-flight request.

    Args:
        block_size: tokens per KV cache block (prefix affinity works on full blocks).
        prefix_affinity: prefer the engine that served a prompt's prefix (with prefix caching on).
    """

    def __init__(self, block_size: int, prefix_affinity: bool = True) -> None:
        self._block_size = block_size
        self._prefix_affinity = prefix_affinity
        self._accepting: set[int] = set()  # ranks that take new requests
        self._published: dict[int, int] = {}  # rank -> running + waiting in its last stats
        self._sent_since_stats: dict[int, int] = {}
        self._in_flight: dict[int, set[str]] = {}
        self._owner: dict[str, int] = {}  # request id -> rank
        self._stats: dict[int, SchedulerStats] = {}
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # chained block hash -> rank that computed it

    # ---- engines ---------------------------------------------------------------------------------------

    def add_engine(self, rank: int) -> None:
        """Start sending new requests to `rank` (a fresh engine: no load)."""
        self._accepting.add(rank)
        self._published[rank] = 0
        self._sent_since_stats[rank] = 0
        self._in_flight.setdefault(rank, set())

    def stop_accepting(self, rank: int) -> None:
        """Send no new request to `rank` (draining); its in-flight requests stay tracked."""
        self._accepting.discard(rank)

    def remove_engine(self, rank: int) -> list[str]:
        """Forget `rank` entirely; returns the ids of its requests still in flight (now untracked)."""
        self._accepting.discard(rank)
        self._published.pop(rank, None)
        self._sent_since_stats.pop(rank, None)
        self._stats.pop(rank, None)
        lost = sorted(self._in_flight.pop(rank, set()))
        for request_id in lost:
            self._owner.pop(request_id, None)
        for key in [k for k, r in self._prefixes.items() if r == rank]:
            del self._prefixes[key]
        return lost

    @property
    def accepting_ranks(self) -> list[int]:
        """Ranks that take new requests, ascending."""
        return sorted(self._accepting)

    def num_in_flight(self, rank: int) -> int:
        """This client's unfinished requests on `rank`."""
        return len(self._in_flight.get(rank, ()))

    def load(self, rank: int) -> int:
        """Running + waiting requests last published by `rank` + requests sent to it since."""
        return self._published.get(rank, 0) + self._sent_since_stats.get(rank, 0)

    # ---- requests --------------------------------------------------------------------------------------

    def choose(self, request: EngineCoreRequest, pinned_rank: int | None = None) -> int:
        """The rank to send `request` to (see the module docstring).

        Args:
            pinned_rank: `generate(..., data_parallel_rank=k)`: use rank k.
        Raises:
            InvalidRequestError: `pinned_rank` is not an engine taking new requests, or no engine takes any.
        """
        if pinned_rank is not None:
            if pinned_rank not in self._accepting:
                raise InvalidRequestError(
                    f"data_parallel_rank={pinned_rank!r}: not a serving engine rank (serving: {self.accepting_ranks})"
                )
            return pinned_rank
        if not self._accepting:
            raise InvalidRequestError("no data-parallel engine takes new requests (all are draining or restarting)")
        least = min(self._accepting, key=lambda r: (self.load(r), self.num_in_flight(r), r))
        if self._prefix_affinity:
            affine = self._affine_rank(request.prompt_token_ids)
            if affine is not None and self.load(affine) <= self.load(least) + affinity_slack(self.load(least)):
                return affine
        return least

    def track(self, request: EngineCoreRequest, rank: int) -> None:
        """Record that `request` was sent to `rank`."""
        self._owner[request.request_id] = rank
        self._in_flight[rank].add(request.request_id)
        self._sent_since_stats[rank] += 1
        if self._prefix_affinity:
            self._remember_prefix(request.prompt_token_ids, rank)

    def owner(self, request_id: str) -> int | None:
        """The rank holding an in-flight request, or None."""
        return self._owner.get(request_id)

    def group_by_owner(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """In-flight `request_ids` grouped by the rank holding them (unknown ids are left out)."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._owner.get(request_id)
            if rank is not None:
                groups.setdefault(rank, []).append(request_id)
        return groups

    def observe(self, outputs: EngineCoreOutputs) -> None:
        """Update loads and in-flight sets from a batch of outputs (stats, finished and failed requests)."""
        for request_id in outputs.finished_requests or ():
            self._untrack(request_id)
        for request_id in outputs.failed_requests or ():
            self._untrack(request_id)
        stats = outputs.scheduler_stats
        rank = outputs.engine_index
        if stats is not None and rank in self._published:
            self._stats[rank] = stats
            self._published[rank] = stats.num_running_reqs + stats.num_waiting_reqs
            self._sent_since_stats[rank] = 0

    def _untrack(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._in_flight.get(rank, set()).discard(request_id)

    # ---- prefix affinity -------------------------------------------------------------------------------

    def _block_hashes(self, token_ids: list[int]) -> list[int]:
        size, hashes, parent = self._block_size, [], 0
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, tuple(token_ids[start : start + size])))
            hashes.append(parent)
        return hashes

    def _affine_rank(self, token_ids: list[int]) -> int | None:
        """The accepting rank that last computed the longest run of this prompt's full blocks, or None."""
        found = None
        for block_hash in self._block_hashes(token_ids):
            rank = self._prefixes.get(block_hash)
            if rank is None:
                break
            if rank in self._accepting:
                found = rank
        return found

    def _remember_prefix(self, token_ids: list[int], rank: int) -> None:
        for block_hash in self._block_hashes(token_ids):
            self._prefixes[block_hash] = rank
            self._prefixes.move_to_end(block_hash)
        while len(self._prefixes) > MAX_PREFIX_ENTRIES:
            self._prefixes.popitem(last=False)
