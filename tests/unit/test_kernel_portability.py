"""The C++ kernels compile for CPUs other than this one: `-march=native` builds them for the host, so a path guarded
by an ISA macro (`__AVX512VNNI__`, `__AVX2__`, ...) that leaks a name into unguarded code breaks the build only on
other hosts. (The VNNI int8 kernel's panel width was declared inside its guard and used outside it: an AVX2-only
CPU could not build any kernel, 2026-12-05.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

from asyncllm.model.kernels.row_kernels import SOURCES

# x86-64-v3: AVX2 and FMA, no AVX-512 (an AVX2-only AMD EPYC); x86-64-v4: AVX-512 F/BW/DQ/VL without VNNI
TARGETS = ("x86-64-v3", "x86-64-v4")


def _isa_guarded_sources() -> list[str]:
    return [str(p) for p in SOURCES if any(m in p.read_text() for m in ("__AVX2__", "__AVX512", "__AMX"))]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("g++") is None, reason="needs g++ on Linux")
@pytest.mark.parametrize("march", TARGETS)
def test_the_isa_guarded_kernels_compile_for_other_cpus(march: str) -> None:
    sources = _isa_guarded_sources()
    assert len(sources) >= 3  # block_quant.cpp, fp32_gemv.cpp, int8_gemm.cpp at least
    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    done = subprocess.run(
        ["g++", "-std=c++17", "-fsyntax-only", f"-march={march}", "-DTORCH_EXTENSION_NAME=check", *includes, *sources],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
