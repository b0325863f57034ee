"""How busy the other processes keep the machine's CPUs, from Linux `/proc/stat`."""

from __future__ import annotations

import os
import time


class OtherCpuLoad:
    """From its creation to `cpus()`, the CPUs that processes other than this one kept busy on average: the
    machine's busy time (Linux `/proc/stat`, proc(5): the first `cpu` line, all but idle and iowait, in
    `sysconf(SC_CLK_TCK)` ticks) minus this process's CPU time, over the wall time between."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.start = (time.perf_counter(), time.process_time(), self._machine_busy_s())

    def cpus(self) -> float | None:
        """Average busy CPUs of other processes since creation; None where `/proc/stat` cannot be read."""
        wall, own, busy = self.start
        now_busy = self._machine_busy_s()
        if busy is None or now_busy is None:
            return None
        elapsed = max(time.perf_counter() - wall, 1e-3)
        return max(0.0, (now_busy - busy) - (time.process_time() - own)) / elapsed

    def _machine_busy_s(self) -> float | None:
        try:
            with open(self.path, "rb") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError, ZeroDivisionError):
            return None
        if len(fields) < 5:
            return None
        return (sum(fields[:8]) - fields[3] - fields[4]) * tick_s  # user .. steal, less idle and iowait
