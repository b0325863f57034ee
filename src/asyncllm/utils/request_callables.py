"""Per-request callables (`SamplingParams.logits_processors`) between the frontend and an in-process worker.

Callables cannot ride the msgpack wire (no pickle on sockets), so the frontend keeps them here under the user
request's internal id (`SamplingParams.logits_processors_key`, copied to each of its n > 1 completions) and sends
the parameters without them; a worker in the same process (engine in a thread, "uni" executor) reads them back
by that key at each step. The frontend forgets the key when the user request ends (finished, aborted or failed);
a worker that then finds no entry leaves the row alone (the request is being aborted).

Plain dict operations: atomic under the GIL, so the frontend's loop thread and the engine thread share it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

LogitsProcessor = Callable[..., Any]  # (output_ids, logits) -> logits, or (prompt_ids, output_ids, logits) -> logits

_registry: dict[str, tuple[LogitsProcessor, ...]] = {}


def register(key: str, processors: Sequence[LogitsProcessor]) -> None:
    """Keep `processors` for the request whose internal id is `key`."""
    _registry[key] = tuple(processors)


def lookup(key: str) -> tuple[LogitsProcessor, ...] | None:
    """The processors kept under `key`, or None once forgotten."""
    return _registry.get(key)


def forget(key: str) -> None:
    """Drop `key`'s processors (no-op when absent)."""
    _registry.pop(key, None)
