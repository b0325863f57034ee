"""`AdaptiveThreads`: pick the torch intra-op thread count that makes steps fastest right now.

Why: torch's OpenMP threads wait for each other at the end of every parallel op. When another CPU-bound process
takes one of the cores, one of our threads is descheduled for whole time slices and the rest wait on it, so a
multi-thread step slows far more than a one-thread step. No fixed count is right both quiet and contended, so the
worker measures (the measurements behind the policy and its defaults: `benchmarks/analysis.md`, "Thread policy").

Policy: steps are compared only with steps of the same size (`StepKey`: scheduled tokens and rows). The worker
starts at `max_threads`. Every `probe_interval` steps (doubling after each probe that confirms the current count,
up to `max_probe_interval`) it runs `probe_steps` steps at the other count, which wins when its median step time
is lower by `hysteresis` than that of the last `probe_steps` steps at the current count (fresh against fresh, so
quiet history never decides a contended probe). A step at `max_threads` slower than `slowdown` x the fastest
recent step of its size brings the probe forward to `probe_steps` steps later (so the current count is judged
on steps that all ran in the new conditions); a slow one-thread step does not (more load never makes more threads
faster).

Coming back from one thread: the end of contention does not slow one-thread steps, so the worker also reads the
machine's idle CPU time during them (`SystemIdleMeter`): when at least `idle_cpus_to_probe` CPUs sat idle on
average over `idle_window_steps` steps, it probes `max_threads` at once (the gap between such probes doubles while
they confirm one thread). With that trigger, the periodic probe from one thread comes only every
`max_probe_interval` steps, since each multi-thread probe step beside a busy process costs several one-thread
steps; it still catches a competitor that yields its core without leaving a CPU idle (a niced one). The trigger
and the hysteresis are low because fp32 packed products keep all threads busy while torch runs on one
(`model/kernels/fp32.py`), so a quiet one-thread step leaves little CPU idle and is only a little slower.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

StepKey = tuple[int, int]  # (scheduled tokens, sampled rows)


class SystemIdleMeter:
    """Idle CPU-seconds of the whole machine so far (all CPUs, idle + iowait), read from Linux `/proc/stat`
    (proc(5): the first `cpu` line, in USER_HZ ticks of `sysconf(SC_CLK_TCK)` seconds). Calling it returns None
    where that file or the tick length cannot be read (the idle trigger is then off)."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self.tick_s: float | None
        try:
            self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError, ZeroDivisionError):
            self.tick_s = None

    def __call__(self) -> float | None:
        if self.tick_s is None:
            return None
        try:
            with open(self.path, "rb") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 6 or fields[0] != b"cpu":
            return None
        return (int(fields[4]) + int(fields[5])) * self.tick_s


