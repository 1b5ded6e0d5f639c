"""`radixgen router` options: one frozen dataclass whose fields are also the flags (radixgen.common.flags),
validated before anything starts. The worker list is the one flag outside it (`--worker-urls URL ...`)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

from radixgen.common.flags import add_dataclass_flags, values_of
from radixgen.common.options import check_choice, option
from radixgen.router.policies import POLICIES
from radixgen.router.workers import normalize_url

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = option("cache_aware", "how a worker is chosen for each request", choices=POLICIES)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_keys: tuple[str, ...] = option(
        (), "require `Authorization: Bearer <key>` with one of these keys at the router (without any, the "
        "client's header goes to the workers, which check their own keys)", flags=("--api-key",)
    )
    health_check_interval: float = option(5.0, "seconds between two /health checks of every worker")
    balance_abs_threshold: int = option(
        32, "cache_aware: the loads (requests in flight) are out of balance when max - min exceeds this ..."
    )
    balance_rel_threshold: float = option(1.5, "cache_aware: ... and max exceeds this times min")
    cache_threshold: float = option(
        0.5, "cache_aware: a match shorter than this fraction of the prompt counts as none (the request goes to the "
        "least loaded worker)"
    )
    max_tree_chars: int = option(1 << 24, "cache_aware: characters of prompt text remembered per worker (LRU)")
    log_level: str = option("info", "log level of the router", choices=LOG_LEVELS)
    max_request_bytes: int = option(32 << 20, "a request body larger than this is refused (413) before it is forwarded")

    def __post_init__(self) -> None:
        check_choice("policy", self.policy, POLICIES)
        check_choice("log_level", self.log_level, LOG_LEVELS)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.health_check_interval <= 0:
            raise ValueError(f"health_check_interval must be positive, got {self.health_check_interval}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_tree_chars <= 0:
            raise ValueError(f"max_tree_chars must be positive, got {self.max_tree_chars}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api_keys: a key must be non-empty, without surrounding whitespace")
        if self.policy != "cache_aware":  # never accept an option and ignore it
            changed = [k for k in _CACHE_AWARE_KEYS if getattr(self, k) != _DEFAULTS[k]]
            if changed:
                raise ValueError(f"{', '.join(changed)}: only used by the cache_aware policy, not {self.policy}")

    def cache_aware_options(self) -> dict:
        if self.policy != "cache_aware":
            return {}
        return {
            "balance_abs": self.balance_abs_threshold,
            "balance_rel": self.balance_rel_threshold,
            "cache_threshold": self.cache_threshold,
            "max_tree_chars": self.max_tree_chars,
        }

    def public(self) -> dict:
        return {**asdict(self), "api_keys": f"<{len(self.api_keys)} set>" if self.api_keys else None}


_CACHE_AWARE_KEYS = ("balance_abs_threshold", "balance_rel_threshold", "cache_threshold", "max_tree_chars")
_DEFAULTS = {f.name: f.default for f in fields(RouterConfig)}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker-urls", nargs="*", action="extend", default=[], metavar="URL",
        help="http://host:port of each worker (more can join later by POST /add_worker?url=...)",
    )
    add_dataclass_flags(parser, RouterConfig)


def router_args_from(ns: argparse.Namespace) -> tuple[RouterConfig, tuple[str, ...]]:
    """(the config, the normalized worker URLs); raises ValueError naming a bad value."""
    urls = tuple(normalize_url(u) for u in ns.worker_urls)
    if len(set(urls)) != len(urls):
        raise ValueError(f"--worker-urls: a worker is listed twice: {list(urls)}")
    return RouterConfig(**values_of(RouterConfig, ns)), urls
