"""Linear weights kept as blocks of 32 quantized values (Q8_0, Q4_0, Q4_1) and their C++ kernels.

A `BlockQuantWeight` stores an `[in, out]` weight as blocks of 32 values along the input dimension, each with a
float16 scale d (and for Q4_1 a float16 minimum m): Q8_0 `w = d * q` (q int8, |q| <= 127), Q4_0 `w = d * (q - 8)`
(q 0..15), Q4_1 `w = d * q + m` (q 0..15). These are the block types of llama.cpp's GGUF files, with the same
dequantized values (`gguf.quants.dequantize`), so a GGUF file's own blocks can be kept as they are: the loader
hands them over as their bytes (`FileBlocks`, regrouped without dequantizing), and `from_values` finds them again
in dequantized values bit for bit. The products (`block_linear`, `csrc/block_quant.cpp`) quantize the input per row
and block of 32 to int8 (`dx = max |x| / 127`) and sum each block's integer products exactly (AMX int8 tiles,
AVX-512 VNNI, AVX2 or scalar: the best this CPU has, the same bits on each); 4.5-5 bits per Q4 weight value
instead of 32.

In memory (the layout `csrc/block_quant.h` documents): output columns in groups of 4 (the last zero-padded), each
group's blocks interleaved by block index, so a product reads 4 columns' blocks from one place and reuses them for
up to 4 rows (on AVX-512 VNNI the 1-5 row GEMV takes 4 neighbouring groups, 16 columns, per pass). From 6 rows
a GEMM unpacks each panel of columns (16 on AVX-512 VNNI, every kind; 8 on AVX2, Q4_0 and Q4_1) once per call into
int8 and sweeps every row over it (`csrc/block_quant.cpp`), with the same bits per row as the 1-row kernel. On the
"amx" path (a CPU with AMX-INT8 and Linux's permission for its tile data, asked at the first call;
`block_quant_amx_status` says why not, logged) products of 16 rows or more take the panels as AMX tiles: one tile
product per block of 32 (its exact int32 dots), then the same float32 steps per block.

Quantizing float weights (`quantize_blocks`) follows llama.cpp's rules: Q8_0 `d = max |w| / 127`; Q4_0 `d = -w* / 8`
for w* the block's value of largest magnitude (so it maps to q = 0); Q4_1 `m = min w`, `d = (max w - m) / 15`; the
scales rounded to float16 before the values are rounded to them. On values that came from blocks of the same type
these rules give those blocks back, which `from_values(exact=True)` checks bit for bit.

Checked at start-up (`block_kernels`): every path of this build against `reference_block_linear` (numpy, the same
float32 operations in the same order) on each kind; a path that differs is not used, and without any (no C++
compiler, `ASYNCLLM_FUSED_KERNELS=0`) the products dequantize each weight at each call, with a warning.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from asyncllm.engine_config import BLOCK_QUANTIZATIONS
from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels

logger = logging.getLogger(__name__)

BlockKind = Literal["q8_0", "q4_0", "q4_1"]
BLOCK = 32  # values per block
GROUP = 4  # output columns per interleaved group
KIND_CODES: dict[str, int] = {"q8_0": 0, "q4_0": 1, "q4_1": 2}
PATH_ENV = "ASYNCLLM_BLOCK_QUANT_PATH"
SELF_CHECK_ROWS = (1, 3, 9, 35)  # the GEMV, the vnni GEMM (from 6 rows), the AMX GEMM (from 16)
SLOW_FALLBACK = (
    "block-quantized products DEQUANTIZE EVERY WEIGHT AT EVERY CALL (much slower); install a C++ compiler "
    "(e.g. g++) and unset ASYNCLLM_FUSED_KERNELS=0"
)


class BlockShapeError(ValueError):
    """A weight cannot be stored in blocks of 32 (its input features are not a multiple of 32)."""


@dataclass
class BlockQuantWeight:
    """A linear weight `[in_features, out_features]` in blocks of 32 along the input dimension.

    Fields:
        kind: "q8_0", "q4_0" or "q4_1".
        in_features, out_features: the weight's shape (in a multiple of 32).
        qs: uint8 `[groups, in / 32, 4, 32]` (Q8_0: int8 values) or `[groups, in / 32, 4, 16]` (Q4: byte j holds
            value j in its low nibble, value j + 16 in its high one); groups = ceil(out / 4).
        d: float16 `[groups, in / 32, 4]` block scales.
        m: float16 `[groups, in / 32, 4]` block minimums (Q4_1), else None.
    """

    kind: BlockKind
    in_features: int
    out_features: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.in_features, self.out_features))

    @property
    def nbytes(self) -> int:
        """Bytes of this weight in memory (values, scales, minimums; the padding columns included)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def values(self, columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q int16 `[n, in / 32, 32]` (Q4: the stored 0..15, Q4_0's offset 8 not taken off), d float32
        `[n, in / 32]`, m float32 or None) of `columns` ([n] int64; None: all, in order)."""
        if columns is None:
            columns = torch.arange(self.out_features)
        groups, slot = columns // GROUP, columns % GROUP
        qs = self.qs[groups, :, slot]  # [n, nb, bytes]
        if self.kind == "q8_0":
            q = qs.view(torch.int8).to(torch.int16)
        else:
            q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int16)
        d = self.d[groups, :, slot].float()
        m = self.m[groups, :, slot].float() if self.m is not None else None
        return q, d, m

    def dequantize_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """The dequantized weight's `columns` ([n] int64) as rows: `[n, in_features]` float32 (an embedding lookup
        in a tied LM head), the values `gguf.quants.dequantize` gives for the same blocks: in one kernel call where
        the block kernels passed their check (`block_dequantize_columns`, the same bits), else in torch ops."""
        checked = block_kernels()
        if checked is not None:
            m = self.m if self.m is not None else _EMPTY_HALF
            kernels = checked[0]
            return kernels.block_dequantize_columns(
                self.qs, self.d, m, KIND_CODES[self.kind], self.in_features, columns.contiguous()
            )
        return self.reference_dequantize_columns(columns)

    def reference_dequantize_columns(self, columns: torch.Tensor) -> torch.Tensor:
        """`dequantize_columns` in torch ops (what the kernel is checked against)."""
        q, d, m = self.values(columns)
        if self.kind == "q8_0":
            w = q.float() * d[..., None]
        elif self.kind == "q4_0":
            w = (q - 8).float() * d[..., None]
        else:
            assert m is not None
            w = d[..., None] * q.float() + m[..., None]
        return w.reshape(len(columns), self.in_features)

    def dequantize(self) -> torch.Tensor:
        """`[in_features, out_features]` float32: the values the blocks stand for."""
        return self.dequantize_columns(torch.arange(self.out_features)).t().contiguous()


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def quantize_blocks(weight: torch.Tensor, kind: BlockKind) -> BlockQuantWeight:
    """An `[in, out]` float weight as blocks of `kind` (llama.cpp's rules, the module docstring).

    Raises:
        BlockShapeError: in_features is not a multiple of 32.
        ValueError: an unknown kind or a weight that is not 2-D.
    """
    if kind not in KIND_CODES:
        raise ValueError(f"unknown block kind {kind!r}: expected one of {sorted(KIND_CODES)}")
    if weight.dim() != 2:
        raise ValueError(f"a block weight is 2-D [in, out], not {tuple(weight.shape)}")
    in_features, out_features = weight.shape
    if in_features % BLOCK:
        raise BlockShapeError(f"a [{in_features}, {out_features}] weight cannot be stored in blocks of 32 inputs")
    nb = in_features // BLOCK
    w = weight.detach().float().t().reshape(out_features, nb, BLOCK)  # [out, nb, 32]
    m = None
    if kind == "q8_0":
        d = _fp16(w.abs().amax(-1) / 127)
        q = torch.where(d[..., None] > 0, torch.round(w / d[..., None]), 0).clamp_(-127, 127)
    elif kind == "q4_0":
        peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]
        d = _fp16(peak / -8)
        q = _q4_0_values(w, d)
    else:
        m = _fp16(w.amin(-1))
        d = _fp16((w.amax(-1) - m) / 15)
        q = torch.where(d[..., None] > 0, torch.round((w - m[..., None]) / d[..., None]), 0).clamp_(0, 15)
    return _pack(kind, in_features, out_features, q.to(torch.int16), d, m)


def _q4_0_values(w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return torch.where(d[..., None] != 0, torch.round(w / d[..., None]) + 8, 8).clamp_(0, 15)


def _pack(
    kind: BlockKind, in_features: int, out_features: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> BlockQuantWeight:
    """Integer values `[out, nb, 32]` and float scales `[out, nb]` into the grouped layout."""
    if kind == "q8_0":
        qs = q.to(torch.int8).view(torch.uint8)
    else:
        q = q.to(torch.uint8)
        qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return _grouped_weight(kind, in_features, qs, d.to(torch.float16), m.to(torch.float16) if m is not None else None)


def _grouped_weight(
    kind: BlockKind, in_features: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> BlockQuantWeight:
    """Packed bytes uint8 `[out, nb, 32 or 16]` and float16 scales (minimums) `[out, nb]` into the grouped layout."""
    out_features = qs.shape[0]
    groups = -(-out_features // GROUP)
    pad = groups * GROUP - out_features

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [out, nb, ...] -> [groups, nb, 4, ...]
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
        return t.reshape(groups, GROUP, *t.shape[1:]).transpose(1, 2).contiguous()

    minimums = grouped(m) if m is not None else None
    return BlockQuantWeight(kind, in_features, out_features, grouped(qs), grouped(d), minimums)


# GGUF block types with a kernel here, by `gguf.GGMLQuantizationType` value, and their bytes per block of 32.
GGUF_BLOCK_KINDS: dict[int, BlockKind] = {8: "q8_0", 2: "q4_0", 3: "q4_1"}
GGUF_BLOCK_BYTES: dict[BlockKind, int] = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


@dataclass
class FileBlocks:
    """A weight's blocks as a GGUF file stores them: one row per output, each row's blocks along the input.

    A Q8_0 block is 34 bytes (float16 d, 32 int8 values), Q4_0 18 (float16 d, 16 bytes of nibbles: byte j holds
    value j low and value j + 16 high), Q4_1 20 (float16 d, float16 m, 16 bytes of nibbles): ggml's `block_q8_0`,
    `block_q4_0`, `block_q4_1`, the same packing `BlockQuantWeight` keeps (so `to_weight` only regroups bytes).
    Rows can be permuted, split and concatenated like an `[out, in]` tensor's (`raw`'s first dim).

    Fields:
        kind: "q8_0", "q4_0" or "q4_1".
        raw: uint8 `[out, in / 32, bytes per block]`, the file's bytes.
    """

    kind: BlockKind
    raw: torch.Tensor

    @property
    def in_features(self) -> int:
        return int(self.raw.shape[1]) * BLOCK

    def dequantize(self) -> torch.Tensor:
        """`[out, in]` float32: `gguf.quants.dequantize` of the bytes (what a float load of the file gives)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        code = next(c for c, kind in GGUF_BLOCK_KINDS.items() if kind == self.kind)
        rows = self.raw.reshape(self.raw.shape[0], -1).numpy()
        return torch.from_numpy(np.array(dequantize(rows, GGMLQuantizationType(code)), dtype=np.float32))

    def to_weight(self) -> BlockQuantWeight:
        """The same blocks as a `BlockQuantWeight` (`[in, out]`), without dequantizing: the bytes regrouped. A block
        of scale 0 (all its values zero) is written as `quantize_blocks` writes one (Q8_0 / Q4_1: q = 0, d = +0, a
        zero m +0; Q4_0: q = 8, d = -(its first value) / 8, a signed zero), so the blocks are bit for bit the ones
        `from_values` finds in the dequantized values."""
        header = 4 if self.kind == "q4_1" else 2

        def halves(start: int) -> torch.Tensor:  # float16 [out, nb] from 2 bytes per block
            return self.raw[..., start : start + 2].contiguous().view(torch.float16)[..., 0]

        qs, d = self.raw[..., header:], halves(0)
        minimums = halves(2) if self.kind == "q4_1" else None
        zero = d == 0
        if bool(zero.any()):
            qs, d = qs.clone(), d.clone()
            if self.kind == "q4_0":
                first = (qs[..., 0] & 15).float() - 8  # the block's first value over d: the one of largest |w|
                d[zero] = (d.float() * first / -8).to(torch.float16)[zero]
            else:
                d[zero] = 0.0  # +0
            qs[zero] = 0x88 if self.kind == "q4_0" else 0
            if minimums is not None:
                minimums = torch.where(minimums == 0, 0.0, minimums).to(torch.float16)
        return _grouped_weight(self.kind, self.in_features, qs, d, minimums)

    @staticmethod
    def concat(parts: list[FileBlocks]) -> FileBlocks | None:
        """The parts' rows in order as one weight, or None when their kinds or input widths differ."""
        if len({(p.kind, p.in_features) for p in parts}) != 1:
            return None
        return FileBlocks(parts[0].kind, torch.cat([p.raw for p in parts]))


