"""`AdaptiveThreads` on simulated step times: stays at 2 threads when quiet (probing rarely), drops to 1 when
2-thread steps become slow (contention), and returns to 2 when the contention ends: within a few steps when the
machine's idle CPU time shows it, else at the next periodic probe."""

from __future__ import annotations

import random

import pytest

from asyncllm.worker.step_cost import StepCostFit, nonnegative_least_squares
from asyncllm.worker.thread_policy import AdaptiveThreads, SystemIdleMeter


class _Machine:
    """Step seconds by thread count: quiet 2 threads 10 ms, 1 thread 17 ms; contended 40 ms and 19 ms."""

    def __init__(self) -> None:
        self.threads = 0
        self.contended = False
        self.now = 0.0
        self.idle_s = 0.0  # idle CPU-seconds of the 2-CPU machine so far
        self.steps_at = {1: 0, 2: 0}

    def idle_meter(self) -> float:
        return self.idle_s

    def set_threads(self, n: int) -> None:
        self.threads = n

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        cost = {(2, False): 0.010, (1, False): 0.017, (2, True): 0.040, (1, True): 0.019}
        seconds = cost[(self.threads, self.contended)]
        self.now += seconds
        self.idle_s += 0.0 if self.contended else seconds * (2 - self.threads)  # the CPUs our threads leave free
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


def test_each_switch_is_logged_with_the_step_times_behind_it(caplog: pytest.LogCaptureFixture) -> None:
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    with caplog.at_level("INFO", logger="asyncllm.worker.thread_policy"):
        _run(policy, machine, 300)
        assert caplog.messages == []  # probes that change nothing are not logged
        machine.contended = True
        _run(policy, machine, 20)
    (message,) = caplog.messages
    assert message == "thread policy: 2 -> 1 threads (step (32, 32): median 40.0 ms at 2 threads, 19.0 ms at 1)"


class _PoolMachine(_Machine):
    """Packed products keep two threads when torch runs on one (`model/kernels/fp32.py`), so a quiet one-thread step
    is only 12% slower than a two-thread one and leaves 0.3 CPUs idle, not 1 (as measured: fp32, 32 rows)."""

    def step(self) -> None:
        cost = {(2, False): 0.010, (1, False): 0.0112, (2, True): 0.040, (1, True): 0.015}
        seconds = cost[(self.threads, self.contended)]
        self.now += seconds
        self.idle_s += 0.0 if self.contended else seconds * (2 - self.threads) * 0.3
        self.steps_at[self.threads] += 1


@pytest.mark.parametrize("machine_type", [_Machine, _PoolMachine])
def test_idle_cpus_bring_two_threads_back_within_a_few_steps(machine_type: type[_Machine]) -> None:
    """Also where packed products keep two threads at one (`_PoolMachine`): the contention's end shows as 0.3 idle
    CPUs (the default trigger is 0.2), and two threads win by 12% (the default hysteresis is 5%)."""
    machine = machine_type()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, idle_meter=machine.idle_meter)
    _run(policy, machine, 300)
    machine.contended = True
    _run(policy, machine, 1000)  # the periodic probes confirm 1 thread: the probe interval grows to 512 steps
    assert policy.threads == 1
    machine.steps_at = {1: 0, 2: 0}
    _run(policy, machine, 1000)
    assert machine.steps_at[2] / 1000 < 0.05  # contended, no CPU is idle: no extra probes
    machine.contended = False
    steps = 0
    while policy.threads == 1:
        _run(policy, machine, 1)
        steps += 1
        assert steps <= 20, "still one thread 20 steps after the contention ended"
    assert machine.threads == 2
    machine.steps_at = {1: 0, 2: 0}
    _run(policy, machine, 1000)
    assert policy.threads == 2
    assert machine.steps_at[1] / 1000 < 0.05


