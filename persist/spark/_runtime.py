"""Running persist's asyncio API from Spark's synchronous Python workers.

Each worker process gets one event loop on a daemon thread (``persist.bridge.LoopThread``). A
task's calls hop onto it and wait, while the loop keeps running between them: the handles a task
resumes go on heartbeating while Spark's thread is busy elsewhere (pulling rows from the plan,
say). Spark forks its workers, so the loop belongs to the process that started it and a fork
starts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import persist
from persist.bridge import LoopThread
from persist.spark._options import Options

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` on this process's persist loop and waits for its result."""
    return LoopThread.for_process().run(coro)


def iterate(agen: AsyncIterator[T]) -> Iterator[T]:
    """The items of an async iterator, pulled one at a time through the persist loop; it is
    closed on the loop (and waited for) however the iteration ends."""
    return LoopThread.for_process().iterate(agen)


@contextlib.contextmanager
def client(options: Options) -> Iterator[persist.PersistClient]:
    """A client on the options' location, closed at exit. Closing it stops the heartbeats of the
    handles it resumed without expiring them: they belong to the job, not the task."""
    c = run(_connect(options))
    try:
        yield c
    finally:
        run(c.close())


async def _connect(options: Options) -> persist.PersistClient:
    return await persist.connect(options.blob, options.consensus)
