"""KV cache sizing: the default follows the configuration (capped by available memory), the explicit knobs
still win, the stats report block size and bytes, and the cache costs resident memory only once written."""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import pathlib

import pytest
import torch

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from asyncllm.engine.core import EngineCore
from asyncllm.model.loading.loader import read_arch_config
from asyncllm.utils import huge_pages
from asyncllm.utils.cpu_info import cpu_info
from asyncllm.worker import kv_cache_sizing
from asyncllm.worker.kv_cache_sizing import allocate_zeroed, default_num_kv_blocks

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv_heads * head_dim * float32


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def _core(model_path: str, cache: CacheConfig, max_num_seqs: int = 4, max_model_len: int | None = 200) -> EngineCore:
    return EngineCore(
        EngineConfig(
            ModelConfig("tiny", model_path, load_format="dummy", max_model_len=max_model_len),
            cache,
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
            ParallelConfig(num_threads=1),
        )
    )


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_default_size_is_max_num_seqs_full_sequences_capped_by_memory() -> None:
    assert default_num_kv_blocks(4, 200, 16, 1000, available_bytes=10**12) == 4 * 13
    cap = int(kv_cache_sizing.KV_CACHE_MEMORY_FRACTION * 10**8) // 1000
    assert default_num_kv_blocks(64, 8192, 16, 1000, available_bytes=10**8) == cap
    assert default_num_kv_blocks(64, 8192, 16, 1000, available_bytes=0) == 1


@pytest.mark.parametrize(
    ("cache", "max_num_seqs", "expected_blocks"),
    [
        (CacheConfig(block_size=16), 4, 4 * math.ceil(200 / 16)),  # the default: what the configuration can use
        (CacheConfig(block_size=16), 2, 2 * math.ceil(200 / 16)),
        (CacheConfig(block_size=16, num_kv_blocks=40), 4, 40),
        (CacheConfig(block_size=16, kv_cache_memory_bytes=30 * BYTES_PER_BLOCK + 5), 4, 30),
    ],
)
def test_kv_cache_size_and_stats(
    tiny_model_path: str, cache: CacheConfig, max_num_seqs: int, expected_blocks: int
) -> None:
    core = _core(tiny_model_path, cache, max_num_seqs=max_num_seqs)
    try:
        stats = core.scheduler.get_stats()
        assert stats.num_total_blocks == expected_blocks
        assert stats.block_size == 16
        assert stats.kv_cache_bytes == expected_blocks * BYTES_PER_BLOCK
        assert read_arch_config(tiny_model_path).kv_cache_bytes_per_block(16) == BYTES_PER_BLOCK
    finally:
        core.shutdown()


def test_default_size_follows_the_models_context_when_max_model_len_is_unset(tiny_model_path: str) -> None:
    core = _core(tiny_model_path, CacheConfig(block_size=16), max_num_seqs=3, max_model_len=None)
    try:
        assert core.scheduler.get_stats().num_total_blocks == 3 * 512 // 16
    finally:
        core.shutdown()


