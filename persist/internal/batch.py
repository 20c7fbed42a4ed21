"""Writing updates to blob as batches of Parquet parts, and the portable ``Batch`` handle.

A write cuts the updates into parts of about ``part_target_bytes`` (so memory beyond the input
stays bounded however large the write), sorts and consolidates each small part (a big one is
stored as an unsorted run: ``PersistConfig.sorted_part_max_bytes``), encodes it and puts it
in blob under the writer's prefix, ``io_concurrency`` parts at a time, in worker threads (pyarrow
releases the GIL). A batch may also be written as its updates come (``PartWriter.add``), a part
at a time, so that not even the input is held whole. Nothing is visible until a compare-and-set
makes the state reference it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import msgspec
import pyarrow as pa

from persist.config import PersistConfig
from persist.core.arrow.keyrange import encode_keys, key_index_rows
from persist.core.arrow.order import is_one_run
from persist.core.arrow.updates import (
    DIFF,
    TIME,
    checksum,
    drop_zero_diffs,
    encode_part,
    may_overflow,
    part_row_group_rows,
    sort_consolidate,
    strictly_ascending,
)
from persist.core.shard import codec, keys
from persist.core.shard.types import HollowBatch, PartRef
from persist.internal.retry import retry_idempotent
from persist.location import Blob
from persist.metrics import on as metrics_on

__all__ = [
    "INLINE_BYTES",
    "Batch",
    "PartWriter",
    "RecentParts",
    "delete_keys",
    "delete_parts",
]

# Parts up to this size in memory (decoded) are encoded and decoded on the event loop: that is
# cheaper than a thread hop, and blocks the loop for well under a millisecond.
INLINE_BYTES = 256 * 1024


class Batch(msgspec.Struct, frozen=True):
    """Updates written to blob but not yet part of the shard.

    Made by ``WriteHandle.batch``; made visible by ``WriteHandle.compare_and_append_batch``
    (possibly in another process: ``to_bytes``/``from_bytes`` carry it there) or thrown away by
    ``PersistClient.delete_batch``. Every update's time is in ``[lower, upper)``.
    """

    shard_id: str
    writer_id: str
    lower: int
    upper: int | None
    hollow: HollowBatch

    @property
    def rows(self) -> int:
        """The number of (consolidated) updates in the batch."""
        return self.hollow.rows

    def to_bytes(self) -> bytes:
        """A compact, checksummed encoding for moving this batch to another process."""
        return codec.encode_frame(codec.KIND_BATCH, self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Batch:
        """The batch ``to_bytes`` encoded; ``InvalidUsage`` if ``data`` is not one."""
        return codec.decode_handed(codec.KIND_BATCH, data, cls)


class RecentParts:
    """The decoded tables of the small parts this client wrote lately, by key, up to
    ``budget_bytes`` in all (the oldest go first).

    A listener or snapshot in the process that wrote a part takes it from here instead of
    reading and decoding it again: that is most of what hearing about a local write costs. Part
    keys are written once, so an entry never goes stale; the state alone decides which parts a
    read uses.
    """

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        # Each table with its ``nbytes``, which pyarrow works out anew (a few microseconds)
        # each time it is asked.
        self._tables: dict[str, tuple[pa.Table, int]] = {}
        self._bytes = 0

    def put(self, key: str, table: pa.Table, nbytes: int | None = None) -> None:
        """Remembers ``table`` (of ``nbytes``, if the caller knows its ``nbytes``)."""
        size = table.nbytes if nbytes is None else nbytes
        if size > min(INLINE_BYTES, self._budget) or key in self._tables:
            return
        if any(col.num_chunks > 1 for col in table.columns):
            # A table of many tiny chunks (a group of small streamed writes, a DoPut of many
            # batches) holds about 1.5 KB of native memory per chunk that ``nbytes`` does not
            # count: the budget would hold tens of times itself.
            table = table.combine_chunks()
            size = table.nbytes
        self._tables[key] = (table, size)
        self._bytes += size
        while self._bytes > self._budget:
            oldest = next(iter(self._tables))
            self._bytes -= self._tables.pop(oldest)[1]

    def get(self, key: str, schema: pa.Schema) -> pa.Table | None:
        """The table of part ``key``, if remembered with exactly ``schema``."""
        entry = self._tables.get(key)
        return entry[0] if entry is not None and entry[0].schema.equals(schema) else None


class _Encoded(NamedTuple):
    data: bytes
    digest: str
    rows: int
    min_time: int
    max_time: int
    nbytes: int
    # Rows of the part in its order (sort keys only), its first and last among them: whether
    # the parts of a write line up into one sorted run (``is_one_run``). None for an unsorted
    # run. The rows of its key index, which cost no second take.
    bounds: pa.Table | None
    # The part as encoded (full schema; sorted and consolidated unless ``bounds`` is None).
    table: pa.Table
    # Whether it lives in its PartRef (an inline write) rather than in blob.
    inline: bool
    # Its key index (``core.arrow.keyrange``); an inline part needs none: it is at hand whole.
    key_index: bytes
    # The smallest and largest of its diffs (``PartRef.min_diff``/``max_diff``).
    min_diff: int
    max_diff: int
    # How many of its updates retract (negative diff).
    retracted: int


def _encode_chunk(
    chunk: pa.Table,
    data_cols: list[str],
    inline_max_bytes: int,
    sorted_max_bytes: int,
    nbytes: int | None = None,
) -> _Encoded | None:
    """``nbytes``: ``chunk.nbytes``, if the caller knows it. pyarrow works it out anew each time
    it is asked, about 2 us a column: asked five times, it was a tenth of a small part's encode."""
    keys = [*data_cols, TIME]
    chunk_size = chunk.nbytes if nbytes is None else nbytes
    # numpy: a third of the time of the compute kernel on the one-row parts of small appends.
    diffs = chunk.column(DIFF).to_numpy()
    unsorted = (
        chunk_size > sorted_max_bytes
        and chunk.num_rows > 1
        # Updates whose equal rows might sum outside int64 are consolidated now, so that
        # the write, not a later read, refuses them.
        and not may_overflow(diffs)
        # Rows that come in key order are a sorted run already, at no cost.
        and not strictly_ascending(chunk.column(keys[0]))
    )
    part = drop_zero_diffs(chunk) if unsorted else sort_consolidate(chunk, keys)
    n = part.num_rows
    if n == 0:
        return None
    part_size = chunk_size
    if part is not chunk:
        diffs = part.column(DIFF).to_numpy()
        part_size = part.nbytes
    data = encode_part(
        part,
        dictionary=chunk_size > INLINE_BYTES,
        row_group_rows=part_row_group_rows(n, part_size),
        key_names=data_cols,
        unsorted=unsorted,
    )
    # An unsorted run is never inline: engines take inline parts decoded by persist (a sorted
    # run, where the same row's updates are summed) and files as stored, and the part's diff
    # bounds and rows must describe what they read (the rows as stored).
    inline = not unsorted and len(data) <= inline_max_bytes
    bounds, index = None, b""
    if not unsorted:
        # One take of a few rows, bounds and key index at once: a copy, not slices that would
        # keep the whole part in memory.
        at = pa.array([0, n - 1], pa.int64()) if inline else key_index_rows(n, part_size)
        bounds = part.select(keys).take(at)
        if not inline:
            index = encode_keys(bounds.select(data_cols))
    times = part.column(TIME).to_numpy()  # numpy, as the diffs: half pc.min_max's time
    dmin, dmax = int(diffs.min()), int(diffs.max())
    retracted = int((diffs < 0).sum()) if dmin < 0 else 0
    return _Encoded(
        data,
        checksum(data),
        n,
        int(times.min()),
        int(times.max()),
        part_size,
        bounds,
        part,
        inline,
        index,
        dmin,
        dmax,
        retracted,
    )


