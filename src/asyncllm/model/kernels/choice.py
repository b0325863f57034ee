"""Which kernel runs each linear product on this host, chosen by measurement.

A linear product (`[rows, in] @ [in, out]`) has several implementations, the candidates of its kind: for int8
weights oneDNN's prepacked kernel, `torch._int_mm` and our AVX2 kernel (`model/kernels/int8.py`); for float32
weights `x @ W`, MKL's packed GEMM and oneDNN's reordered weights (`model/kernels/fp32.py`). Which one is fastest
depends on the CPU, its ISA, the libraries and the row count, and an exact kernel can still be the wrong choice: on
CPUs with AVX-512 VNNI but no AMX (AMD EPYC) oneDNN runs its reference kernel for int8 activations, 100x slower than
float32 (docs/kernels.md). So, for each weight shape, the first time it is asked for on a host, `KernelChooser`:

1. runs every available candidate on a random weight of that shape at each timed row count, against an exact
   reference (float64 sums); a candidate that disagrees is never used in this process (a warning says so);
2. times the candidates that agree, interleaved, at one row count per row class (`ROW_CLASSES`), best of several
   passes over copies of the weight (`STREAM_BYTES` of them, so the weights come from memory as in a step, not
   from the CPU's caches); a candidate `SLOW_FACTOR` times slower than the best is not timed again in this process;
3. picks per row class the fastest; within the kind's `tie_margin` of it, the candidate earlier in its order wins;
   and a weight keeps at most one copy of its own beside the plain weight (`pick_kernels`): where the picks need two
   packed layouts (on an AMD EPYC, MKL's for some row classes and oneDNN's for others: 2.4 GB instead of 1.8 for
   the default model in float32), the layout whose row classes lose least keeps its classes and the others take
   the best of it and the candidates that use the plain weight; but the 1-row class keeps its own pick where that is
   `ONE_ROW_COPY_GAIN` faster (batch-1 decoding).

Choices are kept in a JSON file beside the built kernels (`$XDG_CACHE_HOME/asyncllm/kernels/`), one file per host
fingerprint (CPU model and flags, torch, oneDNN and MKL versions, torch threads, the kind's available candidates, a
digest of asyncllm's C++ kernel sources), so later starts on the same host measure nothing and a different CPU,
library or kernel code measures again. A choice measured
while other processes kept the CPUs busy (timings then say little) is measured again at a start that finds the
machine quiet. A user forces one
kernel per kind with `EngineArgs(linear_kernels={"int8": "int_mm"})` or `ASYNCLLM_LINEAR_KERNELS="int8=int_mm"`
(the engine argument wins); a forced kernel that is missing here or disagrees with the reference is a `ConfigError`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from asyncllm.engine_config import LINEAR_KERNEL_ENV, parse_linear_kernels
from asyncllm.errors import ConfigError
from asyncllm.model.kernels.choice_cache import ChoiceCache, host_fingerprint, kernel_cache_dir
from asyncllm.model.kernels.row_kernels import kernel_sources_digest
from asyncllm.utils.cpu_load import OtherCpuLoad

logger = logging.getLogger(__name__)

# (first, last) rows of each class; None: no limit. 512+ is a prefill chunk's class: on a Xeon (fam 6 model 167), one
# thread, `x @ W` ran a layer's four fp32 products 7.5% faster than `mkl_packed` at 1024 rows (50.1 vs 54.2 ms; 1536x576
# 20% faster), while at 128 rows `mkl_packed` was 17% faster and at 256-512 they tied: one class for 65+ rows, timed
# at 128, gave prefill chunks the kernel of small batches.
# 2-8 and 9-16 are two classes since the float32 GEMV (`fp32.py`) reads its weight once per 8 rows: 23.6 ms against
# oneDNN's 30.7 for 30 layers' products at 8 rows on an AMD EPYC (family 25 model 17, 2 threads), 50 against 39 at 16.
ROW_CLASSES = ((1, 1), (2, 8), (9, 16), (17, 64), (65, 511), (512, None))
TIMED_ROWS = (1, 8, 16, 32, 128, 1024)  # the row count each class is timed at (its last row below 512)
LARGE_ROWS = 512  # from this many rows a product reads each weight value this often: timed over one weight copy
ONE_ROW_COPY_GAIN = 0.15  # the 1-row class keeps a second packed copy of a weight when it is this much faster
SLOW_FACTOR = 10.0  # a candidate this much slower than the best is not timed again (a reference kernel)
SLOW_MIN_S = 0.002  # ... and at least this much slower in seconds, so timer noise on tiny products drops nothing
TIME_BUDGET_S = 0.03  # seconds of products per candidate and row count, at least `MIN_CALLS` passes
STREAM_BYTES = 32 << 20  # a timing pass goes over this many bytes of weights of one shape (past the L2 caches)
MAX_COPIES = 16
MIN_CALLS, MAX_CALLS = 3, 25
BUSY_CPUS = 0.3  # other processes' average CPU use during a measurement above which it is measured again later
BUSY_PROBE_S = 0.2  # seconds of looking at the machine's load before a busy measurement is used again

W = TypeVar("W")


def row_class(rows: int) -> int:
    """The index in `ROW_CLASSES` of a product of `rows` rows (>= 1)."""
    return next(index for index, (_, last) in enumerate(ROW_CLASSES) if last is None or rows <= last)


@dataclass(frozen=True)
class Candidate(Generic[W]):
    """One implementation of a kind of product.

    Fields:
        name: its name in `EngineArgs.linear_kernels`, the cache and the log.
        available: whether this build and CPU have it (cheap after the first call; never raises).
        prepare: the kind's plain weight -> this kernel's operand (packed once per weight at load).
        run: (`[rows, in]` input, operand) -> `[rows, out]` float32.
        copies_weight: whether `prepare` makes a copy of the weight (a packed layout: memory), rather than handing
            on the plain weight itself.
        max_rows: the kernel is timed and picked only for the row classes that end at or below this many rows
            (a matrix-vector kernel, right for any row count but slow for many); None: every class.
    """

    name: str
    available: Callable[[], bool]
    prepare: Callable[[W], Any]
    run: Callable[[torch.Tensor, Any], torch.Tensor]
    copies_weight: bool = True
    max_rows: int | None = None

    def serves(self, class_index: int) -> bool:
        """Whether this kernel is offered for row class `class_index` (`ROW_CLASSES`)."""
        last = ROW_CLASSES[class_index][1]
        return self.max_rows is None or (last is not None and last <= self.max_rows)


@dataclass(frozen=True)
class ProductKind(Generic[W]):
    """A kind of product (int8 or float32 weights) with its candidates and an exact reference.

    Fields:
        name: "int8" or "fp32".
        candidates: in order of preference on ties.
        make_weight: (in_features, out_features, generator) -> a random plain weight of that shape.
        make_input: (rows, in_features, generator) -> a random `[rows, in]` input of the kind.
        reference: (input, plain weight, [k] int64 output columns) -> `[rows, k]` float32 of those columns,
            computed with exact (float64) sums.
        agrees: (output, reference) -> whether a candidate's output is right (exactly, or within float32 rounding).
        out_features: a plain weight's output columns.
        itemsize: bytes per weight value (4 for float32, 1 for int8).
        tie_margin: a candidate this close to the fastest (fraction) wins if it comes earlier in `candidates`.
    """

    name: str
    candidates: tuple[Candidate[W], ...]
    make_weight: Callable[[int, int, torch.Generator], W]
    make_input: Callable[[int, int, torch.Generator], torch.Tensor]
    reference: Callable[[torch.Tensor, W, torch.Tensor], torch.Tensor]
    agrees: Callable[[torch.Tensor, torch.Tensor], bool]
    out_features: Callable[[W], int]
    itemsize: int
    tie_margin: float = 0.03


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of each row class for one weight shape.

    Fields:
        kind: "int8" or "fp32".
        shape: (in_features, out_features).
        kernels: a candidate name per row class (`ROW_CLASSES`).
        how: "measured", "cached" (measured by an earlier start on this host) or "forced" (and by what).
        times_ms: per row class, the best time of each candidate timed, in milliseconds (empty when forced).
        busy_cpus: the CPUs other processes kept busy while it was measured (0.0 when unknown or forced).
    """

    kind: str
    shape: tuple[int, int]
    kernels: tuple[str, ...]
    how: str
    times_ms: tuple[dict[str, float], ...] = ()
    busy_cpus: float = 0.0

    def kernel_for(self, rows: int) -> str:
        """The candidate name that runs a product of `rows` rows."""
        return self.kernels[row_class(rows)]

    def describe(self) -> str:
        """`576x960: 1 onednn (0.05 ms; int_mm 0.07), 2-16 ...` for the start-up log."""
        parts = []
        for index, ((first, last), name) in enumerate(zip(ROW_CLASSES, self.kernels, strict=True)):
            rows = str(first) if first == last else f"{first}-{last}" if last else f"{first}+"
            times = self.times_ms[index] if self.times_ms else {}
            others = ", ".join(f"{n} {t:.3g}" for n, t in sorted(times.items(), key=lambda kv: kv[1]) if n != name)
            timing = f" ({times[name]:.3g} ms{'; ' + others if others else ''})" if name in times else ""
            parts.append(f"{rows} {name}{timing}")
        return f"{self.shape[0]}x{self.shape[1]}: " + ", ".join(parts)

    @property
    def cache_name(self) -> str:
        return cache_name(self.kind, self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"kernels": list(self.kernels), "times_ms": list(self.times_ms), "busy_cpus": self.busy_cpus}

    @classmethod
    def from_json(cls, kind: str, shape: tuple[int, int], entry: Mapping[str, Any]) -> KernelChoice | None:
        """The choice a cache entry holds ("cached"), or None for an entry of another form."""
        try:
            kernels = tuple(str(name) for name in entry["kernels"])
            times = tuple({str(k): float(v) for k, v in t.items()} for t in entry["times_ms"])
            busy_cpus = float(entry["busy_cpus"])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if len(kernels) != len(ROW_CLASSES):
            return None
        how = f"cached, measured beside {busy_cpus:.1f} busy CPUs" if busy_cpus > BUSY_CPUS else "cached"
        return cls(kind, shape, kernels, how, times, busy_cpus)


