"""msgpack serial: typed round trips, numpy/torch arrays inline and as zero-copy frames, hostile payloads."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import torch

from asyncllm import SamplingParams
from asyncllm.engine.core_proc import decode_request
from asyncllm.messages.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from asyncllm.messages.serial import EXT_NUMPY, INLINE_LIMIT_BYTES, MsgpackDecoder, MsgpackEncoder
from asyncllm.sampling_params import RequestOutputKind


def test_request_and_outputs_round_trip_typed() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=["x"], output_kind=RequestOutputKind.DELTA, seed=3)
    request = EngineCoreRequest("r1", [1, 2, 3], params, eos_token_id=2, arrival_time=12.5, priority=-1)
    frames = MsgpackEncoder().encode(request)
    assert len(frames) == 1
    assert MsgpackDecoder(EngineCoreRequest).decode(frames) == request

    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5], FinishReason.LENGTH), EngineCoreOutput("r2", [6, 7], stop_reason="s")],
        scheduler_stats=SchedulerStats(1, 2, 3, 4),
        utility_result=UtilityResult(9, result=[1, "a"]),
        finished_requests=["r1"],
        failed_requests={"r3": "ValueError: bad"},
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded == outputs
    assert decoded.outputs[0].finish_reason is FinishReason.LENGTH


def test_small_arrays_are_inlined_and_large_ones_travel_as_zero_copy_frames() -> None:
    small = np.arange(4, dtype=np.int32)
    large = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    assert small.nbytes <= INLINE_LIMIT_BYTES < large.nbytes
    frames = MsgpackEncoder().encode({"small": small, "large": large})
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), large), "the large array was copied"

    decoded = MsgpackDecoder().decode(frames)
    np.testing.assert_array_equal(decoded["small"], small)
    np.testing.assert_array_equal(decoded["large"], large)
    assert decoded["large"].shape == (100, 100)
    assert np.shares_memory(decoded["large"], np.frombuffer(frames[1], dtype=np.float32)), "decode copied"


def test_torch_tensors_round_trip_with_dtype_and_shape() -> None:
    tensors = [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.randn(64, 64), torch.tensor([True, False])]
    frames = MsgpackEncoder().encode(tensors)
    decoded = MsgpackDecoder(list[object]).decode(frames)
    for got, want in zip(decoded, tensors, strict=True):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    decoded[1].add_(1.0)  # decoded tensors are writable (they own a copy)


def test_unencodable_objects_are_refused() -> None:
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(object())
    with pytest.raises(TypeError, match="dtype"):
        MsgpackEncoder().encode(np.array([object(), object()], dtype=object))


def ext(code: int, dtype: str, shape: list[int], data) -> bytes:
    return msgspec.msgpack.encode(msgspec.msgpack.Ext(code, msgspec.msgpack.encode([dtype, shape, data])))


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([ext(EXT_NUMPY, "|O", [1], b"\0" * 8)], "refusing"),
        ([ext(EXT_NUMPY, "<f4", [4], 1)], "missing frame"),
        ([ext(EXT_NUMPY, "<f4", [4], b"\0" * 3)], "size"),
        ([ext(77, "<f4", [1], b"\0" * 4)], "extension type"),
    ],
)
def test_hostile_array_extensions_are_rejected(frames, error) -> None:
    with pytest.raises(ValueError, match=error):
        MsgpackDecoder().decode(frames)


class Boom:
    def __reduce__(self):
        return (print, ("executed",))


def test_pickles_and_garbage_never_decode_as_requests() -> None:
    decoders = {
        EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
        EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
        EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityCall),
    }
    hostile = [
        [b"\x00", pickle.dumps(Boom())],
        [pickle.dumps(Boom())],
        [b"\x07", b"{}"],
        [b"\x00", b"\xff\xfe garbage"],
        [b"\x00"],
        [b"\x01", msgspec.msgpack.encode({"not": "a list"})],
        [b"\x02", msgspec.msgpack.encode(["not", "a", "call", 1])],
    ]
    for frames in hostile:
        with pytest.raises((ValueError, msgspec.DecodeError, msgspec.ValidationError)):
            decode_request([memoryview(f) for f in frames], decoders)
    kind, payload = decode_request([memoryview(b"\x01"), memoryview(msgspec.msgpack.encode(["a", "b"]))], decoders)
    assert (kind, payload) == (EngineCoreRequestType.ABORT, ["a", "b"])
