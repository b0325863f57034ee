"""Fused row kernels for the decoder layer, built from `csrc/row_kernels.cpp` on first use.

Inside a decode step every small torch op costs several times its cost alone (most likely each product's
megabytes of weights evict from the caches what the next op needs; `benchmarks/op_overhead.py`, measurements in
`benchmarks/analysis.md`, "Fused row kernels"). These kernels do in one call per row what takes 2-12 torch ops:

- `rms_norm(x, weight, eps)`: RMSNorm (every norm of the fp32 model, and the final norm).
- `silu_mul(gate_up)`: SiLU(gate) * up from the fused gate/up product (fp32 MLP).
- `scale_bias_rotate_(qkv, row_scale, bias, cos, sin, rotated)`: in place, the q/k/v product times its rows'
  activation scales (int8) plus the bias (Qwen2), with rotary embeddings applied to the q and k heads.
- int8 layers: `rms_norm_quantize(x, weight, eps)` (RMSNorm then per-row int8 quantization: qkv's and gate/up's
  input), `silu_mul_quantize(gate_up, row_scale)` (scale by the rows' activation scales, SiLU(gate) * up,
  quantize: down's input), `quantize_rows(x)` (o_proj's and the LM head's input) and `add_scaled_(residual, out,
  row_scale)` (`residual + out * row_scale` into `out`: the residual adds). An int8 layer runs 7 kernel calls
  around its four products instead of about 55 torch ops; an fp32 layer 4 instead of about 20.
- K/V copies (both paths): `store_kv_cache_` (this step's keys and values into the paged cache at their slots:
  `attention.write_kv_cache`'s permute, stack and indexed write; into a bfloat16 cache rounded to nearest even,
  as `.to(torch.bfloat16)`) and `store_kv_rows_` (the new token into the
  decode K/V mirror: two indexed writes), as plain copies instead of indexed writes.
- `paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale, window)`: decode attention read
  straight from the paged KV cache through the block tables (`csrc/paged_attention.cpp`; a float32 or bfloat16
  cache, widened to float32 in registers), instead of gathering every cached token into a dense copy per layer
  and step. Not bit-exact with SDPA (another summation order):
  `self_check` compares it with SDPA within a tolerance (`model/kernels/attention_checks.py`).
- `paged_prefill_attention_(out, query, kv_cache, block_tables, query_starts, query_lens, seq_lens, scale,
  window)`: prefill (and chunked-prefill) attention read the same way (`csrc/paged_prefill_attention.cpp`: flash
  attention's online softmax over tiles of the cache, the cached prefix and the chunk's own keys in one pass),
  instead of a gather of the cached prefix and two ATen flash calls merged per sequence and layer; checked against
  SDPA the same way. With a bfloat16 cache on a CPU with AVX512_BF16 it multiplies in bfloat16 (`vdpbf16ps`: the
  queries and softmax weights rounded to bfloat16, float32 sums), as SDPA in bfloat16 does;
  `paged_prefill_attention_bf16_dot()` says whether this build does.
- block-quantized products (`block_linear`, `csrc/block_quant.cpp`): Q8_0 / Q4_0 / Q4_1 weights times int8
  activation blocks, checked and used by `model/kernels/block_quant.py`.
- float32 products with a weight packed once by MKL in column chunks (`sgemm_pack`, `sgemm_packed`, in
  `csrc/packed_gemm.cpp`: the CBLAS packed-GEMM routines of the MKL torch links, where it exports them, with the
  chunks handed out on demand to threads). Not row kernels and not bit-exact with other GEMMs:
  `model/kernels/fp32.py` checks them and decides whether to use them.

Every row kernel gives the eager ops' values bit for bit (RMSNorm adds its squares in the order of ATen's sum kernel,
which is exact for rows of up to `MAX_NORM_COLUMNS`; longer rows are summed across threads by ATen); decode
attention and the packed GEMMs are the exceptions (float32 sums in another order, each independent of the batch and
the thread count). `self_check` compares them with torch at start-up and `tests/unit/test_row_kernels.py` on more
shapes.

The kernels are compiled with `torch.utils.cpp_extension.load` (a C++ compiler and ninja, which asyncllm
installs from PyPI into the interpreter's scripts directory, put first on the build's PATH here; about 20 s once
per machine, cached in `$XDG_CACHE_HOME/asyncllm/kernels/`, default `~/.cache/asyncllm/kernels/`), for this CPU's
vector width (`-march=native`; the cache name includes the CPU's flags, so a shared home directory never loads
another CPU's build, and the paths of the sources and of torch, so checkouts and venvs never rebuild each
other's). Loaded, they log which run (INFO). Where the build or the start-up self-check fails, `load_kernels`
returns None, logs a WARNING once saying why and what it costs, and the model uses the eager ops.
`ASYNCLLM_FUSED_KERNELS=0` turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import platform
import sysconfig
import time
from types import ModuleType
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from asyncllm.model.kernels.attention_checks import compare_decode_attention, compare_prefill_attention
from asyncllm.model.kernels.rotary import apply_rotary
from asyncllm.model.kernels.row_quant import quantize_rows
from asyncllm.utils.cpu_info import cpu_info

logger = logging.getLogger(__name__)
SOURCE = pathlib.Path(__file__).parent / "csrc" / "row_kernels.cpp"
# compiled together; with the headers, in the cache key
SOURCES = tuple(
    SOURCE.with_name(name)
    for name in (
        "row_kernels.cpp",
        "packed_gemm.cpp",
        "paged_attention.cpp",
        "paged_prefill_attention.cpp",
        "block_quant.cpp",
        "int8_gemm.cpp",
        "fp32_gemv.cpp",
    )
)
HEADERS = tuple(
    SOURCE.with_name(name)
    for name in (
        "packed_gemm.h",
        "paged_attention.h",
        "paged_prefill_attention.h",
        "paged_kv_checks.h",
        "block_quant.h",
        "int8_gemm.h",
        "fp32_gemv.h",
        "vec_capability.h",
    )
)
ENV_SWITCH = "ASYNCLLM_FUSED_KERNELS"
STALE_LOCK_S = 600.0  # seconds; a build takes about 20
SLOW_FALLBACK = (
    "THE MODEL RUNS SLOWER on torch ops (no fused row kernels, no MKL packed fp32 GEMM; the kernels took 24-32% off "
    "an int8 decode step, README 'Speed'). Install a C++ compiler (e.g. g++) and reinstall asyncllm (brings ninja)"
)
MAX_NORM_COLUMNS = 16384  # `rms_norm_quantize` equals F.rms_norm for rows up to this many columns


class DecodeStack(Protocol):
    """A compiled decode stack (`csrc/row_kernels.cpp`; `model/decode_stack.py` builds them): a decode-only step
    over every layer of a model at TP=1 in one call, making the calls its layers make per layer in the same order
    (the same bits), then the final RMSNorm. `BlockDecodeStack`: block weights, as
    `LlamaDecoderLayer._forward_blocks`; `Int8DecodeStack`: int8 weights, as `LlamaDecoderLayer._forward_fused_int8`."""

    def num_layers(self) -> int:
        """Layers in the stack."""
        ...

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        kv_caches: list[torch.Tensor],
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """`[rows, hidden]` float32 (row i: sequence i's one token), `[rows]` int64 positions, the model's
        `[max_positions, head_dim]` rotary tables, one KV cache per layer (written in place), `[rows]` int64 block
        ids and offsets of the tokens' slots, `[rows, max_blocks]` int64 block tables, `[rows]` int64 sequence
        lengths (this token included) -> `[rows, hidden]` float32 final-normed hidden states. Raises RuntimeError
        (IndexError for a slot or block outside the cache) on what the separate calls refuse."""
        ...


class RowKernels(Protocol):
    """The compiled module's functions (shapes: `[rows, cols]` float32 contiguous inputs, `[rows, 1]` scales).

    Each raises RuntimeError on a wrong dtype, shape or layout.
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """[rows, hidden], [hidden] -> [rows, hidden] float32."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] -> [rows, inter] float32."""
        ...

    def scale_bias_rotate_(
        self,
        qkv: torch.Tensor,
        row_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotated: int,
    ) -> None:
        """In place on `[rows, cols]` qkv: times `[rows, 1]` row_scale, plus `[cols]` bias, then the first `rotated`
        columns (whole heads) rotated with `[rows, 1, head_dim]` sign-folded cos/sin tables (`llama.apply_rotary`)."""
        ...

    def rms_norm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, hidden], [hidden] -> (int8 [rows, hidden], float32 [rows, 1] scales)."""
        ...

    def silu_mul_quantize(self, gate_up: torch.Tensor, row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, 2 * inter] unscaled gate/up, [rows, 1] -> (int8 [rows, inter], float32 [rows, 1])."""
        ...

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, cols] -> (int8 [rows, cols], float32 [rows, 1])."""
        ...

    def add_scaled_(self, residual: torch.Tensor, out: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        """`out = residual + out * row_scale`, in place; returns `out`."""
        ...

    def store_kv_cache_(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None:
        """`kv_cache[blocks[i], 0, offsets[i]] = key[i]` and `[..., 1, ...] = value[i]` for a contiguous float32 or
        bfloat16 (rounded to nearest even, as `.to(torch.bfloat16)`) `[num_blocks, 2, block_size, heads, head_dim]`
        cache, float32 `[rows, heads, head_dim]` key/value (rows may be
        strided) and `[rows]` int64 blocks/offsets. Raises IndexError for a slot outside the cache."""
        ...

    def store_kv_rows_(
        self,
        key_dst: torch.Tensor,
        value_dst: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """`key_dst[i, positions[i]] = key[i]` and the same for value, for contiguous `[rows, capacity, heads,
        head_dim]` destinations. Raises IndexError for a position outside the capacity."""
        ...

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """Attention of each sequence's one query token over its cached tokens, read through its block table.

        `query` [num_seqs, num_heads, head_dim] float32 contiguous; `kv_cache` [num_blocks, 2, block_size,
        num_kv_heads, head_dim] float32 or bfloat16 contiguous (num_heads a multiple of num_kv_heads: GQA);
        `block_tables` [num_seqs, max_blocks] int64; `seq_lens` [num_seqs] int64 tokens in the cache (the query's
        own included). `window` > 0: only the last `window` tokens are seen. Returns [num_seqs, num_heads *
        head_dim] float32. Raises RuntimeError on a wrong dtype/shape/layout, IndexError on a block outside the
        cache or a table too short."""
        ...

    def paged_prefill_attention_available(self) -> bool:
        """Whether this build has the prefill attention kernel's vector code (AVX-512 or AVX2 with FMA)."""
        ...

    def paged_prefill_attention_bf16_dot(self) -> bool:
        """Whether the prefill attention kernel multiplies a bfloat16 cache's keys and values in bfloat16 (AVX512_BF16's
        `vdpbf16ps`; for head_dim a multiple of 32): queries (times the scale) and softmax weights rounded to
        bfloat16, float32 sums, about 2^-8 of the values' magnitude from float32 arithmetic
        (`attention_checks.BF16_DOT_TOLERANCE`). False: a bfloat16 cache is widened to float32 (exact) and the
        arithmetic is the float32 cache's."""
        ...

    def paged_prefill_attention_(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int,
    ) -> None:
        """In place: `out[query_starts[s] + i]` = attention of sequence s's query token i, at position `seq_lens[s] -
        query_lens[s] + i`, over its cached tokens up to that position (`window` > 0: the last `window` of them only),
        read through its block table; this step's keys and values are already in the cache. Other rows of `out` are
        left as they are; the GIL is released meanwhile.

        `out` [>= num_tokens, num_heads * head_dim] float32; `query` [num_tokens, num_heads, head_dim] float32;
        `kv_cache` [num_blocks, 2, block_size, num_kv_heads, head_dim] float32 or bfloat16 (num_heads a multiple of
        num_kv_heads: GQA; head_dim a multiple of 8); `block_tables` [num_seqs, max_blocks] int64; `query_starts`,
        `query_lens`, `seq_lens` [num_seqs] int64; all contiguous. Raises RuntimeError on a wrong dtype, shape or
        layout, IndexError on a span outside the query rows, a block outside the cache or a table too short."""
        ...

    def has_packed_sgemm(self) -> bool:
        """Whether the MKL packed-GEMM routines below are linked (torch's MKL exports them)."""
        ...

    def sgemm_pack(self, weight: torch.Tensor, chunk_cols: int) -> torch.Tensor:
        """`[in, out]` float32 contiguous -> MKL's packed copy in `chunk_cols`-wide column chunks (opaque uint8; must
        not be copied or moved: pack the copy's weight again). Raises RuntimeError without MKL."""
        ...

    def block_quant_paths(self) -> list[str]:
        """The block-quantized product paths this build and process have, best first ("amx", "vnni", "avx2",
        "scalar"; "amx" where the CPU has AMX-INT8 and Linux granted the tile data permission)."""
        ...

    def block_quant_amx_status(self) -> str:
        """ "" when the "amx" block path is offered, else why not (the build, the CPU or Linux's permission)."""
        ...

    def block_quantize_rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """`[rows, in]` float32 (in a multiple of 32) -> [int8 `[rows, in]`, float32 `[rows, in / 32]` scales,
        int32 `[rows, in / 32]` block sums] (`csrc/block_quant.h`)."""
        ...

    def block_linear(
        self,
        x: torch.Tensor,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        kind: int,
        out_features: int,
        path: str,
    ) -> torch.Tensor:
        """`x @ W` for a block-quantized weight (`model/kernels/block_quant.py`, `csrc/block_quant.h`):
        `[rows, in]` float32 -> `[rows, out_features]` float32; the GIL is released meanwhile. Raises RuntimeError
        on wrong shapes or dtypes or a path this build does not have."""
        ...

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[rows, n]` float32 contiguous (n >= 1) -> `[rows]` int64: `x.max(dim=-1).indices`, bit for bit (the first
        index of each row's maximum; a NaN is the maximum, the first NaN wins)."""
        ...

    def block_dequantize_columns(
        self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: int, in_features: int, columns: torch.Tensor
    ) -> torch.Tensor:
        """A block weight's `[n]` int64 columns dequantized as `[n, in_features]` float32 rows
        (`BlockQuantWeight.dequantize_columns`' values bit for bit; `csrc/block_quant.h`). Raises RuntimeError on
        wrong shapes or dtypes, IndexError for a column outside the weight."""
        ...

    def block_linear_fused(
        self,
        x: torch.Tensor,
        prologue: int,
        norm_weight: torch.Tensor | None,
        eps: float,
        residual: torch.Tensor | None,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        kind: int,
        out_features: int,
        path: str,
    ) -> torch.Tensor:
        """`block_linear` of `x` as it is (prologue 0), of `rms_norm(x, norm_weight, eps)` (1) or of
        `silu_mul(x)` (2), plus `residual` (`[rows, out_features]`, if given), in one call with the same bits as
        the separate calls (`csrc/row_kernels.cpp`). Raises RuntimeError on what those calls refuse."""
        ...

    def BlockDecodeStack(  # the C++ class's name
        self,
        tensors: list[torch.Tensor],
        ints: list[int],
        final_norm: torch.Tensor,
        eps: float,
        head_dim: int,
        q_size: int,
        kv_size: int,
        scale: float,
        path: str,
    ) -> DecodeStack:
        """A stack of block layers for decode-only steps in one call (`BlockDecodeStack`; `model/decode_stack.py`
        builds it): per layer 15 tensors (input and post-attention norm weights, the qkv bias or an empty tensor, then
        `qs`, `d`, `m` of qkv, o, gate_up and down) and 9 ints (the four kinds, the four out_features, the sliding
        window or 0). Raises RuntimeError on lists of other lengths."""
        ...

    def Int8DecodeStack(  # the C++ class's name
        self,
        tensors: list[torch.Tensor],
        ints: list[int],
        final_norm: torch.Tensor,
        eps: float,
        head_dim: int,
        q_size: int,
        kv_size: int,
        scale: float,
    ) -> DecodeStack:
        """A stack of int8 layers for decode-only steps in one call (`Int8DecodeStack`; `model/decode_stack.py`
        builds it): per layer 15 tensors (input and post-attention norm weights, the qkv bias or an empty tensor,
        then the packed weight, correction (empty for AVX2) and `[out]` scales of qkv, o, gate_up and down) and 13
        ints (the four kernels, 0 VNNI or 1 AVX2; the four in_features; the four out_features; the sliding window or
        0). Raises RuntimeError on lists of other lengths or a kernel this build lacks."""
        ...

    def int8_avx2_available(self) -> bool:
        """Whether this build has the AVX2 int8 product (`csrc/int8_gemm.h`)."""
        ...

    def int8_pack_avx2(self, qweight: torch.Tensor) -> torch.Tensor:
        """`[in, out]` int8 weight (no -128) -> its packed copy, `[ceil(out / 8), ceil(in / 4), 8, 4]` uint8
        (`csrc/int8_gemm.h`). Raises RuntimeError on a wrong dtype or shape or a value of -128."""
        ...

    def int8_gemm_avx2(
        self, qx: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, in_features: int, out_features: int
    ) -> torch.Tensor:
        """`[rows, in_features]` int8 activations times a packed `[in_features, out_features]` int8 weight (its packed
        shape holds `in_features` only in quads of 4) -> `[rows, out_features]` float32
        `float(exact int32 sum) * scale[column]`, `torch._int_mm(qx, qweight).float() * scale` bit for bit; the GIL
        is released meanwhile. Raises RuntimeError on wrong shapes or dtypes or without the AVX2 path."""
        ...

    def int8_vnni_available(self) -> bool:
        """Whether this build has the AVX-512 VNNI int8 product (`csrc/int8_gemm.h`)."""
        ...

    def int8_pack_vnni(self, qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[in, out]` int8 weight -> (its packed copy, `[ceil(out / 16), ceil(in / 4), 16, 4]` uint8; its `[out]`
        int32 correction, `128 * sum_k qweight[k, n]`) (`csrc/int8_gemm.h`). Raises RuntimeError on a wrong dtype or
        shape."""
        ...

    def int8_gemm_vnni(
        self,
        qx: torch.Tensor,
        packed: torch.Tensor,
        correction: torch.Tensor,
        scale: torch.Tensor,
        in_features: int,
        out_features: int,
    ) -> torch.Tensor:
        """As `int8_gemm_avx2`, on `int8_pack_vnni`'s packed weight and correction: `[rows, out_features]` float32,
        `torch._int_mm(qx, qweight).float() * scale` bit for bit; the GIL is released meanwhile. Raises RuntimeError
        on wrong shapes or dtypes or without the VNNI path."""
        ...

    def fp32_gemv_available(self) -> bool:
        """Whether this build has the float32 GEMV (`csrc/fp32_gemv.h`: AVX2 and FMA)."""
        ...

    def fp32_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight` for `[rows, in]` float32 contiguous `x` and the plain `[in, out]` float32 contiguous weight ->
        `[rows, out]` float32, streaming the weight once per 8 rows (`csrc/fp32_gemv.cpp`: float32 sums in a fixed
        order that does not depend on the thread count); the GIL is released meanwhile. Raises RuntimeError on wrong
        shapes, dtypes or layouts, or without the vector path."""
        ...

    def sgemm_packed(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, num_threads: int) -> torch.Tensor:
        """`x @ W`: `[rows, in]` float32 contiguous times a packed `[in, out_features]` weight -> `[rows, out_features]`
        (MKL's kernel, float32 arithmetic in its own summation order), its column chunks handed out on demand to
        `num_threads` threads (`csrc/packed_gemm.cpp`); the GIL is released meanwhile. Raises RuntimeError on a
        buffer of another shape."""
        ...


