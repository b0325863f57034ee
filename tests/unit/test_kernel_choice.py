"""The kernel chooser (`model/kernels/choice.py`): it never picks a wrong or a pathologically slow kernel, honours and
logs a forced one, caches per host fingerprint, and does not cache what it measured on a busy machine."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from asyncllm.config import EngineArgs, ModelConfig
from asyncllm.engine_config import LINEAR_KERNEL_NAMES, parse_linear_kernels
from asyncllm.errors import ConfigError
from asyncllm.model.kernels import choice as choice_module
from asyncllm.model.kernels.choice import (
    ROW_CLASSES,
    Candidate,
    KernelChooser,
    ProductKind,
    check_columns,
    pick_kernels,
    row_class,
)
from asyncllm.model.kernels.choice_cache import host_fingerprint
from asyncllm.model.kernels.fp32 import FP32_PRODUCT
from asyncllm.model.kernels.int8 import INT8_PRODUCT, Int8Weight
from asyncllm.model.loading.loader import load_model
from asyncllm.utils.cpu_load import OtherCpuLoad
from tests.kernel_checks import force_or_refused
from tests.unit.test_quant import TINY_LLAMA

HOST = {"cpu": "Test CPU 9000", "cpu_flags": "abc", "torch": "2.13.0", "onednn": "v3.12.0", "threads": "2"}


class QuietLoad:
    """An `OtherCpuLoad` that reports a quiet machine (the test suite may run beside other work)."""

    def cpus(self) -> float:
        return 0.0


class BusyLoad:
    def cpus(self) -> float:
        return 1.5


def _kind(calls: dict[str, int], slow_s: float = 0.02) -> ProductKind[torch.Tensor]:
    """A kind with a right, a deliberately slow (sleeps `slow_s` per call) and a deliberately wrong candidate."""

    def counted(name: str, run: Any) -> Any:
        def wrapper(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls[name] = calls.get(name, 0) + 1
            return run(x, w)

        return wrapper

    def slow(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        time.sleep(slow_s)
        return x @ w

    return ProductKind(
        name="fp32",
        candidates=(
            Candidate("slow", lambda: True, lambda w: w, counted("slow", slow)),
            Candidate("wrong", lambda: True, lambda w: w, counted("wrong", lambda x, w: x @ w + 1e-2)),
            Candidate("right", lambda: True, lambda w: w, counted("right", lambda x, w: x @ w)),
            Candidate("missing", lambda: False, lambda w: w, counted("missing", lambda x, w: x @ w)),
        ),
        make_weight=lambda i, o, g: torch.randn(i, o, generator=g),
        make_input=lambda r, i, g: torch.randn(r, i, generator=g),
        reference=lambda x, w, columns: (x.double() @ w[:, columns].double()).float(),
        agrees=FP32_PRODUCT.agrees,
        out_features=lambda w: w.shape[1],
        itemsize=4,
    )


def _chooser(  # type: ignore[no-untyped-def]
    tmp_path, calls: dict[str, int], host: dict[str, str] = HOST, slow_s: float = 0.02, **kwargs: Any
) -> KernelChooser:
    kwargs.setdefault("other_load", QuietLoad)
    return KernelChooser(_kind(calls, slow_s), cache_dir=tmp_path, fingerprint=host, **kwargs)


def test_the_chooser_picks_neither_the_slow_nor_the_wrong_kernel(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, int] = {}
    chooser = _chooser(tmp_path, calls)
    assert [c.name for c in chooser.available] == ["slow", "wrong", "right"]
    with caplog.at_level(logging.WARNING, logger="asyncllm.model.kernels.choice"):
        choice = chooser.choose(64, 48)
    assert choice.kernels == ("right",) * len(ROW_CLASSES)
    assert choice.how == "measured"
    assert "'wrong' disagrees with the exact reference" in caplog.text
    assert "'slow' is" in caplog.text
    assert "slower than the fastest" in caplog.text
    assert calls["wrong"] == 1  # checked once, dropped for the rest of the process
    slow_calls = calls["slow"]
    chooser.choose(32, 16)  # another shape: the dropped kernels are not run again
    assert calls["slow"] == slow_calls
    assert calls["wrong"] == 1
    assert "missing" not in calls
    assert set(choice.times_ms[0]) == {"right"}
    assert "64x48: 1 right (" in chooser.describe()


def test_a_kernel_only_a_little_slower_is_timed_but_not_chosen(tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, int] = {}
    # 1.5 ms slower per call: under `SLOW_MIN_S` (2 ms), so it is timed at every row class, and far enough above the
    # right kernel's microseconds that a loaded machine does not bring the two within the tie margin (0.5 ms did once,
    # beside a kernel build on the other core, 2026-12-05)
    kind = _kind(calls, slow_s=0.0015)
    chooser = KernelChooser(kind, cache_dir=tmp_path, fingerprint=HOST, other_load=QuietLoad)
    choice = chooser.choose(16, 8)
    assert choice.kernels == ("right",) * len(ROW_CLASSES)
    assert all(times["slow"] > times["right"] for times in choice.times_ms)  # timed at every row class


def test_a_forced_kernel_is_honoured_without_measuring(tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, int] = {}
    chooser = _chooser(tmp_path, calls, forced="slow")
    choice = chooser.choose(64, 48)
    assert choice.kernels == ("slow",) * len(ROW_CLASSES)
    assert choice.how == "forced"
    assert "right" not in calls  # nothing else was run
    assert "(forced;" in chooser.describe()
    with pytest.raises(ConfigError, match="'wrong' gives wrong results for a 64x48 weight"):
        _chooser(tmp_path, {}, forced="wrong").choose(64, 48)
    with pytest.raises(ConfigError, match="'missing' is not available on this host"):
        _chooser(tmp_path, {}, forced="missing")


def test_the_cache_is_keyed_by_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, int] = {}
    first = _chooser(tmp_path, calls, slow_s=0.001).choose(64, 48)
    measured_calls = calls["right"]
    again = _chooser(tmp_path, calls, slow_s=0.001).choose(64, 48)  # a later start on the same host
    assert again.how == "cached"
    assert again.kernels == first.kernels
    assert calls["right"] == measured_calls  # nothing was run
    for changed in ({"cpu": "Other CPU"}, {"cpu_flags": "abd"}, {"torch": "2.14.0"}, {"onednn": "v3.13.0"}):
        before = calls["right"]
        choice = _chooser(tmp_path, calls, host={**HOST, **changed}, slow_s=0.001).choose(64, 48)
        assert choice.how == "measured", changed
        assert calls["right"] > before
    files = sorted(tmp_path.glob("linear-kernels-*.json"))
    assert len(files) == 5
    stored = json.loads(files[0].read_text())
    assert stored["key"]["candidates"] == "slow,wrong,right"  # the available ones, not "missing"
    assert list(stored["choices"]) == ["fp32 64x48"]


def test_changed_kernel_sources_are_measured_again(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A cached choice was timed with the C++ kernels' code of its day: the VNNI int8 kernel, rewritten, kept its
    first version's losing times until the cache file was removed (2026-12-05)."""
    calls: dict[str, int] = {}
    monkeypatch.setattr(choice_module, "kernel_sources_digest", lambda: "old code")
    assert _chooser(tmp_path, calls, slow_s=0.001).choose(64, 48).how == "measured"
    assert _chooser(tmp_path, calls, slow_s=0.001).choose(64, 48).how == "cached"
    monkeypatch.setattr(choice_module, "kernel_sources_digest", lambda: "new code")
    before = calls["right"]
    assert _chooser(tmp_path, calls, slow_s=0.001).choose(64, 48).how == "measured"
    assert calls["right"] > before
    stored = [json.loads(f.read_text())["key"]["kernel_sources"] for f in tmp_path.glob("linear-kernels-*.json")]
    assert sorted(stored) == ["new code", "old code"]


