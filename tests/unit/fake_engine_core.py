"""A scripted stand-in for `EngineCore`: emits given token ids, one per step per request, no model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from asyncllm.messages.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReadyInfo,
    FinishReason,
    SchedulerStats,
)

NUM_BLOCKS = 64


class FakeEngineCore:
    """Replays `script(request) -> token ids` one token per step; honours max_tokens and EOS like the engine.

    Args:
        script: the tokens each request generates (cycled if shorter than max_tokens).
        step_delay: seconds each step sleeps (simulates the model).
        fail_at_step: raise RuntimeError in this step (1-based), to test engine death.
    `add_request` raises ValueError for request ids starting with "refuse" (one request failing alone).
    """

    def __init__(
        self,
        script: Callable[[EngineCoreRequest], list[int]],
        step_delay: float = 0.0,
        fail_at_step: int | None = None,
        max_model_len: int = 64,
        vocab_size: int = 49152,
    ) -> None:
        self.ready_info = EngineReadyInfo(num_kv_blocks=NUM_BLOCKS, max_model_len=max_model_len, vocab_size=vocab_size)
        self._script = script
        self._step_delay = step_delay
        self._fail_at_step = fail_at_step
        self.running: dict[str, tuple[EngineCoreRequest, list[int], int]] = {}
        self.num_steps = 0
        self.aborted: list[str] = []
        self.emitted: dict[str, int] = {}  # request id -> tokens emitted (also after it finished or was aborted)
        self.shut_down = threading.Event()
        self.failure_callbacks: list[Callable[[], None]] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id.startswith("refuse"):
            raise ValueError(f"refused {request.request_id}")
        self.running[request.request_id] = (request, self._script(request), 0)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.running.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> EngineCoreOutputs:
        self.num_steps += 1
        if self.num_steps == self._fail_at_step:
            raise RuntimeError("scripted engine failure")
        time.sleep(self._step_delay)
        outputs = [self._advance(request_id) for request_id in list(self.running)]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.get_scheduler_stats())

    def _advance(self, request_id: str) -> EngineCoreOutput:
        request, tokens, num_done = self.running[request_id]
        token = tokens[num_done % len(tokens)]
        num_done += 1
        self.emitted[request_id] = num_done
        params = request.sampling_params
        reason = None
        if token == request.eos_token_id and not params.ignore_eos:
            reason = FinishReason.STOP
        elif num_done >= (params.max_tokens or 1 << 30):
            reason = FinishReason.LENGTH
        if reason is None:
            self.running[request_id] = (request, tokens, num_done)
        else:
            del self.running[request_id]
        return EngineCoreOutput(request_id, [token], finish_reason=reason)

    def get_scheduler_stats(self) -> SchedulerStats:
        used = len(self.running)
        return SchedulerStats(used, 0, NUM_BLOCKS - used, NUM_BLOCKS)

    def echo(self, *args: Any) -> list[Any]:
        return list(args)

    def reset_prefix_cache(self) -> bool:
        return not self.running

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        raise ValueError(f"the fake core has no workers for {method!r}")

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self.failure_callbacks.append(callback)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        self.shut_down.set()
