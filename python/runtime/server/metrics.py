"""Prometheus metrics kept by the HTTP process, rendered in the text exposition format (version 0.0.4)."""

from __future__ import annotations

from radixgen.common.prometheus import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
        self.tier_hit_tokens = Counter(
            f"{p}_prefix_cache_hit_tokens_by_tier_total",
            "Prompt tokens served from the prefix cache, by the tier they were in at arrival (device, host, disk)",
            ("tier",),
        )
        self.host_tier_used = Gauge(f"{p}_hicache_host_tokens", "Tokens held in the hierarchical cache's host tier")
        self.host_tier_total = Gauge(f"{p}_hicache_host_capacity_tokens", "Capacity of the host tier, in tokens")
        self.disk_tier_pages = Gauge(f"{p}_hicache_disk_pages", "Page files this server knows in the disk tier")
        self.disk_tier_bytes = Gauge(f"{p}_hicache_disk_bytes", "Bytes of those page files")
        self.disk_tier_on = Gauge(f"{p}_hicache_disk_enabled", "1 while the disk tier is in use (0: off or turned off)")
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
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            self.tier_hit_tokens.inc(n, tier=tier)
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
        tiers = info.get("hicache") or {}
        host, disk = tiers.get("host") or {}, tiers.get("disk") or {}
        self.host_tier_used.set(host.get("used_tokens", 0))
        self.host_tier_total.set(host.get("capacity_tokens", 0))
        self.disk_tier_pages.set(disk.get("pages", 0))
        self.disk_tier_bytes.set(disk.get("bytes", 0))
        self.disk_tier_on.set(1 if disk.get("enabled") else 0)

    def all(self) -> list:
        return [v for v in vars(self).values() if isinstance(v, (Counter, Gauge, Histogram))]

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all():
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples())
        return "\n".join(lines) + "\n"
