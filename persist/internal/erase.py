"""Erasing rows (``PersistClient.erase``), the edge of ``core.erasure``: reads the shard's
parts, writes the rewrite of each part in blob that holds a matching update, and commits them
all as one change (``erasure.erase``), reading what was committed meanwhile until it lands.

A rewrite in blob goes under the compaction prefix with its start time in the key, like a
merge's output: one that never lands is swept as abandoned compaction output, and the commit is
refused once garbage collection could be sweeping it. What the rewrites replaced, and the
rollups and consensus diffs that still hold it, go with the rollup and collection that follow
(``Maintenance.erase``).
"""

from __future__ import annotations

import asyncio

import pyarrow.compute as pc

from persist.core import erasure
from persist.core.arrow.evolution import View, current_view
from persist.core.erasure import Erased, Rewrite
from persist.core.shard import keys as blob_keys
from persist.core.shard.transitions import finalized_error
from persist.core.shard.types import PartRef, State
from persist.errors import ExternalError, IntegrityError
from persist.ids import new_id
from persist.internal.batch import INLINE_BYTES, delete_keys, part_bytes, put_part
from persist.internal.machine import Machine
from persist.internal.retry import Tries
from persist.internal.tasks import in_background_thread

__all__ = ["erase_rows"]

# Each round reads only the parts in blob committed since the one before (appends of inline
# parts the commit takes itself), so rounds get short; a shard whose batches change faster
# than that for this many rounds is left as it was.
_ROUNDS = 32


class _Read:
    """What was read of the shard's parts, by key (``erasure.erase``'s ``read``), and the
    rewrites written to blob for it, with when the oldest of those was started."""

    def __init__(self) -> None:
        self.parts: dict[str, Rewrite | None] = {}
        self.in_blob: list[str] = []
        self.started_ms: int | None = None

    def of(self, state: State) -> erasure.Read:
        """What was read, with ``state`` (every part of it read) as the last read."""
        dirty = tuple(
            (b.lower, b.upper)
            for b in state.batches.values()
            if any(self.parts[p.key] is not None for p in b.parts)
        )
        return erasure.Read(dict(self.parts), state.upper, dirty)

    def forget_blob(self) -> list[str]:
        """Forgets the rewrites in blob (they are getting too old to commit); their keys."""
        dropped = set(self.in_blob)
        for key, done in list(self.parts.items()):
            if done is not None and done.part is not None and done.part.key in dropped:
                del self.parts[key]
        self.in_blob, self.started_ms = [], None
        return sorted(dropped)


async def erase_rows(
    m: Machine, predicate: pc.Expression, busy: set[str], rounds: int = _ROUNDS
) -> Erased:
    """Removes every stored update of the rows ``predicate`` (a checked row predicate) matches
    from the shard, in one commit. ``busy``: the ids of batches this client's merges leave
    alone; the batches read are added while it runs (a merge would only make it read again)."""
    cfg = m.cfg
    timeout_ms = int(cfg.compaction_timeout_s * 1000)
    read = _Read()
    tries = Tries()
    held: set[str] = set()
    try:
        for _ in range(rounds):
            state = m.state
            if state.finalized:
                raise finalized_error(state)
            fresh = set(state.batches) - busy
            busy.update(fresh)
            held.update(fresh)
            # Well before the commit would be refused for it: a round takes time too.
            if read.started_ms is not None and cfg.now_ms() - read.started_ms > timeout_ms // 2:
                forgotten = read.forget_blob()
                if not tries.maybe_committed:  # else the orphan sweep takes them in time
                    await delete_keys(m.blob, forgotten)
            todo = [p for b in state.batches.values() for p in b.parts if p.key not in read.parts]
            if not await _read_parts(m, todo, predicate, current_view(state), read):
                # Merged away and collected since the read (an erase holds no reader): the
                # state says where those rows are now.
                _check_vanished(await m.refresh(), todo, read)
                continue
            erased = await _commit(m, predicate, read.of(state), read.started_ms, timeout_ms, tries)
            if erased is not None:
                if not tries.maybe_committed:
                    await delete_keys(m.blob, [k for k in read.in_blob if k not in erased.in_blob])
                return erased
            # A part in blob was committed since the read: the cached state, which the
            # transition ran against, names it; read it in the next round.
        raise ExternalError(
            f"erase: the shard's parts kept changing for {rounds} rounds; nothing was erased",
            determinate=True,
        )
    except BaseException:
        # A try that may have landed refers to the rewrites: the orphan sweep takes them once
        # they are certainly unreferenced.
        if not tries.maybe_committed:
            await delete_keys(m.blob, read.in_blob)
        raise
    finally:
        busy.difference_update(held)


async def _commit(
    m: Machine,
    predicate: pc.Expression,
    read: erasure.Read,
    started_ms: int | None,
    timeout_ms: int,
    tries: Tries,
) -> Erased | None:
    # Its own function: the transition binds this round's read, not the loop's variables.
    return await m.apply(
        lambda s, now: erasure.erase(s, predicate, read, started_ms, timeout_ms, now),
        tries=tries,
    )


async def _read_parts(
    m: Machine, parts: list[PartRef], predicate: pc.Expression, view: View, read: _Read
) -> bool:
    """Reads ``parts`` (``io_concurrency`` at a time) into ``read``, writing the rewrites of
    those in blob; False if any of them was missing from blob."""
    cfg = m.cfg
    gate = asyncio.Semaphore(cfg.io_concurrency)
    started_ms = cfg.now_ms()
    found = True

    async def one(part: PartRef) -> None:
        nonlocal found
        async with gate:
            data = await part_bytes(m.blob, cfg, part)
            if data is None:
                found = False
                return
            key = blob_keys.compaction_part_key(m.shard_id, started_ms, new_id("b"), 0)
            args = (data, part, predicate, view, key)
            if 0 < part.nbytes <= INLINE_BYTES:
                # A small part's rewrite takes less than a hop to a worker thread: a round of
                # a writer's small appends is read before the next one lands.
                done = erasure.rewrite(*args)
            else:
                done = await in_background_thread(erasure.rewrite, *args)
            if done is not None and done.data:
                if read.started_ms is None:
                    read.started_ms = started_ms
                read.in_blob.append(key)
                await put_part(m.blob, cfg, key, done.data)
            read.parts[part.key] = done

    tasks = [asyncio.ensure_future(one(p)) for p in parts]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        # The others must not write rewrites after the caller deleted those it knows of.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return found


def _check_vanished(state: State, parts: list[PartRef], read: _Read) -> None:
    """``IntegrityError`` if a part missing from blob is still in the shard's latest state."""
    live = {p.key for b in state.batches.values() for p in b.parts if not p.inline}
    lost = sorted(p.key for p in parts if p.key not in read.parts and p.key in live)
    if lost:
        raise IntegrityError(f"erase: part {lost[0]} of the shard is missing from blob")
