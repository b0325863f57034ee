"""Memory on transparent huge pages (Linux THP, `Documentation/admin-guide/mm/transhuge.rst`).

A private anonymous `mmap` advised with `madvise(MADV_HUGEPAGE)`: zero-filled and committed on first write (POSIX),
in 2 MiB pages where the host's `/sys/kernel/mm/transparent_hugepage/enabled` is "always" or "madvise". Reads that
jump around a large region (a weight stream of ~100 MB per step, KV cache blocks placed anywhere) then miss the TLB
512 times less often. The mapping must be private: a shared anonymous one is shmem, whose huge pages follow
`shmem_enabled` instead ("never" by default).
"""

from __future__ import annotations

import mmap
import pathlib

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64's PMD-sized transparent huge page
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages_granted(setting: pathlib.Path = THP_SETTING) -> bool:
    """Whether the host hands huge pages to advised anonymous memory: THP "always" or "madvise" (False where the
    setting cannot be read, e.g. not Linux)."""
    try:
        text = setting.read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def huge_page_bytes(nbytes: int, align: int = 1) -> torch.Tensor:
    """A zero-filled uint8 `[nbytes]` tensor on a private anonymous mapping advised for huge pages, starting at an
    address that is a multiple of `align` bytes (`HUGE_PAGE_BYTES`: its first byte starts a huge page; the mapping
    is then up to `align` bytes longer). Lazily committed: resident only where written. The tensor keeps the
    mapping alive.

    Raises:
        OSError, ValueError: the operating system refuses the mapping (`mmap`), or nbytes < 1.
    """
    if nbytes < 1:
        raise ValueError(f"huge_page_bytes needs nbytes >= 1, got {nbytes}")
    buffer = mmap.mmap(-1, nbytes + align - 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; an advice, never an error
        buffer.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -flat.data_ptr() % align
    return flat[start : start + nbytes]
