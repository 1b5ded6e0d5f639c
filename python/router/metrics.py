"""The router's own Prometheus metrics (text format 0.0.4): per worker requests, matched prompt prefix,
failed attempts; the health and in-flight count of every worker as gauges read at scrape time."""

from __future__ import annotations

from radixgen.common.prometheus import PROMETHEUS_CONTENT_TYPE, Counter
from radixgen.router.workers import WorkerPool

__all__ = ["PROMETHEUS_CONTENT_TYPE", "RouterMetrics"]


class RouterMetrics:
    def __init__(self, prefix: str = "radixgen_router"):
        p = prefix
        self.requests = Counter(f"{p}_requests_total", "Requests routed, by worker and route", ("worker", "route"))
        self.prompt_chars = Counter(f"{p}_prompt_chars_total", "Prompt characters routed, by worker", ("worker",))
        self.matched_chars = Counter(
            f"{p}_matched_prefix_chars_total",
            "Prompt characters the cache-aware tree of the chosen worker already held (its expected cache hit)",
            ("worker",),
        )
        self.failed_attempts = Counter(
            f"{p}_failed_attempts_total",
            "Attempts that failed before their first byte (retried on another worker), by worker",
            ("worker",),
        )
        self.unserved = Counter(f"{p}_unserved_requests_total", "Requests answered 503: no worker could serve them")
        self.broken_streams = Counter(
            f"{p}_broken_streams_total", "Streams cut by their worker after the first byte", ("worker",)
        )

    def render(self, pool: WorkerPool) -> str:
        lines: list[str] = []
        for m in (self.requests, self.prompt_chars, self.matched_chars, self.failed_attempts, self.unserved,
                  self.broken_streams):
            lines += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} counter", *m.samples()]
        workers = sorted(pool.workers.values(), key=lambda w: w.url)
        for name, help_, value in (
            ("worker_healthy", "1 while the worker is in the rotation", lambda w: int(w.healthy)),
            ("worker_in_flight", "Requests in flight on the worker", lambda w: w.in_flight),
        ):
            lines += [f"# HELP radixgen_router_{name} {help_}", f"# TYPE radixgen_router_{name} gauge"]
            lines += [f'radixgen_router_{name}{{worker="{w.url}"}} {value(w)}' for w in workers]
        return "\n".join(lines) + "\n"