def test_contention_onset_is_judged_on_fresh_steps() -> None:
    """The 2-thread history is full of quiet steps when contention starts: judged against them, 2 threads won the
    first probes and kept running slow steps; judged on the steps after the slowdown, one probe decides."""
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _run(policy, machine, 300)
    machine.contended = True
    machine.steps_at = {1: 0, 2: 0}
    while policy.threads == 2:
        _run(policy, machine, 1)
        assert machine.steps_at[1] + machine.steps_at[2] <= 40, "still two threads 40 steps into the contention"
    assert machine.steps_at[2] == 1 + policy.probe_steps  # the slow step and the fresh ones the probe is judged on
    assert machine.steps_at[1] == policy.probe_steps


def test_one_thread_with_an_idle_meter_seldom_probes_two_while_contended() -> None:
    """Each 2-thread probe step beside a CPU-bound process costs about two 1-thread steps here (40 vs 19 ms);
    where the idle meter watches for the contention's end, periodic probes start max_probe_interval apart."""
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, idle_meter=machine.idle_meter)
    _run(policy, machine, 300)
    machine.contended = True
    _run(policy, machine, 10)
    assert policy.threads == 1
    machine.steps_at = {1: 0, 2: 0}
    _run(policy, machine, 500)
    assert machine.steps_at[2] == 0  # without the meter: probes after 32, 64, 128 and 256 steps (12 steps)
    machine.contended = False
    _run(policy, machine, 20)
    assert policy.threads == 2  # the idle trigger, not the periodic probe, brings 2 threads back


def test_a_slow_one_thread_step_starts_no_probe() -> None:
    """Beside a CPU-bound process a one-thread step is now and then descheduled for a time slice; two threads would
    only be slower, so such a blip must not start a 2-thread probe."""
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _run(policy, machine, 300)
    machine.contended = True
    _run(policy, machine, 10)
    assert policy.threads == 1
    machine.steps_at = {1: 0, 2: 0}
    for _ in range(10):  # 20 steps: fewer than the first periodic probe (32)
        policy.run((32, 32), lambda: setattr(machine, "now", machine.now + 0.100))  # a 5x slower one-thread step
        _run(policy, machine, 1)
    assert policy.current == 1
    assert machine.steps_at[2] == 0


def test_idle_probes_that_keep_losing_back_off() -> None:
    machine = _Machine()
    idle = {"s": 0.0}

    def always_idle() -> float:  # the meter says a CPU is free, yet 2-thread steps stay slow (e.g. a noisy VM)
        idle["s"] += 1.0
        return idle["s"]

    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, idle_meter=always_idle)
    _run(policy, machine, 50)
    machine.contended = True
    _run(policy, machine, 3000)
    assert policy.threads == 1
    assert machine.steps_at[2] < 3 * 20 + 50  # a probe per 8, 16, 32 ... 512 steps, not one per 8 steps


