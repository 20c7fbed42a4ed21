"""A snapshot as an engine reads it: which Parquet parts, and what to do with their rows.

An engine (Spark, DuckDB, Polars) can read a snapshot of a shard with its own Parquet reader:
the parts are Parquet files of the data columns plus ``_time`` (uint64) and ``_diff`` (int64).
``plan_scan(state, as_of)`` says, from the state alone (no I/O), which parts to read and the
least the engine must do to their rows to get the snapshot as of ``as_of``:

1. ``filter_time``: keep only the rows with ``_time <= as_of`` (when False, no row is later).
2. Then, for the **contents** (each row as many times as its multiplicity), ``contents``:

   - ``NONE``: take the rows as they are: every update is a +1.
   - ``REPEAT``: repeat each row ``_diff`` times, failing on a row whose ``_diff`` is negative
     (every update is positive, or no row appears twice, so each row's diff is its
     multiplicity).
   - ``SUM``: group the rows by the data columns, sum ``_diff``, drop zero sums; repeat each
     row by its sum and fail on a negative one. The rows of a part marked ``untouched`` may
     instead be taken as they are (one copy per update) and left out of the sum: every update
     of each of them is a +1 (``untouched``).

   and for the **updates** (each distinct row once, ``_time = as_of``, ``_diff`` its
   multiplicity), ``updates``:

   - ``NONE``: each row as it is, with ``_time`` set to ``as_of``: no row appears twice.
   - ``SUM``: group by the data columns, sum ``_diff``, drop zero sums, ``_time = as_of``.

Rows are equal as values, as everywhere in persist: nulls equal nulls, every NaN equals every
NaN, -0.0 equals 0.0 (what Spark's grouping does too). Every rule is conservative: it asks
for less work only when the state proves that less is enough. ``tests/core/test_scan.py``
holds the rules to a brute-force model.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.keyrange import decode_keys, rank
from persist.core.frontier import check_below_upper, check_since
from persist.core.read.queries import parts_as_of
from persist.core.shard.types import PartRef, State

__all__ = ["Consolidation", "Scan", "ScanPart", "plan_scan", "untouched"]


class Consolidation(enum.Enum):
    """What an engine must do to a scan's (time-filtered) rows; see the module's docstring."""

    NONE = "none"
    REPEAT = "repeat"
    SUM = "sum"


class ScanPart(msgspec.Struct, frozen=True):
    """One part a scan reads: a Parquet file of the data columns plus ``_time`` and ``_diff``.

    ``key`` names it in the shard's blob; ``inline`` holds its Parquet bytes when it lives in
    the state instead (then nothing is stored at ``key``). ``size`` is its Parquet size in
    bytes, ``rows`` its updates before any filtering, ``checksum`` as ``PartRef.checksum``.
    ``min_diff``/``max_diff`` are None when unknown (parts written before they were recorded).
    """

    key: str
    size: int
    rows: int
    checksum: str
    min_time: int
    max_time: int
    min_diff: int | None
    max_diff: int | None
    # Whether it may hold updates after the scan's as_of (which the filter drops).
    filter_time: bool
    inline: bytes = b""
    # The schema version it was written in (``PartRef.schema_version``).
    schema_version: int = 0
    # Every update of it is a +1, and no part that may hold another diff may hold one of its
    # rows (their key ranges don't meet): its rows are contents as they are, one copy per
    # update, whatever the scan's consolidation. Set only where ``contents`` is ``SUM``.
    untouched: bool = False


class Scan(msgspec.Struct, frozen=True):
    """A snapshot of shard ``shard_id`` as of ``as_of``, read from the parts of the state at
    ``seqno``: ``parts`` in blob and ``inline_parts`` in the state. Which rows to keep and how
    to consolidate them: ``filter_time``, ``contents``, ``updates`` (see ``core.read.scan``).

    ``min_diff``/``max_diff`` bound every ``_diff`` read (None: unknown, or no part).
    ``distinct_rows``: no data row appears twice among the rows kept (the state proves it).
    ``uniform``: every part was written in ``schema`` (the shard's current version); when
    False, a part's columns are its own version's (``ScanPart.schema_version``), which only
    persist's reads show in ``schema`` (``core.arrow.evolution``), and the scan is never
    ``plain``.
    """

    shard_id: str
    seqno: int
    as_of: int
    since: int | None
    upper: int | None
    schema: bytes  # the data columns, Arrow IPC (as ``State.schema``)
    parts: tuple[ScanPart, ...]
    inline_parts: tuple[ScanPart, ...]
    filter_time: bool
    min_diff: int | None
    max_diff: int | None
    distinct_rows: bool
    contents: Consolidation
    updates: Consolidation
    uniform: bool = True

    @property
    def rows(self) -> int:
        """Updates in all the parts, before filtering."""
        return sum(p.rows for p in (*self.parts, *self.inline_parts))

    @property
    def size(self) -> int:
        """Bytes of the parts in blob."""
        return sum(p.size for p in self.parts)

    @property
    def plain(self) -> bool:
        """Whether the contents are the parts' data columns read as they are: no filter, no
        consolidation."""
        return self.uniform and not self.filter_time and self.contents is Consolidation.NONE


def plan_scan(state: State, as_of: int) -> Scan:
    """The scan of ``state``'s snapshot as of ``as_of``. ``InvalidUsage`` when the state can't
    answer it: ``as_of`` below the since (compaction may have moved times it needs) or not
    below the upper (updates at ``as_of`` may still come)."""
    check_since(as_of, state.since)
    check_below_upper(as_of, state.upper)
    # A part's min_time and max_time are exact: recorded from its rows as it was written, and
    # a part is never rewritten. A batch's upper is no bound on its parts' times: compaction
    # moves times up to the since, which may be past the batch's upper.
    chosen = [(p, p.max_time > as_of) for p in parts_as_of(state, as_of)]
    scan_parts = [_scan_part(p, later) for p, later in chosen]
    filter_time = any(later for _, later in chosen)
    lows = [p.min_diff for p, _ in chosen]
    highs = [p.max_diff for p, _ in chosen]
    known = bool(chosen) and None not in lows and None not in highs
    min_diff = min(d for d in lows if d is not None) if known else None
    max_diff = max(d for d in highs if d is not None) if known else None
    current = max(state.schemas, default=0)
    uniform = all(p.schema_version == current for p, _ in chosen)
    distinct = uniform and distinct_rows([p for p, _ in chosen], state.schema, as_of)
    if not uniform:
        contents = Consolidation.SUM
    elif not chosen or (min_diff == 1 and max_diff == 1):
        contents = Consolidation.NONE
    elif distinct or (min_diff is not None and min_diff >= 1):
        contents = Consolidation.REPEAT
    else:
        contents = Consolidation.SUM
    if contents is Consolidation.SUM and uniform:
        apart = untouched([p for p, _ in chosen], state.schema)
        scan_parts = [
            msgspec.structs.replace(part, untouched=u)
            for part, u in zip(scan_parts, apart, strict=True)
        ]
    return Scan(
        shard_id=state.shard_id,
        seqno=state.seqno,
        as_of=as_of,
        since=state.since,
        upper=state.upper,
        schema=state.schema,
        parts=tuple(p for p in scan_parts if not p.inline),
        inline_parts=tuple(p for p in scan_parts if p.inline),
        filter_time=filter_time,
        min_diff=min_diff,
        max_diff=max_diff,
        distinct_rows=distinct,
        contents=contents,
        updates=Consolidation.NONE if distinct else Consolidation.SUM,
        uniform=uniform,
    )


def _scan_part(part: PartRef, later: bool) -> ScanPart:
    return ScanPart(
        key=part.key,
        size=part.size,
        rows=part.rows,
        checksum=part.checksum,
        min_time=part.min_time,
        max_time=part.max_time,
        min_diff=part.min_diff,
        max_diff=part.max_diff,
        filter_time=later,
        inline=part.inline,
        schema_version=part.schema_version,
    )


def distinct_rows(parts: Sequence[PartRef], schema: bytes, as_of: int) -> bool:
    """Whether no data row appears twice among the updates of ``parts`` at times ``<= as_of``.

    Within a sorted run a row appears once per time (it is consolidated per row and time), so
    once when the times it keeps are one; an unsorted run proves nothing (a row may appear in
    it twice). Across parts, the parts' key ranges (first and last key, from their key indexes)
    must not meet; a part without an index (inline, or written before indexes) proves nothing
    beside another part.
    """
    if any(p.unsorted or p.min_time != min(p.max_time, as_of) for p in parts):
        return False
    if len(parts) <= 1:
        return True
    if not all(p.key_index for p in parts):
        return False
    data = pa.ipc.read_schema(pa.py_buffer(schema))
    indexes = [decode_keys(p.key_index, data) for p in parts]
    firsts = pa.concat_tables([ix.slice(0, 1) for ix in indexes])
    lasts = pa.concat_tables([ix.slice(ix.num_rows - 1, 1) for ix in indexes])
    order = _sorted_order(firsts)
    firsts, lasts = firsts.take(order), lasts.take(order)
    # Sorted by first key, the ranges are disjoint iff each last key sorts strictly before the
    # next part's first key: then exactly the firsts up to its own sort at or before it.
    at_or_before = rank(firsts, lasts)
    return bool(np.array_equal(at_or_before, np.arange(1, len(parts) + 1)))


def untouched(parts: Sequence[PartRef], schema: bytes) -> list[bool]:
    """Per part: whether each of its updates is a +1 and no part that may hold another diff
    (``min_diff``/``max_diff`` other than 1, or unknown) may hold one of its rows. Then each row
    of it has only +1 updates, wherever they are, and its updates are contents as they are.

    A part's key range is its key index's first and last key (parts of one schema version:
    ``schema`` is theirs); a part without one (inline, unsorted, or written before indexes)
    may hold any key, so it is never untouched, and as a part with other diffs it meets every
    part. A part a merge wrote alone (``PartRef.alone``) meets none of the parts of that merge
    (``PartRef.origin``), whatever their ranges: none of them holds one of its rows.
    """
    odd = [not (p.min_diff == 1 and p.max_diff == 1) for p in parts]
    candidates = [i for i, p in enumerate(parts) if not odd[i] and p.key_index]
    ranged = [i for i, p in enumerate(parts) if odd[i] and p.key_index]
    out = [False] * len(parts)
    if not candidates or any(o and not p.key_index for o, p in zip(odd, parts, strict=True)):
        return out
    if not ranged:
        for i in candidates:
            out[i] = True
        return out
    data = pa.ipc.read_schema(pa.py_buffer(schema))
    indexes = [decode_keys(parts[i].key_index, data) for i in (*candidates, *ranged)]
    ends = pa.concat_tables(
        [ix.slice(0, 1) for ix in indexes] + [ix.slice(ix.num_rows - 1, 1) for ix in indexes]
    )
    # Each first and last key as a number that orders them as the parts' rows are sorted
    # (equal keys, equal numbers): how many of them sort at or before it.
    ordinal = rank(ends.take(_sorted_order(ends)), ends)
    n = len(indexes)
    first, last = ordinal[:n], ordinal[n:]
    c, o = len(candidates), slice(len(candidates), n)
    # Two ranges meet where each starts at or before the other's end.
    meet = (first[o][None, :] <= last[:c][:, None]) & (first[:c][:, None] <= last[o][None, :])
    # A part a merge wrote alone shares no row with the other parts of that merge.
    alone = np.array([parts[i].alone and bool(parts[i].origin) for i in candidates])
    mine = np.array([parts[i].origin for i in candidates], object)
    theirs = np.array([parts[j].origin for j in ranged], object)
    meet &= ~(alone[:, None] & (mine[:, None] == theirs[None, :]))
    met = [bool(m) for m in np.asarray(meet.any(axis=1)).tolist()]
    for i, hit in zip(candidates, met, strict=True):
        out[i] = not hit
    return out


def _sorted_order(keys: pa.Table) -> pa.Array:
    return pc.sort_indices(keys, sort_keys=[(n, "ascending") for n in keys.column_names])
