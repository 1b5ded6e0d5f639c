"""The router's workers: their URLs, health and in-flight counts, and the periodic health check."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from radixgen.router.policies import Candidate, Policy

HEALTH_TIMEOUT_S = 5.0
FAILED_CHECKS_TO_LEAVE = 2  # a slow answer or one 5xx is not yet death; a refused connection is
logger = logging.getLogger("radixgen.router")


def normalize_url(url: str) -> str:
    """`http(s)://host[:port]` without a trailing slash; anything else is a ValueError naming it."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"worker url must look like http://host:port, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as e:
        raise ValueError(f"worker url {url!r}: {e}") from e
    return url


@dataclass(eq=False)
class Worker:
    url: str
    healthy: bool = False  # unknown until the first check passes
    in_flight: int = 0  # requests the router has sent and not finished relaying
    last_error: str | None = None
    failed_checks: int = 0  # consecutive


class WorkerPool:
    """Workers by URL. A worker that fails a health check (or a connection) leaves the rotation and the
    policy forgets what it routed there; it rejoins with an empty tree when a check passes again."""

    def __init__(self, policy: Policy, client: httpx.AsyncClient):
        self.policy = policy
        self.client = client
        self.workers: dict[str, Worker] = {}

    def add(self, url: str) -> Worker:
        url = normalize_url(url)
        if url in self.workers:
            raise ValueError(f"worker {url} is already in the pool")
        self.workers[url] = worker = Worker(url)
        return worker

    def remove(self, url: str) -> Worker:
        """Requests in flight on it finish; new ones go elsewhere."""
        worker = self.workers.pop(normalize_url(url), None)
        if worker is None:
            raise KeyError(f"worker {url} is not in the pool")
        self.policy.forget(worker.url)
        return worker

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def candidates(self, exclude: set[str]) -> list[Candidate]:
        return [Candidate(w.url, w.in_flight) for w in self.healthy() if w.url not in exclude]

    def mark_down(self, worker: Worker, why: str) -> None:
        if worker.healthy:
            logger.warning("worker %s left the rotation: %s", worker.url, why)
        worker.healthy = False
        worker.last_error = why
        self.policy.forget(worker.url)

    async def check(self, worker: Worker) -> bool:
        refused = False
        try:
            r = await self.client.get(f"{worker.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
            refused = isinstance(e, httpx.ConnectError)
        if worker.url not in self.workers:  # removed while the check ran
            return ok
        if ok:
            if not worker.healthy:
                logger.info("worker %s is healthy", worker.url)
            worker.healthy, worker.last_error, worker.failed_checks = True, None, 0
            return True
        worker.failed_checks += 1
        worker.last_error = why
        if refused or worker.failed_checks >= FAILED_CHECKS_TO_LEAVE:
            self.mark_down(worker, why)
        return False

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))

    async def run_health_checks(self, interval_s: float) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the checks must go on whatever one round hit
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)