def test_system_idle_meter_reads_proc_stat(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 700 30 0 0 0 0 0\ncpu0 50 0 25 350 15 0 0 0 0 0\n")
    meter = SystemIdleMeter(str(stat))
    assert meter.tick_s is not None
    assert meter() == pytest.approx(730 * meter.tick_s)  # idle + iowait ticks
    stat.write_text("intr 1 2 3\n")
    assert meter() is None
    assert SystemIdleMeter(str(tmp_path / "missing"))() is None
    meter.tick_s = None  # no sysconf(SC_CLK_TCK): no reading rather than a guessed tick
    stat.write_text("cpu  100 0 50 700 30 0 0 0 0 0\n")
    assert meter() is None


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


class _Serving:
    """Step keys of a server under staggered arrivals (seeded): requests join with 50-512-token prompts (prefilled
    within a 1024-token step budget beside the decodes, so a prompt may span two steps), and each decoding request
    finishes with chance 1/64 a step; a request arrives with chance 0.3 a step, at most 32 in flight. So rows wander
    over 1..32, decode-only steps have tokens == rows and mixed steps carry prefill chunks, keyed as `worker.py` keys
    steps (scheduled tokens, rows)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.decoding = 1
        self.prefill_left: list[int] = []

    def next_key(self) -> tuple[int, int]:
        rng = self.rng
        self.decoding -= sum(rng.random() < 1 / 64 for _ in range(self.decoding))
        if self.decoding + len(self.prefill_left) < 32 and rng.random() < 0.3:
            self.prefill_left.append(rng.randint(50, 512))
        if self.decoding + len(self.prefill_left) == 0:
            self.prefill_left.append(rng.randint(50, 512))
        tokens, rows = self.decoding, self.decoding
        budget = 1024 - tokens
        for i, left in enumerate(self.prefill_left):
            if budget <= 0:
                break
            chunk = min(left, budget)
            self.prefill_left[i] -= chunk
            tokens, rows, budget = tokens + chunk, rows + 1, budget - chunk
        self.decoding += sum(left == 0 for left in self.prefill_left)
        self.prefill_left = [left for left in self.prefill_left if left > 0]
        return tokens, rows


class _ServingMachine(_Machine):
    """Quiet 2-thread step: 24 ms + 0.5 ms per token + rows**0.85 ms (not linear in rows, like the logits product),
    times noise of ~5% (seeded). One thread runs 1.25x as long quietly; contention makes 2-thread steps
    `contended_2` x slower and 1-thread steps 1.1x. Quiet 1-thread steps leave 0.3 CPUs idle (`_PoolMachine`)."""

    def __init__(self, contended_2: float, seed: int = 1) -> None:
        super().__init__()
        self.factor = {(2, False): 1.0, (1, False): 1.25, (2, True): contended_2, (1, True): 1.25 * 1.1}
        self.rng = random.Random(seed)
        self.key = (1, 1)

    def step(self) -> None:
        tokens, rows = self.key
        quiet_2 = 0.024 + 0.0005 * tokens + 0.001 * rows**0.85
        seconds = quiet_2 * self.factor[(self.threads, self.contended)] * self.rng.lognormvariate(0.0, 0.05)
        self.now += seconds
        self.idle_s += 0.0 if self.contended else seconds * (2 - self.threads) * 0.3
        self.steps_at[self.threads] += 1


def _serve(policy: AdaptiveThreads, machine: _ServingMachine, serving: _Serving, steps: int) -> None:
    for _ in range(steps):
        machine.key = serving.next_key()
        policy.run(machine.key, machine.step)


@pytest.mark.parametrize("contended_2", [2.0, 3.0])
def test_serving_steps_of_changing_sizes_switch_within_a_few_probes(contended_2: float) -> None:
    """Under serving, exact step sizes seldom repeat: the policy must judge steps of different sizes against each
    other. Measured before the fix: beside a busy process a server stayed at 2 threads for ~105 s."""
    serving, machine = _Serving(seed=0), _ServingMachine(contended_2)
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, idle_meter=machine.idle_meter)
    keys = [serving.next_key() for _ in range(2000)]
    assert len(set(keys)) > 400  # the replay is varied: one step in five has a size of its own
    assert {rows for _, rows in keys} >= set(range(2, 27))

    _serve(policy, machine, serving, 3000)
    assert policy.threads == 2
    assert machine.steps_at[1] / 3000 < 0.03  # quiet: few probe steps

    machine.contended = True
    steps = 0
    while policy.threads == 2:  # before the fix: 46 steps (the slowdown trigger waited for a size to repeat)
        _serve(policy, machine, serving, 1)
        steps += 1
        assert steps <= 10, "still two threads 10 steps into the contention"
    machine.steps_at = {1: 0, 2: 0}
    _serve(policy, machine, serving, 2000)
    assert policy.threads == 1
    assert machine.steps_at[2] / 2000 < 0.05  # contended: few 2-thread probe steps

    machine.contended = False
    steps = 0
    while policy.threads == 1:
        _serve(policy, machine, serving, 1)
        steps += 1
        assert steps <= 64, "still one thread 64 steps after the contention ended"
    machine.steps_at = {1: 0, 2: 0}
    _serve(policy, machine, serving, 2000)
    assert policy.threads == 2
    assert machine.steps_at[1] / 2000 < 0.03


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_server_started_beside_a_busy_process_drops_to_one_thread_soon(seed: int) -> None:
    """No quiet history to call a step slow: only the periodic probes can decide, and the sizes they compare seldom
    match exactly. Before the fix each undecided probe doubled the interval: 102 steps here, 2,037 with seed 3 (and
    ~105 s into a real server's run, `benchmarks/analysis.md`); with the cost fit and the first probe 32 steps in,
    35-38 steps; with the first probe 8 steps in, 11-12."""
    serving, machine = _Serving(seed), _ServingMachine(contended_2=2.5, seed=seed + 1)
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, idle_meter=machine.idle_meter)
    machine.contended = True
    steps = 0
    while policy.threads == 2:
        _serve(policy, machine, serving, 1)
        steps += 1
        assert steps <= 16, "still two threads 16 steps into a contended run"
    _serve(policy, machine, serving, 1000)
    assert policy.threads == 1


def test_step_cost_fit_recovers_a_linear_cost_and_refuses_sizes_it_has_not_seen() -> None:
    fit = StepCostFit(window=64)
    assert fit.expected((32, 32)) is None  # fewer than min_steps steps
    rng = random.Random(0)
    for _ in range(100):
        rows = rng.randint(1, 32)
        tokens = rows + (rng.randint(50, 512) if rng.random() < 0.4 else 0)
        fit.add((tokens, rows), 0.024 + 0.0005 * tokens + 0.001 * rows)
    assert len(fit) == 64
    assert fit.expected((300, 10)) == pytest.approx(0.024 + 0.15 + 0.010, rel=3e-3)  # the ridge: 0.1% bias
    assert fit.expected((16, 16)) == pytest.approx(0.024 + 0.008 + 0.016, rel=3e-3)
    assert fit.expected((4000, 32)) is None  # far more tokens than any step it fitted
    assert fit.recent_ratios(3) == pytest.approx([1.0, 1.0, 1.0], rel=3e-3)


def test_step_cost_fit_decode_only_and_single_size_steps() -> None:
    """Decode-only steps (tokens == rows) cannot tell the token cost from the row cost; the fit still predicts
    along them, and refuses a mixed step it knows nothing about. One size only: the mean."""
    decode = StepCostFit()
    for rows in [1, 5, 9, 13, 17, 21, 25, 29, 32] * 3:
        decode.add((rows, rows), 0.020 + 0.0015 * rows)
    assert decode.expected((20, 20)) == pytest.approx(0.050, rel=1e-3)
    assert decode.expected((300, 10)) is None
    same = StepCostFit()
    for seconds in [0.010, 0.012, 0.011, 0.013]:
        same.add((32, 32), seconds)
    assert same.expected((32, 32)) == pytest.approx(0.0115)
    assert same.expected((128, 32)) is None  # more than twice the tokens of any step seen
    with pytest.raises(ValueError, match="min_steps"):
        StepCostFit(window=2, min_steps=4)


def test_a_probe_waits_through_sizes_the_fit_cannot_judge() -> None:
    """A step of a size no step at the chosen count had cannot be judged: it runs at the chosen count, joins the fit,
    and the probe waits for steps it can judge. (Before, the probe ran up to 2 x `probe_steps` such steps at the other
    count and, with none judged, ended undecided.)"""
    machine = _Machine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=32)
    _run(policy, machine, 32)  # the 32nd step starts the first probe
    assert policy.current == 1
    policy.run((900, 1), machine.step)  # a long prefill: no 2-thread step had its size
    assert machine.steps_at[1] == 0
    assert machine.threads == 1
    _run(policy, machine, policy.probe_steps)
    assert machine.steps_at[1] == policy.probe_steps
    assert policy.threads == 2
    assert policy.current == 2
    _run(policy, machine, 63)
    assert policy.current == 2
    _run(policy, machine, 1)
    assert policy.current == 1  # a confirming probe doubles the interval: the next came 64 steps later


class _PrefillMachine(_Machine):
    """Step seconds grow with the step's size: 10 ms + 1.7 ms per token + 2 ms per row at 2 threads, 1.9x that at
    one (as measured for int8 on the 2-core AMD EPYC: a 1024-token mixed step 1.7-2.1 s at 2 threads, 2.9-3.7 s at
    1)."""

    def __init__(self) -> None:
        super().__init__()
        self.key = (1, 1)
        self.keys_at: dict[int, list[tuple[int, int]]] = {1: [], 2: []}

    def step(self) -> None:
        tokens, rows = self.key
        seconds = (0.010 + 0.0017 * tokens + 0.002 * rows) * (1.9 if self.threads == 1 else 1.0)
        if self.contended:  # beside a busy process, as measured: 2-row steps 15 ms -> 0.65-1.2 s, 1024-token ~3x
            seconds *= 40.0 if self.threads == 2 and tokens < 64 else 3.0 if self.threads == 2 else 1.15
        self.now += seconds
        self.keys_at[self.threads].append(self.key)
        self.steps_at[self.threads] += 1


def _replay(policy: AdaptiveThreads, machine: _PrefillMachine, keys: list[tuple[int, int]]) -> None:
    """Run one step of each size in `keys` through `policy` on `machine`."""
    for key in keys:
        machine.key = key
        policy.run(key, machine.step)


# The first 24 step sizes (scheduled tokens, rows) of `asyncllm serve --quantization int8` on serving_shapes.py's
# chat shape (2026-12-04, AMD EPYC): a few decodes, then the first probe, then 256-token prompts arriving faster than
# they are prefilled (1024-token steps), then 32 decodes.
TRACE_FIRST_PROBE = 8  # the default `first_probe` when the traces below were recorded (the first probe 9 steps in)
_CHAT_START = [(32, 1), (33, 2), *[(2, 2)] * 6, (1, 1), (256, 1), *[(1024, r) for r in range(5, 30, 4)], (881, 32)]
_CHAT_START += [(32, 32)] * 6


def test_a_probe_leaves_long_steps_at_the_chosen_count() -> None:
    """Before the fix the first probe ran 1 thread over the 256-token prompt and four 1024-token steps (the probe
    waited for sizes its fit knew, and ran every step it waited through at 1 thread): 14 s of the real run at half
    speed, ~7 s lost, for one judged step. A probe step now costs what a typical step costs: longer ones run at the
    chosen count and teach the fit their size, and the probe is judged on the decodes after them."""
    machine = _PrefillMachine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=TRACE_FIRST_PROBE)
    _replay(policy, machine, _CHAT_START)
    assert machine.keys_at[1] == [(1, 1), (32, 32), (32, 32)]
    assert policy.threads == 2
    assert policy.current == 2


def test_beside_a_busy_process_a_probe_runs_a_burst_of_prompts_at_the_count_it_favours() -> None:
    """The same start beside a busy process (`serving_shapes.py --contended`, int8, AMD EPYC): 2-row steps took
    0.65-1.2 s at 2 threads, the probe's first (1, 1) step 20 ms at 1 thread, and the seven 1024-token steps that
    followed 6.5-9.5 s each at 2 threads (mean TTFT 20.6 s against vLLM's 10.9), because the probe left them at the
    chosen count. They now run at 1 thread, which the probe's judged step already favours."""
    machine = _PrefillMachine()
    machine.contended = True
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=TRACE_FIRST_PROBE)
    _replay(policy, machine, _CHAT_START)
    assert [key for key in machine.keys_at[2] if key[0] >= 256] == []
    assert policy.threads == 1


class _ReplayMachine(_PrefillMachine):
    """`_PrefillMachine` beside a busy process whose first 2-thread steps take the recorded seconds."""

    def __init__(self, two_thread_seconds: list[float]) -> None:
        super().__init__()
        self.contended = True
        self.recorded = list(two_thread_seconds)

    def step(self) -> None:
        if self.threads == 2 and self.recorded:
            self.now += self.recorded.pop(0)
            self.keys_at[2].append(self.key)
            self.steps_at[2] += 1
        else:
            super().step()


def test_a_probe_decides_beside_a_busy_process_when_recent_steps_happened_to_be_fast() -> None:
    """A step trace of `serving_shapes.py --contended --shapes chat` (int8, AMD EPYC, 2026-12-04): the first eight
    2-thread steps took 270, 863, 297, 34, 1024, 297, 35 and 36 ms (the busy process left the core now and then).
    The least-squares fit of those times expected a negative time for the probe's first step, (1, 1), so the probe
    could not judge it and waited: then it met only prompts it could not use, and the burst of 1024-token steps ran
    at 2 threads, 6.5-6.9 s each (mean TTFT 21.8 s against vLLM's 10.0 in that run). A step costs no less than
    nothing per token and per row, so the fit now judges (1, 1); and the probe's lead is weighed against the chosen
    count's recent steps, not its last three alone."""
    machine = _ReplayMachine([0.2698, 0.8632, 0.2972, 0.0337, 1.0243, 0.2970, 0.0353, 0.0363])
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=TRACE_FIRST_PROBE)
    _replay(policy, machine, _CHAT_START)
    assert [key for key in machine.keys_at[2] if key[0] >= 1024] == []
    assert policy.threads == 1


# The same start as `_CHAT_START` as int8 met it in a later run of the contended chat shape (2026-12-04, AMD EPYC):
# the probe's first step was already a 256-token prompt, and no short step came until the burst had been prefilled.
_CHAT_START_NO_SHORT_STEP = [(32, 1), (33, 2), *[(2, 2)] * 6, (256, 1), *[(1024, r) for r in range(5, 30, 4)]]
_CHAT_START_NO_SHORT_STEP += [(881, 32), *[(32, 32)] * 6]


def test_beside_a_busy_process_a_probe_with_no_short_step_runs_one_long_step_and_decides() -> None:
    """With no step it could judge, the probe waited through the whole burst at 2 threads: 72 s of 1024-token steps
    at 6.4-6.9 s each (mean TTFT 20.7 s against vLLM's 10.1 in that run). Now it waits through one step (the
    256-token prompt: the fit learns a long step's size), then runs the next at 1 thread and decides on it."""
    machine = _PrefillMachine()
    machine.contended = True
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=TRACE_FIRST_PROBE)
    _replay(policy, machine, _CHAT_START_NO_SHORT_STEP)
    assert [key for key in machine.keys_at[2] if key[0] >= 256] == [(256, 1), (1024, 5)]
    assert policy.threads == 1
    assert policy.num_switches == 1


