"""Metrics read back as objects (vLLM's `vllm.v1.metrics.reader`): `LLM.get_metrics()` / `AsyncLLM.get_metrics()`.

Each metric family of a Prometheus registry whose name has the engine's prefix (`asyncllm:`, or `vllm:` with
`EngineArgs(metrics_prefix="vllm")`) becomes one object per label set:
    Gauge(name, labels, value)
    Counter(name, labels, value: int)                   name without the `_total` suffix, as the family's
    Vector(name, labels, values: list[int])             `spec_decode_num_accepted_tokens_per_pos`: one value per
                                                        draft position (the `position` label folded in)
    Histogram(name, labels, count, sum, buckets)        buckets: upper bound as text ("0.01", ..., "+Inf") ->
                                                        cumulative count, as Prometheus keeps them
Other collector types (summary, info, ...) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector", "get_metrics_snapshot"]

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """One metric of one label set."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: Any, prefix: str = "asyncllm") -> list[Metric]:
    """The metrics of `registry` (a prometheus-client `CollectorRegistry`) named `<prefix>:*`, now.

    Returns:
        One `Metric` per family and label set (see the module docstring); [] for a None registry.
    """
    if registry is None:
        return []
    found: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(f"{prefix}:"):
            continue
        if family.type == "gauge":
            found += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name == f"{family.name}_total"]
            if family.name.endswith(PER_POSITION):
                found += _vectors(family.name, totals)
            else:
                found += [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
        elif family.type == "histogram":
            found += _histograms(family.name, family.samples)
    return found


def _key(labels: dict[str, str], without: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != without))


def _vectors(name: str, samples: list[Any]) -> list[Metric]:
    by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for sample in samples:
        by_labels.setdefault(_key(sample.labels, "position"), {})[int(sample.labels["position"])] = int(sample.value)
    vectors: list[Metric] = []
    for key, values in by_labels.items():
        vectors.append(Vector(name, dict(key), [values.get(i, 0) for i in range(max(values) + 1)]))
    return vectors


def _histograms(name: str, samples: list[Any]) -> list[Metric]:
    parts: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in samples:
        part = parts.setdefault(_key(sample.labels, "le"), {"buckets": {}, "count": 0, "sum": 0.0})
        if sample.name == f"{name}_bucket":
            part["buckets"][sample.labels["le"]] = int(sample.value)
        elif sample.name == f"{name}_count":
            part["count"] = int(sample.value)
        elif sample.name == f"{name}_sum":
            part["sum"] = float(sample.value)
    return [Histogram(name, dict(key), p["count"], p["sum"], p["buckets"]) for key, p in parts.items()]
