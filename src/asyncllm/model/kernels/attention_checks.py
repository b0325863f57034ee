"""The attention kernels' references and start-up checks (`csrc/paged_attention.cpp`,
`csrc/paged_prefill_attention.cpp`): what each computes, by torch ops one sequence at a time, and the comparisons
`row_kernels.self_check` makes. The kernels sum in another order than SDPA, so they are held to a tolerance, not to
the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# |kernel - SDPA| at most this x max |value| (float32 sums in another order: ~1e-7 relative seen)
ATTENTION_TOLERANCE = 1e-5
# The prefill kernel's bfloat16 products (`RowKernels.paged_prefill_attention_bf16_dot`) against SDPA on the same
# bfloat16-rounded queries: each softmax weight rounded to bfloat16 moves by at most 2^-9 of itself, and the weights
# are normalized by their rounded sum, so a row's output, a convex combination of its values, moves by at most
# 2 x 2^-9 of the values' largest magnitude.
BF16_DOT_TOLERANCE = 2.0**-8


def decode_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """What `paged_decode_attention` computes, by torch ops one sequence at a time: the cached tokens gathered
    through the block table (a bfloat16 cache widened to float32, exactly), SDPA over the query heads (GQA by
    repeating K/V heads). `[num_seqs, num_heads * head_dim]` float32."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    rows = []
    for s in range(num_seqs):
        length = int(seq_lens[s])
        first = max(0, length - window) if window > 0 else 0
        blocks = block_tables[s, : -(-length // block_size)]
        key, value = (kv_cache[blocks, i].float().reshape(-1, num_kv_heads, head_dim)[first:length] for i in (0, 1))
        key, value = (t.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0) for t in (key, value))
        out = F.scaled_dot_product_attention(query[s].unsqueeze(1), key, value)  # [num_heads, 1, head_dim]
        rows.append(out.reshape(-1))
    return torch.stack(rows)


def compare_decode_attention(decode: Callable[..., torch.Tensor], gen: torch.Generator) -> str:
    """`decode` (the kernel's `paged_decode_attention`) against `decode_attention_reference` on a shuffled float32 and
    bfloat16 cache: GQA (8 query heads over 2 K/V heads), sequences of 1, 5 and 37 tokens (a partial last block), with
    and without a window. Returns "" when every result is within `ATTENTION_TOLERANCE`, else what differs."""
    block_size, head_dim = 4, 16
    float_cache = torch.randn(32, 2, block_size, 2, head_dim, generator=gen)
    seq_lens = torch.tensor([1, 5, 37])
    block_tables = torch.randperm(32, generator=gen)[:30].view(3, 10).contiguous()
    query = torch.randn(3, 8, head_dim, generator=gen)
    for kv_cache in (float_cache, float_cache.to(torch.bfloat16)):
        bound = ATTENTION_TOLERANCE * float(kv_cache[:, 1].abs().max())
        for window in (0, 6):
            got = decode(query, kv_cache, block_tables, seq_lens, head_dim**-0.5, window)
            want = decode_attention_reference(query, kv_cache, block_tables, seq_lens, window)
            if got.shape != want.shape or float((got - want).abs().max()) > bound:
                return f"paged_decode_attention differs from SDPA (window {window}, {kv_cache.dtype} cache)"
    return ""


def prefill_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    spans: list[tuple[int, int, int]],
    window: int = 0,
    bf16_queries: bool = False,
) -> torch.Tensor:
    """What `paged_prefill_attention_` computes, by torch ops one sequence at a time: the cached tokens gathered
    through the block table (a bfloat16 cache widened to float32, exactly), SDPA in float64 over the query heads (GQA
    by repeating K/V heads) with the causal (and window) mask of each query's position, scale 1 / sqrt(head_dim).
    `bf16_queries`: the queries times the scale rounded to bfloat16 first, as the kernel's bfloat16 products do.
    `spans`: (first query row, query tokens, tokens in the cache) per sequence. `[num_tokens, num_heads * head_dim]`
    float32; rows of no span are 0."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    scaled = query * head_dim**-0.5  # float32, as the kernel scales
    scaled = scaled.bfloat16() if bf16_queries else scaled
    out = query.new_zeros(num_tokens, num_heads * head_dim)
    for s, (start, query_len, seq_len) in enumerate(spans):
        blocks = block_tables[s, : -(-seq_len // block_size)]
        key, value = (
            kv_cache[blocks, i].double().reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1) for i in (0, 1)
        )
        key, value = (t.repeat_interleave(num_heads // num_kv_heads, dim=0) for t in (key, value))
        positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        allowed = (keys <= positions) & ((keys > positions - window) if window > 0 else True)
        q = scaled[start : start + query_len].transpose(0, 1).double()
        o = F.scaled_dot_product_attention(q, key, value, attn_mask=allowed, scale=1.0)  # [heads, query_len, head_dim]
        out[start : start + query_len] = o.transpose(0, 1).reshape(query_len, -1).float()
    return out


def compare_prefill_attention(prefill_: Callable[..., None], gen: torch.Generator, bf16_dot: bool = False) -> str:
    """`prefill_` (the kernel's `paged_prefill_attention_`) against `prefill_attention_reference` on a shuffled float32
    and bfloat16 cache: GQA (8 query heads of 32 over 2 K/V heads), a fresh chunk of 5 tokens, 13 tokens after 21
    cached (partial blocks at both ends) and one token after 6, with and without a window. Returns "" when every
    result is within `ATTENTION_TOLERANCE` (`bf16_dot`, the kernel's bfloat16 products: the bfloat16 cache within
    `BF16_DOT_TOLERANCE` more, against bfloat16-rounded queries), else what differs."""
    block_size, head_dim = 4, 32
    float_cache = torch.randn(40, 2, block_size, 2, head_dim, generator=gen)
    spans = [(0, 5, 5), (5, 13, 34), (18, 1, 7)]
    block_tables = torch.randperm(40, generator=gen)[:27].view(3, 9).contiguous()
    query = torch.randn(19, 8, head_dim, generator=gen)
    starts, query_lens, seq_lens = (torch.tensor(column) for column in zip(*spans, strict=True))
    for kv_cache in (float_cache, float_cache.to(torch.bfloat16)):
        bf16_products = bf16_dot and kv_cache.dtype == torch.bfloat16
        tolerance = ATTENTION_TOLERANCE + (BF16_DOT_TOLERANCE if bf16_products else 0.0)
        bound = tolerance * float(kv_cache[:, 1].abs().max())
        for window in (0, 6):
            got = torch.zeros(19, 8 * head_dim)
            prefill_(got, query, kv_cache, block_tables, starts, query_lens, seq_lens, head_dim**-0.5, window)
            want = prefill_attention_reference(query, kv_cache, block_tables, spans, window, bf16_products)
            if float((got - want).abs().max()) > bound:
                return f"paged_prefill_attention_ differs from SDPA (window {window}, {kv_cache.dtype} cache)"
    return ""