def test_on_a_quiet_machine_a_probe_with_no_short_step_costs_one_long_step() -> None:
    """The same start on a quiet machine: one long step runs at 1 thread (1.9x its 2-thread time here), the probe
    keeps 2 threads on it, and the rest of the burst runs at 2 threads."""
    machine = _PrefillMachine()
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock, first_probe=TRACE_FIRST_PROBE)
    _replay(policy, machine, _CHAT_START_NO_SHORT_STEP)
    assert machine.keys_at[1] == [(1024, 9)]
    assert policy.threads == 2
    assert policy.num_switches == 0


def test_step_cost_fit_never_expects_a_negative_time_for_a_size_it_has_seen_around() -> None:
    """The same eight steps: unconstrained least squares (intercept -0.90 s, 0.57 s per row) expected -0.30 s for
    (1, 1). The cost's parts (a fixed cost, a cost per token, a cost per row) are each at least zero: here no fixed
    cost, 11 ms per token and 142 ms per row, so (2, 2) is expected at 0.31 s (its six steps' mean: 0.29 s)."""
    fit = StepCostFit()
    keys = [(32, 1), (33, 2), *[(2, 2)] * 6]
    for key, seconds in zip(keys, [0.2698, 0.8632, 0.2972, 0.0337, 1.0243, 0.2970, 0.0353, 0.0363], strict=True):
        fit.add(key, seconds)
    assert fit.expected((1, 1)) == pytest.approx(0.153, abs=1e-3)
    assert fit.expected((2, 2)) == pytest.approx(0.306, abs=1e-3)


