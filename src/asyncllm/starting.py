"""`StartingAsyncLLM`: what `AsyncLLM.create()` returns, an engine start that does not block the event loop."""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio

from asyncllm.utils.threads import run_in_daemon_thread


class Startable(Protocol):
    """What `StartingAsyncLLM` needs of what it starts (an `AsyncLLM`)."""

    @property
    def _finalizer(self) -> Callable[[], Any]:
        """Stops the engine (blocking)."""

    def shutdown(self) -> Awaitable[None]: ...

    def _bind_to_current_loop(self) -> Any:
        """Binds to the running loop and starts the background output handler there."""


AsyncLLM = TypeVar("AsyncLLM", bound=Startable)


class StartingAsyncLLM(Generic[AsyncLLM]):
    """Await it for the `AsyncLLM`, or use it in `async with` (which also shuts the engine down on exit).

    Awaitable once. Works on asyncio and trio. The start (`AsyncLLM.from_engine_args`) runs in a daemon thread;
    the background output handler then starts on the awaiting loop.

    Args:
        start: builds the `AsyncLLM` (blocking); called once, in a worker thread.
    """

    def __init__(self, start: Callable[[], AsyncLLM]) -> None:
        self._start = start
        self._llm: AsyncLLM | None = None

    def __await__(self) -> Generator[Any, None, AsyncLLM]:
        return self._start_in_thread().__await__()

    async def __aenter__(self) -> AsyncLLM:
        self._llm = await self._start_in_thread()
        return self._llm

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._llm is not None:
            await self._llm.shutdown()

    async def _start_in_thread(self) -> AsyncLLM:
        """Start in a worker thread; a cancelled await returns at once and the engine is stopped once it is up
        (the thread cannot be interrupted)."""
        lock = threading.Lock()
        state: dict[str, Any] = {"abandoned": False, "llm": None}

        def start() -> AsyncLLM:
            llm = self._start()
            with lock:
                abandoned = state["abandoned"]
                state["llm"] = llm
            if abandoned:
                llm._finalizer()
            return llm

        try:
            llm = await run_in_daemon_thread(start, name="asyncllm-start", abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            with lock:
                state["abandoned"] = True
                llm = state["llm"]
            if llm is not None:  # it finished just as we were cancelled: stop it here (shutdown blocks)
                threading.Thread(target=llm._finalizer, name="asyncllm-abandoned-start", daemon=True).start()
            raise
        llm._bind_to_current_loop()
        return llm


def bind_start(from_engine_args: Callable[..., AsyncLLM], *args: Any) -> Callable[[], AsyncLLM]:
    """`from_engine_args(*args)` as a callable for `StartingAsyncLLM`."""
    return functools.partial(from_engine_args, *args)
