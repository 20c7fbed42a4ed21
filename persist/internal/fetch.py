"""Reading updates back from blob: the portable ``Split`` and the fetch paths.

Parts are fetched ``io_concurrency`` at a time; decoding (checksum, Parquet, time filtering) runs
in worker threads, and so does the final merge. Parts are sorted and consolidated when written,
so a merge of parts that line up in key order is one linear pass (see ``core.arrow.updates``).
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist.config import PersistConfig
from persist.core.arrow.evolution import Shapes, View
from persist.core.arrow.keyrange import (
    ROW_GROUP_BYTES,
    Key,
    count_below,
    decode_keys,
    encode_keys,
    slice_range,
)
from persist.core.arrow.updates import (
    DIFF,
    ROW_GROUP_KEYS,
    TIME,
    advance_times,
    decode_part,
    decode_row_groups,
    filter_times,
    full_schema,
    merge_consolidate,
)
from persist.core.read.queries import key_ranges
from persist.core.read.scan import distinct_rows
from persist.core.shard import codec
from persist.core.shard.types import PartRef
from persist.errors import IntegrityError, InvalidUsage
from persist.internal.batch import INLINE_BYTES, RecentParts, count_read, part_bytes
from persist.internal.retry import retry_idempotent
from persist.location import Blob

__all__ = [
    "Consolidate",
    "Split",
    "fetch_parts",
    "read_split",
    "read_updates",
    "schema_from_bytes",
    "stream_split",
]


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
    # The key range (``core.arrow.keyrange.encode_keys`` of one key; empty: unbounded).
    lower: bytes = b""
    upper: bytes = b""
    # Set: the split holds the updates with ``updates_from <= _time <= as_of`` at their own
    # times (``ReadHandle.splits_between``), not the contents as of ``as_of``.
    updates_from: int | None = None
    # Set when a part is in another schema version than ``schema``'s (or the reader's version
    # lost a field to a drop): how each is shown in ``schema`` (``core.arrow.evolution``).
    shapes: Shapes | None = None

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

# How a streamed snapshot split is merged: True, every piece (each row once, in key order);
# False, only a piece with a retraction; "never", no piece (the updates as stored).
Consolidate = bool | Literal["never"]


async def fetch_parts(
    blob: Blob,
    cfg: PersistConfig,
    parts: Sequence[PartRef],
    transform: Transform,
    *,
    schema: pa.Schema | None = None,
    recent: RecentParts | None = None,
    key_range: tuple[Key | None, Key | None] | None = None,
    carry: Carry | None = None,
    view: View | None = None,
) -> list[pa.Table]:
    """The decoded tables of ``parts`` (checksums verified), each through ``transform``, in
    order. The decoding and the transform run in worker threads. Parts in ``recent`` (with
    ``schema``) are taken from there. With ``key_range`` (the transform keeps only those keys),
    a part of several row groups is read only as far as the row groups that can hold them.
    With ``carry`` (one piece of a piecewise read), what the previous piece kept of a part is
    used, and what the next piece will need of it again is kept (see ``Carry``).

    ``schema`` (the shard's full schema, ``full_schema``) is the one the tables come back in;
    without it, each part's own record of the schema it was written with. With ``view``, a
    part of another schema version is decoded in its own and shown in ``schema`` (whole:
    such a part is read without its key index), before ``transform``.
    """
    gate = asyncio.Semaphore(cfg.io_concurrency)
    # Parts decode one per worker; with fewer parts than cores, each decodes its columns
    # in parallel too.
    threads = len(parts) < (os.cpu_count() or 1)

    async def one(part: PartRef) -> pa.Table:
        if view is not None and not view.direct(part.schema_version):
            async with gate:
                data = await part_bytes(blob, cfg, part)
            if data is None:
                raise MissingPart(part.key)
            return await asyncio.to_thread(_shown, data, part, view, transform)
        if recent is not None and schema is not None:
            table = recent.get(part.key, schema)
            if table is not None:
                # On the loop: only parts small enough to decode there are remembered.
                return transform(table, part)
        # A part of one row group (known to be small) that the next piece reads as well is
        # decoded once and kept: within the one row group per part a piecewise read may hold.
        keep = carry is not None and part.key in carry.next and 0 < part.nbytes <= ROW_GROUP_BYTES
        if carry is not None and part.key in carry.whole:
            table = carry.whole.pop(part.key)
            if keep:
                carry.whole[part.key] = table
            return await _then(transform, table, part, part.nbytes <= INLINE_BYTES)
        async with gate:
            if key_range is not None and by_row_group(part):
                table = await _row_groups(blob, cfg, part, schema, *key_range, carry)
                if table is not None:
                    return await asyncio.to_thread(transform, table, part)
            data = await part_bytes(blob, cfg, part)
            if data is None:
                raise MissingPart(part.key)
            # By decoded size: a well-compressed part can be fifty times its size in blob.
            # Parts written before that size was recorded (0) go to a thread.
            on_loop = 0 < part.nbytes <= INLINE_BYTES and len(data) <= INLINE_BYTES
            if keep and carry is not None:
                args = (data, part.checksum, part.key)
                table = (
                    decode_part(*args, schema=schema)
                    if on_loop
                    else await asyncio.to_thread(decode_part, *args, schema=schema)
                )
                carry.whole[part.key] = table
                return await _then(transform, table, part, on_loop)
            if on_loop:
                return _decode_then(data, part, transform, schema, False)
            return await asyncio.to_thread(_decode_then, data, part, transform, schema, threads)

    return list(await asyncio.gather(*(one(p) for p in parts)))


def by_row_group(part: PartRef) -> bool:
    """Whether ``part`` can be read by row group: it is in blob, several row groups long (they
    are cut by decoded size), and written with its row groups' keys."""
    return not part.inline and bool(part.key_index) and part.nbytes > ROW_GROUP_BYTES


# The tail of a part read first for its footer: enough for the footer of any part persist
# writes in one read (a second one fetches the rest of a longer footer).
FOOTER_READ = 16 << 10


def _ranged(blob: Blob, cfg: PersistConfig, part: PartRef) -> Callable[[int, int], Any]:
    """Reads bytes ``[start, end)`` of ``part`` (retried; ``MissingPart`` if it is gone)."""

    async def get(start: int, end: int) -> bytes:
        data = await retry_idempotent(
            lambda: blob.get_range(part.key, start, end),
            cfg.retry_attempts,
            cfg.retry_initial_delay_s,
        )
        if data is None:
            raise MissingPart(part.key)
        count_read(data)
        return data

    return get


async def _footer(get: Callable[[int, int], Any], part: PartRef) -> tuple[int, bytes]:
    """The tail of ``part`` that holds its whole footer, and where it starts."""
    size = part.size
    tail_at = max(0, size - FOOTER_READ)
    tail: bytes = await get(tail_at, size)
    if len(tail) < 8 or tail[-4:] != b"PAR1":
        raise IntegrityError(f"blob {part.key} is not a Parquet file (no footer)")
    footer = int.from_bytes(tail[-8:-4], "little") + 8
    if footer > size:
        raise IntegrityError(f"blob {part.key} has a footer longer than itself")
    if footer > len(tail):
        tail_at = size - footer
        tail = await get(tail_at, size)
    return tail_at, tail


# A part's footer, and its row groups' keys when it records them.
_Layout = tuple[pq.FileMetaData, pa.Table | None]


class Carry:
    """What a piecewise read of a split (``stream_split``) keeps of its parts from one piece to
    the next, so that no row group is fetched and decoded twice: pieces come in key order, so
    the next piece starts in the row group where this one ended, in every part it straddles.

    Per part the next piece reads (``next``, set before each piece): its footer, and the last
    row group this piece decoded (``_Held``); or, for a part of one row group, the part
    (``whole``). That is at most one row group per part beyond the piece, which the pieces'
    memory bound already counts (a row group per part at each end)."""

    def __init__(self) -> None:
        self.next: frozenset[str] = frozenset()
        self.groups: dict[str, _Held] = {}
        self.whole: dict[str, pa.Table] = {}


class _Held:
    """A part's fetched footer and row groups' keys, and the last row group a piece decoded
    (``group``, ``table``)."""

    def __init__(self, tail_at: int, tail: bytes, layout: _Layout) -> None:
        self.tail_at, self.tail, self.layout = tail_at, tail, layout
        self.group = -1
        self.table: pa.Table | None = None


async def _row_groups(
    blob: Blob,
    cfg: PersistConfig,
    part: PartRef,
    schema: pa.Schema | None,
    lower: Key | None,
    upper: Key | None,
    carry: Carry | None = None,
) -> pa.Table | None:
    """The rows of the row groups of ``part`` that can hold keys in ``[lower, upper)``, fetched
    by range; None when the whole part is wanted or it records no row-group keys."""

    get = _ranged(blob, cfg, part)
    held = None if carry is None else carry.groups.pop(part.key, None)
    if held is None:
        tail_at, tail = await _footer(get, part)
        names = [n for n in (schema.names if schema is not None else []) if n not in (TIME, DIFF)]
        source = _Sparse(part.size, [(tail_at, tail)])
        layout = await asyncio.to_thread(_layout, source, part.key, names, schema)
        held = _Held(tail_at, tail, layout)
    meta, bounds = held.layout
    if bounds is None or schema is None:
        return None
    groups = meta.num_row_groups
    first, last = _span(bounds, lower, upper)
    keep = carry is not None and part.key in carry.next
    if carry is not None and keep:
        carry.groups[part.key] = held
    if first >= last:
        return schema.empty_table()
    # The previous piece ended in the row group this one starts in: it is decoded already.
    reuse = held.table is not None and held.group == first
    tables = [held.table] if reuse and held.table is not None else []
    at = first + 1 if reuse else first
    if not reuse and not keep and first == 0 and last == groups:
        return None  # read whole, under the part's checksum
    if at < last:
        spans = [_column_span(meta.row_group(g)) for g in (at, last - 1)]
        start, end = spans[0][0], spans[1][1]
        source = _Sparse(part.size, [(held.tail_at, held.tail), (start, await get(start, end))])
        # The last row group decoded on its own when it is kept: it must not pin the others.
        cut = last - 1 if keep else last
        for span in (range(at, cut), range(cut, last)):
            if len(span):
                tables.append(
                    await asyncio.to_thread(
                        decode_row_groups, source, span, part.key, schema=schema
                    )
                )
        held.group, held.table = last - 1, tables[-1]
    if not keep:
        held.table = None
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _layout(source: _Sparse, key: str, names: list[str], schema: pa.Schema | None) -> _Layout:
    """A part's footer and its row groups' keys (``ROW_GROUP_KEYS``: the first key of each
    group, then the last key; None when it records none: it is read whole)."""
    try:
        meta = pq.read_metadata(source)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise IntegrityError(f"blob {key}'s footer does not decode: {exc}") from exc
    raw = (meta.metadata or {}).get(ROW_GROUP_KEYS)
    groups = meta.num_row_groups
    if raw is None or schema is None or groups < 2:
        return meta, None
    bounds = decode_keys(raw, pa.schema([schema.field(n) for n in names]))
    if bounds.num_rows != groups + 1:
        raise IntegrityError(f"blob {key} records {bounds.num_rows} keys for {groups} row groups")
    return meta, bounds


def _span(bounds: pa.Table, lower: Key | None, upper: Key | None) -> tuple[int, int]:
    """The row groups ``[first, last)`` that can hold keys in ``[lower, upper)``."""
    groups = bounds.num_rows - 1
    # Row group i holds keys from bounds[i] to bounds[i + 1] (a key may straddle two groups).
    first = 0 if lower is None else max(0, count_below(bounds, lower) - 1)
    last = groups if upper is None else min(groups, count_below(bounds.slice(0, groups), upper))
    return first, last


def _column_span(group: pq.RowGroupMetaData) -> tuple[int, int]:
    """The bytes of a row group: from its first column chunk's first page to its last one's end."""
    start, end = None, 0
    for i in range(group.num_columns):
        col = group.column(i)
        at = col.dictionary_page_offset if col.has_dictionary_page else None
        at = col.data_page_offset if at is None else min(at, col.data_page_offset)
        start = at if start is None else min(start, at)
        end = max(end, at + col.total_compressed_size)
    return start or 0, end


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges were fetched: what Parquet's
    reader needs of a part to decode some of its row groups. Reading elsewhere is an error."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._size = size
        self._pieces = list(pieces)
        self._pos = 0

    def add(self, start: int, data: bytes) -> None:
        self._pieces.append((start, data))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._size - self._pos)
        if want <= 0:
            return 0
        for start, data in self._pieces:
            if start <= self._pos and self._pos + want <= start + len(data):
                at = self._pos - start
                buffer[:want] = data[at : at + want]
                self._pos += want
                return want
            if self._pos < start and self._pos + want == self._size == start + len(data):
                # Parquet's reader takes the footer from a speculative read of the file's last
                # 64 KiB: the bytes before the fetched tail are data it does not look at.
                gap = start - self._pos
                buffer[:gap] = bytes(gap)
                buffer[gap:want] = data
                self._pos += want
                return want
        raise OSError(f"bytes [{self._pos}, {self._pos + want}) of the part were not fetched")


