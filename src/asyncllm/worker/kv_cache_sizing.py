"""How many KV cache blocks to allocate, and the lazily committed, zero-filled memory that holds them.

Default size (no `num_kv_blocks`, no `kv_cache_memory_bytes`): enough blocks for what the configuration can
use, `max_num_seqs` sequences of `max_model_len` tokens each, capped by `KV_CACHE_MEMORY_FRACTION` of the
memory available when the engine starts (`MemAvailable` in /proc/meminfo, Linux `proc(5)`).

The cache is allocated with a private anonymous `mmap` (POSIX: zero-filled, pages committed on first write), so a
block costs resident memory only once a request first writes into it; `torch.zeros` would touch every page at
start. Blocks are handed out least-recently-freed first (`sched/block_pool.py`), so under varied traffic the
resident size grows towards the full cache over time. `EngineArgs.populate_kv_cache` (on in `asyncllm serve`)
writes every page at start-up instead, as a server that reserves its cache would: the first requests then take no
page faults, which on a VM cost 4-8% of a fresh server's first serving run (`benchmarks/analysis.md`, 2026-12-06).

The mapping is advised for transparent huge pages (`madvise(MADV_HUGEPAGE)`, Linux; a no-op where the host's
`/sys/kernel/mm/transparent_hugepage/enabled` says "never"). It must be private: a shared anonymous mapping is
shmem, whose huge pages follow `shmem_enabled` instead ("never" by default), which left the cache on 4 KiB pages
until 2026-12-05. A sequence's blocks lie anywhere in the cache, and with 4 KiB pages the decode kernel's reads
miss the TLB at almost every block. Measured on the decode kernel
alone (one thread, CPU time, 32 sequences at 300 tokens x 30 layers, blocks placed at random; busy host, three
alternating runs): float32 cache 48-51 -> 44-45 ms, bfloat16 28-31 -> 26-28 ms (`benchmarks/analysis.md`). The
cost: resident memory then grows in steps of up to 2 MiB per layer's mapping instead of 4 KiB.
"""

from __future__ import annotations

import math
import os

import torch

from asyncllm.utils.huge_pages import huge_page_bytes

KV_CACHE_MEMORY_FRACTION = 0.05  # of the memory available at start-up, for the default-sized KV cache


def available_memory_bytes() -> int:
    """Memory available for new allocations without swapping, in bytes (`MemAvailable`; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_num_kv_blocks(
    max_num_seqs: int, max_model_len: int, block_size: int, bytes_per_block: int, available_bytes: int
) -> int:
    """Blocks for `max_num_seqs` full-length sequences, capped by `KV_CACHE_MEMORY_FRACTION * available_bytes`.

    Args:
        max_num_seqs: sequences running at once at most.
        max_model_len: tokens per sequence at most.
        block_size: tokens per block.
        bytes_per_block: bytes of one block over all layers (this rank's share).
        available_bytes: memory available now, bytes.
    Returns:
        At least 1 block.
    """
    wanted = max_num_seqs * math.ceil(max_model_len / block_size)
    cap = int(KV_CACHE_MEMORY_FRACTION * available_bytes) // bytes_per_block
    return max(1, min(wanted, cap))


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, populate: bool = False) -> torch.Tensor:
    """A zero-filled tensor of `shape` on anonymous mmap memory advised for huge pages: resident only where it has
    been written (in pages of up to 2 MiB where the host grants transparent huge pages; `utils/huge_pages.py`), or
    with `populate` resident from the start.

    Raises:
        OSError: the operating system refuses the mapping or, with `populate`, the memory.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_bytes(nbytes, populate=populate).view(dtype).view(shape)
