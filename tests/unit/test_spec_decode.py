"""Speculative decoding parts without a model: `speculative_config` parsing, the n-gram proposer, the rejection
sampler (greedy exactness; the sampled first-token distribution by a chi-square test), and the scheduler's
token accounting (draft slots, rollback of rejected drafts, stops inside an accepted run, blocks freed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm import EngineArgs, SamplingParams
from asyncllm.config import SchedulerConfig, SpeculativeConfig
from asyncllm.errors import ConfigError
from asyncllm.messages.engine import EngineCoreRequest, FinishReason, LogprobsLists
from asyncllm.messages.scheduler import ModelRunnerOutput
from asyncllm.sched.ngram_proposer import NgramProposer, propose_ngram
from asyncllm.sched.scheduler import Scheduler
from asyncllm.worker.rejection_sampler import RejectionSampler
from asyncllm.worker.sampler import Sampler, SamplingMetadata

# chi-square critical values at significance 0.001 by degrees of freedom (standard tables)
CHI2_CRITICAL_0_001 = {5: 20.515, 7: 24.322}


def _spec(k: int = 3, low: int = 1, high: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, low, high)


# ---- config -------------------------------------------------------------------------------------------------


def test_speculative_config_follows_vllm_names_and_defaults() -> None:
    both = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    assert SpeculativeConfig.from_user(text) == SpeculativeConfig("ngram", 3, 1, 4)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "only 'ngram'"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<= prompt"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config keys"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_speculative_config_is_a_config_error(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineArgs(speculative_config=value).validate()  # type: ignore[arg-type]


# ---- proposer -----------------------------------------------------------------------------------------------


def test_proposer_prefers_the_longest_ngram_and_the_latest_match() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 3, 5, 6, 2, 3], dtype=np.int64)
    # the 2-gram (2, 3) occurs at 1 -> continues 4, 9, 3; the 1-gram (3) alone would match latest at 5 -> 5, 6
    assert propose_ngram(tokens, 3, 1, 2) == [4, 9, 3]
    assert propose_ngram(tokens, 3, 1, 1) == [5, 6, 2]
    assert propose_ngram(tokens, 2, 3, 3) == []  # (6, 2, 3) never occurred before
    assert propose_ngram(np.array([7, 7], dtype=np.int64), 4, 1, 3) == [7]  # the draft stops at the end


def test_proposer_respects_the_room_left() -> None:
    proposer = NgramProposer(_spec(k=4, low=1, high=2))
    assert proposer.propose([1, 2, 3, 1, 2, 3, 1, 2], max_num_tokens=2) == [3, 1]
    assert proposer.propose([1, 2, 3, 1, 2], max_num_tokens=0) == []
    assert proposer.propose([5], max_num_tokens=4) == []


# ---- rejection sampler -----------------------------------------------------------------------------------


def _meta(params: list[SamplingParams], vocab: int, generators: dict[int, torch.Generator] | None = None):  # type: ignore[no-untyped-def]
    return SamplingMetadata.from_params(params, vocab, generators or {})


def test_greedy_verification_accepts_the_matching_prefix_then_corrects() -> None:
    vocab = 10
    argmaxes = [4, 7, 1, 3]  # rows 0..3 of one request with 3 drafts
    logits = torch.full((4, vocab), -1.0)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    sampler = RejectionSampler(Sampler(0))
    greedy = SamplingParams(temperature=0.0)
    meta = _meta([greedy] * 4, vocab)
    assert sampler(logits, meta, [[4, 7, 9]]).token_ids == [[4, 7, 1]]  # third draft rejected: argmax 1
    assert sampler(logits, meta, [[4, 7, 1]]).token_ids == [[4, 7, 1, 3]]  # all accepted: bonus 3
    assert sampler(logits, meta, [[5, 7, 1]]).token_ids == [[4]]
    result = sampler(logits, meta, [[4, 7, 1]])
    assert result.rows == [[0, 1, 2, 3]]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_sampled_first_token_has_the_target_distribution(draft: int) -> None:
    """2,000 draws of the first emitted token (accepted draft or resampled) against p: chi-square, alpha 0.001."""
    vocab, draws = 8, 2000
    row_logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.2, 0.0, -0.3])
    params = SamplingParams(temperature=0.8)
    probs = torch.softmax(row_logits / 0.8, dim=-1).numpy().astype(np.float64)
    logits = row_logits.repeat(2 * draws, 1)  # each draw: one request with one draft (2 rows)
    result = RejectionSampler(Sampler(1234))(logits, _meta([params] * (2 * draws), vocab), [[draft]] * draws)
    first = np.array([tokens[0] for tokens in result.token_ids])
    counts = np.bincount(first, minlength=vocab).astype(np.float64)
    assert _chi_square(counts, probs) < CHI2_CRITICAL_0_001[vocab - 1]
    accepted = sum(len(tokens) == 2 for tokens in result.token_ids)
    assert abs(accepted / draws - probs[draft]) < 4 * np.sqrt(probs[draft] * (1 - probs[draft]) / draws)


def test_sampled_verification_honours_top_k() -> None:
    """With top_k=3 a draft outside the top 3 is always rejected and the resample stays in the top 3."""
    vocab, draws = 8, 500
    row_logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.2, 0.1, 0.0, -1.0])
    params = SamplingParams(temperature=1.0, top_k=3)
    logits = row_logits.repeat(2 * draws, 1)
    result = RejectionSampler(Sampler(7))(logits, _meta([params] * (2 * draws), vocab), [[5]] * draws)
    assert all(len(tokens) == 1 and tokens[0] in (0, 1, 2) for tokens in result.token_ids)


def test_seeded_verification_is_reproducible() -> None:
    vocab = 8
    row_logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=42)

    def once() -> list[list[int]]:
        generators = {0: torch.Generator().manual_seed(11), 1: torch.Generator().manual_seed(12)}
        return RejectionSampler(Sampler(0))(row_logits, _meta([params] * 2, vocab, generators), [[2]]).token_ids

    assert once() == once()


# ---- scheduler token accounting -----------------------------------------------------------------------------

EOS = 2


def _scheduler(k: int = 3, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(4, 64), num_blocks, 4, 128, speculative_config=_spec(k, 1, 2))


def _add(scheduler: Scheduler, prompt: list[int], **params: object) -> None:
    params.setdefault("max_tokens", 32)
    scheduler.add_request(EngineCoreRequest("r", prompt, SamplingParams(**params), EOS))


def _prefill(scheduler: Scheduler, first_token: int) -> None:
    so = scheduler.schedule()
    scheduler.update_from_output(so, ModelRunnerOutput({"r": [first_token]}))


def test_drafts_are_scheduled_and_rejected_ones_rolled_back() -> None:
    scheduler = _scheduler(k=3)
    _add(scheduler, [5, 6, 7, 8, 5, 6, 7, 8, 5])
    _prefill(scheduler, 6)  # tokens ... 5, 6 -> the 2-gram (5, 6) continues 7, 8, 5
    req = scheduler.requests["r"]
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [7, 8, 5]}
    assert so.num_scheduled_tokens == {"r": 4}
    assert req.num_computed_tokens == 10 + 3  # advanced over the drafts while the step runs
    # the runner accepted 7 and corrected the second draft to 9
    out = scheduler.update_from_output(so, ModelRunnerOutput({"r": [7, 9]}))
    assert out.outputs[0].new_token_ids == [7, 9]
    assert req.num_computed_tokens == 11  # 10 known before + the accepted draft; 9 is not computed yet
    assert req.num_tokens == 12
    stats = scheduler.get_stats().spec_decode
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]


@pytest.mark.parametrize(
    ("params", "emitted", "reason", "stop_reason"),
    [
        ({"stop_token_ids": [8]}, [7, 8], FinishReason.STOP, 8),  # stop token in the middle of the run
        ({}, [7, EOS], FinishReason.STOP, None),  # EOS in the middle
        ({"max_tokens": 3}, [6, 7, 1], FinishReason.LENGTH, None),  # drafts capped: max_tokens at the bonus token
    ],
)
def test_a_stop_inside_an_accepted_run_ends_the_request_there(
    params: dict[str, object], emitted: list[int], reason: FinishReason, stop_reason: object
) -> None:
    scheduler = _scheduler(k=3, num_blocks=32)
    _add(scheduler, [5, 6, 7, 8, 5, 6, 7, 8, 5], logprobs=0, **params)
    _prefill(scheduler, 6)
    so = scheduler.schedule()
    drafts = so.scheduled_spec_decode_tokens["r"]
    sampled = [7, EOS, 5, 1] if params == {} else [*drafts, 1]
    lists = LogprobsLists([[t] for t in sampled], [[-0.5] for _ in sampled], [1] * len(sampled))
    out = scheduler.update_from_output(so, ModelRunnerOutput({"r": sampled}, logprobs={"r": lists}))
    output = out.outputs[0]
    assert [6, *output.new_token_ids][-len(emitted) :] == emitted
    assert output.finish_reason == reason
    assert output.stop_reason == stop_reason
    assert output.new_logprobs is not None
    assert len(output.new_logprobs) == len(output.new_token_ids)
    assert output.spec_decode_metrics is not None
    assert output.spec_decode_metrics.num_drafts == 1
    assert scheduler.kv_cache_manager.num_free_blocks == 32


def test_max_tokens_caps_the_drafts() -> None:
    scheduler = _scheduler(k=3)
    _add(scheduler, [5, 6, 7, 8, 5, 6, 7, 8, 5], max_tokens=3)
    _prefill(scheduler, 6)
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [7]}  # 2 tokens left: one draft + the bonus
    scheduler.update_from_output(so, ModelRunnerOutput({"r": [7, 8]}))
    assert scheduler.requests == {}  # finished at max_tokens


def test_no_drafts_during_prefill() -> None:
    scheduler = _scheduler(k=3)
    _add(scheduler, [5, 6, 7, 8, 5, 6, 7, 8, 5])
    so = scheduler.schedule()  # the prefill
    assert so.scheduled_spec_decode_tokens == {}
