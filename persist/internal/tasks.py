"""The background tasks of a client, how a task tells it was asked to stop, and how
maintenance's data work steps aside for callers'."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("persist")

__all__ = ["Tasks", "being_cancelled", "foreground", "in_background_thread", "step_aside"]


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


# Work callers wait on (the encoding and writing of appends) in flight in this process.
_foreground = 0
_foreground_lock = threading.Lock()
_STEP_ASIDE_POLL_S = 0.005
# Bounds how long one background step waits, so a steady stream of writes can't starve it.
_STEP_ASIDE_MAX_S = 0.5
# Maintenance's data work has threads of its own: in the loop's default pool, a merge decoding
# its inputs would hold the threads that callers' blob writes and reads queue for.
_BACKGROUND = ThreadPoolExecutor(max_workers=2, thread_name_prefix="persist-maintenance")


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Marks data work a caller waits on; background steps wait (a bounded time) for it."""
    global _foreground
    with _foreground_lock:
        _foreground += 1
    try:
        yield
    finally:
        with _foreground_lock:
            _foreground -= 1


async def step_aside() -> None:
    """Returns once no caller's data work is in flight (or after a bounded wait): maintenance
    calls it before each step of data work (decoding, encoding, a blob write). Stepping aside
    leaves callers the CPU, the disk and the GIL; lowering the threads' priority instead would
    starve ``client.maintain`` whenever other processes keep the CPU busy."""
    waited = 0.0
    while _foreground and waited < _STEP_ASIDE_MAX_S:
        await asyncio.sleep(_STEP_ASIDE_POLL_S)
        waited += _STEP_ASIDE_POLL_S


async def in_background_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a maintenance thread, after ``step_aside``: for maintenance (merges),
    never for work a caller waits on."""
    await step_aside()
    return await asyncio.get_running_loop().run_in_executor(_BACKGROUND, fn, *args)
