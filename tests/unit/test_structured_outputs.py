"""Structured outputs below the engine: params, grammar checks, the bitmask, the sampler's masking, and the
scheduler with a real `StructuredOutputManager` (xgrammar on the real SmolLM2 tokenizer) driven by a fake
model runner that samples the lowest allowed token."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncllm.config import SchedulerConfig
from asyncllm.errors import InvalidRequestError
from asyncllm.messages.engine import EngineCoreRequest, FinishReason
from asyncllm.messages.scheduler import ModelRunnerOutput, SchedulerOutput
from asyncllm.model.loading.tokenizer import Tokenizer
from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.grammar import StructuredOutputManager
from asyncllm.sched.request import RequestStatus
from asyncllm.sched.scheduler import Scheduler
from asyncllm.structured_outputs import StructuredOutputsParams
from asyncllm.structured_outputs.backend import check_constraint
from asyncllm.structured_outputs.bitmask import GrammarBitmask, apply_grammar_bitmask, unpack_bitmask
from asyncllm.worker.sampler import Sampler, SamplingMetadata

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.load(model_path)


def test_params_need_exactly_one_kind() -> None:
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json={"type": "object"}).key == ("json", '{"type": "object"}')
    for bad in [{}, {"regex": "a", "grammar": "root ::= 'a'"}, {"choice": []}, {"choice": ["a", ""]}]:
        with pytest.raises(InvalidRequestError):
            StructuredOutputsParams(**bad)  # type: ignore[arg-type]


def test_check_constraint_names_the_problem() -> None:
    check_constraint(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    check_constraint(StructuredOutputsParams(grammar='root ::= "x" | "y"'))
    with pytest.raises(InvalidRequestError, match=r"json is not valid JSON"):
        check_constraint(StructuredOutputsParams(json="{"))
    with pytest.raises(InvalidRequestError, match=r"not a valid JSON schema"):
        check_constraint(StructuredOutputsParams(json={"type": 5}))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex is invalid"):
        check_constraint(StructuredOutputsParams(regex="[a-"))
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.grammar is invalid"):
        check_constraint(StructuredOutputsParams(grammar="root ::= missing"))


def test_bitmask_roundtrip_and_apply_touch_only_constrained_rows() -> None:
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, [5]] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    packed = GrammarBitmask.from_array(["a", "b"], words.to(torch.int32).numpy())  # bit 31 wraps to negative
    assert torch.equal(unpack_bitmask(packed.to_tensor(), 70), allowed)
    logits = torch.randn(3, 70)
    out = apply_grammar_bitmask(logits, torch.tensor([2, 0]), unpack_bitmask(packed.to_tensor(), 70))
    assert torch.equal(out[1], logits[1])  # the free row
    assert out[2, [0, 31, 32, 69]].isfinite().all()
    assert torch.isinf(out[2]).sum() == 66
    assert torch.isinf(out[0]).sum() == 69
    assert out[0, 5] == logits[0, 5]


def test_sampler_masks_before_penalties_and_keeps_free_rows() -> None:
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(params, 50, {})
    free = Sampler()(logits, meta)
    allowed = torch.zeros(1, 50, dtype=torch.bool)
    allowed[0, 7] = True
    meta.grammar_rows, meta.grammar_allowed = torch.tensor([0]), allowed
    masked = Sampler()(logits, meta)
    assert masked[0].item() == 7
    assert masked[1] == free[1]


def _manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(lambda: tokenizer, VOCAB)


def _scheduler(manager: StructuredOutputManager, num_blocks: int = 64) -> Scheduler:
    config = SchedulerConfig(8, 64, "fcfs")
    return Scheduler(config, num_blocks, 4, 4 * num_blocks, structured_output_manager=manager)


def _request(tokenizer: Tokenizer, req_id: str, max_tokens: int = 24, **so: object) -> EngineCoreRequest:
    structured = StructuredOutputsParams(**so) if so else None  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=structured)
    return EngineCoreRequest(req_id, tokenizer.encode("Answer:"), params, tokenizer.eos_token_id)


def _lowest_allowed(so: SchedulerOutput, scheduler: Scheduler, free_token: int) -> ModelRunnerOutput:
    """A model runner that samples the lowest token the grammar allows (or `free_token` for free rows)."""
    masks = {}
    if so.grammar_bitmask is not None:
        allowed = unpack_bitmask(so.grammar_bitmask.to_tensor(), VOCAB)
        masks = {req_id: int(allowed[i].nonzero()[0]) for i, req_id in enumerate(so.grammar_bitmask.req_ids)}
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        req = scheduler.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            sampled[req_id] = [masks.get(req_id, free_token)]
    return ModelRunnerOutput(sampled)


def _run(scheduler: Scheduler, free_token: int = 100, max_steps: int = 400) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        so = scheduler.schedule()
        if not so.num_scheduled_tokens:
            scheduler.structured_output_manager.wait_for_pending(0.05)  # type: ignore[union-attr]
        out = scheduler.update_from_output(so, _lowest_allowed(so, scheduler, free_token))
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                tokens[o.request_id + ":finish"] = [int(o.finish_reason)]
    raise AssertionError("requests did not finish")


def test_request_waits_for_its_grammar_without_blocks_while_others_run(tokenizer: Tokenizer) -> None:
    manager = _manager(tokenizer)
    gate = threading.Event()
    compile_key = manager._compile
    manager._compile = lambda key: (gate.wait(30), compile_key(key))[1]  # type: ignore[method-assign]
    scheduler = _scheduler(manager)
    scheduler.add_request(_request(tokenizer, "free", max_tokens=3))
    scheduler.add_request(_request(tokenizer, "json", regex="[0-9]{3}"))
    assert scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
    for _ in range(3):
        so = scheduler.schedule()
        assert list(so.num_scheduled_tokens) == ["free"]
        assert so.grammar_bitmask is None
        assert scheduler.kv_cache_manager.get_block_ids("json") == []
        assert scheduler.get_stats().num_waiting_reqs == 1  # counted as waiting while it compiles
        scheduler.update_from_output(so, _lowest_allowed(so, scheduler, 100))
    gate.set()
    tokens = _run(scheduler)
    text = tokenizer.decode(tokens["json"])
    assert len(text) == 3, text
    assert text.isdigit(), text
    assert tokens["json"][-1] == tokenizer.eos_token_id
    assert tokens["json:finish"] == [int(FinishReason.STOP)]
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_same_constraint_compiles_once_and_abort_while_pending_frees_everything(tokenizer: Tokenizer) -> None:
    manager = _manager(tokenizer)
    scheduler = _scheduler(manager)
    for i in range(4):
        scheduler.add_request(_request(tokenizer, f"r{i}", choice=["alpha", "beta"]))
    scheduler.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)
    assert "r3" not in manager.pending
    assert "r3" not in scheduler.requests
    tokens = _run(scheduler)
    assert manager.num_compiled == 1
    assert {tokenizer.decode(tokens[f"r{i}"]) for i in range(3)} <= {"alpha", "beta"}
    assert "r3" not in tokens
    assert not scheduler.has_unfinished_requests()


def test_grammar_that_fails_to_compile_fails_only_its_request(tokenizer: Tokenizer) -> None:
    manager = _manager(tokenizer)
    manager._compile = lambda key: (_ for _ in ()).throw(InvalidRequestError("boom"))  # type: ignore[method-assign]
    scheduler = _scheduler(manager)
    scheduler.add_request(_request(tokenizer, "bad", regex="a"))
    scheduler.add_request(_request(tokenizer, "free", max_tokens=2))
    failed: dict[str, str] = {}
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        manager.wait_for_pending(0.05)
        so = scheduler.schedule()
        failed.update(scheduler.update_from_output(so, _lowest_allowed(so, scheduler, 100)).failed_requests or {})
    assert list(failed) == ["bad"]
    assert "boom" in failed["bad"]
    assert not scheduler.requests


def test_preempted_constrained_request_keeps_its_matcher_in_step(tokenizer: Tokenizer) -> None:
    """Two long constrained requests in a 12-block cache (4-token blocks): they preempt each other and resume
    by recompute; every output is still a sentence of the grammar."""
    manager = _manager(tokenizer)
    scheduler = _scheduler(manager, num_blocks=12)
    for i in range(3):
        scheduler.add_request(_request(tokenizer, f"r{i}", max_tokens=30, regex="(ab ){6,9}end"))
    tokens = _run(scheduler)
    assert scheduler.num_preemptions > 0
    for i in range(3):
        text = tokenizer.decode(tokens[f"r{i}"])
        assert text.startswith("ab ab ab ab ab ab "), text
        assert text.endswith("end"), text


def test_grammar_state_sync_rolls_back_to_the_tokens_still_counted(tokenizer: Tokenizer) -> None:
    manager = _manager(tokenizer)
    scheduler = _scheduler(manager)
    scheduler.add_request(_request(tokenizer, "r", regex="[a-z]{1,20}"))
    manager.wait_for_pending(30)
    scheduler.schedule()
    req = scheduler.requests["r"]
    ids = tokenizer.encode("hello world", add_special_tokens=False)[:1] + tokenizer.encode("abc")
    assert req.grammar.accept(ids)
    fresh = manager.make_bitmask([req])  # matcher after `ids`... synced to the request's (empty) output
    assert req.grammar.num_accepted == 0
    req.output_token_ids = ids[:1]
    after_one = manager.make_bitmask([req])
    assert req.grammar.num_accepted == 1
    req.output_token_ids = []
    assert manager.make_bitmask([req]) == fresh != after_one


def test_constrained_request_and_bitmask_cross_process_boundaries_intact() -> None:
    """msgpack round trips: the frontend -> engine request, and the engine -> TP workers schedule (every rank
    decodes the same mask)."""
    import msgspec

    from asyncllm.messages.rpc import RpcRequest, decode_args, encode_request
    from asyncllm.messages.scheduler import NewRequestData

    so = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    params = SamplingParams(max_tokens=4, structured_outputs=so)
    request = EngineCoreRequest("r", [1, 2], params, 2)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params == params
    assert decoded.sampling_params.structured_outputs.key == so.key  # property order survives  # type: ignore[union-attr]
    bitmask = GrammarBitmask.from_array(["r"], torch.tensor([[-1, 5, 0]], dtype=torch.int32).numpy())
    schedule = SchedulerOutput([NewRequestData("r", [1, 2], params, [0])], grammar_bitmask=bitmask)
    frame = encode_request(1, "execute_model", (schedule,), {}, -1)
    (got,), _ = decode_args(msgspec.msgpack.decode(frame, type=RpcRequest))
    assert got == schedule
    assert torch.equal(got.grammar_bitmask.to_tensor(), torch.tensor([[-1, 5, 0]], dtype=torch.int32))


def test_vocabulary_tables_are_built_at_start_in_the_background(tokenizer: Tokenizer) -> None:
    """The first constrained request no longer pays for xgrammar's import, the tokenizer and TokenizerInfo."""
    loads: list[int] = []

    def loader() -> Tokenizer:
        loads.append(1)
        return tokenizer

    manager = StructuredOutputManager(loader, VOCAB)
    deadline = time.monotonic() + 120
    while manager.prebuild_seconds is None:
        assert time.monotonic() < deadline, "prebuild did not finish"
        time.sleep(0.05)
    assert manager._compiler is not None
    manager._get_compiler()
    assert loads == [1]  # built once, reused by compiles
    lazy = StructuredOutputManager(loader, VOCAB, prebuild=False)
    time.sleep(0.2)
    assert lazy._compiler is None
