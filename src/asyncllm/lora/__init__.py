"""Per-request LoRA adapters over the shared base model (docs/lora.md).

`request.py` (the user's `LoRARequest`, no torch), `peft.py` (reads and checks a PEFT adapter directory without
torch: frontend and engine core), `weights.py` (an adapter's tensors in the model's fused layout, this TP rank's
shard; the per-step `LoRABatch` the model adds), `manager.py` (the worker's bounded LRU of loaded adapters).
"""

from asyncllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
