"""Per-step attention metadata for a flat batch of tokens, built once and shared by every layer.

The batch is flat: the scheduled tokens of all sequences, each sequence's tokens contiguous and in order.
Attention runs batched over sequences with padding: queries are scattered into
`[num_seqs, max_query_len]`, keys and values are gathered from the paged cache through the block tables
into `[num_seqs, max_seq_len]`, and one boolean mask gives causality (with the cached-prefix offset) and
padding. No Python loop over sequences runs inside the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncllm.model.layers.kv_mirror import MirrorStep


@dataclass
class AttentionGroup:
    """A padded batch of sequences with similar query lengths (decodes, or prefills).

    Fields:
        block_tables: [num_seqs, max_blocks] int64; each sequence's blocks in order, padded with 0.
        seq_lens: [num_seqs] int64; tokens in the cache for each sequence after this step.
        query_index: [num_seqs, max_query_len] int64; flat token index of each padded query position
            (padding points at index num_tokens: a scratch row that attention discards).
        attn_mask: [num_seqs, 1, max_query_len, max_seq_len] bool; True where a query may attend a key.
        masks_keys: False when `attn_mask` is all True (decodes of sequences of one length), so attention
            may run without it.
        query_positions: [num_seqs, max_query_len] int64 absolute position of each padded query (padding rows
            included; their output is dropped), for the sliding-window masks (`bias`).
        causal_only: every sequence computes all its tokens this step, all of one length (a fresh prefill chunk, or
            several of one length): `attn_mask` is exactly the causal triangle, with no cached prefix and no
            padding, so attention may use SDPA's `is_causal`, which skips the masked blocks.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_index: torch.Tensor
    attn_mask: torch.Tensor
    masks_keys: bool = True
    query_positions: torch.Tensor | None = None
    causal_only: bool = False
    _window_biases: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def max_query_len(self) -> int:
        return int(self.query_index.shape[1])

    @property
    def max_seq_len(self) -> int:
        return int(self.attn_mask.shape[-1])

    @functools.cached_property
    def attn_bias(self) -> torch.Tensor:
        """`attn_mask` in the float form SDPA turns a boolean mask into: `[num_seqs, 1, max_query_len, max_seq_len]`
        float32, 0.0 where True and -inf where False. Made once per step (on first use) instead of once per layer:
        the same values, so the same attention output."""
        return torch.zeros(self.attn_mask.shape).masked_fill_(self.attn_mask.logical_not(), float("-inf"))

    def bias(self, window: int | None = None) -> torch.Tensor | None:
        """The float mask (as `attn_bias`) of a layer attending within a sliding window of `window` tokens (a query
        at position p sees keys p - window + 1 .. p, as HF's `sliding_window_overlay` and llama.cpp's standard SWA),
        or of full attention when `window` is None; None when nothing is masked (attention may run without a mask).
        Made once per step and window, shared by the layers.

        Raises:
            ValueError: `window` < 1, or the group has no `query_positions`.
        """
        if window is None or self.max_seq_len <= window:  # no key can fall out of the window
            return self.attn_bias if self.masks_keys else None
        if window not in self._window_biases:
            if window < 1 or self.query_positions is None:
                raise ValueError(f"sliding window {window}: needs >= 1 and a group built with query positions")
            keys = torch.arange(self.max_seq_len)
            outside = keys[None, None, :] <= self.query_positions[:, :, None] - window  # [num_seqs, max_q, max_s]
            padding = self.query_positions >= self.seq_lens[:, None]  # padding rows keep their one key (key 0)
            outside[:, :, 0] &= padding.logical_not()
            self._window_biases[window] = self.attn_bias.masked_fill(outside[:, None], float("-inf"))
        return self._window_biases[window]

    @functools.cached_property
    def spans(self) -> list[tuple[int, int, int]]:
        """(first flat token index, query tokens, tokens in the cache after this step) of each sequence, as Python
        ints, for attention that runs one sequence at a time (`model/layers/prefill_attention.py`).

        Raises:
            ValueError: the group was built without `query_positions`.
        """
        if self.query_positions is None:
            raise ValueError("spans need a group built with query positions")
        starts = self.query_index[:, 0].tolist()
        prefixes = self.query_positions[:, 0].tolist()
        return [(a, s - p, s) for a, s, p in zip(starts, self.seq_lens.tolist(), prefixes, strict=True)]

    @functools.cached_property
    def span_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`spans` as the prefill kernel takes them: (first flat token index, query tokens) of each sequence,
        [num_seqs] int64 each (the tokens in the cache are `seq_lens`). Made once per step, shared by the layers.

        Raises:
            ValueError: the group was built without `query_positions`.
        """
        starts, query_lens, _ = zip(*self.spans, strict=True)
        return torch.tensor(starts, dtype=torch.int64), torch.tensor(query_lens, dtype=torch.int64)


@dataclass
class AttentionMetadata:
    """What attention needs to read and write the paged KV cache for one step.

    Decodes (one query token) and prefills are padded in separate groups, so a long prefill does not pad
    every decode to its length.

    Fields:
        num_tokens: tokens in the flat batch.
        slot_mapping: [num_tokens] int64; cache slot (block_id * block_size + offset) each token's K/V goes to.
        groups: one or two `AttentionGroup`s covering every sequence once.
        block_size: tokens per block.
        slot_blocks: (block id, offset in block) of each slot, [num_tokens] int64 each (computed once per step).
        mirror: for a decode-only step, the dense K/V kept from the last step (`model/layers/kv_mirror.py`), or None.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    block_size: int
    slot_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    mirror: MirrorStep | None = None


