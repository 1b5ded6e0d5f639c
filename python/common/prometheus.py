"""Prometheus metric types in the text exposition format (version 0.0.4), for the server's and the router's
/metrics."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    parts = [f'{n}="{esc(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Counter:
    """A monotonically increasing count; `name` ends in `_total`."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        if not name.endswith("_total"):
            raise ValueError(f"counter name must end in _total: {name}")
        self.name, self.help, self.labelnames = name, help, labelnames
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0}

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up (got {amount})")
        key = tuple(str(labels[n]) for n in self.labelnames)
        self.values[key] = self.values.get(key, 0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(str(labels[n]) for n in self.labelnames), 0)

    def samples(self) -> Iterable[str]:
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_fmt(v)}"


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help: str):
        self.name, self.help, self.value = name, help, 0.0

    def set(self, value: float) -> None:
        self.value = value

    def samples(self) -> Iterable[str]:
        yield f"{self.name} {_fmt(self.value)}"


class Histogram:
    """Cumulative buckets (`le`), `_sum` and `_count`, as Prometheus expects."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        self.name, self.help = name, help
        self.bounds = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative; summed when rendered
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> Iterable[str]:
        running = 0
        for bound, c in zip(self.bounds, self.counts, strict=True):
            running += c
            yield f'{self.name}_bucket{{le="{_fmt(bound)}"}} {running}'
        yield f"{self.name}_sum {_fmt(self.sum)}"
        yield f"{self.name}_count {self.count}"
