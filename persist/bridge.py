"""Where synchronous threads meet persist's asyncio API: the one bridge every front end uses.

persist is asyncio through and through, but its front ends are called on threads that are not
the loop's: gRPC's threads in ``persist serve``, Spark's Python workers, a test harness's steps.
Each hands a coroutine to one event loop and waits for it on its own thread. The hazards are the
same everywhere, so they are handled here once:

- a waiting thread must notice that its caller gave up (a cancelled gRPC call, a deadline) and
  cancel the coroutine, not leave it running for nobody;
- a loop shut down or cancelling under the waiter must end the wait, not hang it;
- a thread must never wait for the loop it runs on (a deadlock): that is refused at once;
- an async iterator pulled from a thread must be closed on the loop when the thread stops,
  whatever stopped it.

``LoopBridge(loop)`` bridges to a loop someone else runs (the Flight server's own);
``LoopThread.for_process()`` runs a loop of its own on a daemon thread, one per process (a fork
starts its own: Spark forks its Python workers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["Cancelled", "LoopBridge", "LoopThread"]

T = TypeVar("T")

# How often a waiting thread asks whether its caller gave up.
POLL_S = 0.1


class Cancelled(Exception):
    """The waiting thread's caller gave up (its ``cancelled()`` turned true): the coroutine was
    cancelled on the loop."""


class LoopBridge:
    """Runs coroutines on ``loop`` for threads other than the loop's own."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._loop_thread: int | None = None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._loop_thread = threading.get_ident()
        else:
            loop.call_soon_threadsafe(self._note_thread)

    def _note_thread(self) -> None:
        self._loop_thread = threading.get_ident()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts ``coro`` on the loop; the future is its outcome (cancelling it cancels it)."""
        if threading.get_ident() == self._loop_thread:
            coro.close()
            raise RuntimeError("a thread can't wait for the event loop it runs (await instead)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(
        self,
        fut: concurrent.futures.Future[T],
        cancelled: Callable[[], bool] | None = None,
        poll_s: float = POLL_S,
    ) -> T:
        """The outcome of ``fut``, waited for on this thread. When ``cancelled()`` turns true
        meanwhile, the coroutine is cancelled and ``Cancelled`` raised. A future cancelled by
        someone else raises ``concurrent.futures.CancelledError``."""
        if cancelled is None:
            return fut.result()
        while True:
            done, _ = concurrent.futures.wait((fut,), timeout=poll_s)
            if done:
                return fut.result()
            if cancelled():
                fut.cancel()
                raise Cancelled("the caller gave up")

    def run(self, coro: Coroutine[Any, Any, T], cancelled: Callable[[], bool] | None = None) -> T:
        """``wait(submit(coro), cancelled)``."""
        return self.wait(self.submit(coro), cancelled)

    def iterate(
        self,
        agen: AsyncIterator[T],
        cancelled: Callable[[], bool] | None = None,
        *,
        ahead: bool = False,
        track: Callable[[concurrent.futures.Future[Any]], Callable[[], None]] | None = None,
    ) -> Generator[T, None, None]:
        """The items of ``agen``, pulled through the loop. With ``ahead``, the loop already
        fetches the next item while this thread handles the current one. ``track(fut)`` is
        told of each step's future (and returns what to call when it is done: a drain cancels
        tracked futures). The iterator is closed on the loop when this generator ends, however
        it ends."""
        pull = _Pull(agen)
        try:
            while True:
                fut = self.submit(pull.advance(ahead))
                untrack = track(fut) if track is not None else None
                try:
                    item = self.wait(fut, cancelled)
                finally:
                    if untrack is not None:
                        untrack()
                if item is _END:
                    return
                yield item
        finally:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(_close_soon, pull)


_END: Any = object()


class _Pull:
    """One async iterator advanced on the loop, with at most one step in flight."""

    def __init__(self, agen: AsyncIterator[Any]) -> None:
        self._agen = agen
        self._ahead: asyncio.Task[Any] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _step(self) -> Any:
        try:
            return await self._agen.__anext__()
        except StopAsyncIteration:
            return _END

    async def advance(self, ahead: bool) -> Any:
        """The next item (``_END`` at the end); with ``ahead`` the one after it starts at once.
        Cancelling this cancels the step it waits for."""
        task = self._ahead or asyncio.ensure_future(self._step())
        self._ahead = None
        item = await task
        if ahead and item is not _END:
            self._ahead = asyncio.ensure_future(self._step())
        return item

    async def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
            await asyncio.gather(self._ahead, return_exceptions=True)
        aclose = getattr(self._agen, "aclose", None)
        if aclose is not None:
            await aclose()


_closing: set[asyncio.Task[Any]] = set()


def _close_soon(pull: _Pull) -> None:
    # Kept referenced until done: a task nobody holds may be collected mid-run.
    task = asyncio.ensure_future(pull.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


class LoopThread(LoopBridge):
    """An event loop of its own, run forever on a daemon thread."""

    _lock = threading.Lock()
    _current: LoopThread | None = None

    def __init__(self, name: str = "persist-loop") -> None:
        loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self.thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
        self.thread.start()
        super().__init__(loop)

    @classmethod
    def for_process(cls) -> LoopThread:
        """This process's loop thread, started on first use. A forked child starts its own:
        the parent's loop thread does not exist in it."""
        with cls._lock:
            current = cls._current
            if current is None or current.pid != os.getpid():
                current = cls._current = cls()
            return current
