"""OutputProcessor: scripted engine outputs -> RequestOutputs per kind, stop strings, aborts, errors."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer

from asyncllm import EngineDeadError, InvalidRequestError, RequestOutput, RequestOutputKind, SamplingParams
from asyncllm.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from asyncllm.processing.output_processor import OutputProcessor
from asyncllm.streams import RequestOutputCollector

TEXT = "The capital of France is Paris. 😀 Ünïcödé!"


@pytest.fixture(scope="module")
def hf(model_path: str) -> HFTokenizer:
    from asyncllm.model.tokenizer import Tokenizer

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
