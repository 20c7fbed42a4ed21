"""persist.bridge: coroutines run for threads, and what crosses, ends and closes on the way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import select
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from persist.bridge import CallerLoop, Cancelled, LoopBridge, LoopThread

# Every wait in these tests is bounded: a bridge that hangs fails the test, not the run.
LIMIT_S = 5.0


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    thread = LoopThread(name="test-bridge")
    yield thread
    thread.close(timeout_s=LIMIT_S)


def _within(seconds: float = LIMIT_S) -> Callable[[], bool]:
    """A ``cancelled`` that gives up after ``seconds``: a hop that hangs ends the test."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline


def _eventually(check: Callable[[], bool], seconds: float = LIMIT_S) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Source:
    """An async generator that records how far it was pulled, and where and how it ended."""

    def __init__(self, n: int | None = None, *, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.produced = 0
        self.saw_cancel = False
        self.closed = threading.Event()
        self.closed_on: int | None = None
        self.waiting = threading.Event()

    async def items(self) -> AsyncIterator[int]:
        try:
            i = 0
            while self.n is None or i < self.n:
                if i == self.fail_at:
                    raise KeyError("the source failed")
                self.produced += 1
                yield i
                i += 1
        finally:
            self.closed_on = threading.get_ident()
            self.closed.set()

    async def slow(self) -> AsyncIterator[int]:
        """Yields 0, then waits (for nobody) for its next item."""
        try:
            yield 0
            self.waiting.set()
            await asyncio.sleep(60)
            yield 1
        except asyncio.CancelledError:
            self.saw_cancel = True
            raise
        finally:
            self.closed_on = threading.get_ident()
            self.closed.set()


# --- one coroutine ---------------------------------------------------------------------------------


def test_a_result_crosses(lt: LoopThread) -> None:
    async def answer() -> tuple[int, int]:
        return 42, threading.get_ident()

    value, ran_on = lt.run(answer(), cancelled=_within())
    assert value == 42 and ran_on == lt.thread.ident != threading.get_ident()
    # A bridge to a loop someone else runs: the same.
    assert LoopBridge(lt.loop).run(answer(), cancelled=_within())[0] == 42


def test_an_exception_crosses(lt: LoopThread) -> None:
    raised = KeyError("from the loop")

    async def fail() -> None:
        raise raised

    with pytest.raises(KeyError) as e:
        lt.run(fail(), cancelled=_within())
    assert e.value is raised


def test_the_callers_cancel_cancels_the_coroutine(lt: LoopThread) -> None:
    started = threading.Event()
    saw_cancel = threading.Event()
    finished = threading.Event()

    async def long() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            saw_cancel.set()
            raise
        finally:
            finished.set()

    gave_up = time.monotonic()
    with pytest.raises(Cancelled):
        lt.run(long(), cancelled=lambda: started.is_set())
    assert time.monotonic() - gave_up < 2.0
    assert saw_cancel.wait(LIMIT_S), "the coroutine was not cancelled"
    assert finished.wait(LIMIT_S)


def test_waiting_from_the_loops_own_thread_is_refused_at_once(lt: LoopThread) -> None:
    async def inner() -> int:
        return 1

    async def slow() -> None:
        await asyncio.sleep(60)

    foreign = lt.submit(slow())

    async def outer() -> list[str]:
        refused = []
        coro = inner()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="can't wait for the event loop it runs"):
            lt.run(coro)
        refused.append("run")
        # The coroutine was closed, not left "never awaited".
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        with pytest.raises(RuntimeError, match="can't wait for the event loop it runs"):
            lt.wait(foreign)
        refused.append("wait")
        assert time.monotonic() - t0 < 0.5
        return refused

    # Were the refusal missing, the loop would wait for itself and this would give up.
    assert lt.run(outer(), cancelled=_within()) == ["run", "wait"]
    foreign.cancel()


