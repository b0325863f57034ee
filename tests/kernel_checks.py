"""The compiled kernels for the tests that check them (`model/kernels/row_kernels.py`, `model/kernels/fp32.py`).

Every kernel test gets them through `require_kernels` / `require_mkl_packed`, so all follow one rule: where the
kernels should build (x86-64) and do not, the test FAILS under CI (`CI=true`, as CI services set it; the
project's CI builds them with the PyPI `ninja` that asyncllm depends on) and is skipped elsewhere, with the
reason, so a developer without a C++ compiler can still run the rest. On other CPUs the kernels are off by design:
skipped. A torch build without MKL's packed GEMM skips the MKL tests alone (`packed_fp32` uses oneDNN there).
"""

from __future__ import annotations

import os
import pathlib
import platform
from typing import TYPE_CHECKING, Any

import pytest

from asyncllm.model.kernels.row_kernels import RowKernels, load_kernels

if TYPE_CHECKING:
    from asyncllm.model.kernels.choice import KernelChooser

ON_X86 = platform.machine().lower() in ("x86_64", "amd64")


def in_ci() -> bool:
    """Whether this run is CI's (`CI` set to true/1/yes, as GitHub Actions, GitLab and most CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> None:
    """Fail the calling test under CI, skip it elsewhere; both say `reason`."""
    if in_ci():
        pytest.fail(f"{reason} (a failure under CI=true; skipped elsewhere)")
    pytest.skip(f"{reason} (skipped outside CI; CI=true makes this a failure)")


def require_kernels() -> RowKernels:
    """The fused row kernels, built (or loaded from the cache) in this process; see the module doc for when a test
    without them fails or skips."""
    if not ON_X86:
        pytest.skip("the fused row kernels are built for x86-64 only")
    if os.environ.get("ASYNCLLM_FUSED_KERNELS", "1") == "0":
        missing("ASYNCLLM_FUSED_KERNELS=0 turned the fused row kernels off")
    kernels = load_kernels()
    if kernels is None:
        missing("the fused row kernels did not build or failed their self-check (the log says why)")
    assert kernels is not None
    return kernels


def require_mkl_packed() -> RowKernels:
    """The row-kernel module with MKL's packed GEMM, which passed `mkl_packed_kernels`' check (else this test fails);
    skips where this torch build exports no packed GEMM."""
    from asyncllm.model.kernels.fp32 import mkl_packed_kernels

    kernels = require_kernels()
    if not kernels.has_packed_sgemm():
        pytest.skip("this torch build exports no MKL packed GEMM (cblas_sgemm_compute)")
    checked = mkl_packed_kernels()
    assert checked is not None, "MKL's packed GEMM links but failed its check against x @ W"
    return checked


REFERENCE_KERNELS = ("int_mm", "matmul")  # torch's own products: exact (int8) or the reference (fp32) on every host


def force_or_refused(
    kind: Any, name: str, cache_dir: pathlib.Path, shape: tuple[int, int]
) -> KernelChooser[Any] | None:
    """A chooser forcing kernel `name` of product `kind`, or None where the start-up check refused it on `shape` for
    wrong results on this host (oneDNN's int8 product on AVX2-only AMD EPYC gives values off by thousands: the
    check must refuse it, with a ConfigError naming it). torch's own products are never refused."""
    from asyncllm.errors import ConfigError
    from asyncllm.model.kernels.choice import KernelChooser

    chooser = KernelChooser(kind, forced=name, cache_dir=cache_dir)
    try:
        chooser.choose(*shape)
    except ConfigError as e:
        refusal = str(e)
    else:
        return chooser
    assert name not in REFERENCE_KERNELS, f"torch's own {name} refused: {refusal}"
    assert f"{kind.name}={name!r} gives wrong results" in refusal
    return None