def test_nonnegative_least_squares_matches_the_unconstrained_solution_when_that_is_nonnegative() -> None:
    """Normal equations of t = 1 + 2 x on x = 0, 1, 2 (unconstrained: [1, 2]); of t = 3 - x on x = 0, 1, 2 (the
    unconstrained slope is -1: the best with slope 0 is the mean, 2); a singular system (one size) still fits."""
    assert nonnegative_least_squares([[3.0, 3.0], [3.0, 5.0]], [9.0, 13.0]) == pytest.approx([1.0, 2.0])
    assert nonnegative_least_squares([[3.0, 3.0], [3.0, 5.0]], [6.0, 4.0]) == pytest.approx([2.0, 0.0])
    single = nonnegative_least_squares([[2.0, 4.0], [4.0, 8.0]], [6.0, 12.0])  # x = 2 twice, t = 3
    assert single[0] + 2 * single[1] == pytest.approx(3.0)


def test_beside_a_busy_process_the_first_probe_comes_after_four_steps() -> None:
    """int8's start in the run that met the no-short-step case (`serving_shapes.py --contended`, 2026-12-04
    evening): a (64, 2) step took 3.3 s at 2 threads and seven (2, 2) steps 1.2 s each before the first probe began
    (then 3.6 + 6.8 s of long steps before it could decide). The fit answers from 4 steps, so the first probe now
    starts after 4: its (2, 2) steps at 1 thread decide, and no long step runs at 2 threads."""
    machine = _PrefillMachine()
    machine.contended = True
    policy = AdaptiveThreads(2, set_threads=machine.set_threads, clock=machine.clock)
    _replay(policy, machine, [(64, 2), *[(2, 2)] * 7, (256, 1), *[(1024, r) for r in range(5, 30, 4)]])
    assert machine.keys_at[2] == [(64, 2), (2, 2), (2, 2), (2, 2)]
    assert policy.threads == 1