def cache_name(kind: str, shape: tuple[int, int]) -> str:
    """A choice's name in the cache file: "int8 576x960"."""
    return f"{kind} {shape[0]}x{shape[1]}"


class KernelChooser(Generic[W]):
    """Chooses, caches and reports the kernel of each row class for the weight shapes of one kind of product.

    Args:
        kind: the product kind and its candidates.
        forced: a candidate name to run every product of this kind, or None to measure.
        cache_dir: where the choices file lives; None: `kernel_cache_dir()`. The file is skipped (measured every
            start) where the directory cannot be written.
        fingerprint: the host description the cache is keyed by; None: `host_fingerprint()`.
        other_load: measures the CPUs other processes keep busy from its creation on (`OtherCpuLoad`). A shape
            measured while they used more than `BUSY_CPUS` is cached as such, and measured again at a later start
            when the machine is quiet then (a `BUSY_PROBE_S` look at its load, once per process).
    Raises:
        ConfigError: `forced` names a candidate this kind does not have or that is not available here.
    """

    def __init__(
        self,
        kind: ProductKind[W],
        forced: str | None = None,
        cache_dir: pathlib.Path | None = None,
        fingerprint: Mapping[str, str] | None = None,
        other_load: Callable[[], OtherCpuLoad] | None = None,
    ) -> None:
        self.kind = kind
        self.other_load = other_load or OtherCpuLoad
        self.available = tuple(c for c in kind.candidates if c.available())
        if not self.available:
            raise ConfigError(f"no {kind.name} linear kernel is available in this torch build")
        self.forced = forced
        if self.forced is not None and self.forced not in {c.name for c in self.available}:
            known = ", ".join(c.name for c in kind.candidates)
            raise ConfigError(
                f"linear kernel {kind.name}={self.forced!r} is not available on this host (kernels of {kind.name}: "
                f"{known}; available here: {', '.join(c.name for c in self.available)})"
            )
        key = {**(fingerprint or host_fingerprint()), "kind": kind.name}
        key["candidates"] = ",".join(c.name for c in self.available)
        key["kernel_sources"] = kernel_sources_digest()  # our C++ kernels' code: changed code is timed again
        self.cache = ChoiceCache(cache_dir or kernel_cache_dir(), key)
        self.choices: dict[tuple[int, int], KernelChoice] = {}
        self._busy_now: bool | None = None  # the machine's load at a look before using a busy measurement
        self._dropped: set[str] = set()  # wrong or pathologically slow here: never run again in this process

    def choose(self, in_features: int, out_features: int) -> KernelChoice:
        """The kernel of each row class for an `[in_features, out_features]` weight (measured once per host).

        Raises:
            ConfigError: the forced kernel disagrees with the exact reference on this shape.
        """
        shape = (in_features, out_features)
        if shape not in self.choices:
            if self.forced is not None:
                self.choices[shape] = self._forced(shape, self.forced)
            else:
                self.choices[shape] = self._cached(shape) or self._measure(shape)
        return self.choices[shape]

    def prepare(self, weight: W, choice: KernelChoice) -> dict[str, Any]:
        """The operand of each kernel `choice` runs, prepared from the plain `weight` (name -> operand)."""
        return prepare_operands(self.kind, weight, choice.kernels)

    @functools.cached_property
    def _by_name(self) -> dict[str, Candidate[W]]:
        return {c.name: c for c in self.available}

    def describe(self) -> str:
        """One log line: which kernel runs each product of this kind, per row class, and why."""
        if not self.choices:
            return f"{self.kind.name} linear kernels: no product chosen yet"
        hows = ", ".join(sorted({c.how.split(",")[0].split(" beside")[0] for c in self.choices.values()}))
        busy = max(c.busy_cpus for c in self.choices.values())
        if busy > BUSY_CPUS:
            hows += f"; beside up to {busy:.1f} busy CPUs"
        shapes = "; ".join(c.describe() for c in self.choices.values())
        return f"{self.kind.name} linear kernels ({hows}; {self.cache.path}): {shapes}"

    def _forced(self, shape: tuple[int, int], name: str) -> KernelChoice:
        if self._disagreeing(shape, self._by_name[name]):
            raise ConfigError(
                f"the forced linear kernel {self.kind.name}={name!r} gives wrong results for a "
                f"{shape[0]}x{shape[1]} weight here (see the warning above); choose another or none"
            )
        return KernelChoice(self.kind.name, shape, (name,) * len(ROW_CLASSES), "forced")

    def _cached(self, shape: tuple[int, int]) -> KernelChoice | None:
        """The cached choice, unless it names a kernel missing here or was measured beside busy processes while the
        machine is quiet now (then it is measured again)."""
        entry = self.cache.get(cache_name(self.kind.name, shape))
        choice = KernelChoice.from_json(self.kind.name, shape, entry) if entry is not None else None
        if choice is None or any(name not in self._by_name for name in choice.kernels):
            return None
        if choice.busy_cpus > BUSY_CPUS and not self._machine_busy():
            return None
        return choice

    def _machine_busy(self) -> bool:
        if self._busy_now is None:
            load = self.other_load()
            time.sleep(BUSY_PROBE_S)
            self._busy_now = (load.cpus() or 0.0) > BUSY_CPUS
        return self._busy_now

    def _measure(self, shape: tuple[int, int]) -> KernelChoice:
        """Check, time and pick per row class; store the choice in the cache."""
        other_load = self.other_load()
        generator = torch.Generator().manual_seed(0)
        candidates = [c for c in self.available if c.name not in self._dropped]
        names = [c.name for c in candidates]
        weights = [self.kind.make_weight(*shape, generator) for _ in range(num_copies(shape, self.kind.itemsize))]
        copies = [prepare_operands(self.kind, w, names) for w in weights]
        times = []
        for index, rows in enumerate(TIMED_ROWS):
            x = self.kind.make_input(rows, shape[0], generator)
            live = [c for c in candidates if c.name not in self._dropped and c.serves(index)]
            best = self._time_row_class(x, weights[0], live, copies if rows < LARGE_ROWS else copies[:1])
            times.append(best)
        kernels = pick_kernels(self.kind, times)
        busy_cpus = other_load.cpus() or 0.0
        how = f"measured beside {busy_cpus:.1f} busy CPUs" if busy_cpus > BUSY_CPUS else "measured"
        choice = KernelChoice(self.kind.name, shape, tuple(kernels), how, tuple(times), round(busy_cpus, 2))
        self.cache.put(choice.cache_name, choice.to_json())
        return choice

    def _time_row_class(
        self, x: torch.Tensor, weight: W, candidates: list[Candidate[W]], copies: list[dict[str, Any]]
    ) -> dict[str, float]:
        """Best time in ms of one product of each candidate that agrees with the reference on `x` (`weight`, whose
        operands are `copies[0]`); drops the ones that disagree or are `SLOW_FACTOR` times slower than the fastest.
        A timed call is a pass over all `copies`, as a step passes over its layers' weights."""
        agreeing = [c for c in candidates if self._agrees(c, x, weight, copies[0][c.name])]  # also the warm-up
        if not agreeing:
            raise ConfigError(f"every {self.kind.name} linear kernel disagrees with the exact reference here")
        for c in agreeing:  # first calls of the other copies (a kernel's first call of a shape may build it)
            _time_pass(c.run, x, [operands[c.name] for operands in copies[1:]])
        best = {c.name: math.inf for c in agreeing}
        for call in range(MAX_CALLS):  # interleaved, so a slow spell of the machine falls on every candidate alike
            for c in agreeing:
                best[c.name] = min(best[c.name], _time_pass(c.run, x, [operands[c.name] for operands in copies]))
            if call + 1 >= MIN_CALLS and (call + 1) * len(copies) * sum(best.values()) >= TIME_BUDGET_S:
                break
        fastest = min(best.values())
        for name, seconds in best.items():
            if seconds > SLOW_FACTOR * fastest and seconds - fastest > SLOW_MIN_S:
                logger.warning(
                    "%s linear kernel %r is %.0fx slower than the fastest here (%.1f vs %.3f ms, %d rows of %dx%d); "
                    "not used", self.kind.name, name, seconds / fastest, seconds * 1e3, fastest * 1e3, x.shape[0],
                    x.shape[1], self.kind.out_features(weight),
                )  # fmt: skip
                self._dropped.add(name)
        return {name: seconds * 1e3 for name, seconds in best.items() if name not in self._dropped}

    def _agrees(self, candidate: Candidate[W], x: torch.Tensor, weight: W, operand: Any) -> bool:
        """Whether `candidate` gives the reference's values on `x` (on `check_columns` of the output); one that
        does not is dropped for this process, with a warning."""
        out = candidate.run(x, operand)
        columns = check_columns(out.shape[1])
        if self.kind.agrees(out[:, columns], self.kind.reference(x, weight, columns)):
            return True
        logger.warning(
            "%s linear kernel %r disagrees with the exact reference (%d rows of %dx%d); it will not be used",
            self.kind.name, candidate.name, x.shape[0], x.shape[1], out.shape[1],
        )  # fmt: skip
        self._dropped.add(candidate.name)
        return False

    def _disagreeing(self, shape: tuple[int, int], candidate: Candidate[W]) -> bool:
        """Whether `candidate` disagrees with the reference at any timed row count on a random weight of `shape`."""
        generator = torch.Generator().manual_seed(0)
        weight = self.kind.make_weight(*shape, generator)
        operand = candidate.prepare(weight)
        inputs = (self.kind.make_input(rows, shape[0], generator) for rows in TIMED_ROWS)
        return not all(self._agrees(candidate, x, weight, operand) for x in inputs)


