"""Start and stop the engine-core process; its private socket directory; dying with the parent.

The client side uses `make_ipc_dir`, `start_engine_process` and `stop_process`; the engine side calls
`die_with_parent` first thing. Processes use the `spawn` context (a fresh interpreter: no copied locks, threads
or torch state). The engine's configuration crosses as msgspec msgpack bytes, not as a pickled object.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

logger = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PARENT_POLL_INTERVAL_S = 0.5


def make_ipc_dir() -> str:
    """Create a private directory (mode 0700) for one engine's `ipc://` socket files; returns its path."""
    path = tempfile.mkdtemp(prefix="asyncllm-")
    os.chmod(path, 0o700)
    return path


def remove_ipc_dir(path: str) -> None:
    """Remove the socket directory and everything in it; a missing directory is fine."""
    shutil.rmtree(path, ignore_errors=True)


def start_engine_process(target: Any, config: Any, **kwargs: Any) -> BaseProcess:
    """Start `target(config_bytes, parent_pid=..., parent_is_main_thread=..., **kwargs)` in a spawned process.

    Args:
        target: a module-level function (importable in the child).
        config: a msgspec-encodable config (e.g. `EngineConfig`); passed as msgpack bytes.
        kwargs: further plain arguments (strings, numbers).
    Returns:
        The started process (daemon: multiprocessing also ends it at a clean interpreter exit).
    """
    context = multiprocessing.get_context("spawn")
    kwargs = dict(
        kwargs,
        parent_pid=os.getpid(),
        parent_is_main_thread=threading.current_thread() is threading.main_thread(),
    )
    process = context.Process(
        target=target, args=(msgspec.msgpack.encode(config),), kwargs=kwargs, name="asyncllm-engine-core", daemon=True
    )
    process.start()
    return process


def stop_process(process: BaseProcess, timeout_s: float) -> None:
    """Wait up to `timeout_s` seconds for `process` to exit, then SIGTERM it, then SIGKILL it; reap it."""
    process.join(timeout_s)
    if process.exitcode is None:
        logger.warning("engine process %s did not exit within %.1f s: terminating it", process.pid, timeout_s)
        process.terminate()
        process.join(2.0)
    if process.exitcode is None:
        process.kill()
        process.join(2.0)


def die_with_parent(parent_pid: int, parent_is_main_thread: bool, ipc_dir: str) -> None:
    """Make this (engine) process exit soon after its parent dies, removing the parent's socket directory.

    Linux: `prctl(PR_SET_PDEATHSIG, SIGTERM)` (only when the parent's main thread started us: the signal follows
    the thread, not the process). Everywhere: a daemon thread polls `os.getppid()` every 0.5 s. On SIGTERM the
    process raises `SystemExit` in its main thread so normal clean-up runs. SIGINT is ignored (and so is it in
    the worker processes this one spawns, which inherit that): Ctrl-C in a terminal reaches the whole process
    group, and the parent decides what it means (e.g. `asyncllm chat` stops one answer; `asyncllm serve` drains
    and then shuts the engine down).
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(parent_pid, ipc_dir))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux") and parent_is_main_thread:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before we got here
        _exit_orphaned(ipc_dir)
    thread = threading.Thread(target=_watch_parent, args=(parent_pid, ipc_dir), name="parent-watch", daemon=True)
    thread.start()


def _on_sigterm(parent_pid: int, ipc_dir: str) -> None:
    if os.getppid() != parent_pid:
        remove_ipc_dir(ipc_dir)
    raise SystemExit(128 + signal.SIGTERM)


def _watch_parent(parent_pid: int, ipc_dir: str) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    _exit_orphaned(ipc_dir)


def _exit_orphaned(ipc_dir: str) -> None:
    logger.warning("the parent process died: the engine process exits")
    remove_ipc_dir(ipc_dir)
    os._exit(1)