async def _then(transform: Transform, table: pa.Table, part: PartRef, on_loop: bool) -> pa.Table:
    return transform(table, part) if on_loop else await asyncio.to_thread(transform, table, part)


def _decode_then(
    data: bytes, part: PartRef, transform: Transform, schema: pa.Schema | None, threads: bool
) -> pa.Table:
    table = decode_part(data, part.checksum, part.key, schema=schema, use_threads=threads)
    return transform(table, part)


def _shown(data: bytes, part: PartRef, view: View, transform: Transform) -> pa.Table:
    table = view.decoded(data, part.checksum, part.key, part.schema_version)
    return transform(table, part)


async def _merge(tables: list[pa.Table], keys: list[str], *, distinct: bool = False) -> pa.Table:
    if sum(t.nbytes for t in tables) <= INLINE_BYTES:
        return merge_consolidate(tables, keys, distinct=distinct)
    return await asyncio.to_thread(merge_consolidate, tables, keys, distinct=distinct)


def _empty(schema: pa.Schema) -> pa.Table:
    return full_schema(schema).empty_table()


@dataclass(frozen=True, slots=True)
class _Opened:
    """A split as every fetch of it starts: its schema and key range decoded."""

    split: Split
    schema: pa.Schema  # the data columns
    lower: Key | None
    upper: Key | None
    view: View | None

    @property
    def full(self) -> pa.Schema:
        return full_schema(self.schema)

    @property
    def key_range(self) -> tuple[Key | None, Key | None] | None:
        """``fetch_parts``'s ``key_range``: None when the split takes every key."""
        return None if self.lower is None and self.upper is None else (self.lower, self.upper)

    def snapshot_parts(self) -> list[PartRef]:
        """A snapshot split's parts that can hold updates at or before its ``as_of``."""
        return [p for p in self.split.parts if p.min_time <= self.split.as_of]

    def advance(self, table: pa.Table, part: PartRef) -> pa.Table:
        """A snapshot split's ``Transform``: the rows of its key range, at ``as_of``."""
        return advance_times(
            slice_range(table, self.lower, self.upper), self.split.as_of, part.max_time
        )