def test_a_closed_loop_ends_the_wait(lt: LoopThread) -> None:
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(60)

    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            lt.run(forever())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    assert started.wait(LIMIT_S)
    lt.close(timeout_s=LIMIT_S)
    thread.join(LIMIT_S)
    assert not thread.is_alive(), "the waiter hung on a loop that was shut down"
    assert isinstance(outcome[0], concurrent.futures.CancelledError)
    # Nothing runs on a closed loop: refused, and the coroutine closed.
    coro = forever()
    with pytest.raises(RuntimeError):
        lt.run(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


def test_a_loop_that_stops_without_cancelling_ends_the_wait() -> None:
    # Its owner stops and closes it with the coroutine still pending: no one will ever finish
    # the future, so the waiter must see that the loop is gone.
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    bridge = LoopBridge(loop)
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(60)

    fut = bridge.submit(forever())
    assert started.wait(LIMIT_S)
    loop.call_soon_threadsafe(loop.stop)
    runner.join(LIMIT_S)
    loop.close()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        bridge.wait(fut, cancelled=_within())
    assert time.monotonic() - t0 < 1.0


# --- async iterators -------------------------------------------------------------------------------


def test_iterate_closes_on_the_loop_when_the_consumer_stops_early(lt: LoopThread) -> None:
    src = Source()
    agen = src.items()
    items = lt.iterate(agen, _within())
    assert [next(items), next(items)] == [0, 1]
    assert not src.closed.is_set()
    items.close()
    # Closed before close() returned, and on the loop's thread.
    assert src.closed.is_set()
    assert src.closed_on == lt.thread.ident


def test_iterate_closes_on_the_loop_when_the_consumer_raises(lt: LoopThread) -> None:
    src = Source()

    # Held here, so that no garbage collection of it closes it in the bridge's place.
    agen = src.items()

    def consume() -> None:
        for i in lt.iterate(agen, _within()):
            if i == 2:
                raise ValueError("the consumer failed")

    with contextlib.suppress(ValueError):
        consume()
    # The dropped generator closed itself, and the async one with it, on the loop.
    assert src.closed.wait(LIMIT_S)
    assert src.closed_on == lt.thread.ident
    assert src.produced == 3


def test_an_error_of_the_async_iterator_crosses_and_it_is_closed(lt: LoopThread) -> None:
    src = Source(fail_at=2)
    items = lt.iterate(src.items(), _within())
    assert [next(items), next(items)] == [0, 1]
    with pytest.raises(KeyError, match="the source failed"):
        next(items)
    assert src.closed.is_set() and src.closed_on == lt.thread.ident


def test_the_callers_cancel_ends_an_iteration_and_closes_it(lt: LoopThread) -> None:
    src = Source()
    items = lt.iterate(src.slow(), lambda: src.waiting.is_set())
    assert next(items) == 0
    with pytest.raises(Cancelled):
        next(items)
    assert src.closed.is_set() and src.saw_cancel
    assert src.closed_on == lt.thread.ident


@pytest.mark.parametrize("ahead", [True, False])
def test_ahead_fetches_one_ahead(lt: LoopThread, ahead: bool) -> None:
    src = Source()
    tracked: list[concurrent.futures.Future[Any]] = []
    untracked: list[concurrent.futures.Future[Any]] = []

    def track(fut: concurrent.futures.Future[Any]) -> Callable[[], None]:
        tracked.append(fut)
        return lambda: untracked.append(fut)

    items = lt.iterate(src.items(), _within(), ahead=ahead, track=track)
    assert next(items) == 0
    if ahead:
        assert _eventually(lambda: src.produced == 2), "the next item was not fetched ahead"
    time.sleep(0.2)
    # One ahead at most (or none): the loop does not run away with the iterator.
    assert src.produced == (2 if ahead else 1)
    assert next(items) == 1
    assert _eventually(lambda: src.produced == (3 if ahead else 2))
    items.close()
    assert tracked == untracked and len(tracked) == 2


def test_close_iterators_ends_what_a_stuck_thread_pulls(lt: LoopThread) -> None:
    src = Source()
    items = lt.iterate(src.slow())
    assert next(items) == 0
    outcome: list[BaseException] = []

    def pull() -> None:
        try:
            next(items)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=pull, daemon=True)
    thread.start()
    assert src.waiting.wait(LIMIT_S)
    lt.run(lt.close_iterators(), cancelled=_within())
    assert src.closed.is_set() and src.saw_cancel
    thread.join(LIMIT_S)
    assert not thread.is_alive()
    assert isinstance(outcome[0], concurrent.futures.CancelledError)


