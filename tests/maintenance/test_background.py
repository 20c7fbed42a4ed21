"""Maintenance's data work yields to callers: its steps wait for appends in flight."""

from __future__ import annotations

import asyncio

from persist.internal import tasks


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