def pick_kernels(kind: ProductKind[W], times_ms: list[dict[str, float]]) -> tuple[str, ...]:
    """The kernel of each row class from its candidates' times (ms, one dict per row class): the fastest, or within
    the kind's `tie_margin` of it the one earlier in `kind.candidates`; then at most one candidate that copies the
    weight (`Candidate.copies_weight`). When the picks name two or more such candidates, each in turn keeps its row
    classes while the other classes pick again among it and the candidates that use the plain weight; the one whose
    picks sum the least time relative to each class's fastest wins (the earlier in `kind.candidates` on a tie).
    The 1-row class (batch-1 decoding: every token of a lone stream) keeps its own pick, and so a second copy, where
    that is over `ONE_ROW_COPY_GAIN` faster than what the kept layout leaves it (an LM head's GEMV on the AMD EPYC:
    MKL's packed 22.7 ms against 29.1 for Gemma 3's 640 x 262,144 head)."""
    picks = tuple(_pick(kind, times) for times in times_ms)
    copying = {c.name for c in kind.candidates if c.copies_weight}
    packed = [c.name for c in kind.candidates if c.name in set(picks) & copying]
    if len(packed) < 2:
        return picks
    options = []
    for keep in packed:
        allowed = [{n: ms for n, ms in times.items() if n == keep or n not in copying} for times in times_ms]
        if all(allowed):
            choice = tuple(_pick(kind, times) for times in allowed)
            options.append((sum(t[n] / min(t.values()) for t, n in zip(times_ms, choice, strict=True)), choice))
    if not options:
        return picks
    kept = min(options, key=lambda option: option[0])[1]
    if times_ms[0][kept[0]] > (1 + ONE_ROW_COPY_GAIN) * times_ms[0][picks[0]]:
        return (picks[0], *kept[1:])
    return kept


