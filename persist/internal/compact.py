"""Compaction: merging neighbouring batches into one, in the background, in bounded memory.

The spine (``core/shard/trace.py``) says which batches to merge. A merge streams the sorted runs of
its inputs (a compacted batch is one run; a freshly written batch has one run per part), holding
one decoded part per run plus the output part being filled: it never loads a whole shard. Times
are advanced to the shard's since and equal updates consolidated, so an insert and its
retraction disappear once since passes them. The output is written to blob under a fresh key and
proposed to the state machine as "replace these batches by this one" (``apply_merge``), which
accepts it only if every input is still there; otherwise it is discarded and its blobs deleted.
Writers never wait for compaction.

Decoding, merging and encoding run in worker threads (pyarrow's kernels release the GIL); blob
I/O is async. When to merge is ``maintenance``'s business; this module only merges, in the
client's process or, for background merges, in its merge worker (``worker.py``): its inputs
are plain data (blob, config, view, batches) for that reason.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.config import PersistConfig
from persist.core.arrow.evolution import View
from persist.core.arrow.keyrange import encode_keys, key_index
from persist.core.arrow.order import take_final
from persist.core.arrow.updates import (
    DIFF,
    TIME,
    adjacent_equal,
    advance_to_since,
    checksum,
    consolidate_sorted,
    encode_part,
    full_schema,
    merge_consolidate,
    part_row_group_rows,
)
from persist.core.shard import keys as blob_keys
from persist.core.shard.trace import span
from persist.core.shard.types import HollowBatch, PartRef
from persist.errors import ExternalError
from persist.ids import new_id
from persist.internal.batch import RecentParts, delete_parts, part_bytes, put_part
from persist.internal.tasks import in_background_thread, step_aside
from persist.location import Blob

__all__ = ["merge_batches"]


class _Output:
    """Collects the merged rows, in order, into parts of about ``target`` bytes."""

    def __init__(
        self,
        blob: Blob,
        cfg: PersistConfig,
        shard_id: str,
        merge_id: str,
        started_ms: int,
        keys: list[str],
        schema_version: int,
        numbers: Iterator[int],
        alone: bool,
    ) -> None:
        self.schema_version = schema_version
        self.numbers, self.alone = numbers, alone
        self.blob = blob
        self.cfg = cfg
        self.shard_id = shard_id
        self.merge_id = merge_id
        self.started_ms = started_ms
        self.keys = keys
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.parts: list[PartRef] = []

    async def add(self, table: pa.Table | None) -> None:
        if table is None or table.num_rows == 0:
            return
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        if self.pending_bytes >= self.cfg.part_target_bytes:
            await self.flush()

    async def flush(self) -> None:
        if not self.pending:
            return
        tables, self.pending, self.pending_bytes = self.pending, [], 0
        encoded = await in_background_thread(_encode_output, tables, self.keys)
        if encoded is None:
            return
        data, digest, rows, (tmin, tmax), nbytes, index, (dmin, dmax) = encoded
        key = blob_keys.compaction_part_key(
            self.shard_id, self.started_ms, self.merge_id, next(self.numbers)
        )
        await step_aside()  # its fsync would queue a caller's behind it
        await put_part(self.blob, self.cfg, key, data)
        self.parts.append(
            PartRef(
                key,
                rows,
                len(data),
                digest,
                tmin,
                tmax,
                nbytes,
                key_index=index,
                min_diff=dmin,
                max_diff=dmax,
                schema_version=self.schema_version,
                origin=self.merge_id,
                alone=self.alone,
            )
        )


class _Apart:
    """Splits the merged rows, in order, between two outputs: the rows whose only update is a
    +1 (``alone``) and the others. A row's updates may straddle pieces: the last row's are held
    back until the next piece (or ``last``, the merge's final piece, or the end) shows whether
    more follow."""

    def __init__(self, alone: _Output, others: _Output, keys: list[str]) -> None:
        self.alone, self.others, self.keys = alone, others, keys
        self.held: pa.Table | None = None

    async def add(self, table: pa.Table | None, *, last: bool = False) -> None:
        if table is None or table.num_rows == 0:
            return
        split = await in_background_thread(_split_alone, self.held, table, self.keys, last)
        await self._emit(split)

    async def finish(self) -> None:
        if self.held is not None and self.held.num_rows:
            # Only where the final piece was not marked (every update after it cancelled).
            held, self.held = self.held, None
            await self._emit(await in_background_thread(_split_alone, None, held, self.keys, True))
        await self.alone.flush()
        await self.others.flush()

    async def _emit(self, split: tuple[pa.Table | None, pa.Table | None, pa.Table | None]) -> None:
        alone, others, self.held = split
        await self.alone.add(alone)
        await self.others.add(others)

    @property
    def parts(self) -> list[PartRef]:
        return [*self.alone.parts, *self.others.parts]


def _split_alone(
    held: pa.Table | None, table: pa.Table, keys: list[str], last: bool
) -> tuple[pa.Table | None, pa.Table | None, pa.Table | None]:
    """(alone, others, held): the rows of ``held`` then ``table`` (sorted and consolidated on
    ``keys``, each on its own) whose row has exactly one update, a +1; the others; and, unless
    ``last``, the last row's updates, held back (None for an empty table)."""
    if held is not None and held.num_rows:
        table = pa.concat_tables([held, table])
        if _seam_equal([held, table.slice(held.num_rows)], keys):
            table = consolidate_sorted(table, keys)
    n = table.num_rows
    if n == 0:
        return None, None, None
    # Rows equal on the data columns (every update of one row) are adjacent.
    same = adjacent_equal(table, keys[:-1]) if n > 1 else np.zeros(0, bool)
    cut = n
    if not last:
        # The last row's updates: from the first of the trailing run of equal rows.
        unequal = np.flatnonzero(~same)
        cut = int(unequal[-1]) + 1 if unequal.size else 0
    before = np.concatenate(([False], same))
    after = np.concatenate((same, [False]))
    single = ~before & ~after & (table.column(DIFF).to_numpy() == 1)
    single = single[:cut]
    held_out = table.slice(cut) if cut < n else None
    body = table.slice(0, cut)
    if single.all():
        return body, None, held_out
    if not single.any():
        return None, body, held_out
    mask = pa.array(single)
    return body.filter(mask), body.filter(pc.invert(mask)), held_out


_Bounds = tuple[int, int]

# Output parts up to this size (decoded) are written without dictionaries, keeping statistics
# on every column and the page index. Such a part is a low level of the spine, which the next
# as many rows appended rewrite again, and a dictionary is most of what encoding it costs: on
# 64,000 rows of (int64 key, 16-char id, int64 value) it doubled the encode time and made
# the file 1.18x bigger (every value distinct); on low-cardinality columns it saves about a
# fifth of the bytes, which a part of a few MiB can spare until its next rewrite. Larger
# outputs, which engines read as they are for longer, keep them.
PLAIN_OUTPUT_BYTES = 8 << 20


def _encode_output(
    tables: list[pa.Table], keys: list[str]
) -> tuple[bytes, str, int, _Bounds, int, bytes, _Bounds] | None:
    # Rows equal to a cut's frontier can straddle two cuts: one linear pass re-consolidates.
    # Each table is consolidated already, so only a row equal across a seam calls for it.
    part = pa.concat_tables(tables)
    if _seam_equal(tables, keys):
        part = consolidate_sorted(part, keys)
    if part.num_rows == 0:
        return None
    group = part_row_group_rows(part.num_rows, part.nbytes)
    data = encode_part(
        part,
        dictionary=part.nbytes > PLAIN_OUTPUT_BYTES,
        statistics=True,
        row_group_rows=group,
        key_names=keys[:-1],
    )
    index = encode_keys(key_index(part, keys[:-1], part.nbytes))
    times, diffs = pc.min_max(part.column(TIME)), pc.min_max(part.column(DIFF))
    tb = (times["min"].as_py(), times["max"].as_py())
    db = (diffs["min"].as_py(), diffs["max"].as_py())
    return data, checksum(data), part.num_rows, tb, part.nbytes, index, db


def _seam_equal(tables: list[pa.Table], keys: list[str]) -> bool:
    """Whether the last row of a non-empty table of ``tables`` (in order) equals, on ``keys``,
    the first row of the next non-empty one."""
    tables = [t.select(keys) for t in tables if t.num_rows]
    if len(tables) < 2:
        return False
    ends = [e for a, b in pairwise(tables) for e in (a.slice(a.num_rows - 1, 1), b.slice(0, 1))]
    return bool(adjacent_equal(pa.concat_tables(ends), keys)[::2].any())


async def merge_batches(
    blob: Blob,
    cfg: PersistConfig,
    shard_id: str,
    view: View,
    group: Sequence[HollowBatch],
    since: int,
    started_ms: int,
    recent: RecentParts | None = None,
) -> HollowBatch | None:
    """Writes the merge of ``group`` (neighbouring batches of the shard) with times advanced
    to ``since``, under the shard's compaction prefix, in the schema version ``view`` reads
    (the current one): parts of other versions are shown in it, so an insert and its
    retraction written in different versions cancel here too.

    Returns the new batch (None when every update cancelled out). On any failure (a part
    vanished, blob failed) the parts written so far are deleted and the error raised.

    Inputs found in ``recent`` (the decoded small parts this process wrote lately) are taken
    from there: most inputs of a merge of small appends, which then costs no read or decode.
    """
    stored = full_schema(view.schema)
    keys = [*view.schema.names, TIME]
    runs: list[deque[PartRef]] = []
    for b in group:
        # A run shown in another version stays one only if the showing keeps its order.
        if all(view.aligned(p.schema_version) for p in b.parts):
            runs.extend(deque(run) for run in b.runs())
        else:
            runs.extend(deque([p]) for p in b.parts)
    merge_id = new_id("b")
    numbers = itertools.count()
    alone, others = (
        _Output(blob, cfg, shard_id, merge_id, started_ms, keys, view.reader, numbers, apart)
        for apart in (True, False)
    )
    out = _Apart(alone, others, keys)
    buffers: list[pa.Table | None] = [None] * len(runs)

    async def load(i: int) -> None:
        part = runs[i].popleft()
        known = None
        if recent is not None and view.direct(part.schema_version):
            known = recent.get(part.key, stored)
        if known is not None:
            buffers[i] = advance_to_since(known, since)  # small: on the loop
            return
        data = await part_bytes(blob, cfg, part)
        if data is None:
            raise ExternalError(f"part {part.key} vanished during compaction", determinate=True)
        shown = view.decoded  # in the current version, whatever the part's
        args = (data, part.checksum, part.key, part.schema_version)
        table = await in_background_thread(lambda: advance_to_since(shown(*args), since))
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
                    merged = await in_background_thread(merge_consolidate, rest, keys)
                    await out.add(merged, last=True)
                break
            await out.add(await in_background_thread(take_final, buffers, waiting, keys))
        await out.finish()
    except BaseException:
        await delete_parts(blob, [HollowBatch(merge_id, 0, None, since, tuple(out.parts))])
        raise
    if not out.parts:
        return None
    lower, upper = span(group)
    return HollowBatch(merge_id, lower, upper, since, tuple(out.parts), sorted_run=True)
