"""Prometheus metrics kept by the HTTP process, rendered in the text exposition format (version 0.0.4)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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


class ServerMetrics:
    """Everything /metrics reports. Token counts come from finished requests' meta_info."""

    def __init__(self, prefix: str = "radixgen"):
        p = prefix
        self.requests = Counter(f"{p}_requests_total", "HTTP generation requests received", ("api",))
        self.finished = Counter(
            f"{p}_requests_finished_total", "Generation requests finished, by finish reason", ("reason",)
        )
        self.errors = Counter(f"{p}_request_errors_total", "Requests answered with an error", ("status",))
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = Counter(f"{p}_generation_tokens_total", "Generated tokens")
        self.cache_hit_tokens = Counter(
            f"{p}_prefix_cache_hit_tokens_total", "Prompt tokens served from the radix prefix cache"
        )
        self.cache_query_tokens = Counter(
            f"{p}_prefix_cache_query_tokens_total", "Prompt tokens looked up in the radix prefix cache"
        )
        self.spec_draft_tokens = Counter(f"{p}_spec_draft_tokens_total", "Speculative draft tokens proposed")
        self.spec_accepted_tokens = Counter(
            f"{p}_spec_accepted_tokens_total", "Speculative draft tokens accepted (kept in the output)"
        )
        self.spec_verify = Counter(f"{p}_spec_verify_steps_total", "Decode steps of requests under speculation")
        self.num_running = Gauge(f"{p}_num_running_reqs", "Requests in the running batch")
        self.num_waiting = Gauge(f"{p}_num_waiting_reqs", "Requests waiting in the scheduler queue")
        self.kv_total = Gauge(f"{p}_kv_slots_total", "KV cache slots")
        self.kv_free = Gauge(f"{p}_kv_slots_free", "Free KV cache slots")
        self.kv_evictable = Gauge(f"{p}_kv_slots_evictable", "Cached KV slots that may be evicted")
        self.kv_protected = Gauge(f"{p}_kv_slots_protected", "Cached KV slots locked by running requests")
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Time from request arrival to the first token",
            LATENCY_BUCKETS,
        )
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time between output tokens", ITL_BUCKETS)
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds", "Time from request arrival to its last token", LATENCY_BUCKETS
        )

    def observe_finished(self, meta: dict) -> None:
        """Count one finished output (one choice) from its meta_info."""
        reason = meta.get("finish_reason") or {}
        self.finished.inc(reason=reason.get("type", "unknown"))
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        self.cache_hit_tokens.inc(meta.get("cached_tokens", 0))
        self.cache_query_tokens.inc(meta.get("prompt_tokens", 0))
        self.spec_draft_tokens.inc(meta.get("spec_draft_token_num", 0))
        self.spec_accepted_tokens.inc(meta.get("spec_accept_token_num", 0))
        self.spec_verify.inc(meta.get("spec_verify_ct", 0))

    def update_from_server_info(self, info: dict) -> None:
        self.num_running.set(info.get("num_running", 0))
        self.num_waiting.set(info.get("num_waiting", 0))
        cache = info.get("cache") or {}
        self.kv_total.set(cache.get("total", 0))
        self.kv_free.set(cache.get("free", 0))
        self.kv_evictable.set(cache.get("evictable", 0))
        self.kv_protected.set(cache.get("protected", 0))

    def all(self) -> list:
        return [v for v in vars(self).values() if isinstance(v, (Counter, Gauge, Histogram))]

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all():
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples())
        return "\n".join(lines) + "\n"
