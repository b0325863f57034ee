"""`AdaptiveThreads`: pick the torch intra-op thread count that makes steps fastest right now.

Why: torch's OpenMP threads wait for each other at the end of every parallel op. When another CPU-bound process
takes one of the cores, one of our threads is descheduled for whole time slices and the rest wait on it, so a
multi-thread step slows far more than a one-thread step. No fixed count is right both quiet and contended, so the
worker measures (the measurements behind the policy and its defaults: `benchmarks/analysis.md`, "Thread policy").

Steps of different sizes: under serving (arrivals, finishes, prefill chunks) a step's size (`StepKey`: scheduled
tokens and rows) seldom repeats exactly, so steps are judged against a cost model rather than against earlier
steps of the same size. `StepCostFit` fits seconds = a + b * tokens + c * rows by least squares, each part at least
zero, to the last `fit_window` steps at the current count; a step's ratio is its time over the fit's expectation for
its size.
Sizes far outside the range the fit has seen (a long prefill after decodes only) are not judged at all.

Policy: the worker starts at `max_threads` and probes the other count `first_probe` steps in (one started beside a
busy process has no quiet steps to call a step slow). Then every `probe_interval` steps (doubling after each probe
that confirms the current count, up to `max_probe_interval`) it runs `probe_steps` steps at the other count, which
wins when the median ratio of those steps is lower by `hysteresis` than that of the last `probe_steps` steps at the
current count (fresh against fresh, so quiet history never decides a contended probe; both against the same fit, so
only the sizes' relative costs need to be right). A probe runs only on steps the fit can judge and expects to take
at most `probe_step_limit` x the median of its recent steps: a longer step (a prompt's prefill among decodes) would
cost the most at a losing count and teach the probe nothing the decodes do not. At such a step a probe whose judged
steps so far took at most `EARLY_WIN` of the chosen count's time (relative to the fit, over its last `EARLY_WINDOW`
x `probe_steps` steps: beside a busy process some two-thread steps are fast by chance) decides on them at once
(beside a busy process, a burst of prompts must not run at two threads because the probe began just before it: there
one-thread steps take a twentieth of two-thread ones); otherwise the step runs at the chosen count, joins the fit
(which so learns its size) and the probe waits for the next step. A probe that has judged no step yet waits through
one such step only: the next step whose size the fit can judge runs at the probed count, however long, and the probe
decides on it alone, against the step it last waited through (a server's first prompts may come in a burst before
any short step: beside a busy process int8 once ran 72 s of 1024-token steps at 2 threads, 6.5 s each, while
waiting; one step at a losing count costs about one step more). A step at `max_threads` slower than `slowdown` x the
fit's expectation (for a size among those the fit has seen: no extrapolation) brings the probe forward to
`probe_steps` steps later (so the current count is judged on steps that all ran in the new conditions); a slow one-
thread step does not (more load never makes more threads faster). After a switch the fit starts again from the
probe's steps.

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
from collections.abc import Callable

import torch

from asyncllm.worker.step_cost import StepCostFit, StepKey

logger = logging.getLogger(__name__)

EARLY_WIN = 0.5  # a probe whose judged steps took at most this share of the chosen count's time may decide early
EARLY_WINDOW = 3  # ... against the chosen count's last EARLY_WINDOW x probe_steps steps (not its last few alone)


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
        first_probe: steps before the very first probe. A worker that starts beside a busy process has no quiet
            steps for the slowdown trigger to compare with, so only a probe can tell it; its cost when quiet is
            `probe_steps` slower steps once. 4 by default, the fewest steps `StepCostFit` answers from: beside a
            busy process each step before it took 1.2 s where a quiet one takes 12 ms (int8, 2-row decodes).
        max_probe_interval: the longest gap between probes, in steps.
        probe_steps: steps run at the other count per probe.
        probe_step_limit: a probe does not run steps the fit expects to take longer than this factor x the median
            of its recent steps (it decides on its judged steps if they win so far, else waits through them).
        slowdown: a step at `max_threads` slower than this factor x the time `StepCostFit` expects for its size
            triggers a probe.
        hysteresis: the other count must be this much faster (fraction) to be chosen.
        set_threads: sets the thread count (torch.set_num_threads; replaceable in tests).
        clock: seconds (time.perf_counter).
        idle_meter: the machine's idle CPU-seconds so far, or None where unknown (`SystemIdleMeter`); None turns
            the idle trigger off.
        idle_window_steps: one-thread steps over which idle CPU time is averaged.
        idle_cpus_to_probe: average idle CPUs during those steps that start a probe of `max_threads`.
        fit_window: steps at the current count that `StepCostFit` fits.
    Raises:
        ValueError: max_threads < 2, a non-positive interval or fit_window < probe_steps.
    """

    def __init__(
        self,
        max_threads: int,
        probe_interval: int = 32,
        first_probe: int = 4,
        max_probe_interval: int = 512,
        probe_steps: int = 3,
        probe_step_limit: float = 4.0,
        slowdown: float = 1.6,
        hysteresis: float = 0.05,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.perf_counter,
        idle_meter: Callable[[], float | None] | None = None,
        idle_window_steps: int = 8,
        idle_cpus_to_probe: float = 0.2,
        fit_window: int = 64,
    ) -> None:
        if max_threads < 2 or min(probe_interval, first_probe, probe_steps) < 1 or fit_window < probe_steps:
            raise ValueError(
                "AdaptiveThreads needs max_threads >= 2, positive probe sizes and fit_window >= probe_steps"
            )
        self.max_threads = max_threads
        self.base_interval, self.max_interval = probe_interval, max_probe_interval
        self.probe_steps, self.slowdown, self.hysteresis = probe_steps, slowdown, hysteresis
        self.probe_step_limit = probe_step_limit
        self._set_threads, self._clock = set_threads, clock
        self.threads = max_threads  # the chosen count
        self._interval = probe_interval
        self._until_probe = first_probe
        self._probing = 0  # probe steps left
        self.fit_window = fit_window
        self._fit = StepCostFit(fit_window)  # the current count's recent steps
        self._probe: list[tuple[StepKey, float, float | None]] = []  # this probe's steps: size, seconds, ratio
        self._probe_waited = 0  # steps this probe left at the chosen count
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
        if self._probing and self._probe_waits(key):
            early_window = EARLY_WINDOW * self.probe_steps
            if self._probe_leads(1 - EARLY_WIN, early_window):
                self._probing = 0
                self._decide(early_window)  # on the steps judged so far: this step runs at the count they favour
            elif self._probe_stalled(key):
                return self._run_deciding_probe_step(key, step)
            else:
                return self._run_at_chosen_count(key, step)
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

    def _probe_waits(self, key: StepKey) -> bool:
        """Whether a probe cannot use a step of size `key`: the fit cannot judge its size, or expects it to take
        over `probe_step_limit` x the median of its recent steps."""
        expected = self._fit.expected(key)
        return expected is None or expected > self.probe_step_limit * self._fit.median_seconds()

    def _probe_stalled(self, key: StepKey) -> bool:
        """Whether the probe has judged no step yet, has already waited through one, and the fit can judge a step of
        size `key`: then the probe runs this step (however long) rather than wait on through a burst of them."""
        judged = any(ratio is not None for _, _, ratio in self._probe)
        return not judged and self._probe_waited > 0 and self._fit.expected(key) is not None

    def _run_deciding_probe_step(self, key: StepKey, step: Callable[[], object]) -> object:
        """Run a stalled probe's last step (a long one) at the probed count and decide on it alone, against the step
        the probe last waited through: that one was long too, and ran just before (fresh against fresh)."""
        start = self._clock()
        result = step()
        seconds = self._clock() - start
        expected = self._fit.expected(key)
        self._probe.append((key, seconds, seconds / expected if expected else None))
        self._probing = 0
        self._decide(1)
        return result

    def _run_at_chosen_count(self, key: StepKey, step: Callable[[], object]) -> object:
        """Run one step of a pending probe at the chosen count and fit it there; the probe goes on after it."""
        self._probe_waited += 1
        self._set_threads(self.threads)
        try:
            start = self._clock()
            result = step()
            self._fit.add(key, self._clock() - start)
        finally:
            self._set_threads(self._other)
        return result

    def _probe_medians(self, chosen_steps: int) -> tuple[float, float] | None:
        """(the chosen count's, the probe's) median time / expected over the chosen count's last `chosen_steps`
        steps and the probe's judged steps, or None while either has none."""
        ours = self._fit.recent_ratios(chosen_steps)
        theirs = [ratio for _, _, ratio in self._probe if ratio is not None]
        if not ours or not theirs:
            return None
        return statistics.median(ours), statistics.median(theirs)

    def _probe_leads(self, margin: float, chosen_steps: int) -> bool:
        """Whether the probe's judged steps beat the chosen count's last `chosen_steps` by `margin` (a fraction of
        their time)."""
        medians = self._probe_medians(chosen_steps)
        return medians is not None and medians[1] < (1 - margin) * medians[0]

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
        if self._probing:
            expected = self._fit.expected(key)  # the chosen count's fit (during a probe: the steps it waits through)
            self._probe.append((key, seconds, seconds / expected if expected else None))
            self._probing -= 1
            if self._probing == 0:
                self._decide(self.probe_steps)
            return
        slow = False
        if self.threads == self.max_threads:
            expected = self._fit.expected(key, margin=1.0)  # only sizes among those seen: no extrapolation
            slow = expected is not None and seconds > self.slowdown * expected
        self._fit.add(key, seconds)
        self._until_probe -= 1
        if slow:  # probe `probe_steps` steps later
            self._until_probe = min(self._until_probe, self.probe_steps)
        if self._until_probe <= 0:
            self._start_probe()

    def _start_probe(self) -> None:
        self._probing = self.probe_steps
        self._probe = []  # judge the other count on fresh steps only
        self._probe_waited = 0
        self._set_threads(self._other)

    def _decide(self, chosen_steps: int) -> None:
        """End the probe: switch to the probed count when its judged steps beat the chosen count's last
        `chosen_steps` by `hysteresis`, else keep the count and double the interval to the next probe."""
        medians = self._probe_medians(chosen_steps)  # the chosen count's latest steps against the probe's
        if medians is None:  # undecided: no evidence either way, so the interval stays
            logger.debug("thread policy: probe of %d threads undecided (sizes the fit cannot judge)", self._other)
        elif medians[1] < (1 - self.hysteresis) * medians[0]:
            key = next(key for key, _, ratio in reversed(self._probe) if ratio is not None)
            scale = self._fit.expected(key) or 0.0  # both medians as seconds of a step of this size
            logger.info(
                "thread policy: %d -> %d threads (step %s: median %.1f ms at %d threads, %.1f ms at %d)",
                self.threads,
                self._other,
                key,
                1000 * scale * medians[0],
                self.threads,
                1000 * scale * medians[1],
                self._other,
            )
            self.threads = self._other
            self._fit = StepCostFit(self.fit_window)
            for size, seconds, _ in self._probe:
                self._fit.add(size, seconds)
            self.num_switches += 1
            one_thread_watched = self.threads < self.max_threads and self._idle_known
            self._interval = self.max_interval if one_thread_watched else self.base_interval
            self._idle_gap = self.idle_window_steps
        else:
            self._interval = min(2 * self._interval, self.max_interval)
        self._probe = []
        self._until_probe = self._interval
        self._set_threads(self.threads)
