"""Running persist's asyncio API from Spark's synchronous Python workers.

Each worker process gets one event loop on a daemon thread (``persist.bridge.LoopThread``). A
task's calls hop onto it and wait, while the loop keeps running between them: the handles a task
resumes go on heartbeating while Spark's thread is busy elsewhere (pulling rows from the plan,
say). Spark forks its workers, so the loop belongs to the process that started it and a fork
starts its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

import persist
from persist.bridge import LoopThread
from persist.errors import PersistError
from persist.spark._options import Options

T = TypeVar("T")
P = ParamSpec("P")

_log = logging.getLogger("persist.spark")


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
    # A task's client writes the parts of a Spark write: of the job's size.
    target = options.part_target_bytes
    config = None if target is None else persist.PersistConfig(part_target_bytes=target)
    return await persist.connect(options.blob, options.consensus, config=config)


def _hide_traceback(exc: PersistError) -> None:
    # pyspark formats a worker's error as its whole traceback, the ``persist.<Class>: message``
    # line last; with this set (read when the error is formatted, in the worker that raised it,
    # which then exits) that line is all Spark shows. The traceback goes to the worker's log.
    _log.debug("persist error in a Spark worker", exc_info=exc)
    os.environ["SPARK_HIDE_TRACEBACK"] = "1"


def presented(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn``, whose persist errors reach the Spark user as ``persist.<Class>: message`` first,
    not buried under a Python traceback."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except PersistError as exc:
            _hide_traceback(exc)
            raise

    return call


def presented_rows(rows: Iterable[T]) -> Iterator[T]:
    """``rows``, whose persist errors (raised while they are pulled) are shown as by
    ``presented``."""
    try:
        yield from rows
    except PersistError as exc:
        _hide_traceback(exc)
        raise
