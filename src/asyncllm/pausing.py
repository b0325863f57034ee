"""Pausing generation (vLLM's `pause_generation` / `resume_generation` / `is_paused`, used to swap weights
between RL rollouts): the gate new requests wait at while the AsyncLLM is paused, and how in-flight requests are
handled when it pauses.

While paused, `generate()` still validates its prompt at once (bad input raises there), but the request reaches
the engine only when the stream is first awaited after `resume_generation()`; `encode()` waits before it
processes its prompts. Requests the engine already holds are handled by the pause's mode:
    "abort" (vLLM's default): each ends at once with finish_reason "abort" (as `abort()`).
    "wait" (`wait_for_inflight_requests=True`): they run to their end; `pause_generation()` returns once the last
        one has finished.
    "keep": the engine's scheduler stops: they stay where they are (holding their KV blocks; their streams simply
        wait) and go on from there after `resume_generation()`. `clear_cache=True` cannot be honoured then (the
        kept requests hold blocks) and is refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

import anyio

from asyncllm.errors import InvalidRequestError

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES = ("abort", "wait", "keep")
DRAIN_POLL_SECONDS = 0.005  # how often a "wait" pause looks whether the last in-flight request has finished


def resolve_pause_mode(mode: str | None, wait_for_inflight_requests: bool | None) -> str:
    """The pause's mode from vLLM's two ways of saying it: `mode=` (newer vLLM) or the older
    `wait_for_inflight_requests=` (True = "wait", False = "abort"). Neither: "abort", vLLM's default.

    Raises:
        InvalidRequestError: an unknown mode, or both arguments given and disagreeing.
    """
    if wait_for_inflight_requests is not None and not isinstance(wait_for_inflight_requests, bool):
        raise InvalidRequestError(
            f"wait_for_inflight_requests={wait_for_inflight_requests!r} is invalid: must be True, False or None"
        )
    from_flag = None if wait_for_inflight_requests is None else ("wait" if wait_for_inflight_requests else "abort")
    if mode is None:
        return from_flag or "abort"
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"pause_generation(mode={mode!r}) is invalid: must be 'abort', 'wait' or 'keep'")
    if from_flag is not None and from_flag != mode:
        raise InvalidRequestError(
            f"pause_generation got mode={mode!r} and wait_for_inflight_requests={wait_for_inflight_requests!r},"
            " which disagree; give one of them"
        )
    return mode


class PauseGate:
    """Whether generation is paused, and the tasks waiting for it to resume. Used from the AsyncLLM's loop only."""

    def __init__(self) -> None:
        self.paused = False
        self.engine_frozen = False  # the engine's scheduler is paused too (mode "keep")
        self._waiters: list[anyio.Event] = []

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        """Let every waiting request through (idempotent)."""
        self.paused = False
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    async def wait_resumed(self) -> None:
        """Return at once when not paused, else when `resume()` is called."""
        while self.paused:
            event = anyio.Event()
            self._waiters.append(event)
            await event.wait()


async def poll_until(condition: Callable[[], Awaitable[bool]], deadline: float | None) -> bool:
    """Await `condition()` every `DRAIN_POLL_SECONDS` until it is true (True), or until `deadline` seconds have
    passed (False; None = no deadline). Whatever `condition` raises propagates."""
    with anyio.move_on_after(deadline):
        while True:
            if await condition():
                return True
            await anyio.sleep(DRAIN_POLL_SECONDS)
    return False
