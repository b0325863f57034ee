"""Executors: where workers run. `get_executor_class` maps a backend name to an `Executor` subclass."""

from __future__ import annotations

import importlib

from asyncllm.errors import ConfigError
from asyncllm.executors.base import Executor

_BUILTIN = {
    "uni": "asyncllm.executors.uniproc:UniProcExecutor",
    "mp": "asyncllm.executors.multiproc:MultiprocExecutor",
    "ray": "asyncllm.executors.ray:RayExecutor",
}


def get_executor_class(backend: str | type[Executor]) -> type[Executor]:
    """Resolve `distributed_executor_backend`.

    Args:
        backend: "uni" (one worker in the engine process), "mp" (one worker process per TP rank), "ray" (one
            Ray actor per rank); an `Executor` subclass; or "package.module:Class" naming one.
    Returns:
        The executor class.
    Raises:
        ConfigError: unknown name (listing the choices), or a
            "module:Class" that cannot be imported or is not an Executor subclass.
    """
    if isinstance(backend, type):
        if issubclass(backend, Executor):
            return backend
        raise ConfigError(f"executor class {backend!r} is not a subclass of asyncllm Executor")
    target = _BUILTIN.get(backend, backend)
    if ":" not in target:
        choices = [*_BUILTIN, "an Executor subclass", "'package.module:Class'"]
        raise ConfigError(f"unknown distributed_executor_backend {backend!r}; choices: {choices}")
    return _import_executor_class(target)


def _import_executor_class(target: str) -> type[Executor]:
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import executor {target!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ConfigError(f"executor {target!r} is not a subclass of asyncllm Executor")
    return cls


__all__ = ["Executor", "get_executor_class"]
