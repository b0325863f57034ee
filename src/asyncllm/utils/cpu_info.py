"""What this CPU is and which instructions it has, read once from Linux `/proc/cpuinfo` (torch-free: the frontend
reads it before any engine process starts, and the kernel build and choice caches key on it)."""

from __future__ import annotations

import functools
import pathlib
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CPUInfo:
    """This host's CPU.

    Fields:
        model: the first "model name" of `/proc/cpuinfo` ("AMD EPYC"), else `platform.processor()` or
            `platform.machine()` where that file is absent (macOS, Windows).
        flags: the first "flags" line's feature names ({"avx2", "avx512_bf16", ...}); empty where unreadable, so a
            feature test is False there.
    """

    model: str
    flags: frozenset[str]

    def has(self, *features: str) -> bool:
        """True when the CPU reports every one of `features` (Linux flag names, e.g. "avx512_bf16")."""
        return all(feature in self.flags for feature in features)


@functools.cache
def cpu_info() -> CPUInfo:
    """This host's `CPUInfo` (read once per process). Never raises."""
    model, flags = "", ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return CPUInfo(model or platform.processor() or platform.machine(), frozenset(flags.split()))
