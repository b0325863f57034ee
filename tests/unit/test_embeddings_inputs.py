"""Embedding requests and prompt embeddings, without a model: submission checks (`InvalidRequestError` naming the
field), the engine core's re-check, the chunk-accumulating pooler, and the zero-copy wire form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm import InvalidRequestError, PoolingParams, SamplingParams
from asyncllm.engine.core import check_request
from asyncllm.messages.engine import EngineCoreRequest, EngineReadyInfo
from asyncllm.messages.serial import MsgpackDecoder, MsgpackEncoder
from asyncllm.processing.input_processor import InputProcessor, RequestOptions
from asyncllm.sampling_params import RequestOutputKind
from asyncllm.sched.kv_cache_manager import KVCacheManager
from asyncllm.sched.request import Request
from asyncllm.worker.pooler import PromptPooler

HIDDEN = 576
VOCAB = 49152
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def processor(model_path: str) -> InputProcessor:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return InputProcessor(Tokenizer.load(model_path), MAX_MODEL_LEN, VOCAB, hidden_size=HIDDEN)


def test_pooling_request_carries_params_and_a_placeholder_that_never_samples(processor: InputProcessor) -> None:
    params = PoolingParams(pooling="mean", dimensions=64)
    _, request = processor.process("Hello world", options=RequestOptions(request_id="e"), pooling_params=params)
    assert request.pooling_params == params
    assert request.sampling_params.max_tokens == 1
    assert request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
    assert request.prompt_token_ids == processor._tokenizer.encode("Hello world")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (PoolingParams(pooling="max"), "pooling='max'"),
        (PoolingParams(dimensions=0), "dimensions=0"),
        (PoolingParams(dimensions=HIDDEN + 1), f"dimensions={HIDDEN + 1}.*hidden size is {HIDDEN}"),
        (PoolingParams(dimensions=True), "dimensions=True"),
        (PoolingParams(normalize="yes"), "normalize='yes'"),  # type: ignore[arg-type]
    ],
)
def test_bad_pooling_params_are_refused_naming_the_field(
    processor: InputProcessor, params: PoolingParams, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        processor.process("Hi", pooling_params=params)


def test_pooling_with_sampling_params_or_prompt_embeds_is_refused(processor: InputProcessor) -> None:
    with pytest.raises(InvalidRequestError, match="not sampling_params"):
        processor.process("Hi", SamplingParams(), pooling_params=PoolingParams())
    with pytest.raises(InvalidRequestError, match="must be a PoolingParams"):
        processor.process("Hi", pooling_params={"pooling": "last"})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="not prompt_embeds"):
        processor.process({"prompt_embeds": torch.zeros(2, HIDDEN)}, pooling_params=PoolingParams())


def test_prompt_embeds_become_a_float32_array_with_placeholder_ids(processor: InputProcessor) -> None:
    embeds = torch.randn(5, HIDDEN)
    text, request = processor.process({"prompt_embeds": embeds}, SamplingParams(max_tokens=3))
    assert text is None
    assert request.prompt_token_ids == [0] * 5
    assert isinstance(request.prompt_embeds, np.ndarray)
    assert request.prompt_embeds.dtype == np.float32
    assert np.array_equal(request.prompt_embeds, embeds.numpy())


@pytest.mark.parametrize(
    ("embeds", "match"),
    [
        (torch.zeros(3, HIDDEN - 1), f"hidden size {HIDDEN}"),
        (torch.zeros(3, HIDDEN, dtype=torch.float64), "dtype torch.float64"),
        (np.zeros((3, HIDDEN), dtype=np.float16), "dtype float16"),
        (torch.zeros(0, HIDDEN), r"shape \[0, 576\]"),
        (torch.zeros(HIDDEN), r"shape \[576\]"),
        (torch.full((2, HIDDEN), float("nan")), "non-finite"),
        (torch.tensor([[float("inf")] * HIDDEN]), "non-finite"),
        ([[0.0] * HIDDEN], "type list"),
        (torch.zeros(MAX_MODEL_LEN, HIDDEN), "at most 63 fit"),
    ],
)
def test_bad_prompt_embeds_are_refused(processor: InputProcessor, embeds: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        processor.process({"prompt_embeds": embeds}, SamplingParams(max_tokens=1))


def test_prompt_embeds_refuse_params_that_read_prompt_token_ids(processor: InputProcessor) -> None:
    embeds = {"prompt_embeds": torch.zeros(2, HIDDEN)}
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        processor.process(embeds, SamplingParams(max_tokens=1, repetition_penalty=1.2))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        processor.process(embeds, SamplingParams(max_tokens=1, prompt_logprobs=1))
    with pytest.raises(InvalidRequestError, match="no other keys"):
        processor.process({**embeds, "prompt": "x"}, SamplingParams(max_tokens=1))


def test_prompt_embeds_cross_the_wire_as_a_frame_and_the_engine_rechecks_them() -> None:
    embeds = np.random.default_rng(0).standard_normal((4, HIDDEN), dtype=np.float32)
    request = EngineCoreRequest("r-0", [0] * 4, SamplingParams(max_tokens=2), prompt_embeds=embeds)
    frames = MsgpackEncoder().encode(request)
    assert len(frames) == 2  # the array travels out of band, not in the payload
    assert memoryview(frames[1]).nbytes == embeds.nbytes
    decoded = MsgpackDecoder(EngineCoreRequest).decode([bytes(f) for f in frames])
    assert np.array_equal(decoded.prompt_embeds, embeds)
    info = EngineReadyInfo(16, MAX_MODEL_LEN, VOCAB, HIDDEN)
    check_request(decoded, info)
    decoded.prompt_token_ids = [0] * 3  # rows no longer match the prompt length
    with pytest.raises(InvalidRequestError, match="4 rows for 3 prompt positions"):
        check_request(decoded, info)
    pooled = EngineCoreRequest("p-0", [1, 2], SamplingParams(max_tokens=1), pooling_params=PoolingParams(dimensions=0))
    with pytest.raises(InvalidRequestError, match="dimensions=0"):
        check_request(pooled, info)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooler_over_chunks_equals_the_whole_prompt(pooling: str, normalize: bool) -> None:
    hidden = torch.randn(37, 16)
    params = PoolingParams(pooling=pooling, normalize=normalize, dimensions=10)
    expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling][:10]
    if normalize:
        expected = expected / expected.norm()
    whole = PromptPooler(params, 37).add_chunk(hidden, 0)
    chunked = PromptPooler(params, 37)
    assert chunked.add_chunk(hidden[:16], 0) is None
    assert chunked.add_chunk(hidden[16:32], 16) is None
    parts = chunked.add_chunk(hidden[32:], 32)
    assert whole is not None
    assert parts is not None
    assert len(parts) == 10
    torch.testing.assert_close(torch.tensor(whole), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.tensor(parts), expected, atol=1e-6, rtol=1e-6)


def _request(request_id: str, num_tokens: int, **fields: object) -> Request:
    request = EngineCoreRequest(request_id, [0] * num_tokens, SamplingParams(max_tokens=1), **fields)  # type: ignore[arg-type]
    return Request.from_engine_core_request(request)


def test_prompt_embeds_blocks_are_never_cached_and_pooling_never_reads_the_cache() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    embeds = _request("e", 12, prompt_embeds=np.ones((12, 8), dtype=np.float32))
    assert manager.allocate_slots(embeds, 12) is not None
    manager.free(embeds)
    ids_twin = _request("t", 12)  # the same placeholder ids, as token ids: must not hit the embeds' K/V
    assert manager.get_computed_blocks(ids_twin) == []
    assert manager.allocate_slots(ids_twin, 12) is not None  # computes and caches its own blocks
    manager.free(ids_twin)
    assert len(manager.get_computed_blocks(_request("t2", 12))) == 2  # a plain request hits them
    assert manager.get_computed_blocks(_request("p", 12, pooling_params=PoolingParams())) == []
