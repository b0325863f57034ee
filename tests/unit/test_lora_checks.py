"""LoRA pieces without an engine: PEFT directory checks (accepted and refused adapters), `LoRARequest` fields,
EngineArgs ranges, the block-hash root per adapter, the scheduler's `max_loras`, row grouping and the delta math,
and the worker cache's LRU eviction (never an adapter the step uses)."""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from asyncllm import EngineArgs, InvalidRequestError, LoRARequest
from asyncllm.config import LoRAConfig, SchedulerConfig
from asyncllm.errors import ConfigError
from asyncllm.lora import manager as manager_module
from asyncllm.lora.checker import LoRAChecker
from asyncllm.lora.manager import LoRAManager
from asyncllm.lora.peft import model_module_shapes, read_adapter
from asyncllm.lora.weights import AdapterWeights, FusedLoRA, LayerLoRA, LoRABatch
from asyncllm.messages.engine import EngineCoreRequest
from asyncllm.messages.scheduler import ModelRunnerOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.sched.block_pool import ROOT_BLOCK_HASH, root_block_hash
from asyncllm.sched.scheduler import Scheduler
from tests.lora_adapters import write_peft_adapter

# A small Llama-shaped model: 2 layers, hidden 8, 2 heads of 4 (1 KV head), MLP 16.
ARCH = SimpleNamespace(
    hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=2
)
SHAPES = model_module_shapes(8, 16, 2, 1, 4)
PREFIX = "base_model.model.model.layers"


@pytest.fixture
def adapter(tmp_path: pathlib.Path) -> pathlib.Path:
    write_peft_adapter(tmp_path / "a", ARCH, rank=4, alpha=8.0)
    return tmp_path / "a"


def test_a_valid_adapter_reads_with_rank_scale_and_modules(adapter: pathlib.Path) -> None:
    spec = read_adapter(adapter, max_lora_rank=8, module_shapes=SHAPES, num_layers=2)
    assert (spec.rank, spec.scale) == (4, 2.0)
    assert len(spec.modules) == 2 * 7
    assert spec.modules[(1, "mlp.down_proj")] == (
        f"{PREFIX}.1.mlp.down_proj.lora_A.weight",
        f"{PREFIX}.1.mlp.down_proj.lora_B.weight",
    )
    assert spec.in_out["self_attn.k_proj"] == (8, 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "only 'LORA'"),
        ({"r": 16}, r"r=16 must be an integer in \[1, max_lora_rank=8\]"),
        ({"lora_alpha": "big"}, "lora_alpha='big'"),
        ({"use_rslora": True}, "use_rslora=True not supported"),
        ({"use_dora": True}, "use_dora=True not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=\\['lm_head'\\] not supported"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern="),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern="),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
        ({"init_lora_weights": "pissa"}, "changes the base weights"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules \\['embed_tokens'\\] not supported"),
        ({"a_future_peft_option": {"on": 1}}, "a_future_peft_option="),
    ],
)
def test_configs_that_change_the_math_are_refused(
    tmp_path: pathlib.Path, overrides: dict[str, Any], message: str
) -> None:
    write_peft_adapter(tmp_path, ARCH, rank=4, config_overrides=overrides)
    with pytest.raises(InvalidRequestError, match=message):
        read_adapter(tmp_path, max_lora_rank=8)


def test_unset_unknown_keys_and_metadata_are_read_past(tmp_path: pathlib.Path) -> None:
    overrides = {"a_future_peft_option": None, "layers_to_transform": [0], "revision": "main", "lora_dropout": 0.1}
    write_peft_adapter(tmp_path, ARCH, rank=4, config_overrides=overrides, modules=("q_proj", "v_proj"))
    assert len(read_adapter(tmp_path, max_lora_rank=8).modules) == 4


