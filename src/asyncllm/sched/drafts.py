"""The scheduler's use of n-gram drafts (speculative decoding): which drafts a decoding request gets this step,
its KV slots with or without them, and taking the rejected ones back after verification.

The drafts themselves come from `spec_decode/drafter.py` (`Drafter`: proposer, draft-length policy, counters).
"""

from __future__ import annotations

from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request
from asyncllm.spec_decode.drafter import Drafter


def propose_drafts(
    drafter: Drafter | None, req: Request, budget: int, max_model_len: int, num_running: int, num_waiting: int
) -> list[int]:
    """The n-gram drafts to verify after a decoding request's last token (none for a prefill chunk, a
    structured-output request, or when the token budget, `max_tokens` or `max_model_len` leave no room).

    Args:
        budget: tokens left in this step's budget.
        num_running, num_waiting: the scheduler's queue lengths (`disable_by_batch_size`, draft policy).
    """
    structured = req.sampling_params.structured_outputs is not None
    if drafter is None or req.num_tokens_to_compute != 1 or structured or req.pooling_params is not None:
        return []
    room = min(budget, max_model_len - req.num_tokens) - 1
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - req.num_output_tokens - 1)
    return drafter.propose(req, room, num_running, num_waiting)


def allocate_with_drafts(
    kv_cache_manager: KVCacheManager, req: Request, num_tokens: int, drafts: list[int]
) -> tuple[list[int], list[int] | None]:
    """KV slots for `num_tokens` plus `drafts`; without the drafts when they do not fit.

    Returns:
        (drafts kept, new block ids or None when not even `num_tokens` fit).
    """
    new_block_ids = kv_cache_manager.allocate_slots(req, num_tokens + len(drafts))
    if new_block_ids is None and drafts:  # no room for the drafts: run the plain decode instead
        drafts = []
        new_block_ids = kv_cache_manager.allocate_slots(req, num_tokens)
    return drafts, new_block_ids


def apply_verification(drafter: Drafter | None, req: Request, num_drafts: int, num_accepted: int) -> None:
    """Take the rejected drafts back from `num_computed_tokens` and count the verification."""
    req.num_computed_tokens -= num_drafts - num_accepted
    if drafter is not None:
        drafter.observe_verification(req, num_drafts, num_accepted)
