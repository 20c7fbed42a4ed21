"""Compaction: merging neighbouring batches into one, in the background, in bounded memory.

The spine (``core/trace.py``) says which batches to merge. A merge streams the sorted runs of
its inputs (a compacted batch is one run; a freshly written batch has one run per part), holding
one decoded part per run plus the output part being filled: it never loads a whole shard. Times
are advanced to the shard's since and equal updates consolidated, so an insert and its
retraction disappear once since passes them. The output is written to blob under a fresh key and
proposed to the state machine as "replace these batches by this one" (``apply_merge``), which
accepts it only if every input is still there; otherwise it is discarded and its blobs deleted.
Writers never wait for compaction.

Decoding, merging and encoding run in worker threads (pyarrow's kernels release the GIL); blob
I/O is async. A client runs at most ``compaction_concurrency`` merges at once, and a shard's
requests coalesce into one background loop (``Maintenance``), so a burst of writes never queues
a burst of merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from persist.batch import delete_parts
from persist.core import keys as blob_keys
from persist.core import state as st
from persist.core.trace import plan_merges
from persist.core.updates import (
    TIME,
    DiffOverflow,
    checksum,
    consolidate_sorted,
    decode_part,
    encode_part,
    merge_consolidate,
)
from persist.errors import ExternalError, PersistError
from persist.fetch import schema_from_bytes
from persist.gc import collect
from persist.ids import new_id
from persist.retry import Tries, retry_idempotent
from persist.tasks import being_cancelled, in_background_thread

if TYPE_CHECKING:
    from persist.machine import Machine

log = logging.getLogger("persist")

__all__ = ["Maintenance", "merge_batches"]


def _advance_to_since(table: pa.Table, since: int) -> pa.Table:
    """Times below ``since`` become ``since``; sortedness by (data, time) is kept."""
    times = table.column(TIME)
    if table.num_rows == 0 or pc.min(times).as_py() >= since:
        return table
    advanced = pc.max_element_wise(times, pa.scalar(since, pa.uint64()))
    return table.set_column(table.schema.get_field_index(TIME), table.schema.field(TIME), advanced)


def _row_le(a: pa.Table, b: pa.Table, keys: list[str]) -> bool:
    """Whether the one-row table ``a`` sorts at or before the one-row table ``b``."""
    pair = pa.concat_tables([a.select(keys), b.select(keys)])
    order = pc.sort_indices(pair, sort_keys=[(k, "ascending") for k in keys]).to_pylist()
    return bool(order == [0, 1])


def _count_le(table: pa.Table, row: pa.Table, keys: list[str]) -> int:
    """How many leading rows of the sorted ``table`` sort at or before ``row`` (binary search)."""
    lo, hi = 0, table.num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if _row_le(table.slice(mid, 1), row, keys):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _smallest_last(tables: list[pa.Table], keys: list[str]) -> int:
    """The index of the table whose last row sorts first."""
    lasts = pa.concat_tables([t.select(keys).slice(t.num_rows - 1, 1) for t in tables])
    first: int = pc.sort_indices(lasts, sort_keys=[(k, "ascending") for k in keys])[0].as_py()
    return first


def _cut(buffers: list[pa.Table | None], waiting: list[int], keys: list[str]) -> pa.Table | None:
    """Takes from every buffer the rows that no part still to be read can precede.

    ``waiting``: the runs that have parts left to read; their buffers are non-empty. The
    frontier is the smallest last row among them: rows at or before it are final.
    """
    candidates = [buffers[i] for i in waiting]
    assert all(c is not None and c.num_rows for c in candidates)
    j = waiting[_smallest_last([c for c in candidates if c is not None], keys)]
    frontier_run = buffers[j]
    assert frontier_run is not None
    frontier = frontier_run.slice(frontier_run.num_rows - 1, 1)
    pieces: list[pa.Table] = []
    for i, buf in enumerate(buffers):
        if buf is None or buf.num_rows == 0:
            continue
        n = buf.num_rows if i == j else _count_le(buf, frontier, keys)
        if n:
            pieces.append(buf.slice(0, n))
            buffers[i] = buf.slice(n)
    if not pieces:
        return None
    return merge_consolidate(pieces, keys)


class _Output:
    """Collects the merged rows, in order, into parts of about ``target`` bytes."""

    def __init__(self, machine: Machine, merge_id: str, started_ms: int, keys: list[str]) -> None:
        self.machine = machine
        self.merge_id = merge_id
        self.started_ms = started_ms
        self.keys = keys
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.parts: list[st.PartRef] = []

    async def add(self, table: pa.Table | None) -> None:
        if table is None or table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        if self.pending_bytes >= self.machine.cfg.part_target_bytes:
            await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        tables, self.pending, self.pending_bytes = self.pending, [], 0
        encoded = await in_background_thread(_encode_output, tables, self.keys)
        if encoded is None:
            return
        data, digest, rows, tmin, tmax, nbytes = encoded
        m = self.machine
        key = blob_keys.compaction_part_key(
            m.shard_id, self.started_ms, self.merge_id, len(self.parts)
        )
        await retry_idempotent(
            lambda: m.blob.set(key, data), m.cfg.retry_attempts, m.cfg.retry_initial_delay_s
        )
        self.parts.append(st.PartRef(key, rows, len(data), digest, tmin, tmax, nbytes))


def _encode_output(
    tables: list[pa.Table], keys: list[str]
) -> tuple[bytes, str, int, int, int, int] | None:
    # Rows equal to a cut's frontier can straddle two cuts: one linear pass re-consolidates.
    part = consolidate_sorted(pa.concat_tables(tables), keys)
    if part.num_rows == 0:
        return None
    mm = pc.min_max(part.column(TIME))
    data = encode_part(part)
    tmin, tmax = mm["min"].as_py(), mm["max"].as_py()
    return data, checksum(data), part.num_rows, tmin, tmax, part.nbytes


async def merge_batches(
    machine: Machine, group: Sequence[st.HollowBatch], since: int, started_ms: int
) -> st.HollowBatch | None:
    """Writes the merge of ``group`` (neighbouring batches) with times advanced to ``since``.

    Returns the new batch (None when every update cancelled out). On any failure (a part
    vanished, blob failed) the parts written so far are deleted and the error raised.
    """
    state = machine.state
    keys = [*schema_from_bytes(state.schema).names, TIME]
    runs: list[deque[st.PartRef]] = []
    for b in group:
        if b.sorted_run:
            runs.append(deque(b.parts))
        else:
            runs.extend(deque([p]) for p in b.parts)
    merge_id = new_id("b")
    out = _Output(machine, merge_id, started_ms, keys)
    buffers: list[pa.Table | None] = [None] * len(runs)
    cfg = machine.cfg

    async def load(i: int) -> None:
        part = runs[i].popleft()
        data = await retry_idempotent(
            lambda: machine.blob.get(part.key), cfg.retry_attempts, cfg.retry_initial_delay_s
        )
        if data is None:
            raise ExternalError(f"part {part.key} vanished during compaction", determinate=True)
        table = await in_background_thread(
            lambda: _advance_to_since(decode_part(data, part.checksum, part.key), since)
        )
        buffers[i] = table

    try:
        gate = asyncio.Semaphore(cfg.io_concurrency)

        async def load_gated(i: int) -> None:
            async with gate:
                await load(i)

        await asyncio.gather(*(load_gated(i) for i in range(len(runs))))
        while True:
            for i, buf in enumerate(buffers):
                while (buf is None or buf.num_rows == 0) and runs[i]:
                    await load(i)
                    buf = buffers[i]
            waiting = [i for i in range(len(runs)) if runs[i]]
            if not waiting:
                rest = [b for b in buffers if b is not None and b.num_rows]
                if rest:
                    await out.add(await in_background_thread(merge_consolidate, rest, keys))
                break
            await out.add(await in_background_thread(_cut, buffers, waiting, keys))
        await out.flush()
    except BaseException:
        await delete_parts(
            machine.blob, [st.HollowBatch(merge_id, 0, None, since, tuple(out.parts))]
        )
        raise
    if not out.parts:
        return None
    lower = min(b.lower for b in group)
    uppers = [b.upper for b in group]
    upper = None if None in uppers else max(u for u in uppers if u is not None)
    return st.HollowBatch(merge_id, lower, upper, since, tuple(out.parts), sorted_run=True)


class Maintenance:
    """A shard's background compaction and garbage collection: one loop, kicked by commits.

    Kicks coalesce (an event, not a queue), so work is bounded however fast writes come; the
    loop may die or be cancelled at any point without harming correctness (every step is
    idempotent and re-planned from the state). ``run()`` does all due work now, for maintain().
    """

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self._kicked = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.Task[None] | None = None
        self._busy: set[str] = set()
        self.merges_applied = 0
        self.merges_discarded = 0

    def kick(self) -> None:
        m = self.machine
        if not m.cfg.compaction_enabled:
            return
        self._kicked.set()
        self._idle.clear()
        if self._loop is None or self._loop.done():
            self._loop = m.tasks.spawn(self._background(), f"maintenance {m.shard_id}")

    async def settle(self) -> None:
        """Waits until the background loop has no work in hand."""
        loop = self._loop
        while not self._idle.is_set() and loop is not None and not loop.done():
            idle = asyncio.ensure_future(self._idle.wait())
            await asyncio.wait([idle, loop], return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()

    async def _background(self) -> None:
        try:
            while True:
                if not self._kicked.is_set():
                    self._idle.set()
                if being_cancelled():
                    raise asyncio.CancelledError()
                await self._kicked.wait()
                self._kicked.clear()
                try:
                    await self.compact_all()
                    await collect(self.machine, sweep_orphans=False)
                except PersistError as exc:
                    if being_cancelled():
                        raise asyncio.CancelledError() from exc
                    log.info("persist maintenance of %s deferred: %s", self.machine.shard_id, exc)
        finally:
            self._idle.set()

    async def compact_all(self) -> int:
        """Runs merges until the spine has none due; the number applied."""
        applied = 0
        while True:
            state = self.machine.state
            if state.since is None or state.finalized:
                return applied
            groups = plan_merges(list(state.batches.values()), self._busy)
            if not groups:
                return applied
            progress = False
            for group in groups:
                if await self.compact(group):
                    applied += 1
                    progress = True
            # A merge that can't be done now (a part unreadable, the blob store failing) would
            # be planned again at once: leave it to the next kick instead of spinning on it.
            if not progress:
                return applied

    async def compact(self, group: list[st.HollowBatch]) -> bool:
        m = self.machine
        ids = [b.id for b in group]
        if self._busy.intersection(ids):
            return False
        self._busy.update(ids)
        try:
            async with m.tasks.compaction_gate:
                since = m.state.since
                if since is None:
                    return False
                started = m.cfg.now_ms()
                try:
                    output = await merge_batches(m, group, since, started)
                except (ExternalError, DiffOverflow) as exc:
                    # DiffOverflow: at the since, some row's diffs sum outside int64. Left
                    # unmerged the shard stays exact (reads at such times raise it themselves).
                    log.info("persist compaction of %s abandoned: %s", m.shard_id, exc)
                    self.merges_discarded += 1
                    # Most often the inputs were merged and collected by another process:
                    # plan the next round from the state as it is now.
                    with contextlib.suppress(ExternalError):
                        await m.refresh()
                    return False
                timeout = int(m.cfg.compaction_timeout_s * 1000)
                tries = Tries()
                applied = await m.apply(
                    lambda s, now: st.apply_merge(s, ids, output, started, timeout, now),
                    tries=tries,
                )
                if applied:
                    self.merges_applied += 1
                else:
                    self.merges_discarded += 1
                    # A try that may have landed may since have been merged on and its parts
                    # retired while readers use them: the orphan sweep takes them in time.
                    if output is not None and not tries.maybe_committed:
                        await delete_parts(m.blob, [output])
                return applied
        finally:
            self._busy.difference_update(ids)
