"""Paged attention in plain torch: write K/V into the block cache, gather per group, run SDPA, scatter back.

The cache of one layer is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V), float32
or bfloat16 (`CacheConfig.cache_dtype`). With a bfloat16 cache, K/V are rounded to bfloat16 (nearest even) as
they are written; SDPA runs on bfloat16 query/key/value (a fresh chunk's own K/V rounded the same way, so a
result does not depend on whether a prefix came from the cache) and its output goes back to float32; the decode
kernel widens the cached rows to float32 and computes in float32; the prefill kernel multiplies in bfloat16 on CPUs
with AVX512_BF16 (float32 sums and softmax) and widens elsewhere. The rest of the model stays float32.

A token's slot is `block_id * block_size + offset`. For each `AttentionGroup` (decodes, prefills), the keys/values
of every sequence are gathered through its block table into `[num_seqs, max_seq_len, num_kv_heads, head_dim]` and
one batched `scaled_dot_product_attention` call runs with the group's mask (causal with the cached-prefix offset,
plus padding), passed in the float form SDPA would convert a boolean mask to, built once per step
(`AttentionGroup.attn_bias`). No Python loop over sequences or tokens. A sliding-window layer (Gemma 3's local
layers; Beltagy et al., 2020) uses the same gather with the keys before its window masked too
(`AttentionGroup.bias(window)`, built once per step and window). Prefill chunks of full-attention layers, given this
step's K/V, run one sequence at a time instead (`prefill_attention.py`: no padding, no mask, no gather of a fresh
chunk's keys, the masked triangle skipped after a cached prefix).

With the C++ kernels loaded (`model/kernels/row_kernels.py`) none of that runs for float32 or bfloat16 caches
without soft-capping: decodes read the cache through the block tables (`csrc/paged_attention.cpp`), and so do
prefill chunks, full or windowed (`csrc/paged_prefill_attention.cpp`: one pass of flash attention's online softmax
over the cached prefix and the chunk, in float32; per layer 1.3-2.6x the ATen flash path on SmolLM2's heads, AMD EPYC
with AVX-512, `benchmarks/prefill_attention.py`). The torch paths above are the fallback and the reference.

Source: scaled dot-product attention (Vaswani et al., 2017); paged KV cache (Kwon et al., 2023, vLLM);
grouped-query attention (Ainslie et al., 2023).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncllm.model.layers.attention_metadata import AttentionGroup, AttentionMetadata
from asyncllm.model.layers.prefill_attention import prefix_split_available, sequence_prefill_attention

if TYPE_CHECKING:
    from asyncllm.model.kernels.row_kernels import RowKernels


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernels: RowKernels | None = None,
) -> None:
    """Store this step's keys and values in the paged cache, in place (one indexed write for both, or one
    `store_kv_cache_` kernel call: the same values).

    Args:
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] float32 or bfloat16; modified in place.
        key, value: [num_tokens, num_kv_heads, head_dim] float32 (rounded to nearest even into a bfloat16 cache,
            as `.to(torch.bfloat16)`).
        slot_mapping: [num_tokens] int64 slot (block_id * block_size + offset) of each token.
        slot_blocks: (block ids, offsets) of `slot_mapping`, [num_tokens] int64 each, if already computed
            (`AttentionMetadata.slot_blocks`, once per step instead of once per layer).
        kernels: the fused row kernels (`model/kernels/row_kernels.py`), if loaded.
    Raises:
        IndexError: if a slot is outside the cache.
    """
    if slot_blocks is None:
        block_size = kv_cache.shape[2]
        slot_blocks = torch.div(slot_mapping, block_size, rounding_mode="floor"), slot_mapping % block_size
    blocks, offsets = slot_blocks
    if kernels is not None:
        kernels.store_kv_cache_(kv_cache, key, value, blocks, offsets)
        return
    kv_cache.permute(0, 2, 1, 3, 4)[blocks, offsets] = torch.stack((key, value), dim=1).to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a group's sequences, in position order.

    Returns:
        (key, value), each [num_seqs, num_kv_heads, max_seq_len, head_dim] (SDPA layout; strided views).
    """
    num_seqs, max_blocks = group.block_tables.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_ids = group.block_tables.flatten()

    def gather(index: int) -> torch.Tensor:  # one row gather of whole blocks: the fastest copy on CPU
        blocks = torch.index_select(kv_cache[:, index], 0, block_ids)
        flat = blocks.view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
        return flat[:, : group.max_seq_len].transpose(1, 2)

    return gather(0), gather(1)


