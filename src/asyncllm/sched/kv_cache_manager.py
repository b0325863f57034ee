"""`KVCacheManager`: which KV cache blocks each request holds.

Allocation is by tokens: a request with `num_computed_tokens` tokens in the cache that computes
`num_new_tokens` more needs `ceil((num_computed_tokens + num_new_tokens) / block_size)` blocks; only the
missing ones are allocated. Prefix-cache lookup (a later issue) goes here too. After vLLM v1's
`KVCacheManager` (vllm/v1/core/kv_cache_manager.py).
"""

from __future__ import annotations

from asyncllm.sched.block_pool import BlockPool, KVCacheBlock
from asyncllm.sched.request import Request


class KVCacheManager:
    """Per-request block tables over one `BlockPool`.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_total_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its `num_computed_tokens`.

        Returns:
            The ids of the newly allocated blocks (possibly empty), appended to the request's block table;
            None when there are not enough free blocks (nothing is allocated then).
        """
        blocks = self._req_to_blocks.setdefault(request.request_id, [])
        num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        num_missing = num_needed - len(blocks)
        if num_missing <= 0:
            return []
        if num_missing > self.block_pool.num_free_blocks:
            if not blocks:
                del self._req_to_blocks[request.request_id]
            return None
        new_blocks = self.block_pool.allocate(num_missing)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks)."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return every block of `request` to the pool (tail first). No-op if it holds none."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(reversed(blocks))
