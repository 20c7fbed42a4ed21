"""The background tasks of a client, and how a task tells it was asked to stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("persist")

__all__ = ["Tasks", "being_cancelled"]


def being_cancelled() -> bool:
    """Whether the current task was asked to stop (background loops then must not go on)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Tasks:
    """The background tasks of a client: kept referenced, logged when they fail, cancelled on close."""

    def __init__(self, compaction_concurrency: int = 1) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        # Shared by every shard of the client: bounds the memory and CPU compaction takes.
        self.compaction_gate = asyncio.Semaphore(compaction_concurrency)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        if self.closed:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "persist background task %s failed", task.get_name(), exc_info=task.exception()
            )

    async def close(self) -> None:
        self.closed = True
        # Cancel until they are gone: on Python 3.11 a cancellation can be lost inside
        # asyncio.wait_for (used by psycopg's pool), leaving a loop to run on. Asking again
        # soon keeps close() prompt; the loops also check being_cancelled() before they wait.
        while self._tasks:
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=0.05)
