"""EngineCore with a tiny dummy Llama: sample and prompt logprobs survive chunked prefill and batching and
match a dense reference forward; min_tokens masks EOS in the sampler; penalties reach the sampler."""

from __future__ import annotations

import json
import random

import pytest

from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.core import EngineCore
from asyncllm.messages.engine import EngineCoreOutput, EngineCoreRequest, LogprobsLists
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker import model_runner
from tests.model_weights import randomize_matrices
from tests.reference import next_token_logits

VOCAB = 512
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama-logprobs")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = EngineConfig(
        ModelConfig("dummy", str(path), load_format="dummy", max_model_len=128),
        CacheConfig(block_size=16, num_kv_blocks=64),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),  # prompts of > 16 tokens are chunked
        ParallelConfig(num_threads=2),
    )
    engine = EngineCore(config)
    randomize_matrices(engine.executor.worker.model)  # type: ignore[attr-defined]
    yield engine
    engine.shutdown()


def run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[EngineCoreOutput]]:
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for output in core.step().outputs:
            outputs[output.request_id].append(output)
    return outputs


@pytest.mark.parametrize("rows_per_piece", [256, 3])
def test_logprobs_through_chunked_prefill_match_the_dense_reference(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch, rows_per_piece: int
) -> None:
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", rows_per_piece)
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 40, 23)]
    requests = [
        EngineCoreRequest(
            f"p{i}",
            prompt,
            SamplingParams(max_tokens=6, temperature=0.9, seed=i, logprobs=4, prompt_logprobs=3, ignore_eos=True),
        )
        for i, prompt in enumerate(prompts)
    ]
    outputs = run(core, requests)
    model = core.executor.worker.model  # type: ignore[attr-defined]
    for request in requests:
        outs = outputs[request.request_id]
        ids = [t for o in outs for t in o.new_token_ids]
        assert len(ids) == 6
        sample = LogprobsLists.concat([o.new_logprobs for o in outs if o.new_logprobs is not None])
        prompt_parts = [o.new_prompt_logprobs for o in outs if o.new_prompt_logprobs is not None]
        assert len(prompt_parts) == 1, "prompt logprobs are sent once"
        prompt = request.prompt_token_ids
        ref = next_token_logits(model, prompt + ids).log_softmax(dim=-1)
        assert len(sample) == 6
        assert len(prompt_parts[0]) == len(prompt) - 1
        for i, token in enumerate(ids):
            row = ref[len(prompt) - 1 + i]
            assert sample.token_ids[i][0] == token
            assert sample.token_ids[i][1:] == row.topk(4).indices.tolist()
            assert sample.logprobs[i][0] == pytest.approx(row[token].item(), abs=1e-4)
            assert sample.ranks[i] == 1 + int((row > row[token]).sum())
        for j in range(1, len(prompt)):
            assert prompt_parts[0].token_ids[j - 1][0] == prompt[j]
            assert prompt_parts[0].logprobs[j - 1][0] == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)
            assert len(prompt_parts[0].token_ids[j - 1]) == 4


def test_prompt_logprobs_requests_skip_the_prefix_cache(core: EngineCore) -> None:
    prompt = list(range(100, 150))  # 3 full blocks of 16
    run(core, [EngineCoreRequest("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))])
    again = run(core, [EngineCoreRequest("hit", prompt, SamplingParams(max_tokens=1, temperature=0.0))])["hit"]
    assert again[-1].num_cached_tokens == 48, "the prompt's full blocks should be cached"
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = run(core, [EngineCoreRequest("plp", prompt, params)])["plp"]
    prompt_logprobs = [o.new_prompt_logprobs for o in outs if o.new_prompt_logprobs is not None]
    assert len(prompt_logprobs[0]) == len(prompt) - 1
    assert outs[-1].num_cached_tokens == 0


def test_requests_without_logprobs_carry_none(core: EngineCore) -> None:
    outputs = run(core, [EngineCoreRequest("plain", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))])
    assert all(o.new_logprobs is None and o.new_prompt_logprobs is None for o in outputs["plain"])


def test_min_tokens_masks_eos_in_the_sampler(core: EngineCore) -> None:
    prompt = [7, 8, 9]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = run(core, [EngineCoreRequest("probe", prompt, greedy)])["probe"][0].new_token_ids[0]
    # Make the model's own first choice the EOS token: without masking it would stop at once.
    params = SamplingParams(max_tokens=5, min_tokens=3, temperature=0.0)
    outs = run(core, [EngineCoreRequest("min", prompt, params, eos_token_id=first)])["min"]
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) >= 3
    assert first not in ids[:3]
    unmasked = run(
        core, [EngineCoreRequest("nomin", prompt, SamplingParams(max_tokens=5, temperature=0.0), eos_token_id=first)]
    )
    assert [t for o in unmasked["nomin"] for t in o.new_token_ids] == [first]


def test_penalized_greedy_tokens_match_a_reference_on_dense_logits(core: EngineCore) -> None:
    prompt = [11, 12, 13, 11]
    params = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.8,
        logit_bias={5: 1.5},
    )
    outs = run(core, [EngineCoreRequest("pen", prompt, params)])["pen"]
    ids = [t for o in outs for t in o.new_token_ids]
    model = core.executor.worker.model  # type: ignore[attr-defined]
    logits = next_token_logits(model, prompt + ids)
    for i, token in enumerate(ids):
        row = logits[len(prompt) - 1 + i].tolist()
        done = ids[:i]
        edited = []
        for t, value in enumerate(row):
            value += 1.5 if t == 5 else 0.0
            if t in prompt or t in done:
                value = value / 1.8 if value > 0 else value * 1.8
            edited.append(value - 0.7 * done.count(t) - 0.4 * (t in done))
        best = max(range(VOCAB), key=edited.__getitem__)
        second = sorted(edited)[-2]
        if edited[best] - second > 1e-3:  # skip near-ties (fp32 summation order)
            assert token == best, f"step {i}"
    plain = run(
        core, [EngineCoreRequest("plain", prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]
    )
    assert [t for o in plain["plain"] for t in o.new_token_ids] != ids, "the penalties should change this output"