def _pick(kind: ProductKind[W], times_ms: dict[str, float]) -> str:
    fastest = min(times_ms.values())
    order = [c.name for c in kind.candidates if c.name in times_ms]
    return next(name for name in order if times_ms[name] <= fastest * (1 + kind.tie_margin))


def check_columns(out_features: int) -> torch.Tensor:
    """The output columns a kernel is checked on: the first and last 64 and every k-th between (about 256 more),
    so a product's every column chunk is seen while the float64 reference stays cheap. [num_checked] int64."""
    stride = max(1, out_features // 256)
    picked = {*range(min(64, out_features)), *range(max(0, out_features - 64), out_features)}
    picked.update(range(0, out_features, stride))
    return torch.tensor(sorted(picked), dtype=torch.int64)


def prepare_operands(kind: ProductKind[W], weight: W, names: Iterable[str]) -> dict[str, Any]:
    """The operand of each named candidate of `kind`, prepared from the plain `weight`; candidates with the same
    `prepare` share one operand (`x @ W` and the plain weight kept beside a packed one are the same tensor)."""
    by_name = {c.name: c for c in kind.candidates}
    prepared: dict[Callable[[W], Any], Any] = {}
    operands = {}
    for name in dict.fromkeys(names):
        prepare = by_name[name].prepare
        if prepare not in prepared:
            prepared[prepare] = prepare(weight)
        operands[name] = prepared[prepare]
    return operands


def num_copies(shape: tuple[int, int], itemsize: int) -> int:
    """How many weights of `shape` a timing pass goes over: enough for `STREAM_BYTES` (a step streams its layers'
    weights from memory; one weight timed again and again would sit in the CPU's caches), 1 to `MAX_COPIES`."""
    weight_bytes = max(1, shape[0] * shape[1] * itemsize)
    return max(1, min(MAX_COPIES, -(-STREAM_BYTES // weight_bytes)))


def _time_pass(run: Callable[[torch.Tensor, Any], torch.Tensor], x: torch.Tensor, operands: list[Any]) -> float:
    """Seconds per product of `run(x, operand)` over `operands` in turn (0.0 for none)."""
    start = time.perf_counter()
    for operand in operands:
        run(x, operand)
    return (time.perf_counter() - start) / max(1, len(operands))


def forced_kernels_from_env() -> dict[str, str]:
    """`ASYNCLLM_LINEAR_KERNELS` ("int8=int_mm,fp32=matmul") as {kind: kernel}; {} when unset.

    Raises:
        ConfigError: a malformed value, an unknown kind or kernel name.
    """
    return parse_linear_kernels(os.environ.get(LINEAR_KERNEL_ENV), source=LINEAR_KERNEL_ENV)