# The first 15 steps of `asyncllm serve` (fp32) on the quiet chat shape with the first probe after 4 steps
# (2026-12-04 evening, AMD EPYC): sizes, and seconds at the thread count each ran with (1 thread: steps 5-7).
_QUIET_START = [((32, 1), 0.0770), ((33, 2), 0.0964), ((2, 2), 0.0319), ((2, 2), 0.0313), ((2, 2), 0.0459)]
_QUIET_START += [((2, 2), 0.0445), ((2, 2), 0.0457), ((2, 2), 0.0335), ((1, 1), 0.0325), ((256, 1), 0.4553)]
_QUIET_START += [((513, 3), 1.4313), ((1024, 7), 1.6847), ((1024, 11), 1.7839), ((1024, 15), 1.8307)]


def test_a_step_of_a_size_the_fit_has_not_seen_is_not_called_slow() -> None:
    """In that run the (1, 1) step took 33 ms at 2 threads, where the fit of (2, 2) decodes and two prefills
    expected 16: the slowdown trigger started a probe three steps later, inside a burst of 1024-token steps, and the
    probe, judging none, ran one of them at 1 thread (3.3 s against 1.8). A step is called slow only at a size among
    those the fit has seen."""
    now = [0.0]
    threads_of_long_steps = []
    policy = AdaptiveThreads(2, set_threads=lambda n: None, clock=lambda: now[0])
    for key, seconds in _QUIET_START:
        threads = policy.current
        if key[0] >= 256:
            threads_of_long_steps.append(threads)
        step_s = seconds * (1.8 if threads == 1 and key[0] >= 256 else 1.0)
        policy.run(key, lambda s=step_s: now.__setitem__(0, now[0] + s))
    assert threads_of_long_steps == [2, 2, 2, 2, 2]
    assert policy.threads == 2