def _open(split: Split) -> _Opened:
    schema = schema_from_bytes(split.schema)
    lower = decode_keys(split.lower, schema) if split.lower else None
    upper = decode_keys(split.upper, schema) if split.upper else None
    view = None if split.shapes is None else View(split.shapes, schema)
    return _Opened(split, schema, lower, upper, view)


async def read_split(
    blob: Blob,
    cfg: PersistConfig,
    split: Split,
    recent: RecentParts | None = None,
    *,
    consolidate: bool = True,
    carry: Carry | None = None,
) -> pa.Table:
    """The consolidated updates of one split: for a snapshot's, each distinct row of its key
    range once with ``_time == as_of``; for ``splits_between``'s, each (row, time) once.

    ``consolidate=False`` (snapshot splits): when no update read has a negative diff, the
    updates come back as read, unmerged: a row may appear several times, its diffs summing to
    its multiplicity, in no particular order. That is the same multiset of rows without the
    merge's sort. With a retraction among them they are consolidated as usual."""
    o = _open(split)
    schema = o.schema
    if split.updates_from is not None:
        return await read_updates(
            blob, cfg, schema, split.parts, split.updates_from, split.as_of + 1, recent, o.lower,
            o.upper, carry=carry, view=o.view,
        )  # fmt: skip
    parts = o.snapshot_parts()
    tables = await fetch_parts(
        blob, cfg, parts, o.advance, schema=o.full, recent=recent, key_range=o.key_range,
        carry=carry, view=o.view,
    )  # fmt: skip
    if not consolidate and all(_no_retractions(t) for t in tables):
        return pa.concat_tables([_empty(schema), *tables])
    # Parts that keep one time each and whose key ranges don't meet hold every row once
    # already: they need ordering, not the consolidation's comparison of every row. A part
    # shown in another version must be shown one to one (a dropped field may make two rows
    # one).
    view = o.view
    shown_alike = view is None or all(view.keeps_distinct(p.schema_version) for p in parts)
    distinct = shown_alike and distinct_rows(parts, split.schema, split.as_of)
    return await _merge([_empty(schema), *tables], schema.names, distinct=distinct)


