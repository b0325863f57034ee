"""EngineCore end to end: many greedy requests joining at different steps give the same tokens as alone,
also with chunked prefill and preemption; every block is free at the end.

Three models: a tiny Llama with dummy weights (fast; the real model code path), the real SmolLM2 (slow), and
a fake "sum" model that is an exact oracle for the scheduler, runner and paged-cache bookkeeping.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch

from asyncllm.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.core import EngineCore
from asyncllm.executors.base import Executor
from asyncllm.messages.engine import EngineCoreRequest, FinishReason
from asyncllm.model.layers.attention_metadata import AttentionMetadata
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.model_runner import ModelRunner
from tests.model_weights import randomize_matrices
from tests.reference import greedy_margins

NUM_REQUESTS = 16


def _dummy_config(model_path: str, num_kv_blocks: int, max_num_batched_tokens: int = 64) -> EngineConfig:
    return EngineConfig(
        ModelConfig("dummy", model_path, load_format="dummy", max_model_len=128),
        CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks),
        SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=max_num_batched_tokens),
        ParallelConfig(num_threads=2),
    )


TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An HF directory with only a config.json: enough for load_format="dummy"."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _tiny_core(model_path: str, num_kv_blocks: int, max_num_batched_tokens: int = 64) -> EngineCore:
    """A tiny dummy Llama re-initialised with N(0, 1/fan) matrices: the loader's N(0, 0.02) leaves attention so
    weak that the model just repeats its input token, which would hide cache and batching bugs."""
    core = EngineCore(_dummy_config(model_path, num_kv_blocks, max_num_batched_tokens))
    randomize_matrices(core.executor.worker.model)  # type: ignore[attr-defined]
    return core


@pytest.fixture(scope="module")
def dummy_core(tiny_model_path: str) -> Iterator[EngineCore]:
    core = _tiny_core(tiny_model_path, num_kv_blocks=128)
    yield core
    core.shutdown()


def _requests(vocab_size: int, seed: int = 0) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    return [
        EngineCoreRequest(
            f"r{i}",
            [rng.randrange(3, vocab_size) for _ in range(3 + 7 * i)],  # 3 .. 108 tokens
            SamplingParams(temperature=0.0, max_tokens=2 + (5 * i) % 17, ignore_eos=True),
        )
        for i in range(NUM_REQUESTS)
    ]


def _run(core: EngineCore, requests: list[EngineCoreRequest], join_every: int = 0) -> dict[str, list[int]]:
    """Step until done; add all requests at once (join_every=0) or one every `join_every` steps."""
    pending, tokens, finished = list(requests), {r.request_id: [] for r in requests}, set()
    for step in range(10_000):
        if pending and (join_every == 0 or step % join_every == 0):
            for request in pending if join_every == 0 else pending[:1]:
                core.add_request(request)
            pending = [] if join_every == 0 else pending[1:]
        if not pending and not core.has_unfinished_requests():
            break
        for output in core.step().outputs:
            assert output.request_id not in finished
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
                finished.add(output.request_id)
    assert finished == set(tokens)
    return tokens


def _assert_all_free(core: EngineCore) -> None:
    stats = core.get_scheduler_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert core.executor.worker.model_runner.requests == {}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def alone(dummy_core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for request in _requests(dummy_core.ready_info.vocab_size):
        tokens.update(_run(dummy_core, [request]))
    return tokens


def test_alone_gives_max_tokens_and_depends_on_context(alone: dict[str, list[int]]) -> None:
    requests = _requests(TINY_LLAMA["vocab_size"])  # type: ignore[arg-type]
    assert {r: len(t) for r, t in alone.items()} == {r.request_id: r.sampling_params.max_tokens for r in requests}
    assert len({t for tokens in alone.values() for t in tokens}) > 50  # not a copy-the-input model


def _assert_same_where_clear(
    core: EngineCore,
    requests: list[EngineCoreRequest],
    alone: dict[str, list[int]],
    batched: dict[str, list[int]],
    max_diverged: int = 0,
) -> None:
    """Batched tokens equal the alone ones; fp32 sums in a batch round differently than alone, so a greedy
    near-tie may flip and the sequences diverge from there on: allowed only where the top-2 margin < 1e-3,
    at most `max_diverged` times."""
    model = core.executor.worker.model  # type: ignore[attr-defined]
    num_diverged = 0
    for request in requests:
        req_id = request.request_id
        expected, got = alone[req_id], batched[req_id]
        assert len(got) == len(expected), req_id
        first_diff = next((i for i, (x, y) in enumerate(zip(expected, got, strict=True)) if x != y), None)
        if first_diff is not None:
            num_diverged += 1
            margin = greedy_margins(model, request.prompt_token_ids, expected)[first_diff]
            assert margin < 1e-3, (req_id, first_diff, margin)
    assert num_diverged <= max_diverged


@pytest.mark.parametrize("join_every", [0, 1, 3])
def test_batched_matches_alone(dummy_core: EngineCore, alone: dict[str, list[int]], join_every: int) -> None:
    requests = _requests(dummy_core.ready_info.vocab_size)
    _assert_same_where_clear(dummy_core, requests, alone, _run(dummy_core, requests, join_every))
    _assert_all_free(dummy_core)


def test_tiny_kv_cache_preempts_and_still_matches(tiny_model_path: str, alone: dict[str, list[int]]) -> None:
    core = _tiny_core(tiny_model_path, num_kv_blocks=10, max_num_batched_tokens=48)
    try:
        assert core.ready_info.max_model_len == 128  # 10 blocks of 16 hold a whole sequence
        requests = _requests(core.ready_info.vocab_size)
        _assert_same_where_clear(core, requests, alone, _run(core, requests, join_every=1))
        assert core.scheduler.num_preemptions > 0
        _assert_all_free(core)
    finally:
        core.shutdown()


def test_abort_frees_blocks_and_worker_state(dummy_core: EngineCore) -> None:
    requests = _requests(dummy_core.ready_info.vocab_size)[:4]
    for request in requests:
        dummy_core.add_request(request)
    dummy_core.step()
    assert dummy_core.get_scheduler_stats().num_free_blocks < 128
    dummy_core.abort_requests([r.request_id for r in requests])
    outputs = dummy_core.step()
    assert outputs.outputs == []
    assert sorted(outputs.finished_requests or []) == sorted(r.request_id for r in requests)
    assert not dummy_core.has_unfinished_requests()
    _assert_all_free(dummy_core)


def test_step_with_nothing_scheduled_returns_no_outputs(dummy_core: EngineCore) -> None:
    outputs = dummy_core.step()
    assert outputs.outputs == []
    assert outputs.finished_requests is None


@pytest.mark.slow
def test_real_model_batched_matches_alone_where_greedy_choice_is_clear(model_path: str) -> None:
    core = EngineCore(
        EngineArgs(model=model_path, num_kv_blocks=64, max_model_len=512, quantization=None).create_engine_config()
    )
    try:
        requests = _requests(core.ready_info.vocab_size, seed=1)
        alone: dict[str, list[int]] = {}
        for request in requests:
            alone.update(_run(core, [request]))
        batched = _run(core, requests, join_every=2)
        _assert_all_free(core)
        _assert_same_where_clear(core, requests, alone, batched, max_diverged=2)
    finally:
        core.shutdown()


# An exact oracle for the scheduler, runner and attention metadata: a fake model whose next token is
# sum((position + 1) * token) over the whole sequence, mod the vocabulary, read back from the paged cache.
FAKE_VOCAB = 997


def _oracle(prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(sum((i + 1) * t for i, t in enumerate(seq)) % FAKE_VOCAB)
    return seq[len(prompt) :]


class _SumModel:
    """Writes (position + 1) * token as each token's "key"; a query's hidden state is the sum of the keys it
    may attend to (per the metadata's block tables and mask); the logits are one-hot at that sum mod vocab."""

    decode_reads_cache = False  # decode steps get the runner's K/V mirror plan, as the torch attention path does

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        keys = kv_caches[0][:, 0, :, 0, 0]  # [num_blocks, block_size]
        block_size = meta.block_size
        keys[meta.slot_mapping // block_size, meta.slot_mapping % block_size] = ((positions + 1) * input_ids).double()
        hidden = torch.zeros(meta.num_tokens + 1, dtype=torch.float64)
        for group in meta.groups:
            seq_keys = keys[group.block_tables].flatten(1)[:, : group.max_seq_len]  # [num_seqs, max_seq_len]
            hidden[group.query_index] = (group.attn_mask[:, 0] * seq_keys[:, None, :]).sum(-1)
        return hidden[: meta.num_tokens, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        targets = (hidden[:, 0] % FAKE_VOCAB).long()
        return torch.nn.functional.one_hot(targets, FAKE_VOCAB).float()


class _SumModelExecutor(Executor):
    def _init_executor(self) -> None:
        self.runner = ModelRunner(_SumModel(), self.config.cache.block_size, FAKE_VOCAB)  # type: ignore[arg-type]

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, unique_reply_rank=None):  # type: ignore[no-untyped-def]
        return [getattr(self, "_" + method)(*args)]

    def _determine_num_kv_blocks(self) -> int:
        return self.config.cache.num_kv_blocks or 0

    def _initialize_kv_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache.block_size
        self.runner.kv_caches = [torch.zeros(num_blocks, 2, block_size, 1, 1, dtype=torch.float64)]

    def _get_model_info(self) -> tuple[int, int]:
        return 96, FAKE_VOCAB

    def _get_hidden_size(self) -> int:
        return 1

    def _get_kv_cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.runner.kv_caches)

    def _execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(("num_kv_blocks", "max_num_batched_tokens", "join_every"), [(64, 32, 0), (6, 20, 1)])
def test_exact_oracle_through_paged_cache(num_kv_blocks: int, max_num_batched_tokens: int, join_every: int) -> None:
    config = EngineConfig(
        ModelConfig("fake", "fake", max_model_len=96),
        CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks),
        SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=max_num_batched_tokens),
        ParallelConfig(),
    )
    core = EngineCore(config, executor_class=_SumModelExecutor)
    rng = random.Random(3)
    requests = [
        EngineCoreRequest(
            f"r{i}",
            [rng.randrange(FAKE_VOCAB) for _ in range(1 + 5 * i)],
            SamplingParams(temperature=0.0, max_tokens=1 + (7 * i) % 19, ignore_eos=True),
        )
        for i in range(NUM_REQUESTS)
    ]
    tokens = _run(core, requests, join_every)
    for request in requests:
        expected = _oracle(request.prompt_token_ids, request.sampling_params.max_tokens or 0)
        assert tokens[request.request_id] == expected, request.request_id
    assert (core.scheduler.num_preemptions > 0) == (num_kv_blocks == 6)
    stats = core.get_scheduler_stats()
    assert stats.num_free_blocks == stats.num_total_blocks == num_kv_blocks
    assert core.executor.runner.requests == {}  # type: ignore[attr-defined]
