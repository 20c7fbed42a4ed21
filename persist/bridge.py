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
  whatever stopped it, and before the thread goes on (its next call may close what the
  iterator reads from).

Three shapes of the same thing:

- ``LoopBridge(loop)`` bridges to a loop someone else runs (the Flight server's own, run by
  ``asyncio.run`` on the main thread while gRPC's threads hop onto it);
- ``LoopThread.for_process()`` runs a loop of its own on a daemon thread, one per process (a
  fork starts its own: Spark forks its Python workers). The loop runs all the time, so the
  handles a Spark task resumed go on heartbeating between its calls;
- ``CallerLoop()`` is a loop the calling thread owns and runs itself, only while it waits for a
  call (``run_until_complete``). The test harness (``persist.testing.driver``) wants exactly
  that: between two steps nothing of persist runs (no heartbeat, no lag ticker), so a step sees
  only what the previous ones did, and the time a rule spends drawing its inputs is not
  persist's. A ``LoopThread`` would run the loop between the steps and change what the harness
  tests; a thread that is the loop can't wait for it from elsewhere either, so the hazards
  above mostly vanish: a call from a coroutine on the loop (re-entry) is refused at once, and
  an iterator is closed by running the loop once more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import Any, ClassVar, TypeVar

__all__ = ["POLL_S", "CallerLoop", "Cancelled", "LoopBridge", "LoopThread"]

T = TypeVar("T")

log = logging.getLogger("persist")

# How often a waiting thread asks whether its caller gave up and whether the loop is still there.
POLL_S = 0.1

Track = Callable[[concurrent.futures.Future[Any]], Callable[[], None]]


class Cancelled(Exception):
    """The waiting thread's caller gave up (its ``cancelled()`` turned true): the coroutine was
    cancelled on the loop."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class LoopBridge:
    """Runs coroutines on ``loop`` for threads other than the loop's own."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pulls: set[_Pull] = set()

    def on_loop_thread(self) -> bool:
        """Whether this thread is the one running the loop (it must await, never wait)."""
        return _running_loop() is self.loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts ``coro`` on the loop; the future is its outcome (cancelling it cancels it)."""
        if self.on_loop_thread():
            coro.close()
            raise RuntimeError("a thread can't wait for the event loop it runs (await instead)")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except BaseException:
            coro.close()  # never started: not a coroutine "never awaited" on top of the error
            raise

    def wait(
        self,
        fut: concurrent.futures.Future[T],
        cancelled: Callable[[], bool] | None = None,
        poll_s: float = POLL_S,
    ) -> T:
        """The outcome of ``fut``, waited for on this thread. When ``cancelled()`` turns true
        meanwhile, the coroutine is cancelled and ``Cancelled`` raised. A future cancelled by
        someone else (a drain, the loop's shutdown) raises
        ``concurrent.futures.CancelledError``; a loop that is gone raises ``RuntimeError``."""
        if not fut.done() and self.on_loop_thread():
            # (A future submitted from elsewhere.) Waiting would block the loop that has to
            # finish it.
            raise RuntimeError("a thread can't wait for the event loop it runs (await instead)")
        while True:
            done, _ = concurrent.futures.wait((fut,), timeout=poll_s)
            if done:
                return fut.result()
            if cancelled is not None and cancelled():
                fut.cancel()
                raise Cancelled("the caller gave up")
            gone = self._gone()
            if gone is not None:
                fut.cancel()
                raise RuntimeError(gone)

    def _gone(self) -> str | None:
        """Why the loop can no longer finish anything, or None."""
        return "the event loop was closed" if self.loop.is_closed() else None

    def run(self, coro: Coroutine[Any, Any, T], cancelled: Callable[[], bool] | None = None) -> T:
        """``wait(submit(coro), cancelled)``."""
        return self.wait(self.submit(coro), cancelled)

    def call_soon(self, callback: Callable[..., object], *args: Any) -> bool:
        """Schedules ``callback(*args)`` on the loop, unless the loop is closed (False)."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def iterate(
        self,
        agen: AsyncIterator[T],
        cancelled: Callable[[], bool] | None = None,
        *,
        ahead: bool = False,
        track: Track | None = None,
    ) -> Generator[T, None, None]:
        """The items of ``agen``, pulled through the loop. With ``ahead``, the loop already
        fetches the next item while this thread handles the current one. ``track(fut)`` is
        told of each step's future (and returns what to call when it is done: a drain cancels
        tracked futures). However this generator ends (exhausted, closed early, an error, the
        caller gave up), ``agen`` is closed on the loop, and this thread waits for that unless
        it is the loop's own (then the close is only scheduled)."""
        pull = _Pull(agen)
        with self._lock:
            self._pulls.add(pull)
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
            with self._lock:
                self._pulls.discard(pull)
            self._close(pull)

    def _close(self, pull: _Pull) -> None:
        if self.on_loop_thread():
            _close_soon(pull)
            return
        try:
            fut = self.submit(pull.close())
        except RuntimeError:
            return  # the loop is closed: nothing can run the iterator's cleanup any more
        try:
            self.wait(fut)
        except Exception as exc:  # from a finally: must not hide why the iteration stopped
            log.warning("persist: closing an async iterator failed: %r", exc)

    async def close_iterators(self) -> None:
        """Closes, on the loop, every async iterator that a thread is still pulling: for an
        owner that gives up on its threads (a drain past its grace). A thread that resumes
        later finds its iterator ended."""
        with self._lock:
            pulls = list(self._pulls)
        results = await asyncio.gather(*(p.close() for p in pulls), return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.warning("persist: closing an async iterator failed: %r", result)


_END: Any = object()


class _Pull:
    """One async iterator advanced on the loop, with at most one step in flight."""

    def __init__(self, agen: AsyncIterator[Any]) -> None:
        self._agen = agen
        # The step in flight: the one ``advance`` waits for, or the one fetched ahead. Kept
        # until it is done, so that ``close`` never closes the iterator while it still runs
        # (``aclose`` of a running async generator is an error).
        self._step: asyncio.Task[Any] | None = None
        self._closed = False

    async def _next(self) -> Any:
        try:
            return await self._agen.__anext__()
        except StopAsyncIteration:
            return _END

    async def advance(self, ahead: bool) -> Any:
        """The next item (``_END`` at the end); with ``ahead`` the one after it starts at once.
        Cancelling this cancels the step it waits for (the iterator sees ``CancelledError``)."""
        if self._closed:
            return _END
        task = self._step or asyncio.ensure_future(self._next())
        self._step = task
        try:
            item = await task
        finally:
            if task.done() and self._step is task:
                self._step = None
        if ahead and item is not _END and not self._closed:
            self._step = asyncio.ensure_future(self._next())
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        step, self._step = self._step, None
        if step is not None:
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        aclose = getattr(self._agen, "aclose", None)
        if aclose is not None:
            await aclose()


_closing: set[asyncio.Task[Any]] = set()


def _close_soon(pull: _Pull) -> None:
    # Kept referenced until done: a task nobody holds may be collected mid-run.
    task = asyncio.ensure_future(pull.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)
    task.add_done_callback(_log_close_failure)


def _log_close_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("persist: closing an async iterator failed: %r", task.exception())


class LoopThread(LoopBridge):
    """An event loop of its own, run forever on a daemon thread.

    When the interpreter begins to exit, before it shuts down the thread pools that persist's
    calls run blocking work on (blob and SQLite calls, maintenance's merges), the callbacks
    given to ``before_exit`` run, then the process's loop cancels what still runs on it
    (background compaction, heartbeats) and closes: nothing of persist is left running into a
    shut-down pool, so an exit neither fails persist's last calls nor prints their errors."""

    _lock_for_process = threading.Lock()
    _current: LoopThread | None = None
    _before_exit: ClassVar[list[Callable[[], None]]] = []

    def __init__(self, name: str = "persist-loop") -> None:
        super().__init__(asyncio.new_event_loop())
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def for_process(cls) -> LoopThread:
        """This process's loop thread, started on first use. A forked child starts its own:
        the parent's loop thread does not exist in it."""
        with cls._lock_for_process:
            current = cls._current
            if current is None or current.pid != os.getpid() or current.loop.is_closed():
                current = cls._current = cls()
            return current

    @classmethod
    def before_exit(cls, fn: Callable[[], None]) -> None:
        """Has ``fn()`` run as the interpreter begins to exit, while calls on the process's
        loop still work (the latest given runs first; an error is logged)."""
        cls._before_exit.append(fn)

    def _gone(self) -> str | None:
        if self.pid != os.getpid():
            return "the event loop's thread belongs to the parent of this forked process"
        if not self.thread.is_alive():
            return "the event loop's thread has stopped"
        return super()._gone()

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancels what still runs on the loop (its waiters get ``CancelledError``), closes its
        async generators, stops its thread and closes it."""
        if self.loop.is_closed():
            return
        if self.on_loop_thread():
            raise RuntimeError("a loop thread can't close itself (from a coroutine on it)")
        if self.thread.is_alive() and self.pid == os.getpid():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_finish(), self.loop).result(timeout_s)
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()


async def _finish() -> None:
    """What ``asyncio.run`` does once its coroutine is done: cancel every other task, wait for
    them, close the async generators."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _at_exit() -> None:
    for fn in reversed(LoopThread._before_exit):
        try:
            fn()
        except Exception as exc:  # the process is going: say so, then go on with the rest
            log.warning("persist: %r at exit failed: %r", fn, exc)
    current = LoopThread._current
    if current is not None and current.pid == os.getpid():
        current.close()


# Threading's exit hooks run before the interpreter shuts down concurrent.futures' pools (whose
# own hook, registered when concurrent.futures.thread was imported above, runs after this one:
# the latest registered runs first); atexit's run only after that.
_register_atexit = getattr(threading, "_register_atexit", None)
if _register_atexit is not None:
    _register_atexit(_at_exit)
else:  # pragma: no cover - every CPython persist supports has it
    import atexit

    atexit.register(_at_exit)


def _after_fork_in_child() -> None:
    # The parent may have held the lock while it forked; nothing in the child ever releases it.
    LoopThread._lock_for_process = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class CallerLoop:
    """An event loop the calling thread owns and runs only while it waits for a call: between
    calls nothing on it runs (see the module's docstring for who wants that)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs the loop until ``coro`` is done; its result, or its exception. Refused at once
        from a coroutine on this (or any running) loop: the caller would wait for itself."""
        if _running_loop() is not None or self.loop.is_running():
            coro.close()
            raise RuntimeError("a thread can't wait for the event loop it runs (await instead)")
        try:
            return self.loop.run_until_complete(coro)
        except RuntimeError:
            coro.close()  # closed loop: never started (a no-op when it ran)
            raise

    def iterate(self, agen: AsyncIterator[T]) -> Generator[T, None, None]:
        """The items of ``agen``, each pulled by running the loop; ``agen`` is closed (by running
        the loop once more) however this generator ends."""
        pull = _Pull(agen)
        try:
            while (item := self.run(pull.advance(False))) is not _END:
                yield item
        finally:
            if not self.loop.is_closed() and not self.loop.is_running():
                try:
                    self.loop.run_until_complete(pull.close())
                except Exception as exc:  # from a finally: must not hide why it stopped
                    log.warning("persist: closing an async iterator failed: %r", exc)

    def close(self) -> None:
        """Closes the async generators left open, shuts the default executor down and closes
        the loop, each step whatever the previous one did. Tasks left pending are left as they
        are (unlike ``asyncio.run``, which cancels them): the owner says what ends its work."""
        if self.loop.is_closed():
            return
        try:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
