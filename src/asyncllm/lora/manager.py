"""`LoRAManager`: the worker's bounded cache of loaded adapters (least recently used evicted first).

The scheduler keeps at most `max_loras` distinct adapters among the running requests, so every adapter of a step
fits; an adapter a step needs that is not loaded is read from its directory (again after an eviction), taking the
place of the least recently used adapter that this step does not use. After vLLM's `LRUCacheWorkerLoRAManager`
(vllm/lora/worker_manager.py), with one cache level: on a CPU, a loaded adapter is already where the forward reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from asyncllm.lora.request import LoRARequest
from asyncllm.lora.weights import AdapterWeights, LoRABatch, LoRALayerLike, load_adapter
from asyncllm.model.arch import ModelArchConfig


class LoRAManager:
    """Loads adapters on demand into at most `max_loras` places and builds each step's `LoRABatch`.

    Args:
        arch: the model's hyper-parameters (adapter shapes are checked against them).
        layers: the model's decoder layers (fused layout and this rank's shard).
        max_loras: adapters loaded at once at most (>= the distinct adapters of any step).
        max_lora_rank: the largest rank accepted.
    Attributes:
        num_loads: adapters read from disk so far (first loads and reloads after eviction).
    """

    def __init__(
        self, arch: ModelArchConfig, layers: Sequence[LoRALayerLike], max_loras: int, max_lora_rank: int
    ) -> None:
        self.arch = arch
        self.layers = layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.num_loads = 0
        self._loaded: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recently used first

    def list_loras(self) -> list[int]:
        """Ids of the loaded adapters, least recently used first."""
        return list(self._loaded)

    def make_batch(self, lora_requests: Sequence[LoRARequest | None], query_lens: np.ndarray) -> LoRABatch | None:
        """Load the step's adapters (evicting unused ones as needed) and group its rows by adapter.

        Args:
            lora_requests: each scheduled request's adapter (None = base model), in batch order.
            query_lens: [num_requests] tokens of each request this step.
        Returns:
            The step's `LoRABatch`, or None when no request has an adapter.
        Raises:
            RuntimeError: the step has more than `max_loras` adapters (a scheduler bug).
            InvalidRequestError: an adapter directory no longer reads or checks (changed since submission).
        """
        wanted = {r.lora_int_id: r for r in lora_requests if r is not None}
        if not wanted:
            return None
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; max_loras={self.max_loras}")
        for lora_id in wanted.keys() & self._loaded.keys():
            self._loaded.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self._loaded:
                self._evict_for(wanted.keys())
                self._loaded[lora_id] = load_adapter(request, self.arch, self.layers, self.max_lora_rank)
                self.num_loads += 1
        ids = [0 if r is None else r.lora_int_id for r in lora_requests]
        return LoRABatch.from_requests(ids, query_lens, self._loaded)

    def _evict_for(self, in_use: AbstractSet[int]) -> None:
        """Drop least recently used adapters not in `in_use` until one more fits."""
        while len(self._loaded) >= self.max_loras:
            victim = next(lora_id for lora_id in self._loaded if lora_id not in in_use)
            del self._loaded[victim]
