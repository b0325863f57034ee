"""`BlockPool`: the KV cache's fixed-size blocks, an LRU free queue, reference counts and the prefix cache.

A block holds the K/V of `block_size` consecutive tokens of one sequence in every layer. The pool only hands
out and takes back block ids; the workers own the tensors. Prefix caching: once a block is full, it gets the
chained hash of its tokens (`hash_block_tokens`) and is findable by it. A block whose last holder frees it
goes to the back of the free queue with its hash kept, so a later request with the same prefix can take it
back (`touch`); `allocate` takes free blocks from the front (least recently freed first) and evicts their
hashes then. A cached block nobody holds counts as free: it is evictable.
Design after vLLM v1's `BlockPool` and `FreeKVCacheBlockQueue` (vllm/v1/core/block_pool.py, kv_cache_utils.py).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes
ROOT_BLOCK_HASH: BlockHash = b""  # the parent of a sequence's first block


def root_block_hash(cache_salt: str | None, lora_int_id: int | None = None) -> BlockHash:
    """The parent hash of a sequence's first block: empty for a plain request; for a salted one
    sha256("cache_salt" NUL salt); with a LoRA adapter, the chain starts from sha256("lora" NUL int64 id) (and a
    salt is hashed after it).

    A salt or an adapter thus changes the hash of every block of the request (the chain starts from it), so
    requests with different salts or adapters (or one with, one without) never share a cached block: vLLM's
    `cache_salt` and LoRA extra keys, which it mixes into the first block's hash.
    """
    root = ROOT_BLOCK_HASH
    if lora_int_id is not None:
        root = hashlib.sha256(b"lora\0" + lora_int_id.to_bytes(8, "little", signed=True)).digest()
    if cache_salt is not None:
        root = hashlib.sha256(root + b"cache_salt\0" + cache_salt.encode()).digest()
    return root


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: sha256(parent hash || int64 token ids), 32 bytes.

    The parent hash makes a block's hash stand for the whole prefix up to and including it, so equal hashes
    mean equal prefixes (up to sha256 collisions). Deterministic across processes (no PYTHONHASHSEED).
    Source: vLLM v1 `hash_block_tokens` (vllm/v1/core/kv_cache_utils.py), sha256 variant.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass
class KVCacheBlock:
    """One block of the paged KV cache.

    Fields:
        block_id: index into the first dimension of every layer's cache tensor.
        ref_cnt: requests holding this block (0 = free).
        block_hash: chained hash of the block's tokens once full and cached; None otherwise. Kept while the
            block is free until the block is evicted (reallocated).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Hands out free blocks, takes them back when their last holder frees them, and finds cached blocks.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
        enable_caching: keep hashes of full blocks so they can be reused (prefix caching).
    Raises:
        ValueError: if num_blocks < 1.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # LRU order: a freed block goes to the back; allocation takes (and evicts) from the front.
        self._free_blocks: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evictable)."""
        return len(self._free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (held or free)."""
        return len(self._cached_blocks)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (least recently freed first), each with ref_cnt 1 and no hash.

        Raises:
            ValueError: if fewer than `num_blocks` blocks are free (check `num_free_blocks` first).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free")
        blocks = [self._free_blocks.popitem(last=False)[1] for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block cached under `block_hash`, held or free; None on a miss."""
        return self._cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each cached block (a prefix-cache hit); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_blocks[block.block_id]
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full, held block findable by its chained hash. No-op when caching is off, when the block is
        already cached, or when another block already holds the same prefix (the first one stays)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached_blocks:
            return
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds go to the back of the free queue.

        Pass a request's blocks in reverse order (tail first) so that its tail blocks are evicted before its
        shared prefix.

        Raises:
            ValueError: if a block is already free (a double free is a scheduler bug).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_blocks[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, so no later request hits the prefix cache until blocks fill again.

        Returns:
            True when reset; False (nothing changed) while any block is held by a request: a held block's hash
            must stay, or its request could not share it. Follows vLLM's `BlockPool.reset_prefix_cache`.
        """
        if self.num_free_blocks != self.num_total_blocks:
            return False
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached_blocks[block.block_hash]
            block.block_hash = None