def build_attention_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Build the metadata for a step from per-sequence lengths and block tables.

    Args:
        query_lens: tokens each sequence computes this step (>= 1), in flat-batch order.
        seq_lens: tokens each sequence has in the cache after this step (>= query_lens[i]); the new tokens
            are the last `query_lens[i]` of them, at positions seq_lens[i] - query_lens[i] ... seq_lens[i] - 1.
        block_tables: each sequence's KV cache block ids, enough to hold seq_lens[i] tokens.
        block_size: tokens per block.
    Returns:
        AttentionMetadata with int64 index tensors.
    Raises:
        ValueError: if the lists disagree in length, or a block table is too short for its sequence.
    """
    num_seqs = len(query_lens)
    if not (len(seq_lens) == len(block_tables) == num_seqs) or num_seqs == 0:
        raise ValueError("query_lens, seq_lens and block_tables must be non-empty and of one length")
    if all(n == 1 for n in query_lens):
        return decode_metadata(seq_lens, block_tables, block_size)
    return general_metadata(query_lens, seq_lens, block_tables, block_size)


def decode_metadata(seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """`build_attention_metadata` of a decode-only step (every query length 1: one group), the same fields in about
    a third of the array operations (a batch-1 step built the general way spent ~0.25 ms here, run cold between the
    weight streams). Arguments and errors as `build_attention_metadata`'s."""
    s = np.asarray(seq_lens, dtype=np.int64)
    tables = _pad_block_tables(block_tables, s, block_size)
    rows, last, max_s = np.arange(len(s)), s - 1, int(s.max())
    blocks, offsets = tables[rows, last // block_size], last % block_size
    group = AttentionGroup(
        block_tables=torch.from_numpy(np.ascontiguousarray(tables[:, : -(-max_s // block_size)])),
        seq_lens=torch.from_numpy(s),
        query_index=torch.from_numpy(rows[:, None]),
        attn_mask=torch.from_numpy(np.arange(max_s)[None, None, None, :] < s[:, None, None, None]),
        masks_keys=bool((s != max_s).any()),
        query_positions=torch.from_numpy(last[:, None]),
        causal_only=bool((s == 1).all()),
    )
    slot_blocks = torch.from_numpy(blocks), torch.from_numpy(offsets)
    return AttentionMetadata(len(s), torch.from_numpy(blocks * block_size + offsets), [group], block_size, slot_blocks)


def general_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """`build_attention_metadata` for any step (checked arguments): decodes and prefills in up to two groups."""
    num_seqs = len(query_lens)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    tables = _pad_block_tables(block_tables, s, block_size)
    starts = np.concatenate(([0], np.cumsum(q)[:-1]))
    num_tokens = int(q.sum())

    # Slot of each token: positions seq_len - query_len .. seq_len - 1 of its sequence.
    token_seq = np.repeat(np.arange(num_seqs), q)
    token_pos = np.arange(num_tokens) - starts[token_seq] + (s - q)[token_seq]
    slots = tables[token_seq, token_pos // block_size] * block_size + token_pos % block_size

    groups = []
    for members in (np.flatnonzero(q == 1), np.flatnonzero(q > 1)):
        if len(members):
            groups.append(
                _build_group(q[members], s[members], starts[members], tables[members], num_tokens, block_size)
            )
    slot_blocks = (torch.from_numpy(slots // block_size), torch.from_numpy(slots % block_size))
    return AttentionMetadata(num_tokens, torch.from_numpy(slots), groups, block_size, slot_blocks)


def _pad_block_tables(block_tables: list[list[int]], seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    max_blocks = max(1, max(len(t) for t in block_tables))
    tables = np.zeros((len(block_tables), max_blocks), dtype=np.int64)
    for i, table in enumerate(block_tables):
        if len(table) * block_size < seq_lens[i]:
            raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {seq_lens[i]} tokens")
        tables[i, : len(table)] = table
    return tables


def _build_group(
    q: np.ndarray, s: np.ndarray, starts: np.ndarray, tables: np.ndarray, num_tokens: int, block_size: int
) -> AttentionGroup:
    max_q, max_s = int(q.max()), int(s.max())
    col = np.arange(max_q)
    valid = col[None, :] < q[:, None]  # [num_seqs, max_q]
    query_index = np.where(valid, starts[:, None] + col[None, :], num_tokens)
    q_pos = (s - q)[:, None] + col[None, :]  # absolute position of each padded query
    k_pos = np.arange(max_s)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < s[:, None, None])
    mask[~valid] = False
    mask[~valid, 0] = True  # padding rows attend one key so softmax stays finite; their output is dropped
    max_blocks = -(-max_s // block_size)  # gather only the blocks this group's longest sequence uses
    return AttentionGroup(
        block_tables=torch.from_numpy(np.ascontiguousarray(tables[:, :max_blocks])),
        seq_lens=torch.from_numpy(s),
        query_index=torch.from_numpy(query_index),
        attn_mask=torch.from_numpy(mask[:, None, :, :]),
        masks_keys=not bool(mask.all()),
        query_positions=torch.from_numpy(q_pos),
        causal_only=bool((s == q).all() and (q == max_q).all()),
    )
