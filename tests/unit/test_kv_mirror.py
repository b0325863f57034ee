"""The decode K/V mirror (`model/layers/kv_mirror.py`): attention reading the kept dense K/V gives what a fresh gather
through the block tables gives, step after step, and the mirror is dropped whenever it could be stale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm.model.kernels.row_kernels import RowKernels
from asyncllm.model.layers.attention import paged_attention, write_kv_cache
from asyncllm.model.layers.attention_metadata import build_attention_metadata
from asyncllm.model.layers.kv_mirror import DecodeKVMirror
from tests.kernel_checks import require_kernels

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 6, 8, 64


class Sequences:
    """Decoding sequences over two layers' paged caches, each token with fresh random K/V and query."""

    def __init__(
        self,
        lens: dict[str, int],
        seed: int = 0,
        pass_new_kv: bool = True,
        kernels: RowKernels | None = None,
        window: int | None = None,
    ) -> None:
        self.window = window  # the layers' sliding window (None: full attention)
        self.pass_new_kv = pass_new_kv  # attention is given the step's K/V (as the model does) or reads them back
        self.kernels = kernels  # the fused K/V copies, used on the mirror steps (the gathered steps use torch's)
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = [torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=self.gen) for _ in range(2)]
        self.free = list(range(NUM_BLOCKS - 1, 0, -1))  # block 0 stays garbage: the mirror pads with it
        self.lens, self.tables = dict(lens), {name: [] for name in lens}
        for name, n in lens.items():
            self.lens[name] = 0
            for _ in range(n):
                self.decode([name], mirror=None)

    def decode(self, names: list[str], mirror: DecodeKVMirror | None) -> tuple[torch.Tensor, bool | None]:
        """One decode-only step of `names` in both layers; returns the concatenated outputs and whether the
        mirror gathered afresh (None = no mirror used)."""
        for name in names:
            self.lens[name] += 1
            if len(self.tables[name]) * BLOCK_SIZE < self.lens[name]:
                self.tables[name].append(self.free.pop())
        seq_lens = [self.lens[n] for n in names]
        meta = build_attention_metadata([1] * len(names), seq_lens, [self.tables[n] for n in names], BLOCK_SIZE)
        if mirror is not None:
            meta.mirror = mirror.plan(names, np.asarray(seq_lens), meta.groups[0].block_tables.numpy())
        outs, kernels = [], None if mirror is None else self.kernels
        for cache in self.caches:
            k, v = (torch.randn(len(names), KV_HEADS, HEAD_DIM, generator=self.gen) for _ in range(2))
            write_kv_cache(cache, k, v, meta.slot_mapping, meta.slot_blocks, kernels)
            query = torch.randn(len(names), HEADS, HEAD_DIM, generator=self.gen)
            new_kv = (k, v) if self.pass_new_kv else None
            outs.append(paged_attention(query, cache, meta, new_kv=new_kv, kernels=kernels, window=self.window))
        return torch.cat(outs), None if meta.mirror is None else meta.mirror.fresh

    def snapshot(self) -> tuple[list[torch.Tensor], dict[str, int], dict[str, list[int]], list[int], torch.Tensor]:
        return (
            [c.clone() for c in self.caches],
            dict(self.lens),
            {k: list(v) for k, v in self.tables.items()},
            list(self.free),
            self.gen.get_state(),
        )

    def restore(self, snap) -> None:  # type: ignore[no-untyped-def]
        caches, self.lens, self.tables, self.free, state = snap
        for cache, saved in zip(self.caches, caches, strict=True):  # in place: the mirror keys layers by cache
            cache.copy_(saved)
        self.lens, self.tables = dict(self.lens), {k: list(v) for k, v in self.tables.items()}
        self.free = list(self.free)
        self.gen.set_state(state)


def _run_both(seqs: Sequences, schedule: list[list[str]], mirror: DecodeKVMirror) -> list[bool | None]:
    """Each step once with the mirror and once gathering per layer, from the same state: equal outputs."""
    fresh = []
    for names in schedule:
        snap = seqs.snapshot()
        expected, _ = seqs.decode(names, mirror=None)
        seqs.restore(snap)
        out, was_fresh = seqs.decode(names, mirror=mirror)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        fresh.append(was_fresh)
    return fresh


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_kernels", [False, True])
@pytest.mark.parametrize("pass_new_kv", [True, False])
def test_mirror_gives_the_gathered_attention_and_is_kept_only_while_valid(
    pass_new_kv: bool, with_kernels: bool, window: int | None
) -> None:
    kernels = require_kernels() if with_kernels else None  # CI fails where they do not build (kernel_checks.py)
    seqs = Sequences({"a": 3, "b": 9, "c": 14}, pass_new_kv=pass_new_kv, kernels=kernels, window=window)
    bytes_per_token = 2 * 2 * KV_HEADS * HEAD_DIM * 4
    mirror = DecodeKVMirror(BLOCK_SIZE, bytes_per_token, max_bytes=10**9)
    schedule = [["a", "b", "c"]] * 12 + [["a", "c"]] * 3 + [["c", "a"]] * 2
    fresh = _run_both(seqs, schedule, mirror)
    # step 0 gathers; then kept while the same sequences grow (crossing blocks) until the room runs out
    assert fresh[0] is True
    assert fresh[1:4] == [False, False, False]
    assert fresh.count(False) >= 10
    assert fresh[12] is True  # "b" left
    assert fresh[15] is True  # the same sequences in another order
    assert fresh[13:15] == [False, False]
    assert fresh[16] is False


def test_mirror_is_dropped_when_a_used_block_changes_or_a_step_is_skipped() -> None:
    seqs = Sequences({"a": 6, "b": 2})
    mirror = DecodeKVMirror(BLOCK_SIZE, 2 * 2 * KV_HEADS * HEAD_DIM * 4, max_bytes=10**9)
    assert _run_both(seqs, [["a", "b"]] * 2, mirror) == [True, False]
    seqs.tables["a"][0] = seqs.free.pop()  # e.g. preempted and resumed from other blocks: its K/V moved
    seqs.caches[0][seqs.tables["a"][0]] = torch.randn(2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert _run_both(seqs, [["a", "b"]], mirror) == [True]
    seqs.decode(["a", "b"], mirror=None)  # a step the mirror did not see: the lengths jump by two
    assert _run_both(seqs, [["a", "b"]] * 2, mirror) == [True, False]


def test_mirror_over_its_memory_budget_is_not_used() -> None:
    seqs = Sequences({"a": 5, "b": 7})
    per_token = 2 * 2 * KV_HEADS * HEAD_DIM * 4
    mirror = DecodeKVMirror(BLOCK_SIZE, per_token, max_bytes=per_token * 8)
    assert _run_both(seqs, [["a", "b"]] * 2, mirror) == [None, None]
