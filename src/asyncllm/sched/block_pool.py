"""`BlockPool`: the KV cache's fixed-size blocks, a free list and reference counts.

A block holds the K/V of `block_size` consecutive tokens of one sequence in every layer. The pool only hands
out and takes back block ids; the workers own the tensors. Blocks are reference-counted so that prefix caching
(a later issue) can share a full block between requests: each `KVCacheBlock` has a `block_hash` slot for the
chained hash of its tokens, unused for now. Design after vLLM v1's `BlockPool` (vllm/v1/core/block_pool.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """One block of the paged KV cache.

    Fields:
        block_id: index into the first dimension of every layer's cache tensor.
        ref_cnt: requests holding this block (0 = free).
        block_hash: chained hash of the block's tokens once full (prefix caching, a later issue); None now.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Hands out free blocks and takes them back when their last holder frees them.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
    Raises:
        ValueError: if num_blocks < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # FIFO: a freed block goes to the back, so (with prefix caching) the least recently freed is reused first.
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, each with ref_cnt 1.

        Raises:
            ValueError: if fewer than `num_blocks` blocks are free (check `num_free_blocks` first).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        blocks = [self.blocks[self._free_block_ids.popleft()] for _ in range(num_blocks)]
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list.

        Pass a request's blocks in reverse order (tail first) so that, with prefix caching, a request's tail
        blocks are evicted before its shared prefix.

        Raises:
            ValueError: if a block is already free (a double free is a scheduler bug).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.block_hash = None
                self._free_block_ids.append(block.block_id)
