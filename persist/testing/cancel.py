"""Cancelling a public call at its await points, the way a caller's timeout or shutdown does.

Two ways reach two kinds of await point:

- ``Faults(cancel=p)`` cancels the call's task when it calls its location (before the call
  runs, or after it took effect); ``under_test`` makes the call's task the faults' target.
- ``under_test(..., cancel_after=k)`` cancels the task after ``k`` event-loop iterations, which
  lands on whatever the call awaits then: a lock, a thread, a sleep between retries, a queue.

A cancelled call's outcome is indeterminate, as a lost reply's is: the caller settles it by
reading the upper or by retrying the same call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from persist.testing.faults import Faults

__all__ = ["CallCancelled", "under_test"]

T = TypeVar("T")


class CallCancelled(Exception):
    """The call under test ended cancelled (its outcome, for a write, is unknown)."""

    def __init__(self, how: str) -> None:
        super().__init__(f"the call was cancelled ({how})")
        self.how = how


async def under_test(
    coro: Coroutine[Any, Any, T],
    faults: Faults | None = None,
    *,
    cancel_after: int | None = None,
    lose_reply: str | None = None,
    cancel_at: str | None = None,
) -> T:
    """Runs ``coro`` as its own task, the target of ``faults``; cancels it after
    ``cancel_after`` loop iterations when given, and loses the reply of its first ``lose_reply``
    operation that takes effect, and cancels it at its first ``cancel_at`` operation (before it
    runs). Raises ``CallCancelled`` when it ended cancelled; the caller's
    own task is never cancelled by this."""
    task: asyncio.Task[T] = asyncio.ensure_future(coro)
    cancelled_by_us = False
    if faults is None:
        await _drive(task, cancel_after)
    else:
        with faults.target(task):
            if lose_reply is not None:
                faults.lose_next_reply(lose_reply)
            if cancel_at is not None:
                faults.cancel_next(cancel_at)
            cancelled_by_us = await _drive(task, cancel_after)
    if task.cancelled():
        raise CallCancelled("after a number of loop iterations" if cancelled_by_us else "faults")
    return task.result()


async def _drive(task: asyncio.Task[Any], cancel_after: int | None) -> bool:
    """Waits for ``task``, cancelling it after ``cancel_after`` iterations; True if it did."""
    cancelled = False
    if cancel_after is not None:
        for _ in range(cancel_after):
            if task.done():
                break
            await asyncio.sleep(0)
        if not task.done():
            task.cancel()
            cancelled = True
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        # Our own caller is going away (a timeout): take the call with us.
        task.cancel()
        raise
    return cancelled
