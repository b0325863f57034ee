"""User-facing `EngineArgs` and the small frozen configs the engine is built from.

`EngineArgs` is what users write; `EngineArgs.create_engine_config()` resolves the model (downloading the
default model once) and splits the arguments into `ModelConfig`, `CacheConfig`, `SchedulerConfig` and
`ParallelConfig`, each frozen, each passed only to the parts that need it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from asyncllm.errors import ConfigError

LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["int8"]
SchedulingPolicy = Literal["fcfs", "priority"]
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run.

    Fields:
        model: the name or path the user gave.
        model_path: resolved local path: a `.gguf` file or an HF directory.
        load_format: "auto" (real weights) or "dummy" (random weights, same shapes; for fast tests).
        max_model_len: tokens per sequence (prompt + output) at most; None = the model's context length.
        seed: global seed (dummy weights, unseeded sampling).
        quantization: None (float32 weights) or "int8" (int8 linear weights and LM head, see `model/quant.py`).
    """

    model: str
    model_path: str
    load_format: LoadFormat = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: Quantization | None = None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Fields:
        block_size: tokens per KV cache block.
        num_kv_blocks: force this many blocks; None = size from `kv_cache_memory_bytes`.
        kv_cache_memory_bytes: memory budget of the KV cache over all layers, in bytes; None = the default size
            (`max_num_seqs` sequences of `max_model_len` tokens, capped by a fraction of available memory).
        enable_prefix_caching: reuse the KV blocks of a prompt prefix another request computed.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Fields:
        max_num_seqs: requests running in one step at most.
        max_num_batched_tokens: tokens (prefill + decode) in one step at most; long prompts are chunked.
        scheduling_policy: "fcfs" (arrival order) or "priority" (lower `priority` first, may preempt).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    scheduling_policy: SchedulingPolicy = "fcfs"


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
    engine_timeout: float | None = None