def _rewrite_tensors(directory: pathlib.Path, change: Any) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(4)}), "is not a LoRA"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 8)}), "is not a LoRA"),
        (lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_B.bias": torch.ones(8)}), "is not a LoRA"),
        (lambda t: t.pop(f"{PREFIX}.1.mlp.up_proj.lora_B.weight"), "layer 1 mlp.up_proj has lora_A only"),
        (lambda t: t.update({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.ones(2, 8)}), "has rank 2"),
        (lambda t: t.update({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.ones(4, 8, 1)}), "a 2-D float tensor"),
        (lambda t: t.update({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": torch.ones(4, 9)}), "unlike mlp.up_proj"),
        (lambda t: t.clear() or t.update({"x": torch.ones(1)}), "'x' is not a LoRA"),
    ],
)
def test_tensors_that_change_the_math_are_refused(adapter: pathlib.Path, change: Any, message: str) -> None:
    _rewrite_tensors(adapter, change)
    with pytest.raises(InvalidRequestError, match=message):
        read_adapter(adapter, max_lora_rank=8)


def test_shapes_and_layers_are_checked_against_the_model(adapter: pathlib.Path) -> None:
    wider = model_module_shapes(16, 16, 2, 1, 4)
    mismatch = r"mlp\.down_proj has \[in, out\] = \[16, 8\]; the model's is \[16, 16\]"
    with pytest.raises(InvalidRequestError, match=mismatch):
        read_adapter(adapter, 8, wider, 2)
    with pytest.raises(InvalidRequestError, match="adapts layer 1; the model has 1 layers"):
        read_adapter(adapter, 8, SHAPES, 1)


def test_a_module_of_another_layout_is_refused(tmp_path: pathlib.Path) -> None:
    """Phi-3's fused qkv_proj is a module PEFT can target, but a Llama model has q/k/v_proj instead."""
    save_file(
        {
            f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight": torch.ones(4, 8),
            f"{PREFIX}.0.self_attn.qkv_proj.lora_B.weight": torch.ones(16, 4),
        },
        str(tmp_path / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert read_adapter(tmp_path, 8).in_out == {"self_attn.qkv_proj": (8, 16)}  # without the model: a known module
    with pytest.raises(InvalidRequestError, match=r"adapts self_attn\.qkv_proj, which this model does not have"):
        read_adapter(tmp_path, 8, SHAPES, 2)


def test_missing_and_malformed_files_are_invalid_requests(tmp_path: pathlib.Path, adapter: pathlib.Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        read_adapter(tmp_path / "absent", 8)
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match=r"cannot read adapter_config\.json"):
        read_adapter(adapter, 8)
    (adapter / "adapter_config.json").write_text(json.dumps([1]))
    with pytest.raises(InvalidRequestError, match="not a JSON object"):
        read_adapter(adapter, 8)
    write_peft_adapter(adapter, ARCH, rank=4)
    (adapter / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(InvalidRequestError, match=r"cannot read adapter_model\.safetensors"):
        read_adapter(adapter, 8)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidRequestError, match=r"no adapter_model\.safetensors"):
        read_adapter(adapter, 8)


def test_lora_request_fields_are_checked() -> None:
    assert LoRARequest("a", 1, pathlib.Path("/x")).lora_path == "/x"  # type: ignore[arg-type]
    for bad_id in (0, -1, True, 2**31, "1"):
        with pytest.raises(InvalidRequestError, match="lora_int_id"):
            LoRARequest("a", bad_id, "/x")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="lora_name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(InvalidRequestError, match="lora_path"):
        LoRARequest("a", 1, "")


def test_checker_refuses_lora_when_off_and_an_id_reused_for_another_path(adapter: pathlib.Path) -> None:
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        LoRAChecker(None).check(LoRARequest("a", 1, str(adapter)))
    checker = LoRAChecker(LoRAConfig(max_loras=1, max_lora_rank=8))
    with pytest.raises(InvalidRequestError, match="must be a LoRARequest"):
        checker.check("a")
    assert checker.check(LoRARequest("a", 1, str(adapter))).lora_path == str(adapter)
    other = adapter.parent / "b"
    write_peft_adapter(other, ARCH, rank=4)
    with pytest.raises(InvalidRequestError, match="lora_int_id=1 already names the adapter"):
        checker.check(LoRARequest("b", 1, str(other)))
    assert checker.check(LoRARequest("b", 2, str(other))).lora_int_id == 2


def test_engine_args_lora_ranges() -> None:
    with pytest.raises(ConfigError, match="max_lora_rank=65"):
        EngineArgs(enable_lora=True, max_lora_rank=65).validate()
    with pytest.raises(ConfigError, match="max_loras=0"):
        EngineArgs(enable_lora=True, max_loras=0).validate()
    with pytest.raises(ConfigError, match="quantization='int8'"):
        EngineArgs(enable_lora=True, quantization="int8").validate()


def test_each_adapter_roots_its_own_block_hash_chain() -> None:
    import hashlib

    roots = {root_block_hash(None), root_block_hash(None, 1), root_block_hash(None, 2), root_block_hash("s", 1)}
    roots |= {root_block_hash("s")}
    assert len(roots) == 5
    assert root_block_hash(None) == ROOT_BLOCK_HASH
    assert root_block_hash("s") == hashlib.sha256(b"cache_salt\0s").digest()  # salt-only roots unchanged


def _lora_request(request_id: str, lora_id: int | None) -> EngineCoreRequest:
    lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, f"/adapters/{lora_id}")
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), lora_request=lora)


def test_scheduler_runs_at_most_max_loras_adapters_and_passed_over_requests_keep_their_place() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 64), 100, 4, 64, max_loras=1)
    for request_id, lora_id in [("a1", 1), ("b1", 2), ("base", None), ("a2", 1), ("b2", 2)]:
        scheduler.add_request(_lora_request(request_id, lora_id))
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["a1", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["b1", "b2"]
    assert [new.lora_request.lora_int_id if new.lora_request else None for new in so.scheduled_new_reqs] == [1, None, 1]
    scheduler.update_from_output(so, ModelRunnerOutput({i: [7] for i in so.num_scheduled_tokens}))
    so = scheduler.schedule()  # their decodes; adapter 2 still waits
    assert list(so.num_scheduled_tokens) == ["a1", "base", "a2"]
    scheduler.update_from_output(so, ModelRunnerOutput({i: [7] for i in so.num_scheduled_tokens}))  # max_tokens=2
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["b1", "b2"]
    assert [r.lora_int_id for r in scheduler.running] == [2, 2]


def test_a_lora_request_to_a_scheduler_without_lora_is_refused() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 64), 100, 4, 64)
    with pytest.raises(ValueError, match="without LoRA"):
        scheduler.add_request(_lora_request("a", 1))