def test_lazily_committed_cache_is_zero_and_costs_memory_only_where_written() -> None:
    nbytes = 256 << 20
    before = _rss_bytes()
    cache = allocate_zeroed((nbytes // (16 * 1024 * 4), 16, 1024))  # 256 MiB of float32
    allocated = _rss_bytes()
    assert cache.shape == (4096, 16, 1024)
    assert allocated - before < 32 << 20  # far below 256 MiB: no page was touched
    assert torch.count_nonzero(cache[::512]) == 0  # reading maps the shared zero page only
    cache[:64] = 1.0  # 4 MiB written
    written = _rss_bytes()
    assert 3 << 20 <= written - before < 64 << 20
    assert float(cache[:64].sum()) == 64 * 16 * 1024


def test_a_populated_cache_is_zero_and_resident_from_the_start() -> None:
    """`populate=True` (what `asyncllm serve` asks for): every page is resident before anything is written, so the
    first requests take no page faults; the bytes are still zeros."""
    cache = allocate_zeroed((512, 16, 1024), populate=True)  # 32 MiB of float32
    assert _resident_bytes(cache.data_ptr(), 32 << 20) == 32 << 20
    assert torch.count_nonzero(cache) == 0
    lazy = allocate_zeroed((512, 16, 1024))
    assert _resident_bytes(lazy.data_ptr(), 32 << 20) == 0  # the control: nothing written, nothing resident


def test_writing_every_page_makes_a_mapping_resident() -> None:
    """The fallback where the kernel does not know `MADV_POPULATE_WRITE` (before Linux 5.14): one zero written per
    page makes each page resident (a read would map the shared zero page only) and leaves the bytes zero."""
    buffer = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    assert _resident_bytes(flat.data_ptr(), 8 << 20) == 0
    huge_pages.write_every_page(flat)
    assert _resident_bytes(flat.data_ptr(), 8 << 20) == 8 << 20
    assert torch.count_nonzero(flat) == 0


def test_real_engine_populates_its_cache_when_asked(model_path: str) -> None:
    """`EngineArgs.populate_kv_cache`: the engine's per-layer caches are resident before the first request."""
    args = EngineArgs(model=model_path, max_num_seqs=2, max_model_len=256, populate_kv_cache=True)
    core = EngineCore(args.create_engine_config())
    try:
        caches = core.executor.worker.model_runner.kv_caches  # type: ignore[attr-defined]
        assert len(caches) == 30
        for cache in caches:
            nbytes = cache.numel() * cache.element_size()
            assert _resident_bytes(cache.data_ptr(), nbytes) == nbytes
            assert torch.count_nonzero(cache) == 0
    finally:
        core.shutdown()


class _RefusingBuffer:
    """Stands in for an mmap whose kernel answers `madvise` with one errno."""

    def __init__(self, code: int) -> None:
        self.code = code

    def madvise(self, option: int) -> None:
        raise OSError(self.code, os.strerror(self.code))


def test_populating_falls_back_to_writes_only_where_the_kernel_lacks_the_advice() -> None:
    """EINVAL (a kernel before 5.14 does not know MADV_POPULATE_WRITE): every page is written instead. Any other
    error (ENOMEM: the memory is not there) reaches the caller, which names the cache size (`Worker`)."""
    real = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(real, dtype=torch.uint8)
    huge_pages.populate_pages(_RefusingBuffer(errno.EINVAL), flat)  # type: ignore[arg-type]
    assert _resident_bytes(flat.data_ptr(), 4 << 20) == 4 << 20
    with pytest.raises(OSError, match=os.strerror(errno.ENOMEM)) as refused:
        huge_pages.populate_pages(_RefusingBuffer(errno.ENOMEM), flat)  # type: ignore[arg-type]
    assert refused.value.errno == errno.ENOMEM


async def test_real_engine_reports_block_size_and_cache_bytes(model_path: str) -> None:
    args = EngineArgs(model=model_path, max_num_seqs=2, max_model_len=256, engine_process=False)
    async with AsyncLLM.create(args) as llm:
        stats = await llm.get_scheduler_stats()
        assert (stats.block_size, stats.num_total_blocks) == (16, 2 * 256 // 16)
        # "auto" gives the default model's own blocks a bfloat16 cache on a CPU with avx512_bf16, else float32
        itemsize = llm.config.cache.cache_itemsize
        assert itemsize == (2 if cpu_info().has("avx512_bf16") else 4)
        per_block = read_arch_config(model_path).kv_cache_bytes_per_block(16, itemsize)  # 30 layers, 3 KV heads of 64
        assert stats.kv_cache_bytes == 32 * per_block == 32 * 737_280 * itemsize // 4
        out = await llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0)).collect()
        assert out.usage is not None
        assert out.usage.num_generated_tokens == 4


def _smaps_fields(address: int) -> dict[str, list[str]]:
    """The fields (`Rss:`, `AnonHugePages:`, `VmFlags:`, ...) of the mapping of this process that holds `address`
    (`proc(5)`, /proc/self/smaps)."""
    inside, fields = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside:
                fields[head] = line.split()[1:]
    if not fields:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def _resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) of this process that are in memory: the "present" bit (63) of each
    page's entry in /proc/self/pagemap (Linux `Documentation/admin-guide/mm/pagemap.rst`). Exact for the range,
    where a mapping's `Rss:` would also count a neighbour the kernel merged it with."""
    page = mmap.PAGESIZE
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    return present * page


def _vm_flags(address: int) -> list[str]:
    """The `VmFlags` of the mapping of this process that holds `address`."""
    return _smaps_fields(address)["VmFlags:"]


def _thp_setting(name: str) -> str:
    """The selected value of /sys/kernel/mm/transparent_hugepage/`name` ("[madvise]" -> "madvise"), or ""."""
    try:
        text = pathlib.Path("/sys/kernel/mm/transparent_hugepage", name).read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="madvise(MADV_HUGEPAGE) is Linux only")
def test_the_cache_mapping_is_advised_for_huge_pages() -> None:
    """The decode kernel reads blocks placed anywhere in the cache; with 4 KiB pages it misses the TLB at almost
    every block. The kernel marks an advised mapping "hg" in its VmFlags, whatever the host's THP setting."""
    cache = allocate_zeroed((64, 16, 1024))  # 4 MiB
    assert "hg" in _vm_flags(cache.data_ptr())
    plain = mmap.mmap(-1, 4 << 20)  # the control: a mapping nobody advised
    control = torch.frombuffer(plain, dtype=torch.uint8)
    assert "hg" not in _vm_flags(control.data_ptr())


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="madvise(MADV_HUGEPAGE) is Linux only")
def test_the_cache_mapping_is_private_so_the_advice_can_take_effect() -> None:
    """A shared anonymous mapping (Python's `mmap.mmap(-1, n)` default) is shmem, whose huge pages follow THP's
    `shmem_enabled` ("never" by default), so the advice gave the cache no huge page at all (found 2026-12-05:
    AnonHugePages 0 kB in a serving engine). The cache's mapping is private; where the host grants huge pages to
    advised anonymous memory (THP "madvise" or "always", with compaction on fault), written parts get them."""
    cache = allocate_zeroed((512, 16, 1024))  # 32 MiB of float32
    assert "sh" not in _vm_flags(cache.data_ptr())
    if _thp_setting("enabled") not in ("always", "madvise"):
        return  # the host grants none: the private, advised mapping is all the cache can do
    if _thp_setting("defrag") not in ("always", "madvise", "defer+madvise"):
        return  # no compaction at fault: a fragmented host may hand out 4 KiB pages, so the count proves nothing
    cache[:256] = 1.0  # 16 MiB written: at least 7 aligned 2 MiB ranges
    assert int(_smaps_fields(cache.data_ptr())["AnonHugePages:"][0]) >= 2048  # kB
