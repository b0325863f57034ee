"""Prefill attention one sequence at a time: no padding to the group's longest chunk, no mask tensor, and no copy
of a fresh chunk's keys.

A chunk of `Q` query tokens at positions `P .. P + Q - 1` (`P` tokens of the sequence already cached) attends
every key up to its own position. Split the keys in two:
- the cached prefix `0 .. P - 1`, which every query of the chunk sees whole: attention with no mask;
- the chunk's own keys `P .. P + Q - 1`: the causal triangle of a square, which SDPA's flash kernel computes with
  `is_causal`, skipping the blocks above the diagonal. These keys are this step's projections (`new_kv`), so they
  are read in place, never gathered back from the cache.
The two partial results are merged exactly by their log-sum-exps (the flash-attention / "online softmax" merge):
with `L = logaddexp(L1, L2)`, `out = out1 * exp(L1 - L) + out2 * exp(L2 - L)`. A fresh chunk (`P == 0`) needs only
the second part. Padded SDPA with a mask computes the masked upper triangle and the padding as well.

Measured per layer on SmolLM2-135M's shapes (9 query / 3 K/V heads of 64), one thread, CPU time, against one
masked SDPA call (`benchmarks/analysis.md`, "Prefill attention per sequence"): 1024 new tokens after 512 cached
40 -> 30 ms, 1024 after 1024 53 -> 41 ms, 512 after 1024 20 -> 18.5 ms.

The prefix part needs the log-sum-exp, which only ATen's CPU flash kernel returns
(`aten::_scaled_dot_product_flash_attention_for_cpu`, private). As with the C++ kernels, `prefix_split_available()`
checks it once per process against masked SDPA on a small GQA case with a cached prefix; when this torch lacks it
or it disagrees (a WARNING says so), the caller keeps padded SDPA.

Source: flash attention's log-sum-exp merge (Dao et al., 2022; Milakov & Gimelshein, 2018, online softmax).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from asyncllm.model.layers.attention_metadata import AttentionGroup

logger = logging.getLogger(__name__)

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@functools.cache
def prefix_split_available() -> bool:
    """Whether this torch's CPU flash kernel returns the log-sum-exp that the cached-prefix merge needs, and the
    merge it gives equals masked SDPA (within 1e-5) on a GQA case of 6 query / 2 K/V heads, 13 new tokens after 21
    cached. Checked once per process; a failure logs a WARNING."""
    if _FLASH_CPU is None:
        logger.warning("prefill attention: this torch has no CPU flash kernel with log-sum-exp; padded SDPA is used")
        return False
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 16, generator=gen) for heads, n in ((6, 13), (2, 34), (2, 34)))
    allowed = torch.arange(34)[None, :] <= torch.arange(21, 34)[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    try:
        got = _merged(q, (k[:, :, :21], v[:, :, :21]), (k[:, :, 21:], v[:, :, 21:]), None)
    except RuntimeError as e:
        logger.warning("prefill attention: the cached-prefix split failed its check (%s); padded SDPA is used", e)
        return False
    if not torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
        logger.warning("prefill attention: the cached-prefix split disagrees with SDPA; padded SDPA is used")
        return False
    return True


def sequence_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    group: AttentionGroup,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    scale: float | None,
    out: torch.Tensor,
) -> None:
    """Full-attention (no window, no soft-capping) output of each sequence of a prefill group, written into `out`.

    Args:
        query: [num_tokens, num_heads, head_dim] float32, the step's flat queries (rotary applied).
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] float32 or bfloat16, this step's K/V already
            written. With bfloat16, SDPA runs on bfloat16 query/key/value, this step's K/V rounded to nearest even
            as the cache holds them (a result does not depend on whether the prefix came from the cache).
        group: the prefill group (`AttentionGroup.spans` gives each sequence's rows and lengths).
        new_kv: this step's (key, value), [num_tokens, num_kv_heads, head_dim] each, as written to the cache.
        scale: softmax scale; None: 1 / sqrt(head_dim).
        out: [>= num_tokens, num_heads * head_dim] float32; the rows of the group's tokens are overwritten.
    Raises:
        RuntimeError: a sequence has a cached prefix and this torch has no CPU flash kernel with log-sum-exp
            (`prefix_split_available()` is False).
    """
    key, value = new_kv
    block_size, dtype = kv_cache.shape[2], kv_cache.dtype
    for i, (start, query_len, seq_len) in enumerate(group.spans):
        end = start + query_len
        # [1, heads, Q, head_dim]; with a bfloat16 cache all three rounded as the cache holds this step's K/V
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0).to(dtype) for t in (query, key, value))
        prefix = seq_len - query_len
        if prefix == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            blocks = group.block_tables[i, : -(-prefix // block_size)]
            k_pre, v_pre = (_gather_prefix(kv_cache, index, blocks, prefix) for index in (0, 1))
            o = _merged(q, (k_pre, v_pre), (k, v), scale)
        out[start:end] = o[0].transpose(0, 1).reshape(query_len, -1)  # back to float32 (a no-op for float32)


def _merged(
    q: torch.Tensor,
    prefix_kv: tuple[torch.Tensor, torch.Tensor],
    new_kv: tuple[torch.Tensor, torch.Tensor],
    scale: float | None,
) -> torch.Tensor:
    """[1, num_heads, Q, head_dim] attention of `Q` queries (`q`: [1, num_heads, Q, head_dim], the last `Q`
    positions) over the cached prefix's keys/values (`prefix_kv`: [1, num_kv_heads, P, head_dim] each), unmasked,
    and over their own (`new_kv`: [1, num_kv_heads, Q, head_dim] each), causal, merged by log-sum-exp. All float32,
    or all bfloat16 (a bfloat16 cache: the result is float32 then).

    Raises:
        RuntimeError: this torch has no CPU flash kernel with log-sum-exp.
    """
    if _FLASH_CPU is None:
        raise RuntimeError("the cached-prefix split needs aten::_scaled_dot_product_flash_attention_for_cpu")
    o_pre, lse_pre = _FLASH_CPU(q, *prefix_kv, 0.0, False, scale=scale)
    o_new, lse_new = _FLASH_CPU(q, *new_kv, 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_pre, lse_new)  # [1, num_heads, Q] float32
    o = o_pre.float() * (lse_pre - lse).exp_().unsqueeze(-1)  # bfloat16 parts (a bfloat16 cache) merged in float32
    return o.addcmul_(o_new.float(), (lse_new - lse).exp_().unsqueeze(-1))


def _gather_prefix(kv_cache: torch.Tensor, index: int, blocks: torch.Tensor, prefix: int) -> torch.Tensor:
    """[1, num_kv_heads, prefix, head_dim] keys (index 0) or values (1) of one sequence's cached prefix: one row
    gather of its whole blocks (a strided view of the copy)."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    rows = torch.index_select(kv_cache[:, index], 0, blocks).view(-1, num_kv_heads, head_dim)
    return rows[:prefix].transpose(0, 1).unsqueeze(0)
