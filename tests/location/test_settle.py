"""The helpers that settle a cancelled backend call before its cancellation returns."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from persist.location._settle import run_in_task, run_in_thread


class _Blocked:
    """A blocking function that runs until released; records its start and end."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(10), "never released"
        self.finished.set()
        return "done"


async def _until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


async def test_result_and_exception_pass_through() -> None:
    assert await run_in_thread(lambda: 42) == 42

    def fail() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        await run_in_thread(fail)


@pytest.mark.parametrize("cancels", [1, 3])
async def test_cancelled_while_running_waits_for_the_thread(cancels: int) -> None:
    fn = _Blocked()
    interrupts: list[bool] = []
    call = asyncio.create_task(
        run_in_thread(fn, on_cancel=lambda: interrupts.append(fn.finished.is_set()))
    )
    await _until(fn.started)
    for _ in range(cancels):
        call.cancel()
        await asyncio.sleep(0.05)
        assert not call.done(), "returned while its thread still runs"
    assert interrupts == [False], "on_cancel is called once, while the thread runs"
    fn.release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert fn.finished.is_set()
    assert call.cancelled()


async def test_cancelled_while_queued_never_runs() -> None:
    with ThreadPoolExecutor(max_workers=1) as executor:
        busy = _Blocked()
        occupying = asyncio.create_task(run_in_thread(busy, executor=executor))
        await _until(busy.started)
        ran = threading.Event()
        interrupts: list[None] = []
        queued = asyncio.create_task(
            run_in_thread(ran.set, executor=executor, on_cancel=lambda: interrupts.append(None))
        )
        await asyncio.sleep(0.05)
        queued.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert time.monotonic() - started < 1.0, "waited for the job ahead of it"
        busy.release.set()
        assert await occupying == "done"
        # The worker is free now: a job that was going to run would have run.
        assert await run_in_thread(lambda: 1, executor=executor) == 1
        assert not ran.is_set()
        assert interrupts == []


async def test_a_job_that_never_ran_logs_nothing() -> None:
    # The skipped job's future fails with a private exception nobody awaits: it must still be
    # retrieved, or asyncio logs "Future exception was never retrieved" with a traceback.
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        with ThreadPoolExecutor(max_workers=1) as executor:
            busy = _Blocked()
            occupying = asyncio.create_task(run_in_thread(busy, executor=executor))
            await _until(busy.started)
            queued = asyncio.create_task(run_in_thread(lambda: None, executor=executor))
            await asyncio.sleep(0.05)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            busy.release.set()
            await occupying
            await run_in_thread(lambda: None, executor=executor)
        del queued
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert reported == []


async def test_timeout_sees_a_timeout_after_the_thread_is_done() -> None:
    fn = _Blocked()
    threading.Timer(0.3, fn.release.set).start()
    task = asyncio.current_task()
    assert task is not None
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await run_in_thread(fn)
    assert fn.finished.is_set()
    assert task.cancelling() == 0

    fn = _Blocked()
    threading.Timer(0.3, fn.release.set).start()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(run_in_thread(fn), 0.05)
    assert fn.finished.is_set()
    assert task.cancelling() == 0


async def test_an_outer_cancellation_during_a_timeout_is_not_lost() -> None:
    fn = _Blocked()

    async def with_timeout() -> None:
        async with asyncio.timeout(0.05):
            await run_in_thread(fn)

    outer = asyncio.create_task(with_timeout())
    await _until(fn.started)
    await asyncio.sleep(0.1)  # the timeout fired; the call waits for its thread
    outer.cancel()
    await asyncio.sleep(0.05)
    fn.release.set()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert outer.cancelled(), "the outer cancellation became a TimeoutError"


async def test_run_in_task_passes_on_one_cancellation_and_waits() -> None:
    inner_cancels = 0
    release = asyncio.Event()
    finished = False

    async def settles_on_cancel() -> str:
        nonlocal inner_cancels, finished
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            inner_cancels += 1
            # Settling takes a while, and must not be cut short.
            await release.wait()
            finished = True
            raise
        return "not reached"

    call = asyncio.create_task(run_in_task(settles_on_cancel()))
    await asyncio.sleep(0.01)
    for _ in range(3):
        call.cancel()
        await asyncio.sleep(0.01)
    assert not call.done()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert inner_cancels == 1 and finished
    assert await run_in_task(asyncio.sleep(0, "ok")) == "ok"
