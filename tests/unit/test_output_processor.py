"""OutputProcessor: scripted engine outputs -> RequestOutputs per kind, stop strings, aborts, errors, logprobs,
stream_interval and n > 1 (ParentRequest)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from asyncllm import EngineDeadError, InvalidRequestError, RequestOutput, RequestOutputKind, SamplingParams
from asyncllm.messages.engine import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.processing.parallel_sampling import ParentRequest
from asyncllm.streams import RequestOutputCollector
from tests.state_probes import has_user_request, tracked_ids


def child_ids(parent: ParentRequest) -> list[str]:
    return [child.request_id for child in parent.child_requests]


TEXT = "The capital of France is Paris. 😀 Ünïcödé!"


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.loading.tokenizer import Tokenizer

    return Tokenizer.load(model_path).hf


def add(
    processor: OutputProcessor, request_id: str = "r", kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, **kw
) -> RequestOutputCollector:
    params = SamplingParams(output_kind=kind, **kw)
    collector = RequestOutputCollector(kind)
    processor.add_request(EngineCoreRequest(request_id, [1, 2, 3], params), "prompt", collector)
    return collector


def run_steps(
    processor: OutputProcessor,
    collector: RequestOutputCollector,
    ids: list[int],
    finish: FinishReason | None = FinishReason.LENGTH,
    request_id: str = "r",
) -> tuple[list[RequestOutput], list[str]]:
    """One token per step, the consumer keeping up; returns the outputs seen and the ids to abort."""
    outputs, to_abort = [], []
    for i, token in enumerate(ids):
        reason = finish if i == len(ids) - 1 else None
        result = processor.process_outputs([EngineCoreOutput(request_id, [token], finish_reason=reason)])
        to_abort += result.reqs_to_abort
        if (out := collector.get_nowait()) is not None:
            outputs.append(out)
    return outputs, to_abort


def test_cumulative_outputs_grow_and_finish_once(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = hf.encode(TEXT).ids
    outputs, to_abort = run_steps(processor, add(processor), ids)
    assert to_abort == []
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished
    final = outputs[-1].outputs[0]
    assert final.text == TEXT
    assert final.token_ids == ids
    assert final.finish_reason == "length"
    for earlier in outputs[:-1]:
        assert final.text.startswith(earlier.outputs[0].text)
        assert earlier.outputs[0].finish_reason is None
    assert outputs[0].prompt == "prompt"
    assert outputs[0].prompt_token_ids == [1, 2, 3]
    assert processor.num_unfinished_requests == 0


def test_cumulative_outputs_are_not_mutated_later(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    outputs, _ = run_steps(processor, add(processor), hf.encode("one two three").ids)
    assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, len(outputs) + 1))


def test_delta_concatenation_equals_final_text(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = hf.encode(TEXT).ids
    outputs, _ = run_steps(processor, add(processor, kind=RequestOutputKind.DELTA), ids)
    assert "".join(o.outputs[0].text for o in outputs) == TEXT
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert outputs[-1].finished
    assert [o.finished for o in outputs].count(True) == 1
    assert not any("\ufffd" in o.outputs[0].text for o in outputs)


def test_final_only_sends_one_output(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = hf.encode(TEXT).ids
    outputs, _ = run_steps(processor, add(processor, kind=RequestOutputKind.FINAL_ONLY), ids)
    assert len(outputs) == 1
    assert outputs[0].finished
    assert outputs[0].outputs[0].text == TEXT
    assert outputs[0].outputs[0].token_ids == ids


def test_eos_finish_reports_stop_without_stop_reason(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = [*hf.encode("Paris.").ids, hf.token_to_id("<|im_end|>")]
    outputs, _ = run_steps(processor, add(processor), ids, finish=FinishReason.STOP)
    final = outputs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("Paris.", "stop", None)
    assert final.token_ids == ids


def test_stop_string_finishes_and_asks_for_an_engine_abort(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = hf.encode("one two three four five").ids
    collector = add(processor, kind=RequestOutputKind.DELTA, stop=[" three"])
    outputs, to_abort = run_steps(processor, collector, ids)
    assert to_abort == ["r"]
    assert "".join(o.outputs[0].text for o in outputs) == "one two"
    final = outputs[-1]
    assert final.finished
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", " three")
    kept = [t for o in outputs for t in o.outputs[0].token_ids]
    assert kept == ids[: len(kept)]
    assert hf.decode(kept).endswith(" three"), "the token that completed the stop string is kept"
    assert not processor.has_request("r")


def test_stop_string_on_the_engine_finished_step_needs_no_abort(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    ids = hf.encode("say END").ids
    outputs, to_abort = run_steps(processor, add(processor, stop=["END"]), ids, finish=FinishReason.LENGTH)
    assert to_abort == []
    assert (outputs[-1].outputs[0].text, outputs[-1].outputs[0].finish_reason) == ("say ", "stop")


def test_engine_stop_token_reason_is_passed_through(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor)
    processor.process_outputs([EngineCoreOutput("r", [42], finish_reason=FinishReason.STOP, stop_reason=42)])
    final = collector.get_nowait()
    assert final is not None
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", 42)


def test_abort_sends_final_abort_output_and_ignores_later_engine_outputs(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor, kind=RequestOutputKind.DELTA)
    processor.process_outputs([EngineCoreOutput("r", hf.encode("Hello").ids)])
    first = collector.get_nowait()
    assert processor.abort_requests(["r", "unknown"]) == ["r"]
    processor.process_outputs([EngineCoreOutput("r", hf.encode(" there").ids)])
    final = collector.get_nowait()
    assert first is not None
    assert final is not None
    assert final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert first.outputs[0].text + final.outputs[0].text == "Hello"
    assert collector.get_nowait() is None


def test_abort_releases_held_back_text(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor, stop=["Hello world"])
    processor.process_outputs([EngineCoreOutput("r", hf.encode("Hello").ids)])
    assert collector.get_nowait() is not None  # a token, but its text is held back
    processor.abort_requests(["r"])
    final = collector.get_nowait()
    assert final is not None
    assert final.outputs[0].text == "Hello"


def test_abort_without_notify_sends_nothing(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor)
    assert processor.abort_requests(["r"], notify=False) == ["r"]
    assert collector.get_nowait() is None
    assert processor.num_unfinished_requests == 0


def test_duplicate_request_id_is_rejected(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    add(processor)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        add(processor)


def test_partial_prefill_step_sends_nothing(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor)
    processor.process_outputs([EngineCoreOutput("r", [])])
    assert collector.get_nowait() is None


def test_many_requests_in_one_batch(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collectors = {f"r{i}": add(processor, f"r{i}") for i in range(5)}
    token = hf.encode(" x").ids[0]
    result = processor.process_outputs(
        [EngineCoreOutput(rid, [token], finish_reason=FinishReason.LENGTH) for rid in collectors]
    )
    assert result.num_finished == 5
    for collector in collectors.values():
        out = collector.get_nowait()
        assert out is not None
        assert out.finished


def test_propagate_error_reaches_every_request(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collectors = [add(processor, f"r{i}") for i in range(3)]
    processor.propagate_error(EngineDeadError())
    for collector in collectors:
        with pytest.raises(EngineDeadError):
            collector.get_nowait()
    assert processor.num_unfinished_requests == 0


# ---- logprobs, stream_interval and n > 1 on scripted token sequences ----------------------------------


def fake_logprobs(token: int) -> LogprobsLists:
    """One position: the token, then two fixed alternatives; logprob -0.01 * token (so sums are checkable)."""
    return LogprobsLists([[token, 1000, 1001]], [[-0.01 * token, -0.1, -0.2]], [3])


def test_logprobs_align_with_token_ids_in_every_delta_and_after_a_stop_string(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor, kind=RequestOutputKind.DELTA, logprobs=2, stop=["Paris"])
    ids = hf.encode(TEXT).ids
    outputs = []
    for token in ids:
        result = processor.process_outputs([EngineCoreOutput("r", [token], new_logprobs=fake_logprobs(token))])
        if (out := collector.get_nowait()) is not None:
            outputs.append(out)
        if result.reqs_to_abort:
            break
    token_ids, logprobs = [], []
    for out in outputs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids)
        token_ids += completion.token_ids
        logprobs += completion.logprobs
    final = outputs[-1].outputs[0]
    assert final.stop_reason == "Paris"
    assert "".join(o.outputs[0].text for o in outputs) == "The capital of France is "
    assert [next(iter(d)) for d in logprobs] == token_ids  # vLLM's order: the sampled token first, then the top-k
    assert [list(d)[1] for d in logprobs] == [1000] * len(token_ids)
    assert [d[t].logprob for d, t in zip(logprobs, token_ids, strict=True)] == pytest.approx(
        [-0.01 * t for t in token_ids]
    )
    assert final.cumulative_logprob == pytest.approx(sum(-0.01 * t for t in token_ids))


@pytest.mark.parametrize("interval", [1, 3, 4, 100])
def test_stream_interval_emits_every_k_tokens_and_at_the_end(hf: HFTokenizer, interval: int) -> None:
    processor = OutputProcessor(hf)
    collector = add(processor, kind=RequestOutputKind.DELTA, stream_interval=interval)
    ids = hf.encode("one two three four five six seven eight nine ten eleven").ids
    outputs, _ = run_steps(processor, collector, ids)
    sizes = [len(o.outputs[0].token_ids) for o in outputs]
    assert sum(sizes) == len(ids)
    assert all(size == interval for size in sizes[:-1])
    assert 1 <= sizes[-1] <= interval
    assert "".join(o.outputs[0].text for o in outputs) == hf.decode(ids)


def add_parent(
    processor: OutputProcessor, kind: RequestOutputKind, n: int = 3, **kw
) -> tuple[ParentRequest, RequestOutputCollector]:
    parent = ParentRequest(EngineCoreRequest("p", [1, 2, 3], SamplingParams(n=n, output_kind=kind, seed=10, **kw)))
    collector = RequestOutputCollector(kind)
    for index, child in enumerate(parent.child_requests):
        processor.add_request(child, "prompt", collector, parent, index)
    return parent, collector


def test_children_get_derived_seeds_and_n_one() -> None:
    parent = ParentRequest(EngineCoreRequest("p", [1], SamplingParams(n=3, seed=10)))
    assert child_ids(parent) == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in parent.child_requests] == [10, 11, 12]
    assert {c.sampling_params.n for c in parent.child_requests} == {1}
    unseeded = ParentRequest(EngineCoreRequest("q", [1], SamplingParams(n=2)))
    assert [c.sampling_params.seed for c in unseeded.child_requests] == [None, None]


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_n_children_interleaved_finish_each_index_once(hf: HFTokenizer, kind: RequestOutputKind) -> None:
    processor = OutputProcessor(hf)
    parent, collector = add_parent(processor, kind)
    texts = ["Alpha beta gamma.", "Un deux trois quatre cinq six.", "😀 ünï"]
    scripts = [hf.encode(t).ids for t in texts]
    outputs = []
    for step in range(max(len(s) for s in scripts)):
        batch = []
        for i, script in enumerate(scripts):
            if step < len(script):
                last = step == len(script) - 1
                batch.append(
                    EngineCoreOutput(child_ids(parent)[i], [script[step]], FinishReason.LENGTH if last else None)
                )
        processor.process_outputs(batch)
        if (out := collector.get_nowait()) is not None:
            outputs.append(out)
    assert [o.finished for o in outputs].count(True) == 1
    assert outputs[-1].finished
    assert {o.request_id for o in outputs} == {"p"}
    finishes = [c.index for o in outputs for c in o.outputs if c.finished]
    assert sorted(finishes) == [0, 1, 2]
    by_index: dict[int, tuple[str, list[int]]] = {}
    for out in outputs:
        for c in out.outputs:
            if kind == RequestOutputKind.DELTA:
                text, ids = by_index.get(c.index, ("", []))
                by_index[c.index] = (text + c.text, ids + c.token_ids)
            else:
                by_index[c.index] = (c.text, c.token_ids)
    assert by_index == {i: (texts[i], scripts[i]) for i in range(3)}
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1
        assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert processor.num_unfinished_requests == 0
    assert not processor.has_request("p")


def test_aborting_the_parent_aborts_every_unfinished_child(hf: HFTokenizer) -> None:
    processor = OutputProcessor(hf)
    parent, collector = add_parent(processor, RequestOutputKind.DELTA)
    processor.process_outputs([EngineCoreOutput(child_ids(parent)[1], [504], FinishReason.STOP)])
    processor.process_outputs([EngineCoreOutput(cid, [504]) for cid in (child_ids(parent)[0], child_ids(parent)[2])])
    assert processor.abort_requests(["p"]) == ["0_p", "2_p"]
    merged = collector.get_nowait()
    assert merged is not None
    assert merged.finished
    assert {c.index: c.finish_reason for c in merged.outputs} == {0: "abort", 1: "stop", 2: "abort"}
    assert processor.num_unfinished_requests == 0
    assert not processor.has_request("p")
    assert not has_user_request(processor, "p")
    assert tracked_ids(processor) == (0, 0, 0)
    assert processor.abort_requests(["p"]) == []
