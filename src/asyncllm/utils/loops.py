"""Which event loop is running (asyncio or trio, via `sniffio`), whether a loop is still alive, and background
tasks that belong to a loop rather than to a caller's task.

An `AsyncLLM` keeps per-loop state (its background output handler task, events); it binds to the loop that uses
it and rebinds when that loop has ended (several `asyncio.run` calls in one script), but refuses a second live
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import sniffio

from asyncllm.errors import EventLoopError


def current_loop() -> Any:
    """A token for the running event loop: the asyncio loop, or trio's `TrioToken`.

    Raises:
        sniffio.AsyncLibraryNotFoundError: no async library is running in this thread.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token()
    return asyncio.get_running_loop()


def loop_is_alive(token: Any) -> bool:
    """True while the loop behind `token` (from `current_loop`) still runs."""
    if isinstance(token, asyncio.AbstractEventLoop):
        return token.is_running() and not token.is_closed()
    trio = sys.modules["trio"]  # a trio token exists: trio is imported (no import here: GC may run at exit)
    try:
        token.run_sync_soon(_noop)
    except trio.RunFinishedError:
        return False
    return True


class LoopBinding:
    """Remembers the one live event loop (and its thread) an object is used from.

    `bind()` returns True when the binding changed (the caller then drops its per-loop state).
    Raises:
        EventLoopError: another event loop, still running in another thread, is bound.
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._loop: Any = None
        self._thread: threading.Thread | None = None

    @property
    def loop(self) -> Any:
        """The bound loop's token (`current_loop()`), or None before the first `bind()`."""
        return self._loop

    def bind(self) -> bool:
        loop = current_loop()
        if loop is self._loop:
            return False
        if self._loop is not None and self._thread is not threading.current_thread() and loop_is_alive(self._loop):
            thread_name = self._thread.name if self._thread is not None else "?"
            raise EventLoopError(
                f"{self._what} is in use by an event loop running in thread {thread_name!r}; use it from that loop"
                " only (or create one per loop)"
            )
        self._loop, self._thread = loop, threading.current_thread()
        return True


def call_soon_in_loop(token: Any, callback: Any, *args: Any) -> None:
    """Run `callback(*args)` soon on the loop behind `token`, from any thread; nothing if that loop has ended."""
    if isinstance(token, asyncio.AbstractEventLoop):
        with contextlib.suppress(RuntimeError):  # the loop is closed
            token.call_soon_threadsafe(callback, *args)
        return
    trio = sys.modules["trio"]  # a trio token exists: trio is imported (no import here: GC may run at exit)
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(callback, *args)


_background_tasks: set[asyncio.Task[None]] = set()  # asyncio keeps only weak references to tasks


def spawn_background_task(async_fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
    """Run `async_fn()` in the background of the running loop, owned by no caller's task or task group: an
    asyncio task (referenced here until it ends) or a trio system task. Call it on the loop's thread.

    The task ends when `async_fn` returns, or when its loop ends: `asyncio.run` and `trio.run` cancel it then.
    `async_fn` must catch its own exceptions (under trio, one escaping a system task crashes the whole run).
    Raises:
        sniffio.AsyncLibraryNotFoundError: no loop runs in this thread.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(async_fn, name=name)
        return
    task = asyncio.get_running_loop().create_task(async_fn(), name=name)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)


def _noop() -> None:
    pass
