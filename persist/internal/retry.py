"""Retrying external operations: the one policy, in one place."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from persist.errors import ExternalError, IntegrityError
from persist.location import backoff_delays, tries_spent

if TYPE_CHECKING:
    from persist.core.shard.types import State

T = TypeVar("T")


async def retry_idempotent(
    op: Callable[[], Awaitable[T]], attempts: int, initial_delay_s: float
) -> T:
    """Runs ``op``, retrying any ``ExternalError`` but an ``IntegrityError`` or one from a
    backend that already made all its own tries (an S3 blob: its ``max_attempts`` are the
    tries in all).

    Only for operations that may safely happen twice (blob reads and writes under fresh keys,
    consensus reads). The last failure is raised as is.
    """
    delays = backoff_delays(initial_delay_s, attempts)
    for delay in delays:
        try:
            return await op()
        except IntegrityError:
            raise
        except ExternalError as exc:
            if tries_spent(exc):
                raise
            await asyncio.sleep(delay)
    return await op()


@dataclass
class Tries:
    """What the tries of one ``Machine.apply`` may have done, for callers that clean up.

    ``maybe_committed``: some try's compare-and-set may have landed without this call learning
    it (an indeterminate failure, or a cancellation while it was in flight). A caller must then
    not delete anything the change refers to, whatever the answer: the change may be in the
    shard. ``last_seqno`` is the highest seqno such a try could have landed at: once the shard
    is past it, that try has either landed or never will (two compare-and-sets at one seqno can't
    both land). ``unsettled``: a backend reported an indeterminate failure (its effect could still
    be on its way); a cancelled call, by contrast, is settled when its cancellation returns.
    """

    maybe_committed: bool = False
    unsettled: bool = False
    last_seqno: int = 0

    def settled_in(self, state: State) -> bool:
        """Whether every try's outcome is final as of ``state`` (a state read after the call)."""
        return not self.unsettled or state.seqno >= self.last_seqno
