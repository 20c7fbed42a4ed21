"""Running a backend call so that, when its cancellation returns, its effect is settled.

``asyncio.to_thread`` and ``loop.run_in_executor`` hand a cancelled caller its ``CancelledError``
at once while the thread keeps running: a write cancelled by a timeout can land seconds later,
after the caller concluded from a read that it had not. Persist's commit loop reads the state
after an indeterminate outcome to settle it, so a Blob or Consensus call must not outlive its
cancellation. These helpers wait for the work to finish (or make sure it never starts) before
re-raising the cancellation.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

__all__ = ["run_in_task", "run_in_thread"]

_T = TypeVar("_T")


class _Stage(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    SKIPPED = "skipped"


class _Skipped(Exception):
    """The job was cancelled before it started, so it did not run (nobody reads this)."""


class _Job(Generic[_T]):
    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._stage = _Stage.QUEUED

    def run(self) -> _T:
        with self._lock:
            if self._stage is _Stage.SKIPPED:
                raise _Skipped
            self._stage = _Stage.RUNNING
        try:
            return self._fn()
        finally:
            with self._lock:
                self._stage = _Stage.DONE

    def cancel(self, on_cancel: Callable[[], None] | None) -> bool:
        """True if the job will never run; otherwise calls ``on_cancel`` if it is still running.

        ``on_cancel`` runs under the job's lock, so the job can't finish meanwhile and let the
        worker start another job that ``on_cancel`` (say, interrupting a connection) would hit.
        """
        with self._lock:
            if self._stage is _Stage.QUEUED:
                self._stage = _Stage.SKIPPED
                return True
            if self._stage is _Stage.RUNNING and on_cancel is not None:
                on_cancel()
            return False


async def _wait_through_cancellations(fut: asyncio.Future[Any]) -> None:
    """Waits until ``fut`` is done, however often this task is cancelled meanwhile.

    The cancellations are swallowed here, not undone: the caller re-raises one CancelledError
    and every ``cancel()`` stays counted in ``Task.cancelling()``, so ``asyncio.timeout`` and
    an outer canceller each still see their own.
    """
    while not fut.done():
        try:
            await asyncio.wait((fut,))
        except asyncio.CancelledError:
            continue
    # The outcome is dropped (the caller was cancelled), but marked retrieved so asyncio does
    # not log it as never retrieved.
    _drop_outcome(fut)


async def run_in_thread(
    fn: Callable[[], _T],
    *,
    executor: Executor | None = None,
    on_cancel: Callable[[], None] | None = None,
) -> _T:
    """``fn()`` in ``executor`` (default: the loop's, like ``asyncio.to_thread``), settled on cancel.

    Cancelled before ``fn`` started, it never starts. Cancelled while it runs, ``on_cancel`` is
    called (once, on the event loop; it must be quick and thread-safe: e.g. interrupt the
    blocking call) and the cancellation returns only once ``fn`` has returned or raised; its
    outcome is dropped and the caller gets ``CancelledError`` all the same.
    """
    loop = asyncio.get_running_loop()
    job = _Job(fn)
    ctx = contextvars.copy_context()
    fut = loop.run_in_executor(executor, ctx.run, job.run)
    try:
        # Shielded: cancelling the executor's future would not stop a running thread anyway.
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if job.cancel(on_cancel):
            # It will fail with _Skipped when the worker reaches it: retrieve that, or asyncio
            # logs it as an exception never retrieved.
            fut.add_done_callback(_drop_outcome)
        else:
            await _wait_through_cancellations(fut)
        raise


def _drop_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def run_in_task(coro: Coroutine[Any, Any, _T]) -> _T:
    """Awaits ``coro`` in its own task, which gets one cancellation however many this one gets.

    For coroutines that settle their own cancellation only if it comes once: psycopg answers
    a cancellation by cancelling the query on the server and waiting for it to end, but a
    second one while it waits makes it close the connection and give up waiting, with the
    statement possibly still queued on a lock and landing later.
    """
    task = asyncio.get_running_loop().create_task(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        await _wait_through_cancellations(task)
        raise
