"""Logprobs: engine-side scoring of raw logits vs a plain reference; frontend dicts with decoded tokens."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from asyncllm.messages.engine import LogprobsLists
from asyncllm.outputs import Logprob
from asyncllm.processing.logprobs import LogprobsProcessor
from asyncllm.worker.logprobs import compute_logprobs


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path).hf


def test_compute_logprobs_matches_a_plain_reference() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 4
    tokens = torch.tensor([int(logits[0].argmax()), int(logits[1].argsort()[5]), 7])
    result = compute_logprobs(logits, tokens, [3, 0, 5])
    for row in range(3):
        values = logits[row].tolist()
        norm = math.log(sum(math.exp(v) for v in values))
        ref = [v - norm for v in values]
        token = int(tokens[row])
        order = sorted(range(40), key=lambda t: -ref[t])
        k = [3, 0, 5][row]
        assert result.token_ids[row] == [token, *order[:k]]
        assert result.logprobs[row] == pytest.approx([ref[token], *(ref[t] for t in order[:k])], abs=1e-5)
        assert result.ranks[row] == 1 + sum(v > ref[token] for v in ref)
    assert result.ranks[0] == 1


def test_processor_builds_dicts_with_the_sampled_token_outside_the_top_k(hf: HFTokenizer) -> None:
    processor = LogprobsProcessor(hf, num_logprobs=2, num_prompt_logprobs=1)
    lists = LogprobsLists(
        token_ids=[[300, 1010, 1011], [1010, 1010, 1012]],
        logprobs=[[-5.0, -0.5, -1.0], [-0.5, -0.5, -2.0]],
        ranks=[9, 1],
    )
    processor.update(lists, LogprobsLists([[1020, 1021]], [[-3.0, -0.1]], [4]))
    assert processor.logprobs == [
        {
            1010: Logprob(-0.5, 1, hf.decode([1010])),
            1011: Logprob(-1.0, 2, hf.decode([1011])),
            300: Logprob(-5.0, 9, hf.decode([300])),
        },
        {1010: Logprob(-0.5, 1, hf.decode([1010])), 1012: Logprob(-2.0, 2, hf.decode([1012]))},
    ]
    assert processor.cumulative_logprob(2) == pytest.approx(-5.5)
    assert processor.prompt_logprobs == [
        None,
        {1021: Logprob(-0.1, 1, hf.decode([1021])), 1020: Logprob(-3.0, 4, hf.decode([1020]))},
    ]
    processor.truncate(1)
    assert len(processor.logprobs) == 1
    assert processor.cumulative_logprob(1) == pytest.approx(-5.0)


def test_processor_without_logprobs_keeps_nothing(hf: HFTokenizer) -> None:
    processor = LogprobsProcessor(hf, None, None)
    processor.update(LogprobsLists([[1]], [[-1.0]], [1]), LogprobsLists([[1]], [[-1.0]], [1]))
    assert (processor.logprobs, processor.prompt_logprobs, processor.cumulative_logprob(1)) == (None, None, None)


def test_cumulative_logprob_is_a_running_sum_that_follows_truncation(hf: HFTokenizer) -> None:
    processor = LogprobsProcessor(hf, num_logprobs=0, num_prompt_logprobs=None)
    for value in (-0.5, -1.25, -2.0):
        processor.update(LogprobsLists([[42]], [[value]], [1]), None)
    assert processor.cumulative_logprob(3) == pytest.approx(-3.75)
    assert processor.cumulative_logprob(2) == pytest.approx(-1.75)  # a held-back stop-string token not counted
    processor.truncate(1)
    assert processor.cumulative_logprob(3) == pytest.approx(-0.5)
    processor.update(LogprobsLists([[42]], [[-0.25]], [1]), None)
    assert processor.cumulative_logprob(2) == pytest.approx(-0.75)
