"""Dense K/V of the decoding sequences, carried from one decode-only step to the next.

Paged attention in plain torch gathers every cached token of every sequence through the block tables, in every
layer, at every step (`attention.gather_kv`), a large share of a many-sequence step (`benchmarks/analysis.md`,
"Decode K/V mirror"). Between two
decode-only steps with the same sequences, each sequence gains exactly one token and its cached K/V do not
change, so the gathered tensors of the last step stay right except for that token. `DecodeKVMirror` keeps them
(one `[num_seqs, capacity, num_kv_heads, head_dim]` K and V per layer) and `MirrorStep` tells attention, once per
step, whether to gather afresh into a new mirror (with room to grow) or to write this step's token into the kept
one and read it in place.

It is kept only while it is provably the same data: the same sequences in the same order, every sequence exactly
one token longer, the blocks it was gathered from still at the head of each block table, the previous model step
a decode-only step that used it, and room for the new token. Anything else (a request joins, finishes, is
preempted or resumes, a step with prefills or draft tokens) gathers afresh. Its memory is bounded by
`max_bytes` (beyond it, attention gathers per layer without a mirror) and freed when no request is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from asyncllm.model.kernels.row_kernels import RowKernels

HEADROOM_BLOCKS = 2  # blocks of room added per sequence when gathering afresh, at least (and 1/4 of the length)


@dataclass
class MirrorStep:
    """What attention does with the mirror in one decode-only step.

    Fields:
        fresh: gather afresh into new tensors (True) or write this step's token into the kept ones (False).
        gather_index: [num_seqs * capacity_blocks] int64 block ids (block tables padded with block 0), for a
            fresh gather.
        capacity_blocks: blocks per sequence in the mirror tensors.
        positions: [num_seqs] int64 position of this step's token in each sequence (where a kept mirror is
            written).
        rows: [num_seqs] int64, 0 .. num_seqs - 1 (the mirror rows written with `positions`).
        tensors: the mirror's per-layer `(key, value)`, keyed by `id(kv_cache)` of the layer.
    """

    fresh: bool
    gather_index: torch.Tensor
    capacity_blocks: int
    positions: torch.Tensor
    rows: torch.Tensor
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def key_value(
        self,
        kv_cache: torch.Tensor,
        slot_blocks: tuple[torch.Tensor, torch.Tensor],
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        kernels: RowKernels | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's `(key, value)`, each `[num_seqs, capacity, num_kv_heads, head_dim]`, up to date with this
        step's token (already written to `kv_cache` at `slot_blocks`, one slot per sequence in order). `new_kv`,
        if given, is that token's (key, value), `[num_seqs, num_kv_heads, head_dim]` each: a kept mirror copies
        them from there instead of reading the cache back. `kernels` (the fused row kernels, if loaded) write the
        token in one call instead of two indexed writes (the same values).

        Raises:
            RuntimeError: a kept mirror has no tensors for this layer (the layers changed between steps).
        """
        layer = id(kv_cache)
        if self.fresh:
            _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            shape = (-1, self.capacity_blocks * block_size, num_kv_heads, head_dim)
            key = torch.index_select(kv_cache[:, 0], 0, self.gather_index).view(shape)
            value = torch.index_select(kv_cache[:, 1], 0, self.gather_index).view(shape)
            self.tensors[layer] = key, value
            return key, value
        if layer not in self.tensors:
            raise RuntimeError("the decode K/V mirror has no tensors for this layer's KV cache")
        key, value = self.tensors[layer]
        if new_kv is None:
            blocks, offsets = slot_blocks
            new = kv_cache[blocks, :, offsets]  # [num_seqs, 2, num_kv_heads, head_dim]
            new_kv = new[:, 0], new[:, 1]
        if key.dtype != new_kv[0].dtype:  # a bfloat16 cache: the token as the cache holds it (nearest even)
            new_kv = new_kv[0].to(key.dtype), new_kv[1].to(key.dtype)
        if kernels is not None and key.dtype == torch.float32:
            kernels.store_kv_rows_(key, value, new_kv[0], new_kv[1], self.positions)
        else:
            key[self.rows, self.positions] = new_kv[0]
            value[self.rows, self.positions] = new_kv[1]
        return key, value


class DecodeKVMirror:
    """Plans the mirror use of each step (`plan`); holds the per-layer tensors between steps.

    Args:
        block_size: tokens per KV cache block.
        bytes_per_token: bytes of one token's K and V over all layers (2 * layers * kv_heads * head_dim * 4).
        max_bytes: the most memory the mirror may take; a step that would need more gathers per layer instead.
    """

    def __init__(self, block_size: int, bytes_per_token: int, max_bytes: int) -> None:
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token
        self.max_bytes = max_bytes
        self._step: MirrorStep | None = None
        self._keys: list[str] = []
        self._seq_lens = np.zeros(0, dtype=np.int64)
        self._tables = np.zeros((0, 0), dtype=np.int64)

    def reset(self) -> None:
        """Forget the kept tensors (a step that is not decode-only, or no request left)."""
        self._step = None
        self._keys = []

    def plan(self, keys: list[str], seq_lens: np.ndarray, tables: np.ndarray) -> MirrorStep | None:
        """The mirror step for a decode-only step, or None (gather per layer) if it would exceed `max_bytes`.

        Args:
            keys: request ids of the sequences, in batch order.
            seq_lens: [num_seqs] int64 tokens in the cache after this step.
            tables: [num_seqs, max_blocks] int64 block tables (padded; at least the blocks seq_lens need).
        """
        step = self._step
        if step is not None and self._continues(keys, seq_lens, tables, step.capacity_blocks):
            step.fresh = False
            step.positions = torch.from_numpy(seq_lens - 1)
        else:
            step = self._fresh_step(seq_lens, tables)
        self._step, self._keys = step, list(keys)
        self._seq_lens, self._tables = seq_lens.copy(), tables.copy()
        return step

    def _continues(self, keys: list[str], seq_lens: np.ndarray, tables: np.ndarray, capacity_blocks: int) -> bool:
        """Same sequences, one token longer each, room left, and the blocks the kept tokens came from unchanged
        (only each sequence's used blocks are compared: a padding column filling with a new block is fine)."""
        if not (
            keys == self._keys
            and np.array_equal(seq_lens, self._seq_lens + 1)
            and int(seq_lens.max()) <= capacity_blocks * self.block_size
        ):
            return False
        width = self._tables.shape[1]
        used = np.arange(width)[None, :] < -(-self._seq_lens[:, None] // self.block_size)
        return tables.shape[1] >= width and bool(np.array_equal(tables[:, :width][used], self._tables[used]))

    def _fresh_step(self, seq_lens: np.ndarray, tables: np.ndarray) -> MirrorStep | None:
        longest = int(seq_lens.max())
        capacity_blocks = -(-longest // self.block_size) + max(HEADROOM_BLOCKS, longest // (4 * self.block_size))
        if len(seq_lens) * capacity_blocks * self.block_size * self.bytes_per_token > self.max_bytes:
            self.reset()
            return None
        padded = np.zeros((len(seq_lens), capacity_blocks), dtype=np.int64)
        width = min(tables.shape[1], capacity_blocks)
        padded[:, :width] = tables[:, :width]
        index, positions = torch.from_numpy(padded.reshape(-1)), torch.from_numpy(seq_lens - 1)
        return MirrorStep(True, index, capacity_blocks, positions, torch.arange(len(seq_lens)))
