"""Fuzzing the wire decoders (hypothesis): random frames and mutations of valid frames never raise anything but
`MessageDecodeError` (the engine's request decoding, and the client's output decoding)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.engine.core_proc import decode_request
from asyncllm.messages.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)
from asyncllm.messages.serial import MessageDecodeError, MsgpackDecoder, MsgpackEncoder
from asyncllm.sampling_params import SamplingParams

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DECODERS = {
    EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
    EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
}
ENCODER = MsgpackEncoder(inline_limit_bytes=16)  # small: arrays travel both inline and out of band
REQUEST = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, logit_bias={5: 1.0}, stop=["x"]), 2)
VALID_INPUTS = [
    [EngineCoreRequestType.ADD.value, *ENCODER.encode(REQUEST)],
    [EngineCoreRequestType.UTILITY.value, *ENCODER.encode(UtilityCall(1, "echo", [np.arange(40), 1.5]))],
    [EngineCoreRequestType.ABORT.value, *ENCODER.encode(["a", "b"])],
]
VALID_OUTPUTS = [ENCODER.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [1, 2])]))]


@st.composite
def mutated(draw: st.DrawFn, valid: list[list]) -> list[bytes]:
    """A valid message with 1-4 byte edits (overwrite, truncate, insert, bit flip) in random frames."""
    frames = [bytearray(bytes(f)) for f in draw(st.sampled_from(valid))]
    for _ in range(draw(st.integers(1, 4))):
        frame = frames[draw(st.integers(0, len(frames) - 1))]
        op = draw(st.integers(0, 3))
        at = draw(st.integers(0, max(len(frame) - 1, 0)))
        byte = draw(st.integers(0, 255))
        if op == 0 and frame:
            frame[at] = byte
        elif op == 1:
            del frame[at:]
        elif op == 2:
            frame.insert(at, byte)
        elif frame:
            frame[at] ^= 1 << (byte % 8)
    return [bytes(f) for f in frames]


TYPE_BYTES = st.sampled_from([t.value for t in EngineCoreRequestType] + [b"", b"\xff"])
RANDOM_FRAMES = st.lists(st.binary(max_size=64), max_size=4)
RANDOM_INPUTS = st.one_of(RANDOM_FRAMES, st.tuples(TYPE_BYTES, RANDOM_FRAMES).map(lambda t: [t[0], *t[1]]))


def decode_input(frames: list[bytes]) -> None:
    with contextlib.suppress(MessageDecodeError):  # anything else fails the test
        decode_request([memoryview(f) for f in frames], DECODERS)


@FUZZ
@given(st.one_of(RANDOM_INPUTS, mutated(VALID_INPUTS)))
def test_request_decoding_raises_only_message_decode_error(frames: list[bytes]) -> None:
    decode_input(frames)


@FUZZ
@given(st.one_of(RANDOM_FRAMES.filter(bool), mutated(VALID_OUTPUTS)))
def test_output_decoding_raises_only_message_decode_error(frames: list[bytes]) -> None:
    with contextlib.suppress(MessageDecodeError):
        MsgpackDecoder(EngineCoreOutputs).decode(frames)


def test_numpy_dtype_parser_is_never_reached_with_junk() -> None:
    """Found by the fuzzer: `numpy.dtype()` raised TypeError and SyntaxError on mutated dtype strings."""
    import msgspec

    for junk in ("<i(", "(i8", "<y8", "", "O", "V8", "c16", "i8,i8", "<U4"):
        ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([junk, [1], b"\x00" * 8]))
        frames = [msgspec.msgpack.encode(ext)]
        with pytest.raises(MessageDecodeError, match="refusing"):
            MsgpackDecoder().decode(frames)