def from_values(weight: torch.Tensor, kind: BlockKind) -> BlockQuantWeight | None:
    """The blocks of `kind` whose dequantized values are exactly `weight` ([in, out] float32, e.g. a GGUF tensor of
    that type dequantized by `gguf.quants.dequantize`), or None when `quantize_blocks` does not give them back bit
    for bit (values that did not come from llama.cpp-style blocks of this kind)."""
    probe = weight[:, :GROUP]  # most values of another type fail here already, at a fraction of the cost
    if not torch.equal(quantize_blocks(probe, kind).dequantize(), probe.float()):
        return None
    blocks = quantize_blocks(weight, kind)
    return blocks if torch.equal(blocks.dequantize(), weight.float()) else None


# --- the engine's quantization modes -------------------------------------------------------------------------------

BLOCK_MODES = BLOCK_QUANTIZATIONS  # `EngineArgs.quantization` values that store weights in blocks
GGUF_KEPT_ORDER: tuple[BlockKind, ...] = ("q4_0", "q4_1", "q8_0")  # smallest first


def block_weight_for(weight: torch.Tensor, mode: str, lm_head: bool = False) -> tuple[BlockQuantWeight, str]:
    """An `[in, out]` float32 weight as blocks for `EngineArgs.quantization=mode`, and how ("kept q4_1",
    "quantized q4_0", "requantized q8_0").

    "q8_0" / "q4_0" quantize the weight; "q4_0" keeps the LM head (`lm_head=True`; in a tied model also the
    embeddings) at Q8_0, as llama.cpp's Q4_0 files do (on the real SmolLM2 a Q4_0 head took top-1 agreement with
    fp32 to 48-55%, a Q8_0 one to 55-59%: that file is Q4_1 already, and Q4_0 on Q4_1 values rounds twice; "gguf"
    keeps it at 95%). A per-block scale search (16 scales, least squared error) gained little (58-68%) for 10x the
    load time and is not used. "gguf" keeps the block type whose blocks give exactly these values (a GGUF
    file's Q4_0, Q4_1 or Q8_0 tensor, dequantized at load, is found again bit for bit: `from_values`), the smallest
    first; values that are no such blocks (a GGUF type without a kernel here: Q4_K, Q5_0, Q6_K, ...; a fused weight
    whose parts have different types; a float checkpoint) are requantized to Q8_0.

    Raises:
        BlockShapeError: in_features is not a multiple of 32.
        ValueError: an unknown mode.
    """
    if mode == "gguf":
        for kind in GGUF_KEPT_ORDER:
            blocks = from_values(weight, kind)
            if blocks is not None:
                return blocks, f"kept {kind}"
        return quantize_blocks(weight, "q8_0"), "requantized q8_0"
    if mode not in ("q8_0", "q4_0"):
        raise ValueError(f"unknown block quantization mode {mode!r}: expected one of {BLOCK_MODES}")
    chosen: BlockKind = "q8_0" if mode == "q8_0" or lm_head else "q4_0"
    return quantize_blocks(weight, chosen), f"quantized {chosen}"