@dataclass(frozen=True)
class ObservabilityConfig:
    """Stats the frontend logs.

    Fields:
        log_stats: log engine stats periodically (`asyncllm.metrics.loggers.LoggingStatLogger`).
        stats_log_interval: seconds between two stats log lines.
    """

    log_stats: bool = False
    stats_log_interval: float = 5.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, as small frozen parts (observability is the frontend's)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)


@dataclass(kw_only=True)
class EngineArgs:
    """Arguments of an engine, as users write them. Unknown keys are rejected (TypeError from the
    constructor, ConfigError from `from_dict`).

    Fields:
        model: "smollm2-135m-instruct" (default; fetched once into the user cache), a `.gguf` path, or an HF
            directory with config.json, *.safetensors and tokenizer.json (paths as str or `pathlib.Path`).
        max_model_len: tokens per sequence at most; None = the model's context length.
        block_size: tokens per KV cache block.
        num_kv_blocks: KV cache blocks (override); None = sized from `kv_cache_memory_bytes`.
        kv_cache_memory_bytes: KV cache budget in bytes; None (default) = enough for `max_num_seqs` sequences
            of `max_model_len` tokens, capped by 5% of the memory available at start (see the README).
        max_num_seqs: concurrent running requests at most.
        max_num_batched_tokens: tokens per step at most.
        num_threads: torch threads per worker; None = torch's default.
        seed: global seed.
        engine_process: engine core in its own process (True, default: model work never competes with the
            caller's event loop, and a crash there cannot take the caller down) or in a background thread (False).
        load_format: "auto" or "dummy" (random weights).
        quantization: None (float32, default) or "int8": every linear layer and the LM head run with int8
            weights (per output channel) and int8 per-row dynamic activations; from float or GGUF checkpoints
            (GGUF is dequantized, then requantized). See README "Speed" and docs/benchmarks.md.
        distributed_executor_backend: "uni" (model in the engine process, default), "mp" (one worker process
            per rank), "ray" (one Ray actor per rank; `asyncllm[ray]`), an `Executor` subclass or
            "package.module:Class". See docs/executors.md.
        tensor_parallel_size: ranks sharding the model ("mp"/"ray"); must divide the model's query heads, KV
            heads and MLP width (SmolLM2-135M: 1 or 3).
        ray_address: Ray cluster address for "ray" (None: `RAY_ADDRESS`, the Ray already initialized, or a
            new local cluster).
        ray_placement_timeout_s: seconds to wait for the Ray placement group's CPUs before failing.
        ray_cpus_per_worker: CPUs each rank reserves in the Ray placement group (fractional allowed; default 1).
        engine_timeout: seconds the engine may stay silent (no heartbeat) while a task waits for its outputs
            before the client reports it unresponsive (`EngineDeadError`, e.g. a SIGSTOPped or frozen engine
            process). The heartbeat comes from a thread of the engine beside its busy loop, so a long step is not
            silence. None (default) = off: only an engine that exits is noticed. See docs/reliability.md.
        enable_prefix_caching: reuse cached KV blocks of shared prompt prefixes (default on).
        scheduling_policy: "fcfs" (default) or "priority" (`generate(..., priority=)`, lower first).
        log_stats: log engine stats (throughput, queue, KV cache, prefix cache hits) periodically.
        stats_log_interval: seconds between two stats log lines (with `log_stats`).
    Raises:
        ConfigError: from `from_dict` or `create_engine_config` for unknown keys or bad values.
    """

    model: str | os.PathLike[str] = DEFAULT_MODEL
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    num_threads: int | None = None
    seed: int = 0
    engine_process: bool = True
    load_format: LoadFormat = "auto"
    quantization: Quantization | None = None
    distributed_executor_backend: str | type = "uni"
    tensor_parallel_size: int = 1
    ray_address: str | None = None
    ray_placement_timeout_s: float = 60.0
    ray_cpus_per_worker: float = 1.0
    engine_timeout: float | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    log_stats: bool = False
    stats_log_interval: float = 5.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineArgs:
        """Build from a mapping, rejecting keys that are not fields.

        Raises:
            ConfigError: naming the unknown keys.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown EngineArgs keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def validate(self) -> None:
        """Check ranges.

        Raises:
            ConfigError: naming the field and its allowed range.
        """
        if not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError(f"EngineArgs.model={self.model!r}: must be a str or a path (os.PathLike)")
        positive = {
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        optional_positive = {
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "num_threads": self.num_threads,
        }
        for name, value in {**positive, **optional_positive}.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"EngineArgs.{name}={value!r} is invalid: must be an integer >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"EngineArgs.load_format={self.load_format!r}: must be 'auto' or 'dummy'")
        if self.quantization not in (None, "int8"):
            raise ConfigError(f"EngineArgs.quantization={self.quantization!r}: must be None or 'int8'")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"EngineArgs.scheduling_policy={self.scheduling_policy!r}: must be 'fcfs' or 'priority'")
        if not isinstance(self.ray_placement_timeout_s, (int, float)) or not self.ray_placement_timeout_s > 0:
            raise ConfigError(
                f"EngineArgs.ray_placement_timeout_s={self.ray_placement_timeout_s!r}: must be > 0 (seconds)"
            )
        if not isinstance(self.ray_cpus_per_worker, (int, float)) or not self.ray_cpus_per_worker > 0:
            raise ConfigError(f"EngineArgs.ray_cpus_per_worker={self.ray_cpus_per_worker!r}: must be > 0")
        timeout = self.engine_timeout
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if timeout is not None and (not number or not timeout > 0):
            raise ConfigError(f"EngineArgs.engine_timeout={timeout!r}: must be None or > 0 (seconds)")
        if not isinstance(self.stats_log_interval, (int, float)) or not self.stats_log_interval > 0:
            raise ConfigError(f"EngineArgs.stats_log_interval={self.stats_log_interval!r}: must be > 0")

    def create_engine_config(self) -> EngineConfig:
        """Validate, resolve the model to a local path (fetching the default model once), and split.

        Raises:
            ConfigError: bad values.
            ModelNotFoundError: the model cannot be resolved or fetched.
        """
        from asyncllm.model.resolve import resolve_model_path

        self.validate()
        model = ModelConfig(
            model=os.fspath(self.model),
            model_path=str(resolve_model_path(self.model)),
            load_format=self.load_format,
            max_model_len=self.max_model_len,
            seed=self.seed,
            quantization=self.quantization,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=bool(self.enable_prefix_caching),
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,
        )
        parallel = ParallelConfig(
            engine_process=self.engine_process,
            num_threads=self.num_threads,
            distributed_executor_backend=executor_backend_name(self.distributed_executor_backend, self.engine_process),
            tensor_parallel_size=self.tensor_parallel_size,
            ray_address=self.ray_address,
            ray_placement_timeout_s=float(self.ray_placement_timeout_s),
            ray_cpus_per_worker=float(self.ray_cpus_per_worker),
            engine_timeout=None if self.engine_timeout is None else float(self.engine_timeout),
        )
        observability = ObservabilityConfig(
            log_stats=bool(self.log_stats), stats_log_interval=float(self.stats_log_interval)
        )
        return EngineConfig(
            model=model, cache=cache, scheduler=scheduler, parallel=parallel, observability=observability
        )


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
