"""get_executor_class: names, classes, "module:Class" targets, and precise errors."""

from __future__ import annotations

import pytest

from asyncllm.errors import ConfigError
from asyncllm.executors import get_executor_class
from asyncllm.executors.base import Executor
from asyncllm.executors.uniproc import UniProcExecutor


def test_uni_is_the_uniproc_executor() -> None:
    assert get_executor_class("uni") is UniProcExecutor


def test_executor_subclass_and_import_path_are_accepted() -> None:
    assert get_executor_class(UniProcExecutor) is UniProcExecutor
    assert get_executor_class("asyncllm.executors.uniproc:UniProcExecutor") is UniProcExecutor


def test_mp_is_the_multiproc_executor() -> None:
    from asyncllm.executors.multiproc import MultiprocExecutor

    assert get_executor_class("mp") is MultiprocExecutor


def test_ray_is_the_ray_executor() -> None:
    from asyncllm.executors.ray import RayExecutor

    assert get_executor_class("ray") is RayExecutor


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown distributed_executor_backend 'gpu'.*'uni'"):
        get_executor_class("gpu")


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("asyncllm.nope:X", "cannot import"),
        ("asyncllm.executors.uniproc:Missing", "cannot import"),
        ("asyncllm.errors:ExecutorError", "not a subclass"),
        (int, "not a subclass"),
    ],
)
def test_bad_targets_are_rejected(backend: str | type[Executor], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_executor_class(backend)


def test_an_executor_class_becomes_an_importable_name_or_a_clear_config_error() -> None:
    from asyncllm.config import executor_backend_name
    from asyncllm.executors.uniproc import UniProcExecutor

    assert executor_backend_name(UniProcExecutor, True) == "asyncllm.executors.uniproc:UniProcExecutor"
    assert executor_backend_name("mp", True) == "mp"

    class Local(UniProcExecutor):
        pass

    with pytest.raises(ConfigError, match="defined inside a function"):
        executor_backend_name(Local, False)
    Local.__module__, Local.__qualname__ = "__main__", "Local"
    with pytest.raises(ConfigError, match="in the script run as __main__"):
        executor_backend_name(Local, True)
    assert executor_backend_name(Local, False) == "__main__:Local"  # thread mode imports it in this process
