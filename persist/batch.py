"""Writing updates to blob as batches of Parquet parts, and the portable ``Batch`` handle.

A write cuts the updates into parts of about ``part_target_bytes`` (so memory beyond the input
stays bounded however large the write), sorts and consolidates each part, encodes it and puts it
in blob under the writer's prefix, ``io_concurrency`` parts at a time, in worker threads (pyarrow
releases the GIL). Nothing is visible until a compare-and-set makes the state reference it.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from persist.config import PersistConfig
from persist.core import codec, keys
from persist.core.keyrange import encode_keys, key_index, row_group_rows
from persist.core.order import is_one_run
from persist.core.state import HollowBatch, PartRef
from persist.core.updates import TIME, checksum, encode_part, sort_consolidate
from persist.internal.retry import retry_idempotent
from persist.location import Blob

__all__ = ["INLINE_BYTES", "Batch", "RecentParts", "delete_keys", "delete_parts", "write_batch"]

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
        self._tables: dict[str, pa.Table] = {}
        self._bytes = 0

    def put(self, key: str, table: pa.Table) -> None:
        if table.nbytes > min(INLINE_BYTES, self._budget) or key in self._tables:
            return
        self._tables[key] = table
        self._bytes += table.nbytes
        while self._bytes > self._budget:
            oldest = next(iter(self._tables))
            self._bytes -= self._tables.pop(oldest).nbytes

    def get(self, key: str, schema: pa.Schema) -> pa.Table | None:
        """The table of part ``key``, if remembered with exactly ``schema``."""
        table = self._tables.get(key)
        return table if table is not None and table.schema.equals(schema) else None


class _Encoded(NamedTuple):
    data: bytes
    digest: str
    rows: int
    min_time: int
    max_time: int
    nbytes: int
    # The part's first and last rows (sort keys only), to tell whether the parts of a write
    # line up into one sorted run.
    bounds: pa.Table
    # The part as encoded (full schema, sorted and consolidated).
    table: pa.Table
    # Whether it lives in its PartRef (an inline write) rather than in blob.
    inline: bool
    # Its key index (``core.keyrange``); an inline part needs none: it is at hand whole.
    key_index: bytes


def _encode_chunk(chunk: pa.Table, data_cols: list[str], inline_max_bytes: int) -> _Encoded | None:
    keys = [*data_cols, TIME]
    part = sort_consolidate(chunk, keys)
    n = part.num_rows
    if n == 0:
        return None
    mm = pc.min_max(part.column(TIME))
    group = row_group_rows(n, part.nbytes)
    data = encode_part(
        part, dictionary=chunk.nbytes > INLINE_BYTES, row_group_rows=group, key_names=data_cols
    )
    bounds = pa.concat_tables([part.select(keys).slice(0, 1), part.select(keys).slice(n - 1, 1)])
    inline = len(data) <= inline_max_bytes
    index = b"" if inline else encode_keys(key_index(part, data_cols, part.nbytes))
    tmin, tmax = mm["min"].as_py(), mm["max"].as_py()
    return _Encoded(data, checksum(data), n, tmin, tmax, part.nbytes, bounds, part, inline, index)


# A write at least this big per worker is cut into parts that encode in parallel: pyarrow's
# Parquet writer uses one core per file, and the parts of a sorted write stay one sorted run.
_PARALLEL_PART_BYTES = 4 << 20


def _part_count(nbytes: int, cfg: PersistConfig) -> int:
    by_size = -(-nbytes // cfg.part_target_bytes)
    for_cores = min(cfg.io_concurrency, nbytes // _PARALLEL_PART_BYTES)
    return max(1, by_size, for_cores)


async def write_batch(
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
) -> HollowBatch:
    """Writes ``updates`` (already checked by ``prepare_updates``) as the parts of batch
    ``batch_id``, under ``keys.batch_prefix``, remembering small ones in ``recent``. A part of at
    most ``inline_max_bytes`` encoded is kept inline (in its ``PartRef``) instead of written.
    If it fails or is cancelled, the parts written so far stay: the caller deletes that prefix
    (every write has settled by then)."""
    n = updates.num_rows
    if n == 0:
        return HollowBatch(batch_id, lower, upper, 0, ())
    rows_per_part = -(-n // _part_count(updates.nbytes, cfg))
    chunks = [updates.slice(i, rows_per_part) for i in range(0, n, rows_per_part)]
    gate = asyncio.Semaphore(cfg.io_concurrency)

    async def write_part(index: int, chunk: pa.Table) -> tuple[PartRef, pa.Table] | None:
        async with gate:
            if chunk.nbytes <= INLINE_BYTES:
                # Sorting and encoding a small part takes a few hundred microseconds, less
                # than a hop to a worker thread and back costs under load.
                encoded = _encode_chunk(chunk, data_cols, inline_max_bytes)
            else:
                encoded = await asyncio.to_thread(_encode_chunk, chunk, data_cols, inline_max_bytes)
            if encoded is None:
                return None
            key = keys.part_key(shard_id, writer_id, batch_id, index)
            e = encoded
            inline = e.data if e.inline else b""
            if not inline:
                await retry_idempotent(
                    lambda: blob.set_new(key, e.data),
                    cfg.retry_attempts,
                    cfg.retry_initial_delay_s,
                )
            if recent is not None:
                recent.put(key, e.table)
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
            )
            return ref, e.bounds

    if len(chunks) == 1:
        written = [await write_part(0, chunks[0])]
    else:
        written = list(await asyncio.gather(*(write_part(i, c) for i, c in enumerate(chunks))))
    parts = [w for w in written if w is not None]
    bounds = [b for _, b in parts]
    sorted_run = len(bounds) <= 1 or await asyncio.to_thread(is_one_run, bounds, [*data_cols, TIME])
    return HollowBatch(batch_id, lower, upper, 0, tuple(p for p, _ in parts), sorted_run)


async def delete_parts(blob: Blob, batches: list[HollowBatch]) -> None:
    """Deletes the parts of batches that no state references (best effort); inline parts
    have nothing in blob."""
    await delete_keys(blob, [p.key for b in batches for p in b.parts if not p.inline])


async def part_bytes(blob: Blob, cfg: PersistConfig, part: PartRef) -> bytes | None:
    """The encoded bytes of ``part``: its inline ones, or read from blob (None if missing)."""
    if part.inline:
        return part.inline
    return await retry_idempotent(
        lambda: blob.get(part.key), cfg.retry_attempts, cfg.retry_initial_delay_s
    )


async def delete_keys(blob: Blob, keys: list[str]) -> None:
    """Deletes blobs that no state references (best effort: a failure leaves them to gc)."""
    await asyncio.gather(*(blob.delete(k) for k in keys), return_exceptions=True)
