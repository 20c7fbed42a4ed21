"""Running persist's asyncio API from Spark's synchronous Python workers.

Each worker process gets one event loop on a daemon thread. A task's calls hop onto it and wait,
while the loop keeps running between them: the handles a task resumes go on heartbeating while
Spark's thread is busy elsewhere (pulling rows from the plan, say). Spark forks its workers, so
the loop belongs to the process that started it and a fork starts its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import persist
from persist.spark._options import Options

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0
_thread: threading.Thread | None = None


def _runtime_loop() -> asyncio.AbstractEventLoop:
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            global _thread
            loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=loop.run_forever, name="persist-spark", daemon=True)
            _thread.start()
            _loop, _pid = loop, os.getpid()
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs ``coro`` on this process's persist loop and waits for its result."""
    loop = _runtime_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("persist.spark: run() called on its own loop (await instead)")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def iterate(agen: AsyncIterator[T]) -> Iterator[T]:
    """The items of an async iterator, pulled one at a time through the persist loop."""

    async def step() -> list[T]:
        try:
            return [await agen.__anext__()]
        except StopAsyncIteration:
            return []

    try:
        while items := run(step()):
            yield items[0]
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            run(aclose())


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
