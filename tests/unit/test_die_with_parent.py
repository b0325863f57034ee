"""`die_with_parent`: a child removes its parent's socket directory however the parent goes away.

Regression (CI, stop 18): when a multi-threaded parent is SIGKILLed, Linux may reparent the child to a sibling
thread of the dying parent before the whole process is gone, and PR_SET_PDEATHSIG fires while `os.getppid()`
still names the parent. The child then exited without removing the directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import sys, time
from asyncllm.utils.process import die_with_parent
die_with_parent(int(sys.argv[1]), True, sys.argv[2])
print("ready", flush=True)
time.sleep(60)
"""

# The parent's main thread starts the child, then ends alone (a raw exit of that thread, no exit_group), while
# another thread keeps the process alive: the child is reparented within the same process and gets its
# PR_SET_PDEATHSIG, with getppid() unchanged. This is the first half of a SIGKILL of a multi-threaded process.
PARENT = """
import ctypes, os, subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"ready\\n"
print(child.pid, flush=True)
threading.Thread(target=time.sleep, args=(30,)).start()
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit on x86-64: this thread only
"""


def wait_until(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="Linux x86-64")
def test_parent_death_signal_while_parent_pid_unchanged_removes_the_directory(tmp_path: Path) -> None:
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    (ipc_dir / "input").write_text("")
    with subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(ipc_dir)], stdout=subprocess.PIPE) as parent:
        try:
            child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
            assert wait_until(lambda: is_gone(child_pid), 30), "the child outlived its parent's starting thread"
            assert not ipc_dir.exists(), "the socket directory was left behind"
        finally:
            parent.kill()
            parent.wait(30)