# --- a loop per process ----------------------------------------------------------------------------


def test_for_process_is_one_loop_per_process() -> None:
    first = LoopThread.for_process()
    seen: list[LoopThread] = []
    other = threading.Thread(target=lambda: seen.append(LoopThread.for_process()))
    other.start()
    other.join(LIMIT_S)
    assert seen == [first] and LoopThread.for_process() is first
    assert first.thread.daemon and first.thread.is_alive()

    async def where() -> int:
        return threading.get_ident()

    assert first.run(where(), cancelled=_within()) == first.thread.ident


def test_a_forked_child_gets_its_own_loop() -> None:
    parent = LoopThread.for_process()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave at once (no pytest teardown here)
        try:
            os.close(r)
            child = LoopThread.for_process()

            async def where() -> int:
                return threading.get_ident()

            ok = (
                child is not parent
                and LoopThread.for_process() is child
                and child.thread.is_alive()
                and child.run(where(), cancelled=_within()) == child.thread.ident
            )
            os.write(w, b"ok" if ok else b"the child reused its parent's loop")
        except BaseException as exc:
            os.write(w, repr(exc).encode()[:500])
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 30)
        answer = os.read(r, 1000).decode() if ready else "the child hung"
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert answer == "ok"
    # The parent's loop is untouched.
    assert LoopThread.for_process() is parent and parent.thread.is_alive()


# --- a loop the caller runs ------------------------------------------------------------------------


def test_caller_loop_runs_only_while_its_caller_waits() -> None:
    cl = CallerLoop()
    ticks: list[int] = []

    async def ticker() -> None:
        while True:
            ticks.append(threading.get_ident())
            await asyncio.sleep(0.005)

    async def start() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(ticker())

    try:
        task = cl.run(start())
        cl.run(asyncio.sleep(0.05))
        n = len(ticks)
        assert n > 1 and set(ticks) == {threading.get_ident()}
        time.sleep(0.2)
        assert len(ticks) == n, "the loop ran between calls"
        cl.run(asyncio.sleep(0.05))
        assert len(ticks) > n
        task.cancel()
        cl.run(asyncio.sleep(0))
    finally:
        cl.close()


def test_caller_loop_results_errors_and_reentry() -> None:
    cl = CallerLoop()

    async def answer() -> int:
        return 7

    async def fail() -> None:
        raise KeyError("from the loop")

    async def reenter() -> str:
        coro = answer()
        with pytest.raises(RuntimeError, match="can't wait for the event loop it runs"):
            cl.run(coro)
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        return "refused"

    try:
        assert cl.run(answer()) == 7
        with pytest.raises(KeyError, match="from the loop"):
            cl.run(fail())
        assert cl.run(reenter()) == "refused"
    finally:
        cl.close()
    coro = answer()
    with pytest.raises(RuntimeError):
        cl.run(coro)
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


def test_caller_loop_closes_iterators() -> None:
    cl = CallerLoop()
    try:
        early = Source()
        items = cl.iterate(early.items())
        assert [next(items), next(items)] == [0, 1]
        items.close()
        assert early.closed.is_set() and early.closed_on == threading.get_ident()
        assert list(cl.iterate(Source(3).items())) == [0, 1, 2]
        # One left suspended is closed when the loop is.
        left = Source()
        agen = left.items()

        async def first() -> int:
            return await agen.__anext__()

        assert cl.run(first()) == 0
        assert not left.closed.is_set()
    finally:
        cl.close()
    assert left.closed.is_set() and cl.loop.is_closed()