@functools.cache
def kernel_sources_digest() -> str:
    """A short digest of the C++ kernels' sources (`SOURCES`, `HEADERS`): the kernel chooser keys its cached
    timings by it, so a changed kernel is measured again rather than judged by its old code's speed."""
    return hashlib.sha256("".join(p.read_text() for p in (*SOURCES, *HEADERS)).encode()).hexdigest()[:12]


def _cpu_tag() -> str:
    """A short digest of this CPU's model and feature flags (`utils/cpu_info.py`), of the source, and of the
    source's and torch's paths and torch's version."""
    info = cpu_info()
    cpu = platform.machine() + info.model + " ".join(sorted(info.flags))
    # and where the sources and torch are: their paths are in build.ninja, so two checkouts or venvs sharing one
    # build directory would rebuild each other's build at every load (40-70 s each on a busy 2-core machine)
    cpu += str(SOURCE.resolve()) + torch.__file__ + torch.__version__
    return hashlib.sha256((cpu + "".join(p.read_text() for p in (*SOURCES, *HEADERS))).encode()).hexdigest()[:12]


@functools.cache
def load_kernels() -> RowKernels | None:
    """The fused kernels, built (or loaded from the cache) once per process; None where they are off
    (`ASYNCLLM_FUSED_KERNELS=0`), cannot be built here, or fail the self-check. Never raises."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        logger.info("fused row kernels are built for x86-64 only; using torch ops")
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"asyncllm_row_kernels_{_cpu_tag()}"
        directory = build_directory(name)
        remove_stale_lock(directory)
        # pip's ninja first (`.venv/bin/python` runs without .venv/bin on PATH): always the same ninja, as another
        # one's `.ninja_log` format makes ninja rebuild everything
        saved_path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.pathsep.join(filter(None, (sysconfig.get_path("scripts"), saved_path)))
        try:
            module = load(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],  # OpenMP: torch's libgomp
                build_directory=str(directory),
                verbose=False,
            )
        finally:
            os.environ["PATH"] = saved_path
    except Exception as exc:  # a missing compiler or ninja, a failed build: the eager ops still work
        logger.warning("fused row kernels could not be built (%s); %s", str(exc)[-400:], SLOW_FALLBACK)
        return None
    kernels = cast(RowKernels, _SharedKernels(module))
    problem = self_check(kernels)
    if problem:
        logger.warning("fused row kernels failed their self-check (%s); %s", problem, SLOW_FALLBACK)
        return None
    logger.info("fused row kernels in use (MKL packed GEMM linked: %s)", kernels.has_packed_sgemm())
    return kernels


def build_directory(name: str) -> pathlib.Path:
    """`$XDG_CACHE_HOME/asyncllm/kernels/<name>` (default `~/.cache/asyncllm/kernels/<name>`), created.

    Raises:
        OSError: the directory cannot be created.
    """
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    path = pathlib.Path(base) / "asyncllm" / "kernels" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_stale_lock(directory: pathlib.Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock `torch.utils.cpp_extension` left in `directory` if it is older than `max_age_s`
    seconds: a process that dies mid-build leaves it, and every later build would wait for it forever. A build
    takes about 20 s, so a lock this old has no live owner. Returns whether a lock was removed."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    logger.warning("removing a %.0f s old build lock left by a stopped process: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


class _SharedKernels:
    """The compiled module's functions, bound once; a deep copy of a model shares them (a Python module can be
    neither copied nor pickled)."""

    def __init__(self, module: ModuleType) -> None:
        for name in KERNELS:
            setattr(self, name, getattr(module, name))

    def __deepcopy__(self, memo: dict[int, object]) -> _SharedKernels:
        return self


KERNELS = (
    "rms_norm",
    "silu_mul",
    "scale_bias_rotate_",
    "rms_norm_quantize",
    "silu_mul_quantize",
    "quantize_rows",
    "add_scaled_",
    "store_kv_cache_",
    "store_kv_rows_",
    "paged_decode_attention",
    "paged_prefill_attention_available",
    "paged_prefill_attention_bf16_dot",
    "paged_prefill_attention_",
    "has_packed_sgemm",
    "sgemm_pack",
    "sgemm_packed",
    "block_quant_paths",
    "block_quant_amx_status",
    "block_quantize_rows",
    "block_linear",
    "block_linear_fused",
    "block_dequantize_columns",
    "argmax_rows",
    "BlockDecodeStack",
    "Int8DecodeStack",
    "int8_avx2_available",
    "int8_pack_avx2",
    "int8_gemm_avx2",
    "int8_vnni_available",
    "int8_pack_vnni",
    "int8_gemm_vnni",
    "fp32_gemv_available",
    "fp32_gemv",
)


def self_check(kernels: RowKernels) -> str:
    """Compare every kernel with the eager ops it replaces, on rows of 70, 576 and 2048 columns (with a row of
    zeros); returns "" when all are equal bit for bit (decode and prefill attention: within
    `attention_checks.ATTENTION_TOLERANCE` of SDPA), else which kernel differs."""
    gen = torch.Generator().manual_seed(0)
    for cols in (70, 576, 2048):
        x = torch.randn(3, cols, generator=gen) * 4
        x[1] = 0.0  # a row of zeros keeps scale 1e-30 / 127 and values 0
        problem = _compare(kernels, x, torch.rand(cols, generator=gen) + 0.5, torch.randn(3, cols, generator=gen))
        if problem:
            return f"{problem} ({cols} columns)"
    return (
        _compare_argmax(kernels, gen)
        or compare_decode_attention(kernels.paged_decode_attention, gen)
        or compare_prefill_attention(
            kernels.paged_prefill_attention_, gen, bf16_dot=kernels.paged_prefill_attention_bf16_dot()
        )
    )


def argmax_check_rows(gen: torch.Generator) -> torch.Tensor:
    """`[8, 1000]` float32 rows for checking `argmax_rows` against `torch.max`: random, a tie of the maximum (the
    first index must win), a NaN after the maximum and two NaNs (the first NaN wins), all -inf, +0 and -0 only, a
    maximum in the last value (past the vector loop), and an integer-valued row with many ties."""
    x = torch.randn(8, 1000, generator=gen)
    x[1, [17, 400]] = 9.0
    x[2, 5], x[2, 700] = 50.0, float("nan")
    x[3, [300, 20]] = float("nan")
    x[4] = float("-inf")
    x[5] = 0.0
    x[5, ::3] = -0.0
    x[6, 999] = 99.0
    x[7] = torch.randint(-3, 4, (1000,), generator=gen).float()
    return x


def _compare_argmax(kernels: RowKernels, gen: torch.Generator) -> str:
    x = argmax_check_rows(gen)
    for rows in (x, x[:, :7].contiguous(), x[:, :33].contiguous()):  # also shorter than, and just past, a vector
        if not torch.equal(kernels.argmax_rows(rows), rows.max(dim=-1).indices):
            return f"argmax_rows differs from torch.max ({rows.shape[1]} columns)"
    return ""


def _compare(kernels: RowKernels, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> str:
    def same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    scale = quantize_rows(x)[1]
    if not same(kernels.quantize_rows(x), quantize_rows(x)):
        return "quantize_rows differs from the eager quantization"
    if not torch.equal(kernels.add_scaled_(residual, x.clone(), scale), residual + x * scale):
        return "add_scaled_ differs from residual + out * scale"
    gate, up = (x * scale).chunk(2, dim=-1)
    if not same(kernels.silu_mul_quantize(x, scale), quantize_rows(F.silu(gate) * up)):
        return "silu_mul_quantize differs from the eager SiLU and quantization"
    normed = F.rms_norm(x, weight.shape, weight, 1e-5)
    if not torch.equal(kernels.rms_norm(x, weight, 1e-5), normed):
        return "rms_norm differs from F.rms_norm"
    if not same(kernels.rms_norm_quantize(x, weight, 1e-5), quantize_rows(normed)):
        return "rms_norm_quantize differs from F.rms_norm and the eager quantization"
    if not torch.equal(kernels.silu_mul(x), F.silu(x[:, : x.shape[1] // 2]) * x[:, x.shape[1] // 2 :]):
        return "silu_mul differs from F.silu(gate) * up"
    return _compare_rotary(kernels, x, scale, weight) or _compare_kv_stores(kernels, x)


def _compare_rotary(kernels: RowKernels, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> str:

    head_dim = 64 if x.shape[1] % 64 == 0 else 2  # some whole heads, some columns left unrotated (like V)
    heads = x.shape[1] // head_dim - 1
    cos, sin = torch.randn(2, x.shape[0], 1, head_dim, generator=torch.Generator().manual_seed(1))
    got = x.clone()
    kernels.scale_bias_rotate_(got, scale, bias, cos, sin, heads * head_dim)
    want = x * scale + bias
    want[:, : heads * head_dim] = apply_rotary(
        want[:, : heads * head_dim].view(x.shape[0], heads, -1), cos, sin
    ).flatten(1)
    return "" if torch.equal(got, want) else "scale_bias_rotate_ differs from scale, bias and apply_rotary"


def _compare_kv_stores(kernels: RowKernels, x: torch.Tensor) -> str:
    """The two K/V copies against torch's indexed writes, with rows taken from a wider tensor (strided rows)."""
    rows, heads, head_dim = x.shape[0], 2, 2
    key, value = (
        x[:, : heads * head_dim].view(rows, heads, head_dim),
        x[:, -heads * head_dim :].view(rows, heads, head_dim),
    )
    blocks, offsets = torch.arange(rows) * 2 % 5, torch.arange(rows) % 3
    for dtype in (torch.float32, torch.bfloat16):
        cache, want = torch.zeros(2, 5, 2, 3, heads, head_dim, dtype=dtype)
        kernels.store_kv_cache_(cache, key, value, blocks, offsets)
        want.permute(0, 2, 1, 3, 4)[blocks, offsets] = torch.stack((key, value), dim=1).to(dtype)  # write_kv_cache
        if not torch.equal(cache, want):
            return f"store_kv_cache_ differs from write_kv_cache ({dtype})"
    got, want = torch.zeros(2, 2, rows, 4, heads, head_dim)
    kernels.store_kv_rows_(got[0], got[1], key, value, offsets)
    want[0][torch.arange(rows), offsets], want[1][torch.arange(rows), offsets] = key, value
    return "" if torch.equal(got, want) else "store_kv_rows_ differs from indexed row writes"
