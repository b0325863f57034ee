"""`KVCacheManager`: which KV cache blocks each request holds, and prefix-cache lookup.

Allocation is by tokens: a request with `num_computed_tokens` tokens in the cache that computes
`num_new_tokens` more needs `ceil((num_computed_tokens + num_new_tokens) / block_size)` blocks; only the
missing ones are allocated. With prefix caching, a request about to be admitted first looks up the chained
hashes of its full blocks (`get_computed_blocks`; the chain starts from its `cache_salt` and LoRA
adapter id, see
`block_pool.root_block_hash`); the longest run of hits becomes its first blocks and
its `num_computed_tokens`, and never covers the last token (it must be computed to have logits to sample).
Full blocks are cached when they are scheduled (their K/V is written by the step that computes them, before
any attention in that step reads it). After vLLM v1's `KVCacheManager` (vllm/v1/core/kv_cache_manager.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncllm.sched.block_pool import BlockPool, KVCacheBlock, hash_block_tokens, root_block_hash
from asyncllm.sched.request import Request


class KVCacheManager:
    """Per-request block tables over one `BlockPool`.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        enable_caching: prefix caching on (reuse cached full blocks across requests).
    Attributes:
        num_prefix_cache_queries: tokens looked up in the prefix cache since start (admitted requests).
        num_prefix_cache_hits: of those, tokens found cached.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_to_num_cached_blocks: dict[str, int] = {}
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (evictable cached blocks included)."""
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start, in [0, 1]; 0.0 before any query."""
        if self.num_prefix_cache_queries == 0:
            return 0.0
        return self.num_prefix_cache_hits / self.num_prefix_cache_queries

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (see `BlockPool.reset_prefix_cache`); False while a request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts the request's tokens (nothing is taken yet).

        At most `(num_tokens - 1) // block_size` blocks, so at least one token is left to compute. Empty when
        caching is off, the request already holds blocks, or it skips the prefix cache
        (`Request.skips_prefix_cache`: prompt logprobs, pooling, prompt embeddings).
        """
        if not self.enable_caching or self._req_to_blocks.get(request.request_id):
            return []
        if request.skips_prefix_cache:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_cache_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup for `prefix_cache_hit_rate` (tokens)."""
        if self.enable_caching:
            self.num_prefix_cache_queries += num_tokens
            self.num_prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request` after its computed ones.

        Args:
            request: its `num_computed_tokens` counts tokens already in its own blocks.
            num_new_tokens: tokens to compute this step.
            computed_blocks: prefix-cache hits from `get_computed_blocks` (only for a request holding no
                blocks); they are taken (ref counted) and become its first blocks.
        Returns:
            The ids of the newly allocated blocks (possibly empty), appended to the request's block table;
            None when there are not enough free blocks (nothing is taken then).
        """
        blocks = self._req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_missing = max(0, num_needed - len(blocks) - len(computed_blocks))
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_missing > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.allocate(num_missing) if num_missing else []
        blocks = self._req_to_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks)."""
        return [block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return every block of `request` to the pool (tail first). No-op if it holds none."""
        self._req_to_num_cached_blocks.pop(request.request_id, None)
        blocks = self._req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free(reversed(blocks))

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its known tokens."""
        size, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        for index in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else root_block_hash(request.cache_salt, request.lora_int_id)
            hashes.append(hash_block_tokens(parent, tokens[index * size : (index + 1) * size]))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Cache the request's blocks that are full once `num_tokens` of its known tokens are computed. Never
        those of an embeddings prompt: their token ids are placeholders, so their hashes would lie."""
        if not self.enable_caching or request.prompt_embeds is not None:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._req_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for index in range(start, num_full):
            self.block_pool.cache_full_block(blocks[index], request.block_hashes[index])
        self._req_to_num_cached_blocks[request.request_id] = num_full