def _adapter(lora_id: int, in_features: int, out_features: int, rank: int, seed: int) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    fused = FusedLoRA(torch.randn(in_features, rank, generator=generator), torch.randn(rank, out_features))
    return AdapterWeights(lora_id, [{"o_proj": fused}])


def test_rows_are_grouped_by_adapter_and_each_gets_its_own_delta() -> None:
    adapters = {1: _adapter(1, 6, 5, 2, 0), 2: _adapter(2, 6, 5, 3, 1)}
    query_lens = np.array([2, 3, 1, 2])
    batch = LoRABatch.from_requests([1, 1, 0, 2], query_lens, adapters)
    assert batch is not None
    (rows1, _), (rows2, _) = batch.groups
    assert rows1 == slice(0, 5)
    assert rows2 == slice(6, 8)
    batch = LoRABatch.from_requests([1, 0, 1, 0], query_lens, adapters)
    assert batch is not None
    assert batch.groups[0][0].tolist() == [0, 1, 5]  # type: ignore[union-attr]
    assert LoRABatch.from_requests([0, 0, 0, 0], query_lens, adapters) is None
    x, base = torch.randn(8, 6), torch.randn(8, 5)
    out = LoRABatch.from_requests([1, 2, 0, 1], query_lens, adapters).layer(0).add(x, base.clone(), "o_proj")  # type: ignore[union-attr]
    expected = base.clone()
    for rows, lora_id in ((slice(0, 2), 1), (slice(2, 5), 2), (slice(6, 8), 1)):
        w = adapters[lora_id].layers[0]["o_proj"]
        expected[rows] += x[rows] @ w.a @ w.b
    torch.testing.assert_close(out, expected)
    assert torch.equal(LayerLoRA([]).add(x, base.clone(), "o_proj"), base)


def test_worker_cache_evicts_least_recently_used_never_one_the_step_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []

    def fake_load(request: LoRARequest, *args: Any) -> AdapterWeights:
        loads.append(request.lora_int_id)
        return AdapterWeights(request.lora_int_id, [{}])

    monkeypatch.setattr(manager_module, "load_adapter", fake_load)
    manager = LoRAManager(ARCH, [], max_loras=2, max_lora_rank=8)  # type: ignore[arg-type]
    one, two, three = (LoRARequest(f"l{i}", i, f"/a/{i}") for i in (1, 2, 3))
    lens = np.array([1, 1])
    assert manager.make_batch([None, None], lens) is None
    manager.make_batch([one, two], lens)
    manager.make_batch([one, None], lens)  # 1 is now the most recently used
    manager.make_batch([three, None], lens)  # evicts 2
    assert manager.list_loras() == [1, 3]
    manager.make_batch([two, three], lens)  # 1 is the only one this step does not use
    assert manager.list_loras() == [3, 2]
    assert loads == [1, 2, 3, 2]
    with pytest.raises(RuntimeError, match="3 adapters; max_loras=2"):
        manager.make_batch([one, two, three], np.array([1, 1, 1]))
