"""n > 1: one user request fanned out into n child engine requests, merged back into one stream.

Child i has request id `f"{i}_{parent_id}"` (as vLLM v1; `parent_id` is the parent's internal id, the user's
id stays in `external_req_id`), `n=1`, and seed `seed + i` when the parent is
seeded. The parent's outputs tag each completion with its `index`; the parent is finished once every child
finished, and aborting the parent aborts every child.
"""

from __future__ import annotations

import msgspec

from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.outputs import CompletionOutput
from asyncllm.sampling_params import RequestOutputKind


class ParentRequest:
    """The frontend state shared by the n children of one request.

    Args:
        request: the user's validated request (`sampling_params.n > 1`).
    Attributes:
        request_id: the parent's internal id (unique).
        external_req_id: the user's request id (what its outputs carry).
        child_requests: the n engine requests, in index order.
        unfinished: child ids still running.
    """

    def __init__(self, request: EngineCoreRequest) -> None:
        self.request_id = request.request_id
        self.external_req_id = request.external_req_id or request.request_id
        self.output_kind = request.sampling_params.output_kind
        self.child_requests = [_make_child(request, i) for i in range(request.sampling_params.n)]
        self.unfinished = {child.request_id for child in self.child_requests}
        self._final_completions: list[CompletionOutput] = []

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def add_completion(self, child_id: str, completion: CompletionOutput) -> list[CompletionOutput] | None:
        """Record a child's completion output; returns the completions the parent's next output carries.

        CUMULATIVE and DELTA: the child's completion at once. FINAL_ONLY: None until every child finished,
        then all n completions in index order.
        """
        if completion.finished:
            self.unfinished.discard(child_id)
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion]
        self._final_completions.append(completion)
        if not self.finished:
            return None
        return sorted(self._final_completions, key=lambda c: c.index)


def child_request_id(parent_id: str, index: int) -> str:
    """The engine request id of completion `index` of `parent_id`."""
    return f"{index}_{parent_id}"


def _make_child(request: EngineCoreRequest, index: int) -> EngineCoreRequest:
    params = request.sampling_params
    seed = None if params.seed is None else params.seed + index
    child_params = msgspec.structs.replace(params, n=1, seed=seed)
    return msgspec.structs.replace(
        request, request_id=child_request_id(request.request_id, index), sampling_params=child_params
    )
