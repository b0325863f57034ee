"""`PendingShutdown`: what `AsyncLLM.shutdown()` returns, a shutdown that is synchronous as vLLM's and awaitable.

vLLM's `AsyncLLM.shutdown()` is a plain method: code written for it calls `engine.shutdown()` without `await`,
also inside a coroutine. asyncllm's callers await it (`await llm.shutdown()`: the blocking part, joining the
engine, runs off the loop). One object serves both:

- called outside any event loop: the engine is stopped before `shutdown()` returns;
- awaited (or run as a task: `asyncio.run(llm.shutdown())`, `asyncio.create_task(...)`, `trio.run(llm.shutdown)`):
  the engine is stopped in a daemon thread while the loop keeps running;
- called inside a coroutine and not awaited (vLLM's way): the engine is stopped, blocking, when the object is
  dropped, i.e. at the end of the statement `llm.shutdown()` (CPython frees it at once), as vLLM's call blocks.

It is no Python coroutine object, so Python never warns that it "was never awaited": it implements the coroutine
protocol (`send`, `throw`, `close`, `__await__`) itself and makes its inner coroutine only when it is first run,
driving it at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Generator
from types import TracebackType
from typing import Any

import sniffio

from asyncllm.utils.threads import run_in_daemon_thread


class PendingShutdown(Coroutine[Any, Any, None]):
    """Stops an engine now (no loop), when awaited or run, or when dropped unawaited (see the module doc).

    Args:
        stop: stops the engine (blocking, idempotent: e.g. the `AsyncLLM`'s `weakref.finalize`).
    """

    def __init__(self, stop: Callable[[], Any]) -> None:
        self._stop = stop
        self._started = False
        self._inner: Coroutine[Any, Any, None] | None = None
        try:
            sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:  # a synchronous caller: done before shutdown() returns
            self._run_now()

    @property
    def started(self) -> bool:
        """True once the engine's stop ran or began (synchronously, in a daemon thread, or awaited)."""
        return self._started

    # ---- the coroutine protocol ---------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, None]:
        return self  # type: ignore[return-value]  # an iterator: `__next__`, `send`, `throw`, `close`

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        if self._inner is None:
            if self._started:  # stopped already (no loop at the call, or awaited before): nothing to wait for
                raise StopIteration
            self._started = True
            self._inner = self._stop_off_the_loop()
        return self._inner.send(value)

    def throw(  # type: ignore[override]
        self, typ: Any, val: BaseException | None = None, tb: TracebackType | None = None
    ) -> Any:
        if self._inner is None:  # e.g. a task cancelled before it ran: the engine still stops, off the loop
            self._stop_in_background()
            error = typ if isinstance(typ, BaseException) else (val if val is not None else typ())
            raise error.with_traceback(tb) if tb is not None else error
        if val is None and tb is None:
            return self._inner.throw(typ)
        return self._inner.throw(typ, val, tb)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        else:
            self._stop_in_background()

    # ---- the work ------------------------------------------------------------------------------------

    async def _stop_off_the_loop(self) -> None:
        await run_in_daemon_thread(self._stop, name="asyncllm-shutdown")

    def _run_now(self) -> None:
        if not self._started:
            self._started = True
            self._stop()

    def _stop_in_background(self) -> None:
        if not self._started:
            self._started = True
            threading.Thread(target=self._stop, name="asyncllm-shutdown", daemon=True).start()

    def __del__(self) -> None:
        self._run_now()  # never awaited (vLLM's synchronous call): stop here; a no-op once started
