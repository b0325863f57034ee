"""Child processes of asyncllm: start them without re-importing the user's script, stop them, exit with the parent.

Engine-core and `mp` worker processes are started as `python -m <module>` subprocesses (a fresh interpreter
that never imports the user's `__main__`, so no `if __name__ == "__main__":` guard is needed). Their launch
arguments arrive as one msgspec msgpack message on stdin (no pickle). The parent watches each child through a
Linux pidfd (`ChildProcess.sentinel`, readable once the child exited); the child calls `die_with_parent` first
thing, so it exits when the parent dies (PR_SET_PDEATHSIG plus a parent-pid watcher) and removes the parent's
private 0700 socket directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

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


class ChildProcess:
    """A `python -m module` child; the surface of `multiprocessing.Process` that asyncllm uses.

    Attributes:
        pid, name: the child's pid and a label for logs.
        sentinel: a pidfd that becomes readable when the child exits (for `multiprocessing.connection.wait`).
    """

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.name = name
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit code, or -signal number when a signal ended it."""
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: forever) for the child to exit."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def close(self) -> None:
        """Release the pidfd (after the child exited)."""
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


def start_module_process(module: str, launch_message: bytes, name: str) -> ChildProcess:
    """Run `python -m module` with `launch_message` (msgpack bytes) on its stdin.

    The child inherits this process's `sys.path` (through PYTHONPATH), so modules the caller can import (e.g. a
    custom executor "pkg.mod:Class") import there too.
    Returns:
        The started child.
    """
    env = dict(os.environ)
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    popen = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)
    assert popen.stdin is not None  # stdin=PIPE
    with popen.stdin:
        popen.stdin.write(launch_message)
    return ChildProcess(popen, name)


def read_launch_message() -> bytes:
    """In the child: the launch message the parent wrote to stdin."""
    return sys.stdin.buffer.read()


def stop_process(process: ChildProcess, timeout_s: float) -> None:
    """Wait up to `timeout_s` seconds for `process` to exit, then SIGTERM it, then SIGKILL it; reap it."""
    process.join(timeout_s)
    if process.exitcode is None:
        logger.warning("process %s did not exit within %.1f s: terminating it", process.pid, timeout_s)
        process.terminate()
        process.join(2.0)
    if process.exitcode is None:
        process.kill()
        process.join(2.0)


def die_with_parent(parent_pid: int, parent_is_main_thread: bool, ipc_dir: str) -> None:
    """Make this (child) process exit soon after its parent dies, removing the parent's socket directory.

    Linux: `prctl(PR_SET_PDEATHSIG, SIGTERM)` (only when the parent's main thread started us: the signal follows
    the thread, not the process). Everywhere: a daemon thread polls `os.getppid()` every 0.5 s. On SIGTERM the
    process removes `ipc_dir` and raises `SystemExit` in its main thread so normal clean-up runs. SIGINT is
    ignored (and so is it in the worker processes this one starts, which inherit that): Ctrl-C in a terminal
    reaches the whole process group, and the parent decides what it means (e.g. `asyncllm chat` stops one
    answer; `asyncllm serve` drains and then shuts the engine down).
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(ipc_dir))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux") and parent_is_main_thread:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before we got here
        _exit_orphaned(ipc_dir)
    thread = threading.Thread(target=_watch_parent, args=(parent_pid, ipc_dir), name="parent-watch", daemon=True)
    thread.start()


def launched_from_main_thread() -> bool:
    """Whether the calling thread is the main thread (PR_SET_PDEATHSIG is only safe then)."""
    return threading.current_thread() is threading.main_thread()


def _on_sigterm(ipc_dir: str) -> None:
    # Always remove the directory: `os.getppid()` cannot tell a parent death apart. When a multi-threaded parent
    # is killed, Linux may first reparent us to one of its still-running threads and send PR_SET_PDEATHSIG then,
    # so getppid() still names the parent. A parent that sends SIGTERM itself is shutting us down and removes the
    # directory anyway (removal ignores a missing directory).
    remove_ipc_dir(ipc_dir)
    raise SystemExit(128 + signal.SIGTERM)


def _watch_parent(parent_pid: int, ipc_dir: str) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_INTERVAL_S)
    _exit_orphaned(ipc_dir)


def _exit_orphaned(ipc_dir: str) -> None:
    logger.warning("the parent process died: this process exits")
    remove_ipc_dir(ipc_dir)
    os._exit(1)
