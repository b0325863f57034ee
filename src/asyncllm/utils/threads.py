"""Blocking calls awaited off the event loop, each in a daemon thread of its own.

Not `anyio.to_thread`: under asyncio its worker threads are not daemon threads and stay alive, idle, until the
loop's root task ends; a script that leaves `asyncio.run` through `sys.exit()` (the `SystemExit` passes through
the loop) then hangs at interpreter exit, waiting for them. A thread of ours never keeps the interpreter alive.
The calls made here (engine start-up and shutdown, tokenizing a long prompt, starting or stopping a
data-parallel engine) take milliseconds to seconds, so starting a thread for each is small beside the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from asyncllm.utils.loops import call_soon_in_loop, current_loop

T = TypeVar("T")


async def run_in_daemon_thread(
    fn: Callable[..., T], *args: Any, name: str = "asyncllm-blocking-call", abandon_on_cancel: bool = False
) -> T:
    """Run `fn(*args)` in a new daemon thread and wait for it without blocking the loop (asyncio or trio).

    Args:
        fn: the blocking call; its exception is raised here.
        name: the thread's name (what a debugger or `threading.enumerate()` shows).
        abandon_on_cancel: a cancelled wait returns at once (the thread still runs to the end; its result is
            dropped); default False: the wait is shielded, as `anyio.to_thread.run_sync`'s.
    Returns:
        What `fn` returned.
    """
    loop = current_loop()
    done = anyio.Event()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:  # handed to the waiting task
            outcome.append((False, e))
        finally:
            call_soon_in_loop(loop, done.set)

    threading.Thread(target=target, name=name, daemon=True).start()
    with anyio.CancelScope(shield=not abandon_on_cancel):
        await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result
