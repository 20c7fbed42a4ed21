"""Reading updates back from blob: the portable ``Split`` and the fetch paths.

Parts are fetched ``io_concurrency`` at a time; decoding (checksum, Parquet, time filtering) runs
in worker threads, and so does the final merge. Parts are sorted and consolidated when written,
so a merge of parts that line up in key order is one linear pass (see ``core.updates``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

import msgspec
import pyarrow as pa

from persist.batch import INLINE_BYTES, RecentParts, part_bytes
from persist.config import PersistConfig
from persist.core import codec
from persist.core.keyrange import Key, decode_keys, slice_range
from persist.core.state import PartRef
from persist.core.updates import (
    TIME,
    advance_times,
    decode_part,
    filter_times,
    full_schema,
    merge_consolidate,
)
from persist.errors import InvalidUsage
from persist.location import Blob

__all__ = ["Split", "fetch_parts", "read_split", "read_updates", "schema_from_bytes"]


class Split(msgspec.Struct, frozen=True):
    """A share of a snapshot: the contents as of ``as_of`` of the keys in ``[lower, upper)``,
    and the parts that may hold them.

    Cheap to serialize (``to_bytes``/``from_bytes``) and fetch anywhere with access to the
    location (``PersistClient.fetch_split``), while the reader that made it holds its since at or
    below ``as_of``. A snapshot's splits cut its keys into disjoint ranges: every update of a row
    is in exactly one split, so each is exact on its own and their union is the contents.
    """

    shard_id: str
    reader_id: str
    as_of: int
    schema: bytes
    parts: tuple[PartRef, ...]
    # The key range (``core.keyrange.encode_keys`` of one key; empty: unbounded).
    lower: bytes = b""
    upper: bytes = b""
    # Set: the split holds the updates with ``updates_from <= _time <= as_of`` at their own
    # times (``ReadHandle.splits_between``), not the contents as of ``as_of``.
    updates_from: int | None = None

    @property
    def size(self) -> int:
        """Bytes of blob this split reads."""
        return sum(p.size for p in self.parts)

    def to_bytes(self) -> bytes:
        """A compact, checksummed encoding for handing this split to another process."""
        return codec.encode_frame(codec.KIND_SPLIT, self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Split:
        """The split ``to_bytes`` encoded; ``InvalidUsage`` if ``data`` is not one."""
        split = codec.decode_handed(codec.KIND_SPLIT, data, cls)
        try:
            schema_from_bytes(split.schema)
        except (pa.ArrowException, ValueError) as exc:
            raise InvalidUsage(f"the split's schema does not decode: {exc}") from None
        return split


def schema_from_bytes(data: bytes) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(data))


class MissingPart(Exception):
    """A part is not in blob (garbage collected, or lost)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


Transform = Callable[[pa.Table, PartRef], pa.Table]


async def fetch_parts(
    blob: Blob,
    cfg: PersistConfig,
    parts: Sequence[PartRef],
    transform: Transform,
    *,
    schema: pa.Schema | None = None,
    recent: RecentParts | None = None,
) -> list[pa.Table]:
    """The decoded tables of ``parts`` (checksums verified), each through ``transform``, in
    order. The decoding and the transform run in worker threads. Parts in ``recent`` (with
    ``schema``) are taken from there.

    ``schema`` (the shard's full schema, ``full_schema``) is the one the tables come back in;
    without it, each part's own record of the schema it was written with.
    """
    gate = asyncio.Semaphore(cfg.io_concurrency)
    # Parts decode one per worker; with fewer parts than cores, each decodes its columns
    # in parallel too.
    threads = len(parts) < (os.cpu_count() or 1)

    async def one(part: PartRef) -> pa.Table:
        if recent is not None and schema is not None:
            table = recent.get(part.key, schema)
            if table is not None:
                # On the loop: only parts small enough to decode there are remembered.
                return transform(table, part)
        async with gate:
            data = await part_bytes(blob, cfg, part)
            if data is None:
                raise MissingPart(part.key)
            # By decoded size: a well-compressed part can be fifty times its size in blob.
            # Parts written before that size was recorded (0) go to a thread.
            if 0 < part.nbytes <= INLINE_BYTES and len(data) <= INLINE_BYTES:
                return _decode_then(data, part, transform, schema, False)
            return await asyncio.to_thread(_decode_then, data, part, transform, schema, threads)

    return list(await asyncio.gather(*(one(p) for p in parts)))


def _decode_then(
    data: bytes, part: PartRef, transform: Transform, schema: pa.Schema | None, threads: bool
) -> pa.Table:
    table = decode_part(data, part.checksum, part.key, schema=schema, use_threads=threads)
    return transform(table, part)


async def _merge(tables: list[pa.Table], keys: list[str]) -> pa.Table:
    if sum(t.nbytes for t in tables) <= INLINE_BYTES:
        return merge_consolidate(tables, keys)
    return await asyncio.to_thread(merge_consolidate, tables, keys)


def _empty(schema: pa.Schema) -> pa.Table:
    return full_schema(schema).empty_table()


async def read_split(
    blob: Blob, cfg: PersistConfig, split: Split, recent: RecentParts | None = None
) -> pa.Table:
    """The consolidated updates of one split: for a snapshot's, each distinct row of its key
    range once with ``_time == as_of``; for ``splits_between``'s, each (row, time) once."""
    schema = schema_from_bytes(split.schema)
    as_of = split.as_of
    lower = decode_keys(split.lower, schema) if split.lower else None
    upper = decode_keys(split.upper, schema) if split.upper else None
    if split.updates_from is not None:
        return await read_updates(
            blob, cfg, schema, split.parts, split.updates_from, as_of + 1, recent, lower, upper
        )

    def advance(table: pa.Table, part: PartRef) -> pa.Table:
        return advance_times(slice_range(table, lower, upper), as_of, part.max_time)

    parts = [p for p in split.parts if p.min_time <= as_of]
    tables = await fetch_parts(blob, cfg, parts, advance, schema=full_schema(schema), recent=recent)
    return await _merge([_empty(schema), *tables], schema.names)


async def read_updates(
    blob: Blob,
    cfg: PersistConfig,
    schema: pa.Schema,
    parts: Sequence[PartRef],
    lower: int,
    upper: int | None,
    recent: RecentParts | None = None,
    lower_key: Key | None = None,
    upper_key: Key | None = None,
) -> pa.Table:
    """The updates of ``parts`` with ``lower <= _time < upper`` (and keys in ``[lower_key,
    upper_key)``), consolidated per (row, time).

    ``parts`` are the ones that can hold such times (``core.queries.parts_between`` leaves out
    the rest); rows outside the window are filtered here.
    """

    def window(table: pa.Table, part: PartRef) -> pa.Table:
        table = slice_range(table, lower_key, upper_key)
        if part.min_time >= lower and (upper is None or part.max_time < upper):
            return table
        return filter_times(table, lower, upper)

    tables = await fetch_parts(blob, cfg, parts, window, schema=full_schema(schema), recent=recent)
    return await _merge([_empty(schema), *tables], [*schema.names, TIME])
