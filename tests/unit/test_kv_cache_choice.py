"""`EngineArgs(kv_cache_dtype="auto")`, the default (`model/loading/kv_cache_choice.py`): float32 weights get a
float32 cache; quantized weights a bfloat16 one where the CPU has AVX512_BF16, the head size suits the kernel and
scores are not soft-capped; explicit values are kept. The rule on given CPUs, and `create_engine_config` on the real
default model's header and on this host's real CPU flags (no weights loaded, no engine)."""

from __future__ import annotations

import pytest

from asyncllm import EngineArgs
from asyncllm.model.loading.kv_cache_choice import choose_kv_cache_dtype
from asyncllm.utils.cpu_info import CPUInfo, cpu_info

ZEN4 = CPUInfo("AMD EPYC", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AVX2 = CPUInfo("AMD EPYC", frozenset({"avx2", "fma"}))
QUANTIZED = ["int8", "q8_0", "q4_0", "gguf"]


def choose(requested: str, quantization: str | None, cpu: CPUInfo, head_dim: int = 64, cap: float | None = None):
    return choose_kv_cache_dtype(
        requested,
        quantization,  # type: ignore[arg-type]
        head_dim=head_dim,
        attn_logit_softcapping=cap,
        cpu=cpu,
    )


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_quantized_weights_on_a_cpu_with_avx512_bf16_get_a_bfloat16_cache(quantization: str) -> None:
    choice = choose("auto", quantization, ZEN4)
    assert choice.dtype == "bfloat16"
    assert choice.reason.startswith(f"kv_cache_dtype='auto' -> bfloat16: quantization={quantization!r} on a CPU ")
    assert "kv_cache_dtype='float32' keeps a float32 cache" in choice.reason


@pytest.mark.parametrize("cpu", [ZEN4, AVX2])
def test_float32_weights_get_a_float32_cache_on_any_cpu(cpu: CPUInfo) -> None:
    choice = choose("auto", None, cpu)
    assert choice.dtype == "float32"
    assert choice.reason == "kv_cache_dtype='auto' -> float32: float32 weights compute in float32 (vLLM's rule: " + (
        "the model's dtype)"
    )


@pytest.mark.parametrize(
    ("cpu", "head_dim", "cap", "why"),
    [
        (AVX2, 64, None, "this CPU (AMD EPYC) has no avx512_bf16"),
        (CPUInfo("unknown", frozenset()), 64, None, "has no avx512_bf16"),  # no /proc/cpuinfo: no features
        (ZEN4, 48, None, "head_dim 48 is not a multiple of 32"),
        (ZEN4, 256, 50.0, "soft-capped attention scores run the torch path"),
    ],
)
def test_quantized_weights_keep_float32_where_the_bfloat16_products_do_not_run(
    cpu: CPUInfo, head_dim: int, cap: float | None, why: str
) -> None:
    choice = choose("auto", "int8", cpu, head_dim, cap)
    assert choice.dtype == "float32"
    assert choice.reason.startswith("kv_cache_dtype='auto' -> float32: quantization='int8', but ")
    assert why in choice.reason


@pytest.mark.parametrize("requested", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("cpu", [ZEN4, AVX2])
def test_an_explicit_dtype_is_kept_as_asked_without_a_reason(requested: str, quantization: str | None, cpu) -> None:
    choice = choose(requested, quantization, cpu)
    assert (choice.dtype, choice.reason) == (requested, "")


def test_the_default_model_resolves_by_this_hosts_cpu_flags(model_path: str) -> None:
    """The default model's Q4_1 blocks ("gguf", head_dim 64): a bfloat16 cache exactly where this CPU has
    avx512_bf16, and float32 weights a float32 cache on any host."""
    assert EngineArgs().kv_cache_dtype == "auto"
    cache = EngineArgs(model=model_path).create_engine_config().cache
    expected = "bfloat16" if "avx512_bf16" in cpu_info().flags else "float32"
    assert cache.cache_dtype == expected
    assert cache.cache_dtype_reason.startswith(f"kv_cache_dtype='auto' -> {expected}: quantization='gguf'")
    assert cache.cache_itemsize == {"bfloat16": 2, "float32": 4}[expected]
    fp32 = EngineArgs(model=model_path, quantization="none").create_engine_config().cache
    assert (fp32.cache_dtype, fp32.cache_itemsize) == ("float32", 4)
    kept = EngineArgs(model=model_path, kv_cache_dtype="float32").create_engine_config().cache
    assert (kept.cache_dtype, kept.cache_dtype_reason) == ("float32", "")


def test_cpu_info_reads_this_hosts_flags() -> None:
    info = cpu_info()
    assert info.model
    with open("/proc/cpuinfo") as f:
        flags_line = next(line for line in f if line.startswith("flags"))
    assert info.flags == frozenset(flags_line.split(":", 1)[1].split())
    assert info.has(*sorted(info.flags)[:3])
    assert not info.has("no_such_flag")