def test_a_measurement_on_a_busy_machine_is_measured_again_when_quiet(tmp_path) -> None:  # type: ignore[no-untyped-def]
    calls: dict[str, int] = {}
    busy = _chooser(tmp_path, calls, other_load=BusyLoad, slow_s=0.01).choose(64, 48)
    assert busy.how == "measured beside 1.5 busy CPUs"
    assert busy.kernels == ("right",) * len(ROW_CLASSES)
    again_busy = _chooser(tmp_path, calls, other_load=BusyLoad, slow_s=0.01).choose(
        64, 48
    )  # still busy: not measured again
    assert again_busy.how == "cached, measured beside 1.5 busy CPUs"
    assert _chooser(tmp_path, calls, slow_s=0.01).choose(64, 48).how == "measured"  # quiet now: measured again
    assert (
        _chooser(tmp_path, calls, other_load=BusyLoad, slow_s=0.01).choose(64, 48).how == "cached"
    )  # a quiet measurement


def test_other_cpu_load_reads_proc_stat(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 10 0 0 0 0 0\n")
    start = time.perf_counter()
    load = OtherCpuLoad(str(stat))
    time.sleep(0.2)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    busy = f"{100 + round(2 / tick)} {round(0.5 / tick)}"  # 2.5 CPU-seconds more of user and nice time
    stat.write_text(f"cpu  {busy} 50 9000 10 0 0 0 0 0\n")
    cpus = load.cpus()
    elapsed = time.perf_counter() - start
    assert cpus is not None
    assert (2.5 - 0.2) / elapsed <= cpus <= 2.5 / 0.2  # less this process's own CPU time (it slept)
    assert OtherCpuLoad(str(tmp_path / "missing")).cpus() is None


def test_row_classes_and_checked_columns() -> None:
    rows = (1, 2, 8, 9, 16, 17, 64, 65, 511, 512, 4096)
    assert [row_class(r) for r in rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    columns = check_columns(49152)
    assert columns[0] == 0
    assert columns[-1] == 49151
    assert 300 < len(columns) < 450
    assert torch.equal(check_columns(40), torch.arange(40))


@pytest.mark.parametrize("kind", [INT8_PRODUCT, FP32_PRODUCT], ids=["int8", "fp32"])
def test_every_real_kernel_agrees_with_the_reference(kind: ProductKind[Any], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each available kernel of this build, forced, passes its own check on a model-like shape (K = 576), or is
    refused for wrong results with a ConfigError (never torch's own product)."""
    names = [c.name for c in kind.candidates if c.available()]
    assert "int_mm" in names or "matmul" in names
    for name in names:
        chooser = force_or_refused(kind, name, tmp_path, (576, 200))
        if chooser is not None:
            assert chooser.choose(576, 200).kernels == (name,) * len(ROW_CLASSES)


def test_forced_kernels_are_validated_at_the_door(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert parse_linear_kernels("int8=int_mm, fp32=matmul") == {"int8": "int_mm", "fp32": "matmul"}
    assert parse_linear_kernels(None) == {}
    assert parse_linear_kernels("") == {}
    assert set(LINEAR_KERNEL_NAMES["int8"]) == {c.name for c in INT8_PRODUCT.candidates}
    assert set(LINEAR_KERNEL_NAMES["fp32"]) == {c.name for c in FP32_PRODUCT.candidates}
    with pytest.raises(ConfigError, match="unknown int8 kernel 'fast'"):
        EngineArgs(linear_kernels={"int8": "fast"}).validate()
    with pytest.raises(ConfigError, match="unknown kind 'int4'"):
        EngineArgs(linear_kernels="int4=x").validate()
    with pytest.raises(ConfigError, match="expected 'kind=kernel' pairs"):
        EngineArgs(linear_kernels="int_mm").validate()
    monkeypatch.setenv("ASYNCLLM_LINEAR_KERNELS", "int8=nope")
    with pytest.raises(ConfigError, match="ASYNCLLM_LINEAR_KERNELS: unknown int8 kernel 'nope'"):
        EngineArgs().validate()


def test_a_forced_kernel_runs_the_model_and_is_logged(tmp_path, caplog, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The engine argument wins over the environment; the start-up log names the kernel of every product."""
    monkeypatch.setenv("ASYNCLLM_LINEAR_KERNELS", "int8=onednn")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = ModelConfig("tiny", str(tmp_path), load_format="dummy", quantization="int8")
    forced = ModelConfig(**{**config.__dict__, "linear_kernels": {"int8": "int_mm"}})
    with caplog.at_level(logging.INFO, logger="asyncllm.model.loading.loader"):
        model = load_model(forced)
    head = model.lm_head
    assert isinstance(head, Int8Weight)
    assert head.choice is not None
    assert head.choice.kernels == ("int_mm",) * len(ROW_CLASSES)
    assert list(head.operands) == ["int_mm"]
    assert "int8 linear kernels (forced;" in caplog.text
    classes = "1 int_mm, 2-8 int_mm, 9-16 int_mm, 17-64 int_mm, 65-511 int_mm, 512+ int_mm"
    assert f"64x{TINY_LLAMA['vocab_size']}: {classes}" in caplog.text
    if force_or_refused(INT8_PRODUCT, "onednn", tmp_path, (64, TINY_LLAMA["vocab_size"])) is None:
        with pytest.raises(ConfigError, match="int8='onednn' gives wrong results"):  # the environment's, refused here
            load_model(config)
        return
    from_env = load_model(config).lm_head
    assert from_env.choice is not None
    assert from_env.choice.kernels == ("onednn",) * len(ROW_CLASSES)


def test_host_fingerprint_names_the_libraries() -> None:
    fingerprint = host_fingerprint()
    assert fingerprint["torch"] == torch.__version__
    assert fingerprint["onednn"].startswith("v")
    assert fingerprint["cpu"]


PROBE = """
import logging, pathlib, sys, torch
logging.basicConfig(level=logging.WARNING)
from asyncllm.model.kernels.choice import KernelChooser
from asyncllm.model.kernels.int8 import INT8_PRODUCT
torch.set_num_threads(1)
print("CHOICE", KernelChooser(INT8_PRODUCT, cache_dir=pathlib.Path(sys.argv[1])).choose(576, 960).kernels)
"""


def test_oneDNNs_reference_kernel_is_rejected_where_it_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """oneDNN runs its reference int8 kernel (`ref_int8`) on CPUs with AVX-512 VNNI but no AMX, such as AMD EPYC:
    capping oneDNN's ISA there (`ONEDNN_MAX_CPU_ISA`) reproduces it on any AVX-512 host. The chooser must not
    pick it (here 50-200x slower than `torch._int_mm`; docs/kernels.md)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ONEDNN_VERBOSE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    if "ref_int8" not in done.stdout:
        pytest.skip("oneDNN does not run its reference int8 kernel on this CPU even with the ISA capped (no AVX-512)")
    choice = next(line for line in done.stdout.splitlines() if line.startswith("CHOICE"))
    assert "'onednn'" not in choice, choice
    assert "'onednn' is" in done.stderr
    assert "slower than the fastest" in done.stderr


def test_a_weight_keeps_at_most_one_packed_copy() -> None:
    """The float32 choice of the LM head (576 x 49152) measured on the AVX2-only AMD EPYC (2026-12-04, 2 threads, ms
    per row class): MKL's packed GEMM at 1 and 512+ rows, oneDNN's reordered weight at 2-511 rows, so the engine kept
    the plain weight and two packed copies (fp32 engine RSS 2,379 MB at start against 1,576 on a Xeon). Now one
    packed layout: oneDNN's, whose classes would lose 18-44% with MKL's, while MKL's lose 35% and 9% with oneDNN's
    (the 1-row class would then take `x @ W`, within the 10% tie margin of oneDNN and earlier in the order)."""
    times = [
        {"mkl_packed": 3.57, "onednn": 4.6, "matmul": 4.83},
        {"mkl_packed": 9.26, "onednn": 6.45, "matmul": 23.2},
        {"mkl_packed": 17.8, "onednn": 13.8, "matmul": 32.2},
        {"mkl_packed": 52.8, "onednn": 44.7, "matmul": 75.4},
        {"mkl_packed": 475.0, "onednn": 434.0, "matmul": 504.0},
    ]
    assert pick_kernels(FP32_PRODUCT, times) == ("mkl_packed", "onednn", "onednn", "onednn", "onednn")
    # but the 1-row class keeps its own packed layout only where it is over 15% faster: here MKL's 3.57 ms against
    # x @ W's 4.83 (batch-1 decoding, every token); with x @ W at 4.1 ms (within 15%) it takes x @ W
    times[0] = {"mkl_packed": 3.57, "onednn": 4.6, "matmul": 4.1}
    assert pick_kernels(FP32_PRODUCT, times) == ("matmul", "onednn", "onednn", "onednn", "onednn")
    # Gemma 3's head (640 x 262,144) there, 2026-12-04: one-row MKL 22.7 ms against x @ W 29.1
    gemma = [
        {"mkl_packed": 22.7, "onednn": 27.4, "matmul": 29.1},
        {"mkl_packed": 57.0, "onednn": 37.9, "matmul": 196.0},
    ]
    assert pick_kernels(FP32_PRODUCT, gemma) == ("mkl_packed", "onednn")
    # 576 x 576 there: oneDNN at 1 row, MKL's (within the 10% tie margin) at 2-511, matmul at 512+
    times = [
        {"mkl_packed": 0.113, "matmul": 0.115, "onednn": 0.0806},
        {"mkl_packed": 0.121, "onednn": 0.117, "matmul": 0.17},
        {"mkl_packed": 0.231, "onednn": 0.216, "matmul": 0.302},
        {"mkl_packed": 0.71, "onednn": 0.683, "matmul": 0.814},
        {"mkl_packed": 5.12, "onednn": 4.16, "matmul": 4.41},
    ]
    assert [_pick_one(FP32_PRODUCT, t) for t in times] == ["onednn", "mkl_packed", "mkl_packed", "mkl_packed", "matmul"]
    assert pick_kernels(FP32_PRODUCT, times) == ("onednn", "onednn", "onednn", "onednn", "matmul")
    # one packed layout and the plain weight: unchanged
    times = [{"mkl_packed": 1.0, "matmul": 2.0}, {"mkl_packed": 2.0, "matmul": 1.0}]
    assert pick_kernels(FP32_PRODUCT, times) == ("mkl_packed", "matmul")
    # int8's plain-weight kernel (`torch._int_mm`) costs no copy either
    times = [{"onednn": 1.0, "int_mm": 3.0, "avx2": 1.1}, {"onednn": 3.0, "int_mm": 5.0, "avx2": 1.0}]
    assert pick_kernels(INT8_PRODUCT, times) == ("avx2", "avx2")


def _pick_one(kind: ProductKind[Any], times: dict[str, float]) -> str:
    (name,) = pick_kernels(kind, [times])
    return name
