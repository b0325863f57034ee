"""`AdaptiveThreads` on simulated step times: stays at 2 threads when quiet (probing rarely), drops to 1 when
2-thread steps become slow (contention), and returns to 2 when the contention ends."""

from __future__ import annotations

import pytest

from asyncllm.worker.thread_policy import AdaptiveThreads


class _Machine:
    """Step seconds by thread count: quiet 2 threads 10 ms, 1 thread 17 ms; contended 40 ms and 19 ms."""

    def __init__(self) -> None:
        self.threads = 0
        self.contended = False
        self.now = 0.0
        self.steps_at = {1: 0, 2: 0}

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        cost = {(2, False): 0.010, (1, False): 0.017, (2, True): 0.040, (1, True): 0.019}
        self.now += cost[(self.threads, self.contended)]
        self.steps_at[self.threads] += 1


def _run(policy: AdaptiveThreads, machine: _Machine, steps: int) -> None:
    for _ in range(steps):
        policy.run((32, 32), machine.step)


def test_quiet_machine_keeps_two_threads_and_rarely_probes() -> None:
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _run(policy, machine, 2000)
    assert policy.threads == 2
    assert policy.num_switches == 0
    assert machine.steps_at[1] / 2000 < 0.02  # probes: 3 steps per 32 .. 512 steps, interval doubling


def test_contention_drops_to_one_thread_and_recovers() -> None:
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _run(policy, machine, 300)
    machine.contended = True
    _run(policy, machine, 20)  # a slow step triggers a probe at once
    assert policy.threads == 1
    assert machine.threads == 1
    machine.steps_at = {1: 0, 2: 0}
    _run(policy, machine, 1000)
    assert machine.steps_at[2] / 1000 < 0.05  # 2-thread probes while contended stay rare
    assert policy.threads == 1
    machine.contended = False
    _run(policy, machine, 1000)  # a periodic probe finds 2 threads faster again
    assert policy.threads == 2


def test_a_long_step_of_another_size_is_not_a_slowdown() -> None:
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _run(policy, machine, 20)
    policy.run((512, 1), lambda: setattr(machine, "now", machine.now + 0.5))  # a long prefill step
    assert policy.current == 2  # no probe started
    policy.run((32, 32), machine.step)
    assert policy.current == 2


def test_needs_two_threads() -> None:
    with pytest.raises(ValueError, match="max_threads >= 2"):
        AdaptiveThreads(1)
