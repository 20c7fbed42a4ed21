"""What both conformance suites share: fresh namespaces, Hypothesis settings, fixture types."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from hypothesis import HealthCheck, settings

from persist.location import Blob, Consensus

_T = TypeVar("_T")

ConsensusFactory = Callable[[], Consensus]
"""Returns a new, independent handle on the location under test."""

ConsensusWriteLock = Callable[[str], AbstractAsyncContextManager[None]]
"""``lock(key)``: holds, from outside the instance under test, what a write of ``key`` waits for."""

PartialWrite = Callable[[Blob, str, float], Callable[[], bool]]
"""``leave(blob, key, age_s)``: leaves what a writer killed mid-``set(key)`` leaves, last touched
``age_s`` seconds ago; returns whether that leftover still exists."""

# Timeouts that cancel a call before it starts, and at various points while it runs.
CANCEL_AFTER_S = [0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05]


async def assert_stays(read: Callable[[], Awaitable[_T]], expected: _T, for_s: float) -> None:
    """Polls ``read`` for ``for_s`` seconds: it must keep answering ``expected``."""
    deadline = time.monotonic() + for_s
    while True:
        got = await read()
        assert got == expected, f"changed after the cancellation returned: {got!r} != {expected!r}"
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


HYPOTHESIS = settings(
    max_examples=30,
    deadline=None,
    # The fixture is set up once per test, not per example; every example uses fresh keys.
    # The same test method runs on every backend's subclass by design (differing executors).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
)


def namespace() -> str:
    return f"t-{uuid.uuid4().hex}/"


def shard_key() -> str:
    return f"test-{uuid.uuid4().hex}"
