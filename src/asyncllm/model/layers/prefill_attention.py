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
(`aten::_scaled_dot_product_flash_attention_for_cpu`, private): `prefix_split_available()` says whether this torch
has it; without it the caller keeps padded SDPA.

Source: flash attention's log-sum-exp merge (Dao et al., 2022; Milakov & Gimelshein, 2018, online softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncllm.model.layers.attention_metadata import AttentionGroup

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_split_available() -> bool:
    """Whether this torch's CPU flash kernel returns the log-sum-exp that the cached-prefix merge needs."""
    return _FLASH_CPU is not None


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
        kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] float32, this step's K/V already written.
        group: the prefill group (`AttentionGroup.spans` gives each sequence's rows and lengths).
        new_kv: this step's (key, value), [num_tokens, num_kv_heads, head_dim] each, as written to the cache.
        scale: softmax scale; None: 1 / sqrt(head_dim).
        out: [>= num_tokens, num_heads * head_dim] float32; the rows of the group's tokens are overwritten.
    Raises:
        RuntimeError: a sequence has a cached prefix and `prefix_split_available()` is False.
    """
    key, value = new_kv
    block_size = kv_cache.shape[2]
    for i, (start, query_len, seq_len) in enumerate(group.spans):
        end = start + query_len
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, Q, head_dim]
        k = key[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, Q, head_dim]: this step's keys
        v = value[start:end].transpose(0, 1).unsqueeze(0)
        prefix = seq_len - query_len
        if prefix == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if _FLASH_CPU is None:
                raise RuntimeError("the cached-prefix split needs aten::_scaled_dot_product_flash_attention_for_cpu")
            blocks = group.block_tables[i, : -(-prefix // block_size)]
            k_pre, v_pre = (_gather_prefix(kv_cache, index, blocks, prefix) for index in (0, 1))
            o_pre, lse_pre = _FLASH_CPU(q, k_pre, v_pre, 0.0, False, scale=scale)
            o_new, lse_new = _FLASH_CPU(q, k, v, 0.0, True, scale=scale)
            lse = torch.logaddexp(lse_pre, lse_new)  # [1, num_heads, Q]
            o = o_pre * (lse_pre - lse).exp_().unsqueeze(-1)
            o.addcmul_(o_new, (lse_new - lse).exp_().unsqueeze(-1))
        out[start:end] = o[0].transpose(0, 1).reshape(query_len, -1)


def _gather_prefix(kv_cache: torch.Tensor, index: int, blocks: torch.Tensor, prefix: int) -> torch.Tensor:
    """[1, num_kv_heads, prefix, head_dim] keys (index 0) or values (1) of one sequence's cached prefix: one row
    gather of its whole blocks (a strided view of the copy)."""
    num_kv_heads, head_dim = kv_cache.shape[3:]
    rows = torch.index_select(kv_cache[:, index], 0, blocks).view(-1, num_kv_heads, head_dim)
    return rows[:prefix].transpose(0, 1).unsqueeze(0)
