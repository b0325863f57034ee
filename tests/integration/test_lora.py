"""LoRA adapters on the real SmolLM2 in both engine modes: an adapter's logits equal the base model with the adapter
merged into its weights; a batch mixing two adapters and the base gives each request its solo output; max_loras=1
evicts and reloads; the prefix cache is separate per adapter; refused adapters fail their request alone; TP=3
equals TP=1 (mp executor)."""

from __future__ import annotations

import asyncio
import copy
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncllm import AsyncLLM, EngineGenerateError, InvalidRequestError, LoRARequest, SamplingParams
from asyncllm.model.loading.loader import read_arch_config
from tests.integration.conftest import EngineFactory, run
from tests.lora_adapters import ATTENTION, merge_adapter, write_peft_adapter
from tests.reference import clear_prefix_len, greedy_margins, next_token_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 8
ALPHA, RANK = 16.0, 8
LOGPROB_ATOL = 1e-2  # fp32 sums in another order (paged, batched, delta added after the matmul): ~3e-3 seen
MARGIN = 0.05  # logits; greedy choices closer than this may flip with summation order (TP sums partials)


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, Any]:
    """Two random rank-8 PEFT adapters: "a" on every module, "b" (larger) on attention only; name -> (request,
    tensors)."""
    arch = read_arch_config(model_path)
    root = tmp_path_factory.mktemp("adapters")
    tensors_a = write_peft_adapter(root / "a", arch, RANK, ALPHA, seed=0)
    tensors_b = write_peft_adapter(root / "b", arch, RANK, ALPHA, modules=ATTENTION, seed=1, std=0.1)
    return {
        "a": (LoRARequest("a", 1, str(root / "a")), tensors_a),
        "b": (LoRARequest("b", 2, str(root / "b")), tensors_b),
        None: (None, None),
    }


@pytest.fixture(scope="module")
def references(reference_model: Any, adapters: dict[str, Any]) -> dict[str | None, torch.nn.Module]:
    """Dense TP=1 models: the base (the session's, read-only), and copies with each adapter merged
    (W' = W + alpha / r * B @ A)."""
    base = reference_model
    models: dict[str | None, torch.nn.Module] = {None: base}
    for name in ("a", "b"):
        models[name] = copy.deepcopy(base)
        merge_adapter(models[name], adapters[name][1], ALPHA / RANK)
    return models


LORA_OVERRIDES: dict[str, Any] = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2}  # engine overrides


@pytest.fixture(scope="module")
def llm_overrides() -> dict[str, Any]:
    """The shared `llm` (both modes) serves LoRA adapters of rank `RANK`, two at a time."""
    return dict(LORA_OVERRIDES)


async def generate_all(
    llm: AsyncLLM, jobs: list[tuple[str, LoRARequest | None]], extra: dict[str, Any] | None = None
) -> list[Any]:
    """Submit every (prompt, adapter) at once (greedy, `extra` sampling parameters); their final outputs in order."""
    params = greedy(**(extra or {}))
    return await asyncio.gather(*(llm.generate(p, params, lora_request=lora).collect() for p, lora in jobs))


@pytest.fixture(scope="module")
def solo(llm: AsyncLLM, adapters: dict[str, Any]) -> dict[tuple[str, str | None], list[int]]:
    """(prompt, adapter name) -> greedy token ids of the request run alone."""

    async def body() -> dict[tuple[str, str | None], list[int]]:
        result = {}
        for prompt in PROMPTS:
            for name in ("a", "b", None):
                (out,) = await generate_all(llm, [(prompt, adapters[name][0])])
                result[(prompt, name)] = list(out.outputs[0].token_ids)
        return result

    return run("asyncio", body)  # type: ignore[no-any-return]


async def test_adapter_logprobs_equal_the_merged_model(
    llm: AsyncLLM, adapters: dict[str, Any], references: dict[str | None, torch.nn.Module]
) -> None:
    prompt = PROMPTS[0]
    (out,) = await generate_all(llm, [(prompt, adapters["a"][0])], {"logprobs": 5, "prompt_logprobs": 5})
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    expected = torch.log_softmax(next_token_logits(references["a"], ids), dim=-1)
    base = torch.log_softmax(next_token_logits(references[None], ids), dim=-1)
    rows = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]  # row i scores token i + 1
    num_compared = 0
    for i, top in enumerate(rows):
        for token_id, logprob in top.items():
            assert logprob.logprob == pytest.approx(expected[i, token_id].item(), abs=LOGPROB_ATOL)
            num_compared += 1
    assert num_compared >= 5 * (len(ids) - 1)
    assert (expected - base).abs().max() > 1.0  # the adapter clearly changes the model
    margins = greedy_margins(references["a"], list(out.prompt_token_ids), list(out.outputs[0].token_ids))
    assert clear_prefix_len(margins, MARGIN) >= 3  # the greedy tokens above are the merged model's, not by luck