def decode_reads_cache(kernels: RowKernels | None, head_dim: int) -> bool:
    """Whether decode-only steps read K/V straight from the paged cache (`RowKernels.paged_decode_attention`,
    for head sizes of 16..256 floats in steps of 16) rather than through a dense copy (`gather_kv` or the K/V mirror).
    """
    return kernels is not None and head_dim % 16 == 0 and head_dim <= 256


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernels: RowKernels | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each query token over its sequence's cached keys/values (this step's already written), or over
    the last `window` of them (itself included) for a sliding-window layer.

    Args:
        query: [num_tokens, num_heads, head_dim] float32 (rotary already applied).
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]; num_heads % num_kv_heads == 0 (GQA).
        meta: the step's metadata; every token belongs to exactly one group.
        scale: softmax scale; default 1 / sqrt(head_dim).
        new_kv: this step's (key, value), [num_tokens, num_kv_heads, head_dim] each, as written to `kv_cache`;
            a decode step's K/V mirror takes them from here instead of reading the cache back. Optional.
        kernels: the fused row kernels, if loaded (the mirror's row writes).
        window: the layer's sliding window, tokens (>= 1), or None for full attention. Keys outside it are
            masked (`AttentionGroup.bias`); the cache and the decode mirror keep every token, so chunked prefill,
            prefix caching and preemption see the same cache as for full attention.
        softcap: cap the scaled scores as `softcap * tanh(scores / softcap)` before the mask and softmax (Gemma 2;
            computed in plain torch ops instead of SDPA), None: no cap.
    Returns:
        [num_tokens, num_heads * head_dim] float32.
    """
    num_tokens, num_heads, head_dim = query.shape
    if len(meta.groups) == 1 and meta.groups[0].max_query_len == 1:  # decodes only: row i is sequence i's query
        return _decode_attention(query, kv_cache, meta, scale, new_kv, kernels, window, softcap)
    # Row num_tokens is a scratch row: padded query positions read it and write their (discarded) output to it.
    padded_query = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])
    out = query.new_empty(num_tokens + 1, num_heads * head_dim)
    for group in meta.groups:  # at most two: decodes, prefills
        one_token = group.max_query_len == 1 and softcap is None
        if one_token and kernels is not None and decode_reads_cache(kernels, head_dim):
            rows = group.query_index[:, 0]  # the decodes of a mixed step: straight from the cache too
            out[rows] = _cache_decode_attention(query[rows], kv_cache, group, scale, kernels, window)
        elif softcap is None and prefill_reads_cache(kernels, group, head_dim):
            assert kernels is not None
            _cache_prefill_attention(query, kv_cache, group, scale, kernels, window, out)
        elif per_sequence_prefill(group, new_kv, window, softcap):
            assert new_kv is not None
            sequence_prefill_attention(query, kv_cache, group, new_kv, scale, out)
        else:
            out[group.query_index] = _group_attention(padded_query, kv_cache, group, scale, window, softcap)
    return out[:num_tokens]


def per_sequence_prefill(
    group: AttentionGroup,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    window: int | None,
    softcap: float | None,
) -> bool:
    """Whether a group of multi-token queries runs one sequence at a time (`sequence_prefill_attention`: no padding,
    no mask, a fresh chunk's keys read in place) rather than as one padded, masked SDPA call: for full attention
    (or a window no key falls out of) without soft-capping, given this step's K/V, where the torch build has what
    the cached-prefix split needs."""
    full = window is None or group.max_seq_len <= window
    return full and softcap is None and new_kv is not None and prefix_split_available()


def prefill_reads_cache(kernels: RowKernels | None, group: AttentionGroup, head_dim: int) -> bool:
    """Whether a group of multi-token queries runs on the prefill kernel, which reads the cache through the block
    tables (`csrc/paged_prefill_attention.cpp`): with the kernels loaded and its vector code built, a head_dim that
    is a multiple of 8, and a group built with query positions."""
    return (
        kernels is not None
        and head_dim % 8 == 0
        and group.query_positions is not None
        and kernels.paged_prefill_attention_available()
    )


def _cache_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float | None,
    kernels: RowKernels,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Attention of a group of multi-token queries (`[num_tokens, num_heads, head_dim]`, the step's flat queries)
    over their sequences' cached tokens, this step's included, causal (and within the last `window` tokens when
    given), read from the cache by the kernel; written into the group's rows of `out` (`[>= num_tokens, num_heads *
    head_dim]` float32, contiguous)."""
    head_dim = query.shape[-1]
    softmax_scale = head_dim**-0.5 if scale is None else scale
    starts, query_lens = group.span_tensors
    kernels.paged_prefill_attention_(
        out,
        query.contiguous(),
        kv_cache,
        group.block_tables,
        starts,
        query_lens,
        group.seq_lens,
        softmax_scale,
        window or 0,
    )


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    kernels: RowKernels | None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[num_seqs, num_heads * head_dim] attention output of a step whose every sequence has one query token
    (query row i belongs to sequence i). With the kernels (`decode_reads_cache`), one kernel call reads the cache
    through the block tables. Otherwise SDPA over a dense copy: no padding row, no scatter, and the
    `[num_seqs, 1, 1, max_seq_len]` mask broadcasts over the query heads of each K/V head (no mask when every
    sequence has the same length: adding a mask of zeros changes nothing); K/V come from the step's mirror when it
    has one."""
    num_seqs, num_heads, head_dim = query.shape
    group = meta.groups[0]
    if softcap is None and kernels is not None and decode_reads_cache(kernels, head_dim):
        return _cache_decode_attention(query, kv_cache, group, scale, kernels, window)
    if meta.mirror is not None and meta.slot_blocks is not None:
        dense_key, dense_value = meta.mirror.key_value(kv_cache, meta.slot_blocks, new_kv, kernels)
        key = dense_key[:, : group.max_seq_len].transpose(1, 2)
        value = dense_value[:, : group.max_seq_len].transpose(1, 2)
    else:
        key, value = gather_kv(kv_cache, group)
    num_kv_heads = key.shape[1]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = _sdpa(q, key, value, group.bias(window), scale, softcap)
    return o.reshape(num_seqs, num_heads * head_dim).float()


def _cache_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float | None,
    kernels: RowKernels,
    window: int | None = None,
) -> torch.Tensor:
    """[num_seqs, num_heads * head_dim] attention of a group of one-token queries (`[num_seqs, num_heads,
    head_dim]`, row i of sequence i), read from the cache through the group's block tables by the kernel, over the
    last `window` tokens only when given."""
    head_dim = query.shape[-1]
    softmax_scale = head_dim**-0.5 if scale is None else scale
    return kernels.paged_decode_attention(
        query.contiguous(), kv_cache, group.block_tables, group.seq_lens, softmax_scale, window or 0
    )


def _group_attention(
    padded_query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """[num_seqs, max_query_len, num_heads * head_dim] attention output of one padded group.

    GQA without copying K/V (HF's `repeat_kv` order: query head h uses K/V head h // group): SDPA's `enable_gqa`,
    with the `[num_seqs, 1, max_query_len, max_seq_len]` mask broadcast over the heads, or `is_causal` for a group
    of fresh prefills of one length (`AttentionGroup.causal_only`: the same mask, its masked blocks skipped). With
    soft-capping (Gemma 2, written out), the query heads sharing a K/V head are folded into the query-length axis
    instead.
    """
    num_seqs, max_query_len = group.query_index.shape
    _, num_heads, head_dim = padded_query.shape
    key, value = gather_kv(kv_cache, group)
    num_kv_heads = key.shape[1]
    per_kv = num_heads // num_kv_heads
    q = padded_query[group.query_index]  # [num_seqs, max_query_len, num_heads, head_dim]
    if softcap is None:
        causal = group.causal_only and (window is None or window >= max_query_len)
        bias = None if causal else group.bias(window)  # [num_seqs, 1, max_query_len, max_seq_len]: 0 or -inf
        mask = None if causal else group.attn_bias if bias is None else bias
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(key.dtype),  # a bfloat16 cache: bfloat16 SDPA (the mask's 0 / -inf are exact)
            key,
            value,
            attn_mask=None if mask is None else mask.to(key.dtype),
            is_causal=causal,
            scale=scale,
            enable_gqa=per_kv > 1,
        )
        return o.transpose(1, 2).reshape(num_seqs, max_query_len, num_heads * head_dim).float()
    q = q.view(num_seqs, max_query_len, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, per_kv * max_query_len, head_dim)
    mask = group.bias(window)  # [num_seqs, 1, max_query_len, max_seq_len] float: 0 or -inf
    if mask is None:
        mask = group.attn_bias
    if per_kv > 1:
        mask = mask.unsqueeze(2).expand(-1, -1, per_kv, -1, -1).reshape(num_seqs, 1, per_kv * max_query_len, -1)
    o = _sdpa(q, key, value, mask, scale, softcap)
    o = o.view(num_seqs, num_kv_heads, per_kv, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(num_seqs, max_query_len, num_heads * head_dim)


def _sdpa(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """`scaled_dot_product_attention(q, key, value, mask, scale)`, or with the scores soft-capped (`softcap`), the
    same steps written out: q k^T * scale, cap, + mask, softmax, @ value. Shapes as SDPA's. Float32 `q` and `mask`
    with bfloat16 K/V (a bfloat16 cache): SDPA runs in bfloat16 (output bfloat16: the caller widens it); the
    soft-capped steps widen K/V to float32 (exact) and stay in float32."""
    if softcap is None:
        if mask is not None:
            mask = mask.to(key.dtype)
        return F.scaled_dot_product_attention(q.to(key.dtype), key, value, attn_mask=mask, scale=scale)
    key, value = key.float(), value.float()
    scores = q @ key.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    return scores.softmax(-1) @ value
