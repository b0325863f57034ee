"""The engine core's handshake on the client's ROUTER: decoding it and turning a failed start into an error.

Each engine core, once built, sends one `EngineHandshake` frame on its DEALER: its ready info (KV blocks, max
model length, vocabulary size, pid, data-parallel rank), or the start-up error's text and class name.
"""

from __future__ import annotations

import logging

import msgspec

from asyncllm import errors
from asyncllm.errors import EngineDeadError
from asyncllm.messages.engine import EngineHandshake

logger = logging.getLogger(__name__)


def decode_handshake(frames: list[bytes]) -> tuple[bytes, EngineHandshake] | None:
    """`(DEALER identity, handshake)` from the ROUTER's frames, or None (logged) for a malformed message."""
    try:
        identity, payload = frames
        return identity, msgspec.msgpack.decode(payload, type=EngineHandshake)
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.error("dropped a malformed handshake (%d frames): %s", len(frames), e)
        return None


def startup_error(handshake: EngineHandshake) -> BaseException:
    """The exception to raise for a failed start-up: the `asyncllm.errors` class it names, else EngineDeadError."""
    message = f"the engine core failed to start: {handshake.error}"
    error_class = getattr(errors, handshake.error_type or "", None)
    if isinstance(error_class, type) and issubclass(error_class, errors.AsyncLLMError):
        return error_class(message)
    return EngineDeadError(message)
