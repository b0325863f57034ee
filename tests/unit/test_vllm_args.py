"""vLLM's engine arguments and request checks that need no engine: `max_logprobs`, `logprobs_mode`, `dtype`,
`disable_log_stats`, `skip_tokenizer_init`, and the frontend's refusals (docs/vllm_compat.md)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from asyncllm import ConfigError, EngineArgs, InvalidRequestError, SamplingParams
from asyncllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from asyncllm.processing.input_processor import InputProcessor
from asyncllm.processing.no_tokenizer import NoTokenizer
from asyncllm.worker.logprobs import compute_logprobs
from asyncllm.worker.sampler import Sampler, SamplingMetadata

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(model_path: str):
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path)


def test_logprobs_over_max_logprobs_fail_with_vllms_wording(tokenizer) -> None:
    default = InputProcessor(tokenizer, 64, VOCAB)  # EngineArgs.max_logprobs default: 20
    with pytest.raises(
        InvalidRequestError, match="requested sample logprobs of 21, which is greater than max allowed: 20"
    ):
        default.process("Hi", SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(InvalidRequestError, match=f"prompt logprobs of {VOCAB}, which is greater than max allowed: 20"):
        default.process("Hi", SamplingParams(max_tokens=2, prompt_logprobs=-1))
    default.process("Hi", SamplingParams(max_tokens=2, logprobs=20))
    whole = InputProcessor(tokenizer, 64, VOCAB, max_logprobs=-1)
    assert whole.process("Hi", SamplingParams(max_tokens=2, logprobs=-1)).request.sampling_params.logprobs == -1
    with pytest.raises(InvalidRequestError, match="logprobs=-2"):
        SamplingParams(logprobs=-2)


def test_logits_processors_are_refused_when_the_worker_is_in_another_process(tokenizer) -> None:
    processor = InputProcessor(tokenizer, 64, VOCAB)  # engine_process=True: callables cannot cross
    with pytest.raises(InvalidRequestError, match="engine_process=False"):
        processor.process("Hi", SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits]))
    with pytest.raises(InvalidRequestError, match="callables"):
        SamplingParams(logits_processors=["not callable"])


def test_bad_words_become_token_sequences_with_and_without_a_leading_space(tokenizer) -> None:
    processor = InputProcessor(tokenizer, 64, VOCAB)
    params = processor.process("Hi", SamplingParams(max_tokens=2, bad_words=["Paris"])).request.sampling_params
    bare = tokenizer.encode("Paris", add_special_tokens=False)
    spaced = tokenizer.encode(" Paris", add_special_tokens=False)
    assert params.bad_words_token_ids == [bare, spaced]


def test_skip_tokenizer_init_takes_token_ids_only(tokenizer) -> None:
    processor = InputProcessor(NoTokenizer(tokenizer.eos_token_id), 64, VOCAB)
    request = processor.process({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2)).request
    assert request.sampling_params.detokenize is False
    assert request.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        processor.process("text", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init"):
        processor.process({"prompt_token_ids": [1]}, SamplingParams(max_tokens=2, stop=["x"]))


@pytest.mark.parametrize("dtype", ["auto", "float32", "float", torch.float32])
def test_float32_dtypes_are_accepted(dtype: object) -> None:
    EngineArgs(dtype=dtype).validate()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "half", torch.bfloat16])
def test_other_dtypes_are_a_config_error_naming_them(dtype: object) -> None:
    with pytest.raises(ConfigError, match=r"dtype=.*(bfloat16|float16|half).* is not supported: .*float32"):
        EngineArgs(dtype=dtype).validate()


@pytest.mark.parametrize("value", ["auto", "float32", "bfloat16"])
def test_kv_cache_dtypes_implemented_are_accepted_and_reach_the_cache_config(value: str) -> None:
    EngineArgs(kv_cache_dtype=value).validate()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--kv-cache-dtype", value]), "m")
    assert args.kv_cache_dtype == value


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2", "float16", "half", "float", "bf16", "", None, 2])
def test_other_kv_cache_dtypes_are_a_config_error_naming_them(value: object) -> None:
    """vLLM's fp8 kinds and anything else: refused before any engine starts, never a silent float32 cache."""
    with pytest.raises(
        ConfigError, match=r"kv_cache_dtype=.* is not supported: must be one of \['auto', 'float32', 'bfloat16'\]"
    ):
        EngineArgs(kv_cache_dtype=value).validate()  # type: ignore[arg-type]


def test_logprobs_mode_and_max_logprobs_are_checked() -> None:
    with pytest.raises(ConfigError, match="logprobs_mode='logits'"):
        EngineArgs(logprobs_mode="logits").validate()
    with pytest.raises(ConfigError, match="max_logprobs=-2"):
        EngineArgs(max_logprobs=-2).validate()
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineArgs(logprobs_mode="processed_logprobs", speculative_config={"method": "ngram"}).validate()


def test_disable_log_stats_is_the_inverse_of_log_stats() -> None:
    assert EngineArgs(disable_log_stats=False).create_engine_config().observability.log_stats is True
    assert EngineArgs(disable_log_stats=True).create_engine_config().observability.log_stats is False
    assert EngineArgs().create_engine_config().observability.log_stats is False
    with pytest.raises(ConfigError, match="disagree"):
        EngineArgs(log_stats=True, disable_log_stats=True).validate()


def test_processed_logprobs_are_after_temperature_and_top_k() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(params, 50, {})
    meta.keep_processed = True
    sampled = Sampler(0)(logits, meta)
    processed = meta.processed_logits
    assert processed is not None
    lists = compute_logprobs(processed, sampled, [50, 50])
    sampled_row = dict(zip(lists.token_ids[0][1:], lists.logprobs[0][1:], strict=True))
    assert sum(1 for v in sampled_row.values() if v > -math.inf) == 3  # top-k = 3 survives
    expected = (logits[0] / 0.5).log_softmax(-1).topk(3)
    top3 = torch.tensor(sorted(v for v in sampled_row.values() if v > -math.inf)[::-1])
    assert torch.allclose(top3, (expected.values - expected.values.logsumexp(-1)), atol=1e-5)
    greedy_row = lists.logprobs[1][1:]
    assert torch.allclose(torch.tensor(greedy_row), logits[1].log_softmax(-1).sort(descending=True).values, atol=1e-5)


@pytest.mark.parametrize(
    ("parallel", "speculative", "reaches"),
    [
        ({"engine_process": False}, None, True),
        ({"engine_process": True}, None, False),
        ({"engine_process": False, "distributed_executor_backend": "mp"}, None, False),
        ({"engine_process": True, "data_parallel_size": 2}, None, False),
        ({"engine_process": False}, {"method": "ngram", "num_speculative_tokens": 2}, False),
    ],
)
def test_logits_processors_reach_only_an_in_process_worker(
    parallel: dict[str, object], speculative: dict[str, object] | None, reaches: bool
) -> None:
    from asyncllm.async_llm import callables_reach_the_worker
    from asyncllm.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    spec = None if speculative is None else SpeculativeConfig.from_user(speculative)
    config = EngineConfig(
        ModelConfig("m", "m"), CacheConfig(), SchedulerConfig(), ParallelConfig(**parallel), speculative=spec
    )
    assert callables_reach_the_worker(config) is reaches
