"""Repetition detection: params validation, the incremental detector at the edges of pattern sizes and counts
(against a direct tail comparison), and the scheduler finishing a request with "repetition"."""

from __future__ import annotations

import random

import pytest

from asyncllm import RepetitionDetectionParams, SamplingParams
from asyncllm.config import SchedulerConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.messages.engine import EngineCoreRequest, FinishReason
from asyncllm.messages.scheduler import ModelRunnerOutput
from asyncllm.messages.serial import MsgpackDecoder, MsgpackEncoder
from asyncllm.sched.repetition import RepetitionDetector
from asyncllm.sched.scheduler import Scheduler


def _reference(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    """The definition, checked directly on the whole sequence: some size L in range has its last L*count
    tokens equal to one L-token pattern repeated count times."""
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = size * params.min_count
        if span <= len(tokens) and tokens[-span:] == tokens[-size:] * params.min_count:
            return True
    return False


def _first_detection(tokens: list[int], params: RepetitionDetectionParams) -> int | None:
    """Index (1-based count of tokens) at which the detector first fires, or None."""
    detector = RepetitionDetector(params)
    for count, token in enumerate(tokens, 1):
        if detector.add_token(token):
            return count
    return None


@pytest.mark.parametrize(
    ("tokens", "params", "expected"),
    [
        # size 1 repeated 3 times fires at the third equal token, not before
        ([5, 1, 1, 1], RepetitionDetectionParams(max_pattern_size=1, min_count=3), 4),
        ([5, 1, 1, 2, 1], RepetitionDetectionParams(max_pattern_size=1, min_count=3), None),
        # size 3, count 2: exactly 6 tokens
        ([1, 2, 3, 1, 2, 3], RepetitionDetectionParams(max_pattern_size=3, min_count=2), 6),
        # the same sequence with max_pattern_size 2 never fires (the pattern is too long)
        ([1, 2, 3, 1, 2, 3], RepetitionDetectionParams(max_pattern_size=2, min_count=2), None),
        # min_pattern_size 3 ignores the size-1 run "7 7" and fires on the size-3 pattern only
        ([7, 7, 4, 5, 6, 4, 5, 6], RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=3, min_count=2), 8),
        ([7, 7, 4], RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=2), None),
        # min_pattern_size 0 means 1
        ([9, 9], RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=0, min_count=2), 2),
        # count 3 of size 2 needs 6 tokens: 5 are one short
        ([1, 2, 1, 2, 1], RepetitionDetectionParams(max_pattern_size=2, min_count=3), None),
        ([1, 2, 1, 2, 1, 2], RepetitionDetectionParams(max_pattern_size=2, min_count=3), 6),
        # the pattern must be contiguous at the tail: a break resets it
        ([1, 2, 1, 2, 9, 1, 2, 1], RepetitionDetectionParams(max_pattern_size=2, min_count=3), None),
    ],
)
def test_detector_fires_exactly_at_the_edge(
    tokens: list[int], params: RepetitionDetectionParams, expected: int | None
) -> None:
    assert _first_detection(tokens, params) == expected


def test_detector_agrees_with_a_direct_tail_check_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(300):
        max_size = rng.randint(1, 6)
        params = RepetitionDetectionParams(
            max_pattern_size=max_size, min_pattern_size=rng.randint(0, max_size), min_count=rng.randint(2, 4)
        )
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 40))]
        detector = RepetitionDetector(params)
        for n in range(1, len(tokens) + 1):
            assert detector.add_token(tokens[n - 1]) == _reference(tokens[:n], params), (trial, tokens[:n], params)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_pattern_size": -1}, "repetition_detection.max_pattern_size"),
        ({"max_pattern_size": 4, "min_pattern_size": -1, "min_count": 2}, "repetition_detection.min_pattern_size"),
        ({"max_pattern_size": 4, "min_pattern_size": 5, "min_count": 2}, "repetition_detection.min_pattern_size"),
        ({"max_pattern_size": 4, "min_count": 1}, "repetition_detection.min_count"),
        ({"max_pattern_size": 4, "min_count": 2.5}, "repetition_detection.min_count"),
    ],
)
def test_bad_params_raise_a_typed_error_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
        RepetitionDetectionParams(**kwargs)  # type: ignore[arg-type]


def test_disabled_params_are_valid_and_do_nothing() -> None:
    params = RepetitionDetectionParams()
    assert not params.enabled
    sampling = SamplingParams(repetition_detection=params)
    decoded = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(sampling))
    assert decoded == sampling


def _scheduler_run(tokens: list[int], params: SamplingParams) -> tuple[list[int], FinishReason | None, object]:
    scheduler = Scheduler(SchedulerConfig(4, 64), 32, 4, 128)
    scheduler.add_request(EngineCoreRequest("r", [3, 4, 5], params, eos_token_id=None))
    emitted: list[int] = []
    for token in tokens:
        so = scheduler.schedule()
        out = scheduler.update_from_output(so, ModelRunnerOutput({"r": [token]}))
        emitted.extend(out.outputs[0].new_token_ids)
        if out.outputs[0].finished:
            assert scheduler.kv_cache_manager.num_free_blocks == 32
            return emitted, out.outputs[0].finish_reason, out.outputs[0].stop_reason
    return emitted, None, None


def test_scheduler_finishes_with_repetition_at_the_first_repeated_token() -> None:
    params = SamplingParams(
        max_tokens=50, repetition_detection=RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    )
    loop = [1, 2, 3] * 10
    emitted, reason, stop_reason = _scheduler_run([9, *loop], params)
    assert emitted == [9, *[1, 2, 3] * 3]
    assert reason == FinishReason.REPETITION
    assert str(reason) == "repetition"
    assert stop_reason == "repetition_detected"


def test_scheduler_without_detection_runs_to_max_tokens() -> None:
    emitted, reason, _ = _scheduler_run([1, 2, 3] * 10, SamplingParams(max_tokens=12))
    assert len(emitted) == 12
    assert reason == FinishReason.LENGTH


def test_length_wins_when_both_hit_on_the_same_token() -> None:
    params = SamplingParams(
        max_tokens=4, repetition_detection=RepetitionDetectionParams(max_pattern_size=1, min_count=4)
    )
    emitted, reason, _ = _scheduler_run([1, 1, 1, 1, 1], params)
    assert emitted == [1, 1, 1, 1]
    assert reason == FinishReason.LENGTH


def test_openai_request_body_carries_repetition_detection() -> None:
    pytest.importorskip("pydantic")
    from asyncllm.entrypoints.openai.protocol import CompletionRequest

    body = {"prompt": "hi", "repetition_detection": {"max_pattern_size": 8, "min_count": 3}}
    params = CompletionRequest.model_validate(body).to_sampling_params(max_tokens=16, logprobs=None)
    assert params.repetition_detection == RepetitionDetectionParams(max_pattern_size=8, min_count=3)
    bad = {"prompt": "hi", "repetition_detection": {"max_pattern_size": 8, "min_count": 1}}
    with pytest.raises(InvalidRequestError, match=r"repetition_detection\.min_count"):
        CompletionRequest.model_validate(bad).to_sampling_params(max_tokens=16, logprobs=None)


def test_output_processor_reports_the_repetition_finish_reason() -> None:
    from asyncllm.processing.request_state import finish_reason_str

    assert finish_reason_str(FinishReason.REPETITION) == "repetition"
