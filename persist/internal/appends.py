"""``append_next`` calls of one shard's write handles in this client, committed in groups.

Handles that append to the same shard at once would otherwise race: each writes its part at the
upper it knows, all but one lose the compare-and-set, and every loser writes its part again at
the new upper. Eight handles of one process on one shard committed a sixth of what one did. Here
the calls queue per shard (and schema version, so a group's rows share one schema), and one task
commits what has queued as one write: write ``i`` of a group at ``t + i``, one part, one commit,
then the next group. Nothing changes for a caller but the wait: its rows land once, at the time
it is told.

The group is written and committed through the handle of its first call (its *leader*: its
writer id owns the part). A failure that is the leader's own (its handle closed or its lease
expired meanwhile) ends only the leader's call, and the rest go on under the next one; any other
failure (the shard sealed, blob or consensus failing past their retries) is every call's.

A call cancelled while it waits in the queue leaves it, and its rows never land; one cancelled
while its group commits may still land (as a ``compare_and_append`` cancelled in its commit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pyarrow as pa

from persist.errors import InvalidUsage
from persist.internal.tasks import Tasks

__all__ = ["Commit", "NextAppends"]

# Commits ``writes`` (updates without ``_time``) at consecutive times from the shard's upper and
# returns the first one's time: the leader handle's ``WriteHandle._commit_next``.
Commit = Callable[[list[pa.Table]], Awaitable[int]]

# A group holds at most this many calls and about this many bytes: past it the next group goes
# on after this one (a part too big to encode quickly would hold every call of it back).
_MAX_CALLS = 1024
_MAX_BYTES = 32 << 20


def _future() -> asyncio.Future[int]:
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    # A call cancelled in its commit no longer awaits the answer: it is not an unread error.
    done.add_done_callback(lambda f: f.cancelled() or f.exception())
    return done


@dataclass
class _Call:
    rows: pa.Table
    commit: Commit
    # Whether the handle of the call can still commit (not closed, lease not lost).
    live: Callable[[], bool]
    done: asyncio.Future[int] = field(default_factory=_future)


class NextAppends:
    """The ``append_next`` queue of one shard in one client."""

    def __init__(self, tasks: Tasks, shard_id: str) -> None:
        self._tasks = tasks
        self._shard_id = shard_id
        self._queues: dict[int, list[_Call]] = {}
        self._running: set[int] = set()

    async def append(
        self, version: int, rows: pa.Table, commit: Commit, live: Callable[[], bool]
    ) -> int:
        """Commits ``rows`` (updates without ``_time``, of schema version ``version``) with the
        calls queued beside it; the time they were given."""
        call = _Call(rows, commit, live)
        queue = self._queues.setdefault(version, [])
        queue.append(call)
        if version not in self._running:
            task = self._tasks.spawn(self._drain(version), f"append_next {self._shard_id}")
            if task is None:
                queue.remove(call)
                raise InvalidUsage("this client is closed")
            self._running.add(version)
        try:
            return await asyncio.shield(call.done)
        except asyncio.CancelledError:
            if call in queue:
                queue.remove(call)  # not taken yet: it never lands
            raise

    async def _drain(self, version: int) -> None:
        queue = self._queues[version]
        group: list[_Call] = []
        try:
            while queue:
                group = _take(queue)
                leader = group[0]
                try:
                    first = await leader.commit([c.rows for c in group])
                except Exception as exc:
                    if leader.live() or len(group) == 1:
                        _fail(group, exc)
                    else:
                        # The leader's own handle failed it: the others go on under the next.
                        _fail(group[:1], exc)
                        queue[:0] = group[1:]
                    group = []
                    continue
                for i, c in enumerate(group):
                    if not c.done.done():
                        c.done.set_result(first + i)
                group = []
        except BaseException:
            # Cancelled (the client closing): no call is left waiting for an answer.
            _fail(group + queue, InvalidUsage("this client closed before the append committed"))
            queue.clear()
            raise
        finally:
            self._running.discard(version)


def _take(queue: list[_Call]) -> list[_Call]:
    """The next group, taken off the front of ``queue``."""
    n, size = 0, 0
    while n < len(queue) and n < _MAX_CALLS and (n == 0 or size < _MAX_BYTES):
        size += queue[n].rows.nbytes
        n += 1
    group = queue[:n]
    del queue[:n]
    return group


def _fail(calls: list[_Call], exc: BaseException) -> None:
    for c in calls:
        if not c.done.done():
            c.done.set_exception(exc)