# --- products ---------------------------------------------------------------------------------------------------


def block_linear(x: torch.Tensor, weight: BlockQuantWeight, path: str | None = None) -> torch.Tensor:
    """`x @ W` for `[rows, in]` float32 `x` -> `[rows, out]` float32 on the C++ kernels (`path`: "amx", "vnni",
    "avx2", "scalar" or None for the checked best; `ASYNCLLM_BLOCK_QUANT_PATH` forces one for the process), else by
    dequantizing the weight (logged once).

    Raises:
        RuntimeError: a forced path this build does not have.
    """
    chosen = block_kernels()
    if chosen is None:
        return x @ weight.dequantize()
    kernels, best = chosen
    m = weight.m if weight.m is not None else _EMPTY_HALF
    return kernels.block_linear(
        x.contiguous(), weight.qs, weight.d, m, KIND_CODES[weight.kind], weight.out_features, path or best
    )


_EMPTY_HALF = torch.empty(0, dtype=torch.float16)
PROLOGUES: dict[str, int] = {"none": 0, "rms_norm": 1, "silu_mul": 2}


def fused_block_linear(
    kernels: RowKernels,
    path: str,
    x: torch.Tensor,
    weight: BlockQuantWeight,
    prologue: Literal["none", "rms_norm", "silu_mul"] = "none",
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """One kernel call for `block_linear(p(x), weight) + residual` on a checked path (`block_kernels()`'s module
    and path): p is nothing, `rms_norm(x, norm_weight, eps)` ([hidden] float32 weight) or `silu_mul(x)` ([rows,
    2 * inter] gate/up), `residual` `[rows, out]` float32 or None. The same bits as the separate calls: the batch-1
    block layer's 4 products in 4 calls instead of 9. `x` `[rows, in]` float32 contiguous; -> `[rows, out]` float32.

    Raises:
        RuntimeError: shapes or dtypes the kernels refuse.
    """
    m = weight.m if weight.m is not None else _EMPTY_HALF
    return kernels.block_linear_fused(
        x, PROLOGUES[prologue], norm_weight, eps, residual, weight.qs, weight.d, m, KIND_CODES[weight.kind],
        weight.out_features, path,
    )  # fmt: skip


@functools.cache
def block_kernels() -> tuple[RowKernels, str] | None:
    """(the compiled module, the path its products run on) after the start-up check, or None (logged) where the
    kernels are not built or no path agrees with `reference_block_linear`. `ASYNCLLM_BLOCK_QUANT_PATH` forces a
    path (which must agree). Never raises."""
    import os

    kernels = load_kernels()
    if kernels is None:
        logger.warning("no block-quantized kernels (the fused kernels are off or did not build); %s", SLOW_FALLBACK)
        return None
    module = kernels
    paths = list(module.block_quant_paths())
    if "amx" not in paths:
        # the CPU flags AMX yet Linux refused its tile data: worth a warning; no AMX at all is the common case
        level = logging.WARNING if "refused" in (why := module.block_quant_amx_status()) else logging.INFO
        logger.log(level, "no AMX block-quantized path: %s", why)
    forced = os.environ.get(PATH_ENV)
    if forced:
        if forced not in paths:
            logger.warning("%s=%s is not a path of this build (%s); checking the others", PATH_ENV, forced, paths)
        else:
            paths = [forced]
    for path in paths:
        problem = self_check(module, path)
        if not problem:
            logger.info("block-quantized kernels in use: %s path (this build has %s)", path, ", ".join(paths))
            return module, path
        logger.warning("block-quantized kernel path %r failed its self-check (%s); not used", path, problem)
    logger.warning("no block-quantized kernel path passed its self-check; %s", SLOW_FALLBACK)
    return None


def self_check(module: RowKernels, path: str) -> str:
    """ "" when `path` gives `reference_block_linear`'s values bit for bit on every kind (1, 3, 9 and 35 rows of a
    random 96 x 37 weight with a zero block and an input block of zeros: on "vnni" 9 rows take the many-row GEMM,
    a full tile and a part one, on "amx" 35 rows the AMX GEMM, 2 full row tiles and a part one; 37 columns a tile
    of 2 panels and a part panel) and `block_dequantize_columns` gives the torch ops' values
    (`reference_dequantize_columns`, 5 columns), else what differs."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 37, generator=generator)
    weight[32:64, 3] = 0.0
    for kind in KIND_CODES:
        blocks = quantize_blocks(weight, kind)  # type: ignore[arg-type]
        for rows in SELF_CHECK_ROWS:
            x = torch.randn(rows, 96, generator=generator) * 3
            x[0, :32] = 0.0
            m = blocks.m if blocks.m is not None else _EMPTY_HALF
            got = module.block_linear(x, blocks.qs, blocks.d, m, KIND_CODES[kind], 37, path)
            if not torch.equal(got, reference_block_linear(x, blocks)):
                return f"{kind}, {rows} rows"
        columns = torch.tensor([36, 0, 3, 5, 3])
        got = module.block_dequantize_columns(blocks.qs, blocks.d, m, KIND_CODES[kind], 96, columns)
        if not torch.equal(got, blocks.reference_dequantize_columns(columns)):
            return f"{kind}, dequantized columns"
    return ""


def reference_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[rows, in]` float32 -> (q int64 `[rows, nb, 32]`, d float32 `[rows, nb]`, s int64 `[rows, nb]`): per block
    of 32, d = max |x| / 127 and q = round_half_even(x / d) (0 where d == 0), s the sum of q."""
    blocks = np.asarray(x, dtype=np.float32).reshape(x.shape[0], -1, BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d).astype(np.float32)
    q = np.where(d[..., None] == 0, 0, np.rint(blocks / safe[..., None])).astype(np.int64)
    return q, d, q.sum(axis=-1)


def reference_block_linear(x: torch.Tensor, weight: BlockQuantWeight) -> torch.Tensor:
    """What every kernel path computes, in numpy: exact integer block sums, then per block in order
    `acc += float(dot) * (dw * dx)` (Q8_0), `float(dot - 8 s) * (dw * dx)` (Q4_0),
    `float(dot) * (dw * dx) + (mw * dx) * float(s)` (Q4_1), all float32. `[rows, out]` float32."""
    qx, dx, sx = reference_quantize_rows(x.numpy())
    q_t, d_t, m_t = weight.values()
    q, d = q_t.numpy().astype(np.int64), d_t.numpy()  # [out, nb, 32], [out, nb]
    m = m_t.numpy() if m_t is not None else None
    dots = np.einsum("rbj,obj->rob", qx, q)  # exact int64 [rows, out, nb]
    if weight.kind == "q4_0":
        dots = dots - 8 * sx[:, None, :]
    acc = np.zeros((x.shape[0], weight.out_features), dtype=np.float32)
    for b in range(q.shape[1]):
        scale = (d[None, :, b] * dx[:, None, b]).astype(np.float32)
        term = (dots[:, :, b].astype(np.float32) * scale).astype(np.float32)
        if weight.kind == "q4_1":
            assert m is not None
            term = term + ((m[None, :, b] * dx[:, None, b]).astype(np.float32) * sx[:, None, b].astype(np.float32))
        acc = (acc + term).astype(np.float32)
    return torch.from_numpy(acc)
