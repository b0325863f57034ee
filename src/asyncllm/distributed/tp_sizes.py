"""Which tensor-parallel sizes a model's shapes allow (torch-free: the frontend checks it before any process
starts; the executors and the model check it again where they build the shards)."""

from __future__ import annotations

from asyncllm.errors import ConfigError


def check_tp_divides(num_attention_heads: int, num_key_value_heads: int, intermediate_size: int, tp: int) -> None:
    """Check that `tp` ranks can each take an equal share of query heads, KV heads and MLP columns.

    KV heads are never replicated: a TP size that does not divide the KV head count is rejected. SmolLM2-135M
    (9 query heads, 3 KV heads, 1536 MLP columns) runs at TP=1 or TP=3; TP=2 is rejected.
    Raises:
        ConfigError: naming the counts that `tp` does not divide and the sizes that would work.
    """
    counts = {
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
    }
    bad = {name: n for name, n in counts.items() if n % tp}
    if bad:
        valid = [t for t in range(1, num_key_value_heads + 1) if all(n % t == 0 for n in counts.values())]
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide the model's {bad}; valid sizes for this model: {valid}"
        )
