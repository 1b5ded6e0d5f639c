"""Waiting for a state to change, for threads and coroutines alike."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Notifier:
    """Wakes waiters when the state changes: threads block on a Condition, coroutines await a
    future resolved on their own loop (thread-safe, so a thread may wake a coroutine)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def bump(self) -> None:
        with self._cond:
            self._cond.notify_all()
            futures, self._futures = self._futures, []
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def wait(self, pred: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(pred)

    async def wait_async(self, pred: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if pred():
                    return
                fut = loop.create_future()
                self._futures.append((loop, fut))
            await fut


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
