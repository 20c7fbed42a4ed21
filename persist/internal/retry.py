"""Retrying external operations: the one policy, in one place."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
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


class CasRetry:
    """The retry rule of persist's compare-and-set loops, a shard's commits (``Machine.apply``)
    and the catalog's changes (``catalog.change_catalog``), so that the two cannot drift apart.

    Each try reads the latest value, runs its change on it and compare-and-sets the result.
    After a try that did not land:

    - Lost to another writer (the compare-and-set answered False): re-read and retry at once,
      spending no try. Another change landed, so the contenders are making progress, and the
      loser's re-read already queues it behind the winner; a sleep would slow every contended
      commit, and a busy key must never run out of tries.
    - Consensus failed (``ExternalError``), determinately or not: one try spent; sleep the next
      ``backoff_delays`` delay, then re-read and retry. Either kind may come from a struggling
      store, which tries in quick succession would burden further and use up in milliseconds.
      The sleep comes before the re-read, so that the retry runs on what consensus holds after
      it: a try that may have landed has had time to settle, the re-read shows it if it did, and
      the change, re-run, recognizes itself as done. Two compare-and-sets at one seqno can't both
      land, so the retry is safe either way.
    - No tries left: the failure is raised, indeterminate if any try was (``settling``): that
      try may have landed without the loop learning it.
    """

    def __init__(self, attempts: int, initial_delay_s: float) -> None:
        self._delays = backoff_delays(initial_delay_s, attempts)
        self.failures = 0
        self.races = 0
        # Some try failed indeterminately: the change may be in, whatever happens after.
        self.uncertain = False

    @property
    def retries(self) -> int:
        """How many tries may follow a failure, in all."""
        return len(self._delays)

    def lost_race(self) -> None:
        """Records a compare-and-set another writer won: re-read and retry at once."""
        self.races += 1

    def failed(self, exc: ExternalError) -> float | None:
        """Records a compare-and-set that failed with ``exc``: the seconds to sleep before the
        re-read and the next try, or None when no try is left (raise ``exc``)."""
        if not exc.determinate:
            self.uncertain = True
        if self.failures >= len(self._delays):
            return None
        self.failures += 1
        return self._delays[self.failures - 1]

    @contextlib.contextmanager
    def settling(self) -> Iterator[None]:
        """Around the loop: an ``ExternalError`` leaving it after an indeterminate try is raised
        as indeterminate (a certain later failure does not undo an earlier uncertain one)."""
        try:
            yield
        except ExternalError as exc:
            if self.uncertain and exc.determinate:
                raise ExternalError(
                    f"the change may or may not have been committed: {exc}", determinate=False
                ) from exc
            raise


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
