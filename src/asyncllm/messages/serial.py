"""msgpack encoding of engine messages (msgspec) with a numpy/torch extension; nothing is ever unpickled.

A message becomes a list of frames: frame 0 is the msgpack payload; arrays larger than `INLINE_LIMIT_BYTES`
travel as extra frames that reference the array's memory (zero-copy on send: ZeroMQ takes the buffer as is)
and are rebuilt on the other side with `numpy.frombuffer` over the received frame (zero-copy on receive for
numpy arrays, which are then read-only; torch tensors get one copy because torch requires writable memory).
Small arrays are inlined in the payload. Only plain numeric dtypes are accepted (no object arrays), so a
crafted frame can at worst fail to decode. Follows vLLM v1's `vllm/v1/serial_utils.py` design.

Ext payload (msgpack array): `[dtype_str, shape, data]` where `data` is the raw bytes (inline) or the int
index of the frame holding them (out of band).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

INLINE_LIMIT_BYTES = 256
EXT_NUMPY = 1
EXT_TORCH = 2
ALLOWED_DTYPE_KINDS = frozenset("biuf")  # bool, signed, unsigned, float; no object/void/str arrays

Buffer = bytes | bytearray | memoryview
# What `MsgpackEncoder` writes (numpy's `dtype.str` of a plain numeric dtype). `numpy.dtype()` parses far more
# (comma lists, tuples, and raises TypeError or even SyntaxError on junk), so anything else is refused unparsed.
_DTYPE_STR = re.compile(r"[<>|=]?[biuf][1248]")


class MessageDecodeError(ValueError):
    """A frame that is not a valid message of the expected type: malformed msgpack, a payload of the wrong shape
    or type, or a bad array extension (unknown dtype, wrong size, missing frame). The only error decoding raises."""


class MsgpackEncoder:
    """Encodes one object (usually a msgspec Struct) to frames `[payload, *array_buffers]`.

    Not thread-safe: one encoder per thread.
    """

    def __init__(self, inline_limit_bytes: int = INLINE_LIMIT_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inline_limit = inline_limit_bytes
        self._frames: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Encode `obj`. Returns frames; frame 0 is the msgpack payload.

        Raises:
            TypeError: an object msgpack and the extension cannot encode.
        """
        frames: list[Buffer] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # never import torch here: the frontend may not have it loaded
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_array(EXT_TORCH, obj.detach().cpu().contiguous().numpy())
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            return self._encode_array(EXT_NUMPY, obj)
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")

    def _encode_array(self, code: int, array: Any) -> msgspec.msgpack.Ext:
        import numpy as np

        array = np.ascontiguousarray(array)
        if array.dtype.kind not in ALLOWED_DTYPE_KINDS:
            raise TypeError(f"cannot encode arrays of dtype {array.dtype}")
        data: int | bytes
        if array.nbytes <= self._inline_limit or self._frames is None:
            data = array.tobytes()
        else:
            self._frames.append(memoryview(array).cast("B"))
            data = len(self._frames) - 1
        return msgspec.msgpack.Ext(code, msgspec.msgpack.encode([array.dtype.str, list(array.shape), data]))


class MsgpackDecoder:
    """Decodes frames made by `MsgpackEncoder` into `type_` (typed: wrong shapes raise, nothing executes).

    Args:
        type_: the expected type, e.g. `EngineCoreRequest`; `Any` decodes to plain objects.
    Raises (from `decode`):
        MessageDecodeError: malformed or mistyped payload, or a bad array extension.
    """

    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Sequence[Buffer]) -> Any:
        """Decode `frames` (frame 0: the msgpack payload; the rest: out-of-band array data).

        Raises:
            MessageDecodeError: see the class docstring.
        """
        if not frames:
            raise MessageDecodeError("no frames")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        except MessageDecodeError:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OverflowError) as e:
            raise MessageDecodeError(f"{type(e).__name__}: {e}") from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_NUMPY, EXT_TORCH):
            raise MessageDecodeError(f"unknown msgpack extension type {code}")
        array = self._decode_array(data)
        if code == EXT_TORCH:
            import torch

            # torch tensors must be writable; received frames are read-only, so tensors pay one copy here.
            return torch.from_numpy(array if array.flags.writeable else array.copy())
        return array

    def _decode_array(self, data: memoryview) -> Any:
        import numpy as np

        dtype_str, shape, payload = msgspec.msgpack.decode(data, type=tuple[str, list[int], int | bytes])
        if not _DTYPE_STR.fullmatch(dtype_str) or any(d < 0 for d in shape):
            raise MessageDecodeError(f"refusing array extension with dtype {dtype_str[:16]!r} and shape {shape[:8]}")
        dtype = np.dtype(dtype_str)
        if isinstance(payload, int):
            if not 0 < payload < len(self._frames):
                raise MessageDecodeError(f"array extension refers to missing frame {payload}")
            buffer: Buffer = self._frames[payload]
        else:
            buffer = payload
        count = 1
        for d in shape:
            count *= d
        if memoryview(buffer).nbytes != count * dtype.itemsize:
            raise MessageDecodeError("array extension size does not match its dtype and shape")
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)