# A write at least this big per worker is cut into parts that encode in parallel: pyarrow's
# Parquet writer uses one core per file, and the parts of a sorted write stay one sorted run.
_PARALLEL_PART_BYTES = 4 << 20


def _part_count(nbytes: int, cfg: PersistConfig, *, round_up: bool = True) -> int:
    by_size = -(-nbytes // cfg.part_target_bytes) if round_up else nbytes // cfg.part_target_bytes
    for_cores = min(cfg.io_concurrency, nbytes // _PARALLEL_PART_BYTES)
    return max(1, by_size, for_cores)


class PartWriter:
    """Writes the parts of batch ``batch_id`` (updates already checked by ``prepare_updates``)
    under ``keys.batch_prefix``, remembering small ones in ``recent``; a part of at most
    ``inline_max_bytes`` encoded is kept inline (in its ``PartRef``) instead of written.

    ``write`` writes updates at once, cut into parts of about ``part_target_bytes``. ``add``
    holds updates until they make such a part and writes it then, so that it holds about one
    part's worth however many updates come. ``finish`` writes what ``add`` holds and returns the
    batch. If a call fails or is cancelled, the parts written so far stay: the caller deletes
    the batch's prefix (every write has settled by then)."""

    def __init__(
        self,
        blob: Blob,
        cfg: PersistConfig,
        shard_id: str,
        writer_id: str,
        data_cols: list[str],
        batch_id: str,
        recent: RecentParts | None = None,
        inline_max_bytes: int = 0,
        schema_version: int = 0,
        defer_puts: bool = False,
    ) -> None:
        self._blob = blob
        # Encoded parts held back for ``put_deferred`` (None: each part is written at once).
        self._deferred: list[tuple[str, bytes]] | None = [] if defer_puts else None
        self._schema_version = schema_version
        self._cfg = cfg
        self._shard_id = shard_id
        self._writer_id = writer_id
        self._data_cols = data_cols
        self._batch_id = batch_id
        self._recent = recent
        self._inline_max_bytes = inline_max_bytes
        self._held: list[pa.Table] = []
        self._held_bytes = 0
        self._next_index = 0
        self._parts: list[tuple[PartRef, pa.Table | None]] = []

    async def write(self, updates: pa.Table) -> None:
        nbytes = updates.nbytes
        await self._put(updates, _part_count(nbytes, self._cfg), nbytes)

    async def add(self, updates: pa.Table) -> None:
        if updates.num_rows:
            self._held.append(updates)
            self._held_bytes += updates.nbytes
        if self._held_bytes >= self._cfg.part_target_bytes:
            await self._flush()

    async def finish(self, lower: int, upper: int | None) -> HollowBatch:
        await self._flush()
        parts = [p for p, _ in self._parts]
        bounds = [b for _, b in self._parts if b is not None]
        keys = [*self._data_cols, TIME]
        if len(bounds) < len(parts):
            sorted_run = False  # an unsorted run is no part of a sorted one
        else:
            sorted_run = len(bounds) <= 1 or await asyncio.to_thread(is_one_run, bounds, keys)
        return HollowBatch(self._batch_id, lower, upper, 0, tuple(parts), sorted_run)

    async def _flush(self) -> None:
        if not self._held:
            return
        table = pa.concat_tables(self._held)
        self._held, self._held_bytes = [], 0
        # Rounded down: the parts of a flush are at least the target (but the last one's).
        await self._put(table, _part_count(table.nbytes, self._cfg, round_up=False))

    async def _put(self, updates: pa.Table, count: int, nbytes: int | None = None) -> None:
        """Writes ``updates`` (of ``nbytes``, if known) as ``count`` parts."""
        n = updates.num_rows
        if n == 0:
            return
        rows_per_part = -(-n // count)
        chunks = [updates.slice(i, rows_per_part) for i in range(0, n, rows_per_part)]
        first, self._next_index = self._next_index, self._next_index + len(chunks)
        if len(chunks) == 1:
            # The one chunk covers all of ``updates``: the same bytes.
            written = [await self._write_part(first, chunks[0], nbytes)]
        else:
            gate = asyncio.Semaphore(self._cfg.io_concurrency)

            async def gated(index: int, chunk: pa.Table) -> tuple[PartRef, pa.Table | None] | None:
                async with gate:
                    return await self._write_part(index, chunk)

            written = await asyncio.gather(*(gated(first + i, c) for i, c in enumerate(chunks)))
        self._parts.extend(w for w in written if w is not None)

    async def _write_part(
        self, index: int, chunk: pa.Table, nbytes: int | None = None
    ) -> tuple[PartRef, pa.Table | None] | None:
        cols, inline_max = self._data_cols, self._inline_max_bytes
        sorted_max = self._cfg.sorted_part_max_bytes
        size = chunk.nbytes if nbytes is None else nbytes
        if size <= INLINE_BYTES:
            # Sorting and encoding a small part takes a few hundred microseconds, less than a
            # hop to a worker thread and back costs under load.
            encoded = _encode_chunk(chunk, cols, inline_max, sorted_max, size)
        else:
            encoded = await asyncio.to_thread(
                _encode_chunk, chunk, cols, inline_max, sorted_max, size
            )
        if encoded is None:
            return None
        key = keys.part_key(self._shard_id, self._writer_id, self._batch_id, index)
        e = encoded
        inline = e.data if e.inline else b""
        if not inline:
            if self._deferred is not None:
                self._deferred.append((key, e.data))
            else:
                await self._put_one(key, e.data)
        unsorted = e.bounds is None
        if self._recent is not None and not unsorted:
            self._recent.put(key, e.table, e.nbytes)
        ref = PartRef(
            key,
            e.rows,
            len(e.data),
            e.digest,
            e.min_time,
            e.max_time,
            e.nbytes,
            inline,
            e.key_index,
            e.min_diff,
            e.max_diff,
            e.retracted,
            self._schema_version,
            unsorted,
        )
        return ref, e.bounds

    async def put_deferred(self) -> None:
        """Writes the parts held back (``defer_puts``), each once; returns or raises only
        once every write has settled (landed or never will), so that a failure's cleanup
        races none of them."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        gate = asyncio.Semaphore(self._cfg.io_concurrency)

        async def gated(key: str, data: bytes) -> None:
            async with gate:
                await self._put_one(key, data)

        results = await asyncio.gather(*(gated(k, d) for k, d in deferred), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _put_one(self, key: str, data: bytes) -> None:
        await put_part(self._blob, self._cfg, key, data)
        if (counted := metrics_on()) is not None:
            counted.parts_written.inc()
            counted.bytes_written.inc(len(data))


async def stage_batch(
    blob: Blob,
    cfg: PersistConfig,
    shard_id: str,
    writer_id: str,
    updates: pa.Table,
    lower: int,
    upper: int | None,
    data_cols: list[str],
    batch_id: str,
    recent: RecentParts | None = None,
    inline_max_bytes: int = 0,
    schema_version: int = 0,
    *,
    defer_puts: bool = True,
) -> tuple[HollowBatch, Callable[[], Awaitable[None]]]:
    """Writes ``updates`` (already checked by ``prepare_updates``) as the parts of batch
    ``batch_id`` (see ``PartWriter``), in schema version ``schema_version``, in two steps: the
    batch, its parts encoded, and the call that writes them to blob (``defer_puts``; else they
    are written already and it does nothing). The batch may be committed only once that call
    returned: a small append plans its commit while its part is being written (the fsync or
    PUT is most of its time). If either step fails or is cancelled, the parts written so far
    stay: the caller deletes the batch's prefix (every write has settled by then)."""
    if updates.num_rows == 0:
        return HollowBatch(batch_id, lower, upper, 0, ()), _nothing
    writer = PartWriter(
        blob, cfg, shard_id, writer_id, data_cols, batch_id, recent, inline_max_bytes,
        schema_version, defer_puts,
    )  # fmt: skip
    await writer.write(updates)
    return await writer.finish(lower, upper), writer.put_deferred


async def _nothing() -> None:
    return None


async def delete_parts(blob: Blob, batches: list[HollowBatch]) -> None:
    """Deletes the parts of batches that no state references (best effort); inline parts
    have nothing in blob."""
    await delete_keys(blob, [p.key for b in batches for p in b.parts if not p.inline])


async def put_part(blob: Blob, cfg: PersistConfig, key: str, data: bytes) -> None:
    """Writes an encoded part under its new ``key`` (written once: a retry is safe)."""
    await retry_idempotent(
        lambda: blob.set_new(key, data), cfg.retry_attempts, cfg.retry_initial_delay_s
    )


async def part_bytes(blob: Blob, cfg: PersistConfig, part: PartRef) -> bytes | None:
    """The encoded bytes of ``part``: its inline ones, or read from blob (None if missing)."""
    if part.inline:
        return part.inline
    data = await retry_idempotent(
        lambda: blob.get(part.key), cfg.retry_attempts, cfg.retry_initial_delay_s
    )
    count_read(data)
    return data


def count_read(data: bytes | None) -> None:
    """Counts a part (or a range of one) read from blob, when metrics are on."""
    if (counted := metrics_on()) is not None and data is not None:
        counted.parts_read.inc()
        counted.bytes_read.inc(len(data))


async def delete_keys(blob: Blob, keys: list[str]) -> None:
    """Deletes blobs that no state references (best effort: a failure leaves them to gc)."""
    await asyncio.gather(*(blob.delete(k) for k in keys), return_exceptions=True)
