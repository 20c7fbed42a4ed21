"""Maintenance's data work yields to callers: niced threads, and steps that wait for appends."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from persist import tasks


async def test_a_background_step_waits_for_foreground_work() -> None:
    order: list[str] = []
    with tasks.foreground():
        step = asyncio.ensure_future(tasks.in_background_thread(order.append, "background"))
        await asyncio.sleep(0.05)
        assert order == [] and not step.done()
        order.append("foreground")
    await step
    assert order == ["foreground", "background"]


async def test_a_background_step_waits_a_bounded_time() -> None:
    # Foreground work that never ends can't hold maintenance back for ever: the step runs while
    # the foreground mark is still held (the timeout only guards against a hang).
    with tasks.foreground():
        assert await asyncio.wait_for(tasks.in_background_thread(sum, [1, 2]), 10) == 3


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
async def test_background_threads_run_at_low_priority() -> None:
    def own_priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert await tasks.in_background_thread(own_priority) == 19
    assert await asyncio.to_thread(own_priority) == os.getpriority(os.PRIO_PROCESS, 0)
