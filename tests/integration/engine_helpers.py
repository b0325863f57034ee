"""Engine cores the engine-process tests build inside the engine process (`EngineCoreClient(core_factory=...)`).

They are module-level callables so an engine process can import them by name. None imports torch.
"""

from __future__ import annotations

import time

from asyncllm.config import EngineConfig
from asyncllm.messages.engine import EngineCoreOutputs, EngineCoreRequest
from tests.unit.fake_engine_core import FakeEngineCore

FAKE_TOKENS = [7, 8, 9]


def make_fake_core(config: EngineConfig) -> FakeEngineCore:
    """Replays FAKE_TOKENS, a few milliseconds per step."""
    return FakeEngineCore(lambda request: FAKE_TOKENS, step_delay=0.005)


def make_long_core(config: EngineConfig) -> FakeEngineCore:
    """Replays FAKE_TOKENS for up to 16k tokens per request, one millisecond per step."""
    return FakeEngineCore(lambda request: FAKE_TOKENS, step_delay=0.001, max_model_len=1 << 14)


def make_failing_core(config: EngineConfig) -> FakeEngineCore:
    """Raises RuntimeError in its third step."""
    return FakeEngineCore(lambda request: FAKE_TOKENS, step_delay=0.005, fail_at_step=3)


def make_sleepy_core(config: EngineConfig) -> FakeEngineCore:
    """Never becomes ready (for the handshake timeout)."""
    time.sleep(3600)
    raise AssertionError("unreachable")


class PickyCore(FakeEngineCore):
    """Refuses requests whose id starts with "bad" (an exception inside one request's processing)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id.startswith("bad"):
            raise ValueError(f"cannot take {request.request_id}")
        super().add_request(request)


def make_picky_core(config: EngineConfig) -> FakeEngineCore:
    return PickyCore(lambda request: FAKE_TOKENS, step_delay=0.005)


def make_broken_core(config: EngineConfig) -> FakeEngineCore:
    """Fails to build: the engine answers the handshake with this error."""
    raise ValueError("this core is broken on purpose")


class BusyCore(FakeEngineCore):
    """Holds the CPU (pure Python, the GIL taken in turns) for `BUSY_S` seconds in its second step: a long step
    that must not be mistaken for an unresponsive engine."""

    BUSY_S = 3.0

    def step(self) -> EngineCoreOutputs:
        if self.num_steps == 1:
            deadline = time.monotonic() + self.BUSY_S
            while time.monotonic() < deadline:
                sum(range(1000))
        return super().step()


def make_busy_core(config: EngineConfig) -> FakeEngineCore:
    return BusyCore(lambda request: FAKE_TOKENS, step_delay=0.005)