async def test_a_batch_mixing_two_adapters_and_the_base_gives_each_its_solo_output(
    llm: AsyncLLM, adapters: dict[str, Any], solo: dict[tuple[str, str | None], list[int]]
) -> None:
    jobs = [(p, name) for p in PROMPTS for name in ("a", None, "b")]
    outs = await generate_all(llm, [(p, adapters[name][0]) for p, name in jobs])
    assert [list(o.outputs[0].token_ids) for o in outs] == [solo[job] for job in jobs]
    for prompt in PROMPTS:  # every adapter changes the output
        assert len({tuple(solo[(prompt, name)]) for name in ("a", "b", None)}) == 3


async def test_the_prefix_cache_is_separate_per_adapter(llm: AsyncLLM, adapters: dict[str, Any]) -> None:
    prompt = "Here is a long and unusual story about a lighthouse keeper who counted every wave " * 3
    order = ["a", "b", None, "a", "b", None]
    cached = []
    for name in order:  # one at a time: each request's blocks are cached before the next one starts
        (out,) = await generate_all(llm, [(prompt, adapters[name][0])])
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # the same prompt under another adapter (or none) shares no block
    assert min(cached[3:]) >= 32  # under the same adapter it does


async def test_refused_adapters_fail_their_request_alone(
    llm: AsyncLLM, adapters: dict[str, Any], tmp_path: pathlib.Path, model_path: str
) -> None:
    (out,) = await generate_all(llm, [(PROMPTS[0], adapters["a"][0])])  # id 1 names adapter "a"
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        llm.generate("Hi", greedy(), lora_request=LoRARequest("x", 9, str(tmp_path / "absent")))
    write_peft_adapter(tmp_path / "rs", read_arch_config(model_path), config_overrides={"use_rslora": True})
    with pytest.raises(InvalidRequestError, match="use_rslora=True not supported"):
        llm.generate("Hi", greedy(), lora_request=LoRARequest("rs", 9, str(tmp_path / "rs")))
    with pytest.raises(InvalidRequestError, match="already names the adapter"):
        llm.generate("Hi", greedy(), lora_request=LoRARequest("a", 1, str(tmp_path / "rs")))
    # Readable, but shaped for another model: only the engine core knows the model's shapes.
    dims = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1}
    small = SimpleNamespace(**dims, head_dim=4, num_hidden_layers=2)
    write_peft_adapter(tmp_path / "small", small)
    stream = llm.generate("Hi", greedy(), lora_request=LoRARequest("small", 10, str(tmp_path / "small")))
    with pytest.raises(EngineGenerateError, match=r"\[in, out\]"):
        await stream.collect()
    (again,) = await generate_all(llm, [(PROMPTS[0], adapters["a"][0])])
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


# Eviction is the worker's (the same code in both modes); one engine mode keeps the suite short.
@pytest.mark.parametrize("mode", ["thread"], indirect=True)
async def test_max_loras_1_alternating_adapters_evict_and_reload(
    mode: str, make_llm: EngineFactory, adapters: dict[str, Any], solo: dict[tuple[str, str | None], list[int]]
) -> None:
    prompt = PROMPTS[1]
    llm = make_llm(**{**LORA_OVERRIDES, "max_loras": 1}, engine_process=mode == "process")
    sequential = []
    for name in ("a", "b", "a", None, "b"):  # each adapter evicts the other
        (out,) = await generate_all(llm, [(prompt, adapters[name][0])])
        sequential.append(list(out.outputs[0].token_ids))
    loaded = await llm.collective_rpc("list_loras")
    together = [
        list(o.outputs[0].token_ids)
        for o in await generate_all(llm, [(prompt, adapters[name][0]) for name in ("a", "b", "a", None)])
    ]
    assert sequential == [solo[(prompt, name)] for name in ("a", "b", "a", None, "b")]
    assert loaded == [[2]]  # one adapter loaded at a time: the last one used
    assert together == [solo[(prompt, name)] for name in ("a", "b", "a", None)]  # the scheduler runs one at a time


@pytest.mark.slow
@pytest.mark.mp
@pytest.mark.parametrize("mode", ["process"], indirect=True)  # one TP=3 engine; TP=1 is the module's process engine
async def test_tp3_equals_tp1(
    make_llm: EngineFactory,
    adapters: dict[str, Any],
    solo: dict[tuple[str, str | None], list[int]],
    references: dict[str | None, torch.nn.Module],
) -> None:
    jobs = [(p, name) for p in PROMPTS for name in ("a", "b", None)]

    llm = make_llm(**LORA_OVERRIDES, distributed_executor_backend="mp", tensor_parallel_size=3)
    outs = await generate_all(llm, [(p, adapters[name][0]) for p, name in jobs])
    num_compared = 0
    for (prompt, name), out in zip(jobs, outs, strict=True):
        expected = solo[(prompt, name)]
        clear = clear_prefix_len(greedy_margins(references[name], list(out.prompt_token_ids), expected), MARGIN)
        assert list(out.outputs[0].token_ids)[:clear] == expected[:clear]
        num_compared += clear
    assert num_compared >= 3 * MAX_TOKENS  # the comparison covered real tokens
