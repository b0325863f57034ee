"""`make test`'s distribution of test files over pytest-xdist workers (`tests/conftest.py`, `FileScheduling`): each
file whole on one worker (its module engines built once, not once per worker) and every Ray file on the same one.

The failing input behind it: with pytest 9.2 and pytest-xdist 3.8, `--dist loadgroup` silently ignored the
per-file `xdist_group` marks, so both workers ran every integration file and built its module engines; a fresh-clone
CI run on a 24 GB host peaked at 22.6 GB."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import RAY_SCOPE, ray_file

pytest.importorskip("xdist")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST_FILE = """
import os, pathlib

def record(name):
    with open(pathlib.Path(__file__).parent / "workers.txt", "a") as f:
        f.write(f"{pathlib.Path(__file__).name} {os.environ['PYTEST_XDIST_WORKER']}\\n")

""" + "".join(f"def test_{i}():\n    record({i})\n\n" for i in range(4))


def test_ray_files_are_named_so():
    assert ray_file("tests/integration/test_executors_ray.py")
    assert ray_file("tests/integration/test_executors_ray_local.py")
    assert ray_file("tests/integration/test_data_parallel_ray.py")
    assert not ray_file("tests/integration/test_array.py")
    assert not ray_file("tests/integration/test_rayleigh.py")


def test_the_scheduler_gives_each_file_one_scope_and_all_ray_files_one():
    from tests.conftest import FileScheduling

    scope = FileScheduling._split_scope
    assert scope(None, "tests/integration/test_int8.py::test_a[thread]") == "tests/integration/test_int8.py"  # type: ignore[arg-type]
    assert scope(None, "tests/integration/test_executors_ray.py::test_b") == RAY_SCOPE  # type: ignore[arg-type]
    assert scope(None, "tests/integration/test_data_parallel_ray.py::test_c") == RAY_SCOPE  # type: ignore[arg-type]


def test_two_workers_run_each_file_whole_and_the_ray_files_together(tmp_path: pathlib.Path):
    """The real run: two xdist workers over two Ray files first (xdist's plain `loadfile` would give one to each
    worker at once) and one more file of four tests."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import FileSchedulingPlugin\n\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(FileSchedulingPlugin())\n"
    )
    for name in ("test_a_ray.py", "test_b_ray.py", "test_c.py"):
        (tmp_path / name).write_text(TEST_FILE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split() for line in (tmp_path / "workers.txt").read_text().splitlines()]
    assert len(runs) == 12
    workers = {name: {worker for file, worker in runs if file == name} for name, _ in runs}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["test_a_ray.py"] == workers["test_b_ray.py"], workers


def test_the_suite_still_runs_with_xdist_turned_off():
    """`pytest -p no:xdist` once stopped at collection: pytest refused `pytest_xdist_make_scheduler` as an unknown
    hook, since only pytest-xdist declares it."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    command.append("tests/unit/test_xdist_scheduling.py::test_ray_files_are_named_so")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
