"""Returning freed memory to the operating system after a thread-mode engine stops.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated, and above its dynamic mmap
threshold large blocks stop being mmapped), so the weights and KV cache a thread-mode engine frees at shutdown stay
in the process's resident set, and each new engine started in the same process adds its own. `malloc_trim(0)`
(glibc `malloc_trim(3)`) after each shutdown hands that memory back (measurements: `benchmarks/analysis.md`,
"Freed memory").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

logger = logging.getLogger(__name__)


def release_freed_memory() -> bool:
    """Collect garbage, then ask glibc to return free arena memory to the OS (`malloc_trim(0)`).

    Returns True when glibc did so; False (and nothing else happens) on other C libraries.
    """
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    return bool(trim(0))
