"""`PendingShutdown`: what `AsyncLLM.shutdown()` returns, a shutdown that is synchronous as vLLM's and awaitable.

vLLM's `AsyncLLM.shutdown()` is a plain method: code written for it calls `engine.shutdown()` without `await`,
also inside a coroutine. asyncllm's callers await it (`await llm.shutdown()`: the blocking part, joining the
engine, runs off the loop). One object serves both:

- called outside any event loop: the engine is stopped before `shutdown()` returns;
- awaited: the engine is stopped in a daemon thread while the loop keeps running;
- called inside a coroutine and not awaited (vLLM's way): the engine is stopped, blocking, when the object is
  dropped, i.e. at the end of the statement `llm.shutdown()` (CPython frees it at once), as vLLM's call blocks.

It is no coroutine, so Python never warns that it "was never awaited"; `__await__` is a generator that makes its
inner coroutine only when the await starts.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import sniffio

from asyncllm.utils.threads import run_in_daemon_thread


class PendingShutdown:
    """Stops an engine now (no loop), when awaited, or when dropped without being awaited (see the module doc).

    Args:
        stop: stops the engine (blocking, idempotent: e.g. the `AsyncLLM`'s `weakref.finalize`).
    """

    def __init__(self, stop: Callable[[], Any]) -> None:
        self._stop = stop
        self._started = False
        try:
            sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:  # a synchronous caller: done before shutdown() returns
            self._run_now()

    @property
    def started(self) -> bool:
        """True once the engine's stop ran or began (synchronously, or in the awaited thread)."""
        return self._started

    def __await__(self) -> Generator[Any, None, None]:
        if self._started:
            return
        self._started = True
        yield from self._stop_off_the_loop().__await__()

    async def _stop_off_the_loop(self) -> None:
        await run_in_daemon_thread(self._stop, name="asyncllm-shutdown")

    def _run_now(self) -> None:
        if not self._started:
            self._started = True
            self._stop()

    def __del__(self) -> None:
        self._run_now()  # never awaited (vLLM's synchronous call): stop here; a no-op once started
