"""Retrying external operations: the one policy, in one place."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from persist.errors import ExternalError, IntegrityError

T = TypeVar("T")


def backoff_delays(initial_s: float, attempts: int, cap_s: float = 2.0) -> list[float]:
    """The sleeps between ``attempts`` tries: exponential from ``initial_s``, capped."""
    return [min(cap_s, initial_s * (2**i)) for i in range(max(attempts - 1, 0))]


async def retry_idempotent(
    op: Callable[[], Awaitable[T]], attempts: int, initial_delay_s: float
) -> T:
    """Runs ``op``, retrying any ``ExternalError`` but an ``IntegrityError``.

    Only for operations that may safely happen twice (blob reads and writes under fresh keys,
    consensus reads). The last failure is raised as is.
    """
    delays = backoff_delays(initial_delay_s, attempts)
    for delay in delays:
        try:
            return await op()
        except IntegrityError:
            raise
        except ExternalError:
            await asyncio.sleep(delay)
    return await op()
