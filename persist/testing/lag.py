"""How long the event loop stalls: a ticker that measures how late its wake-ups are.

A library on asyncio shares its loop with the application; decoding a large part or hashing on
the loop's thread delays every other task (heartbeats included). ``LoopLag`` wakes every
``interval_s`` and keeps the worst lateness it saw::

    async with LoopLag() as lag:
        await work()
    print(lag.worst_ms)

It reports, it never asserts: how late a wake-up is depends on the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

__all__ = ["LoopLag"]


class LoopLag:
    """The worst lateness (ms) of a ticker on the running loop, between ``start`` and ``stop``."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.worst_ms = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts ticking on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = (loop.time() - due) * 1000.0
            self.ticks += 1
            if late > self.worst_ms:
                self.worst_ms = late

    async def __aenter__(self) -> LoopLag:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