class AdaptiveThreads:
    """Switches `torch.set_num_threads` between `max_threads` and 1 by measured step time.

    Args:
        max_threads: the thread count when the machine is quiet (>= 2; with 1 there is nothing to adapt).
        probe_interval: steps between two probes at first (doubles while probes confirm the choice).
        max_probe_interval: the longest gap between probes, in steps.
        probe_steps: steps run at the other count per probe.
        slowdown: a step at `max_threads` slower than this factor x the fastest recent step of its size triggers a
            probe.
        hysteresis: the other count must be this much faster (fraction) to be chosen.
        set_threads: sets the thread count (torch.set_num_threads; replaceable in tests).
        clock: seconds (time.perf_counter).
        idle_meter: the machine's idle CPU-seconds so far, or None where unknown (`SystemIdleMeter`); None turns
            the idle trigger off.
        idle_window_steps: one-thread steps over which idle CPU time is averaged.
        idle_cpus_to_probe: average idle CPUs during those steps that start a probe of `max_threads`.
    Raises:
        ValueError: max_threads < 2 or a non-positive interval.
    """

    def __init__(
        self,
        max_threads: int,
        probe_interval: int = 32,
        max_probe_interval: int = 512,
        probe_steps: int = 3,
        slowdown: float = 1.6,
        hysteresis: float = 0.05,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        idle_meter: Callable[[], float | None] | None = None,
        idle_window_steps: int = 8,
        idle_cpus_to_probe: float = 0.2,
    ) -> None:
        if max_threads < 2 or probe_interval < 1 or probe_steps < 1:
            raise ValueError("AdaptiveThreads needs max_threads >= 2 and positive probe sizes")
        self.max_threads = max_threads
        self.base_interval, self.max_interval = probe_interval, max_probe_interval
        self.probe_steps, self.slowdown, self.hysteresis = probe_steps, slowdown, hysteresis
        self._set_threads, self._clock = set_threads, clock
        self.threads = max_threads  # the chosen count
        self._interval = probe_interval
        self._until_probe = probe_interval
        self._probing = 0  # probe steps left
        self._times: dict[int, dict[StepKey, deque[float]]] = {max_threads: {}, 1: {}}
        self.num_switches = 0
        self._idle_meter = idle_meter
        self._idle_known = idle_meter is not None and idle_meter() is not None  # the meter reads on this machine
        self.idle_window_steps, self.idle_cpus_to_probe = idle_window_steps, idle_cpus_to_probe
        self._idle_s = self._step_s = 0.0  # idle CPU-seconds and wall seconds of this window's one-thread steps
        self._idle_steps = 0
        self._idle_gap = idle_window_steps  # steps between two idle-triggered probes (doubles while they fail)
        self._since_idle_probe = 0
        set_threads(max_threads)

    @property
    def current(self) -> int:
        """Threads the next step runs with."""
        return self._other if self._probing else self.threads

    @property
    def _other(self) -> int:
        return 1 if self.threads == self.max_threads else self.max_threads

    def run(self, key: StepKey, step: Callable[[], object]) -> object:
        """Run one step with the current thread count, time it and update the policy; returns its result."""
        watch = self._watching_idle()
        idle_before = self._idle_meter() if watch and self._idle_meter is not None else None
        start = self._clock()
        result = step()
        seconds = self._clock() - start
        if idle_before is not None and self._idle_meter is not None:
            idle_after = self._idle_meter()
            if idle_after is not None:
                self._add_idle(idle_after - idle_before, seconds)
        self.record(key, seconds)
        return result

    def _watching_idle(self) -> bool:
        """Whether this step's idle CPU time counts: running one thread (not probing) with a meter."""
        return self._idle_meter is not None and self.threads < self.max_threads and not self._probing

    def _add_idle(self, idle_s: float, step_s: float) -> None:
        """Account one one-thread step; probe `max_threads` now if the window shows idle CPUs."""
        self._idle_s += idle_s
        self._step_s += step_s
        self._idle_steps += 1
        self._since_idle_probe += 1
        if self._idle_steps < self.idle_window_steps:
            return
        idle_cpus = self._idle_s / self._step_s if self._step_s > 0 else 0.0
        self._idle_s = self._step_s = 0.0
        self._idle_steps = 0
        if idle_cpus >= self.idle_cpus_to_probe and self._since_idle_probe >= self._idle_gap:
            self._since_idle_probe = 0
            self._idle_gap = min(2 * self._idle_gap, self.max_interval)
            self._start_probe()

    def record(self, key: StepKey, seconds: float) -> None:
        """Account one step of size `key` that took `seconds` at `self.current` threads."""
        threads = self.current
        history = self._times[threads].setdefault(key, deque(maxlen=8))
        fastest = min(history, default=seconds)
        history.append(seconds)
        if self._probing:
            self._probing -= 1
            if self._probing == 0:
                self._decide(key)
            return
        self._until_probe -= 1
        if threads == self.max_threads and seconds > self.slowdown * fastest:  # probe `probe_steps` steps later
            self._until_probe = min(self._until_probe, self.probe_steps)
        if self._until_probe <= 0:
            self._start_probe()

    def _start_probe(self) -> None:
        self._probing = self.probe_steps
        self._times[self._other].clear()  # judge the other count on fresh steps only
        self._set_threads(self._other)

    def _decide(self, key: StepKey) -> None:
        ours, theirs = self._times[self.threads].get(key), self._times[self._other].get(key)
        recent = list(ours)[-self.probe_steps :] if ours else []  # the current count's steps just before the probe
        if recent and theirs and statistics.median(theirs) < (1 - self.hysteresis) * statistics.median(recent):
            logger.info(
                "thread policy: %d -> %d threads (step %s: median %.1f ms at %d threads, %.1f ms at %d)",
                self.threads,
                self._other,
                key,
                1000 * statistics.median(recent),
                self.threads,
                1000 * statistics.median(theirs),
                self._other,
            )
            self.threads = self._other
            self._times[self.threads] = {key: deque(theirs, maxlen=8)}
            self._times[self._other] = {}
            self.num_switches += 1
            one_thread_watched = self.threads < self.max_threads and self._idle_known
            self._interval = self.max_interval if one_thread_watched else self.base_interval
            self._idle_gap = self.idle_window_steps
        else:
            self._interval = min(2 * self._interval, self.max_interval)
        self._until_probe = self._interval
        self._set_threads(self.threads)