def _no_retractions(table: pa.Table) -> bool:
    return table.num_rows == 0 or bool(pc.min(table.column(DIFF)).as_py() > 0)


async def stream_split(
    blob: Blob,
    cfg: PersistConfig,
    split: Split,
    max_bytes: int,
    recent: RecentParts | None = None,
    *,
    consolidate: Consolidate = True,
) -> AsyncIterator[pa.Table]:
    """``read_split``'s rows in key order, in pieces: the split's key range cut (by its parts'
    key indexes) into sub-ranges of about ``max_bytes`` of parts each, read one at a time. Memory
    holds one piece: about ``max_bytes`` plus a row group per part at each end of its range (a
    part without key index, small by nature, is read whole for each piece it may reach).
    ``consolidate`` as ``read_split``'s, or ``"never"``: ``stream_raw``'s updates instead.

    Each row group is fetched and decoded once, however many pieces it straddles: a piece keeps
    (``Carry``) each part's footer and the last row group it decoded for the next piece, which
    starts in that group."""
    if not isinstance(consolidate, bool):
        async for table in stream_raw(blob, cfg, split, max_bytes, recent):
            yield table
        return
    o = _open(split)
    total = sum(p.nbytes or p.size for p in split.parts)
    n = max(1, -(-total // max_bytes))
    ranges = key_ranges(split.parts, o.schema, n, o.lower, o.upper)
    carry = Carry()
    for i, r in enumerate(ranges):
        if not r.parts:
            continue
        following = ranges[i + 1].parts if i + 1 < len(ranges) else []
        carry.next = frozenset(p.key for p in following)
        piece = msgspec.structs.replace(
            split,
            parts=tuple(r.parts),
            lower=b"" if r.lower is None else encode_keys(r.lower),
            upper=b"" if r.upper is None else encode_keys(r.upper),
        )
        table = await read_split(blob, cfg, piece, recent, consolidate=consolidate, carry=carry)
        if table.num_rows:
            yield table


async def stream_raw(
    blob: Blob,
    cfg: PersistConfig,
    split: Split,
    chunk_bytes: int,
    recent: RecentParts | None = None,
) -> AsyncIterator[pa.Table]:
    """A snapshot split's updates as stored, unconsolidated (a row may come several times, and
    with negative diffs: only all of them summed, per row, are the contents), within the split's
    key range and at ``_time == as_of``. Read part by part and, in a part of several row groups,
    about ``chunk_bytes`` of row groups at a time: memory holds one chunk, and no row group is
    read twice."""
    if split.updates_from is not None:
        raise InvalidUsage(
            'consolidate="never" reads a snapshot\'s splits, not those of splits_between'
        )
    o = _open(split)
    full = o.full
    for part in o.snapshot_parts():
        if by_row_group(part) and (o.view is None or o.view.direct(part.schema_version)):
            chunks = _group_chunks(blob, cfg, part, full, o.lower, o.upper, chunk_bytes)
            async for table in chunks:
                table = await asyncio.to_thread(o.advance, table, part)
                if table.num_rows:
                    yield table
            continue
        (table,) = await fetch_parts(
            blob, cfg, [part], o.advance, schema=full, recent=recent, view=o.view
        )
        if table.num_rows:
            yield table


async def _group_chunks(
    blob: Blob,
    cfg: PersistConfig,
    part: PartRef,
    schema: pa.Schema,
    lower: Key | None,
    upper: Key | None,
    chunk_bytes: int,
) -> AsyncIterator[pa.Table]:
    """The row groups of ``part`` that can hold keys in ``[lower, upper)``, decoded about
    ``chunk_bytes`` at a time, each chunk fetched by range."""

    get = _ranged(blob, cfg, part)
    size = part.size
    tail_at, tail = await _footer(get, part)
    names = [n for n in schema.names if n not in (TIME, DIFF)]
    plan = await asyncio.to_thread(
        _chunk_plan, _Sparse(size, [(tail_at, tail)]), part.key, names, schema, lower, upper,
        chunk_bytes,
    )  # fmt: skip
    for groups, start, end in plan:
        data = await get(start, end)
        pieces = _Sparse(size, [(tail_at, tail), (start, data)])
        yield await asyncio.to_thread(decode_row_groups, pieces, groups, part.key, schema=schema)


def _chunk_plan(
    source: _Sparse,
    key: str,
    names: list[str],
    schema: pa.Schema,
    lower: Key | None,
    upper: Key | None,
    chunk_bytes: int,
) -> list[tuple[range, int, int]]:
    """Consecutive row groups of a part cut into chunks of about ``chunk_bytes`` decoded, each
    with its bytes ``[start, end)``: those that can hold keys in ``[lower, upper)`` when the part
    records its row groups' keys, else all."""
    meta, bounds = _layout(source, key, names, schema)
    first, last = (0, meta.num_row_groups) if bounds is None else _span(bounds, lower, upper)
    plan: list[tuple[range, int, int]] = []
    g = first
    while g < last:
        end_g, total = g, 0
        while end_g < last and (end_g == g or total < chunk_bytes):
            total += meta.row_group(end_g).total_byte_size
            end_g += 1
        spans = [_column_span(meta.row_group(i)) for i in (g, end_g - 1)]
        plan.append((range(g, end_g), spans[0][0], spans[1][1]))
        g = end_g
    return plan


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
    *,
    carry: Carry | None = None,
    view: View | None = None,
) -> pa.Table:
    """The updates of ``parts`` with ``lower <= _time < upper`` (and keys in ``[lower_key,
    upper_key)``), consolidated per (row, time).

    ``parts`` are the ones that can hold such times (``core.read.queries.parts_between`` leaves out
    the rest); rows outside the window are filtered here. ``view``: as ``fetch_parts``'s.
    """

    def window(table: pa.Table, part: PartRef) -> pa.Table:
        table = slice_range(table, lower_key, upper_key)
        if part.min_time >= lower and (upper is None or part.max_time < upper):
            return table
        return filter_times(table, lower, upper)

    bounds = None if lower_key is None and upper_key is None else (lower_key, upper_key)
    tables = await fetch_parts(
        blob, cfg, parts, window, schema=full_schema(schema), recent=recent, key_range=bounds,
        carry=carry, view=view,
    )  # fmt: skip
    return await _merge([_empty(schema), *tables], [*schema.names, TIME])
