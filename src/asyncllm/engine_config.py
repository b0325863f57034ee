"""The small frozen configs the engine is built from, one per part (`EngineConfig` holds them all).

`EngineArgs.create_engine_config()` (`config.py`) makes them; each part is passed only to the code that needs it.
`SpeculativeConfig.from_user` parses and checks the user's speculative-decoding dict; `executor_backend_name`
turns the user's executor backend into the string `ParallelConfig` carries. All importable from `asyncllm.config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from asyncllm.errors import ConfigError

LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["int8", "q8_0", "q4_0", "gguf"]
# What `EngineArgs.quantization` accepts: a `Quantization`, "auto" (the default: blocks for a GGUF that is already
# block-quantized, else float32; `model/loading/quant_choice.py`), or "none" / None (float32 weights).
QuantizationArg = Literal["auto", "none", "int8", "q8_0", "q4_0", "gguf"]
KVCacheDtype = Literal["float32", "bfloat16"]  # the cache's element type, once "auto" is resolved
# What `EngineArgs.kv_cache_dtype` accepts: vLLM's "auto" (the default: by weights and CPU,
# `model/loading/kv_cache_choice.py`) and "bfloat16", and asyncllm's "float32".
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
KV_CACHE_ITEMSIZE = {"float32": 4, "bfloat16": 2}  # bytes per cached K or V element
BLOCK_QUANTIZATIONS = ("q8_0", "q4_0", "gguf")  # the modes storing weights in blocks (`model/kernels/block_quant.py`)
SchedulingPolicy = Literal["fcfs", "priority"]
DataParallelBackend = Literal["mp", "ray"]

# The kernels each kind of linear product can run on (`model/kernels/choice.py`; docs/kernels.md), in the order
# they are preferred on a tie.
LINEAR_KERNEL_NAMES: dict[str, tuple[str, ...]] = {
    "int8": ("onednn", "int_mm", "avx2", "vnni"),
    "fp32": ("mkl_packed", "matmul", "onednn", "gemv"),
}
LINEAR_KERNEL_ENV = "ASYNCLLM_LINEAR_KERNELS"


def parse_linear_kernels(
    value: str | dict[str, str] | None, source: str = "EngineArgs.linear_kernels"
) -> dict[str, str]:
    """A forced kernel per kind of linear product, from a dict (`{"int8": "int_mm"}`) or its text form
    (`"int8=int_mm,fp32=matmul"`, as `ASYNCLLM_LINEAR_KERNELS` takes it); None or "" -> {}.

    Raises:
        ConfigError: a malformed value, or a kind or kernel not in `LINEAR_KERNEL_NAMES` (named with `source`).
    """
    if not value:
        return {}
    if isinstance(value, str):
        pairs = [item.partition("=") for item in value.split(",") if item.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ConfigError(f"{source}={value!r}: expected 'kind=kernel' pairs, e.g. 'int8=int_mm,fp32=matmul'")
        value = {kind.strip(): name.strip() for kind, _, name in pairs}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}={value!r}: must be a dict such as {{'int8': 'int_mm'}} or its text form")
    for kind, name in value.items():
        if kind not in LINEAR_KERNEL_NAMES:
            raise ConfigError(f"{source}: unknown kind {kind!r}; kinds: {', '.join(LINEAR_KERNEL_NAMES)}")
        if name not in LINEAR_KERNEL_NAMES[kind]:
            known = ", ".join(LINEAR_KERNEL_NAMES[kind])
            raise ConfigError(f"{source}: unknown {kind} kernel {name!r}; {kind} kernels: {known}")
    return dict(value)


LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
MetricsPrefix = Literal["asyncllm", "vllm"]
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run.

    Fields:
        model: the name or path the user gave.
        model_path: resolved local path: a `.gguf` file or an HF directory.
        load_format: "auto" (real weights) or "dummy" (random weights, same shapes; for fast tests).
        max_model_len: tokens per sequence (prompt + output) at most; None = the model's context length.
        seed: global seed (dummy weights, unseeded sampling).
        quantization: None (float32 weights), "int8" (int8 linear weights and LM head, see `model/kernels/int8.py`), or
            "q8_0" / "q4_0" / "gguf" (weights in blocks of 32, `model/kernels/block_quant.py`). Always resolved:
            `EngineArgs(quantization="auto")` becomes one of these in `create_engine_config`.
        quantization_reason: why `quantization` was chosen when `EngineArgs.quantization` was "auto" (the loader logs
            it at start-up); "" when the user spelled it.
        linear_kernels: a forced kernel per kind of linear product ({"int8": "int_mm"}); kinds left out are chosen
            by measurement on the host (`model/kernels/choice.py`), or forced by `ASYNCLLM_LINEAR_KERNELS`.
        max_logprobs: `logprobs` / `prompt_logprobs` a request may ask for at most; -1 = the whole vocabulary.
        logprobs_mode: what logprobs carry (vLLM's `logprobs_mode`, `LOGPROBS_MODES`): "raw_logprobs" (default),
            "raw_logits", "processed_logprobs", "processed_logits".
        skip_tokenizer_init: no tokenizer in the frontend: token-id prompts only, outputs without text.
        max_prompt_len: a longer prompt is refused at submission, tokens (a LongRoPE checkpoint's original context:
            `model/loading/arch_config.max_prompt_len`); None: only `max_model_len` limits prompts.
    """

    model: str
    model_path: str
    load_format: LoadFormat = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: Quantization | None = None
    quantization_reason: str = ""
    linear_kernels: dict[str, str] | None = None
    max_logprobs: int = 20
    logprobs_mode: LogprobsMode = "raw_logprobs"
    skip_tokenizer_init: bool = False
    max_prompt_len: int | None = None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Fields:
        block_size: tokens per KV cache block.
        num_kv_blocks: force this many blocks; None = size from `kv_cache_memory_bytes`.
        kv_cache_memory_bytes: memory budget of the KV cache over all layers, in bytes; None = the default size
            (`max_num_seqs` sequences of `max_model_len` tokens, capped by a fraction of available memory).
        enable_prefix_caching: reuse the KV blocks of a prompt prefix another request computed.
        populate: make the cache's memory resident at start-up rather than on first write
            (`EngineArgs.populate_kv_cache`).
        cache_dtype: element type of the cached K/V (vLLM's `cache_dtype`, resolved): "float32" or "bfloat16" (half
            the bytes per block; see `EngineArgs.kv_cache_dtype`).
        cache_dtype_reason: why `cache_dtype` was chosen when `EngineArgs.kv_cache_dtype` was "auto" (the worker
            logs it at start-up), else "".
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    populate: bool = False
    cache_dtype: KVCacheDtype = "float32"
    cache_dtype_reason: str = ""

    @property
    def cache_itemsize(self) -> int:
        """Bytes of one cached K or V element: 4 (float32) or 2 (bfloat16)."""
        return KV_CACHE_ITEMSIZE[self.cache_dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Fields:
        max_num_seqs: requests running in one step at most.
        max_num_batched_tokens: tokens (prefill + decode) in one step at most; long prompts are chunked.
        scheduling_policy: "fcfs" (arrival order) or "priority" (lower `priority` first, may preempt).
        prebuild_grammar_compiler: build the structured-outputs vocabulary tables at start (see `EngineArgs`).
        long_prefill_token_threshold: prompt tokens one request computes in a step at most; 0: no limit but
            `max_num_batched_tokens`.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    scheduling_policy: SchedulingPolicy = "fcfs"
    prebuild_grammar_compiler: bool = False
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    """Where the engine core and its workers run.

    Fields:
        engine_process: run the engine core in its own process (True) or a background thread (False).
        num_threads: torch intra-op threads per worker; None = torch's default.
        distributed_executor_backend: "uni", "mp", "ray", or "package.module:Class" (see `executors/`).
        tensor_parallel_size: worker ranks sharding the model (heads and MLP columns).
        ray_address: Ray cluster to connect to ("auto", "ray://host:10001", a GCS address); None = `RAY_ADDRESS`
            or the Ray already initialized in the engine's process, else a new local cluster.
        ray_placement_timeout_s: seconds to wait for the Ray placement group's resources.
        ray_cpus_per_worker: CPUs reserved per rank in the Ray placement group (may be fractional).
        data_parallel_size: independent engine cores behind one client (see `engine/dp_client.py`).
        data_parallel_backend: "mp" (engine processes on this machine) or "ray" (engine-core Ray actors).
        data_parallel_rank: this engine core's rank (set per engine by the client; 0 without DP).
        restart_dead_engines: with DP, an engine that dies fails its own requests and a fresh engine takes its
            rank, instead of making the whole client dead.
        engine_timeout: seconds without a heartbeat from the engine process after which the client declares it
            unresponsive (streams fail with `EngineDeadError`); None = never (only a process exit is noticed).
    """

    engine_process: bool = True
    num_threads: int | None = None
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    ray_address: str | None = None
    ray_placement_timeout_s: float = 60.0
    ray_cpus_per_worker: float = 1.0
    data_parallel_size: int = 1
    data_parallel_backend: DataParallelBackend = "mp"
    data_parallel_rank: int = 0
    restart_dead_engines: bool = False
    engine_timeout: float | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`, method "ngram" only; see docs/speculative.md).

    Fields:
        method: "ngram" (prompt lookup: draft tokens copied from an earlier occurrence of the last n-gram).
        num_speculative_tokens: draft tokens proposed per request and step at most (k >= 1).
        prompt_lookup_min: smallest n-gram looked up (>= 1).
        prompt_lookup_max: largest n-gram looked up (>= prompt_lookup_min); longer matches are tried first.
        disable_by_batch_size: vLLM's knob: no drafts in a step while more than this many requests are running or
            waiting (None: no limit).
        adaptive: asyncllm's draft-length policy (default True): per request, draft only as many tokens as its
            recent acceptance makes worth the extra rows, from a step-cost model fitted online
            (`sched/draft_policy.py`). False: always draft up to k tokens when the n-gram matches.
    """

    method: Literal["ngram"]
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def from_user(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """Parse `EngineArgs.speculative_config`: a dict, or its JSON text (the CLI flag).

        vLLM's defaults: both lookup sizes missing -> 5 and 5; one missing -> the other's value.

        Raises:
            ConfigError: not a dict / JSON object, unknown keys, a method other than "ngram", missing
                `num_speculative_tokens`, or a value out of range (naming the key).
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"EngineArgs.speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"EngineArgs.speculative_config={value!r}: must be a dict (or its JSON text) or None")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
            "adaptive",
        }
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}")
        if value.get("method") != "ngram":
            raise ConfigError(f"speculative_config.method={value.get('method')!r}: only 'ngram' is supported")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config.num_speculative_tokens is required (draft tokens per step)")
        low: Any = value.get("prompt_lookup_min")
        high: Any = value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        config = cls(
            "ngram",
            value["num_speculative_tokens"],
            low,
            high,
            value.get("disable_by_batch_size"),
            value.get("adaptive", True),
        )
        batch_limit = config.disable_by_batch_size
        if batch_limit is not None and (isinstance(batch_limit, bool) or not isinstance(batch_limit, int)):
            raise ConfigError(f"speculative_config.disable_by_batch_size={batch_limit!r}: must be an integer or None")
        if batch_limit is not None and batch_limit < 1:
            raise ConfigError(f"speculative_config.disable_by_batch_size={batch_limit!r}: must be >= 1")
        if not isinstance(config.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive={config.adaptive!r}: must be true or false")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            number = getattr(config, name)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ConfigError(f"speculative_config.{name}={number!r} is invalid: must be an integer >= 1")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min={low} is invalid: must be <= prompt_lookup_max ({high})"
            )
        return config


@dataclass(frozen=True)
class LoRAConfig:
    """Per-request LoRA adapters (docs/lora.md); present in `EngineConfig` only when `enable_lora` is set.

    Fields:
        max_loras: distinct adapters among the running requests at most, and adapters each worker keeps loaded
            (least recently used evicted first).
        max_lora_rank: the largest adapter rank accepted (1..64).
    """

    max_loras: int = 1
    max_lora_rank: int = 16


@dataclass(frozen=True)
class ObservabilityConfig:
    """Stats the frontend logs.

    Fields:
        log_stats: log engine stats periodically (`asyncllm.metrics.loggers.LoggingStatLogger`).
        stats_log_interval: seconds between two stats log lines.
        metrics_prefix: the Prometheus names' prefix: "asyncllm" or "vllm" (vLLM's names, for its dashboards).
    """

    log_stats: bool = False
    stats_log_interval: float = 5.0
    metrics_prefix: MetricsPrefix = "asyncllm"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, as small frozen parts (observability is the frontend's)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None


def executor_backend_name(backend: str | type, engine_process: bool) -> str:
    """`distributed_executor_backend` as the string the engine config carries: a name, or "module:Class" for an
    executor class (the engine core imports it by that name, in its own process or in a thread).

    Raises:
        ConfigError: a class that cannot be imported by its module path (defined in a function, or, with
            `engine_process=True`, in the script run as `__main__`, which the engine process does not import).
    """
    if isinstance(backend, str):
        return backend
    if not isinstance(backend, type):
        raise ConfigError(f"distributed_executor_backend={backend!r}: expected a name or an Executor subclass")
    module, qualname = backend.__module__, backend.__qualname__
    where = "inside a function" if "<locals>" in qualname else "in the script run as __main__"
    if "<locals>" in qualname or (module == "__main__" and engine_process):
        raise ConfigError(
            f"executor class {qualname} is defined {where}: the engine core imports it by name, so define it in an"
            " importable module (or pass 'package.module:Class')"
        )
    return f"{module}:{qualname}"
