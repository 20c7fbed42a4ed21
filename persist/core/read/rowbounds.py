"""How many updates a range of times and keys holds, as far as the state tells (no I/O): what a
reader that takes about N rows at a time (a stream's micro-batches under a row limit) cuts its
ranges by.

By time, a part counts whole towards each range of times it may hold: the rows so counted are
at least the updates of the range (consolidation only merges rows). By key, a part's key index
cuts it into segments: segment ``i`` of a part of ``n`` rows indexed by ``k + 1`` keys
(``core.arrow.keyrange.key_index``) is its rows ``[i * n // k, (i + 1) * n // k)``, whose keys lie
between index keys ``i`` and ``i + 1``, both included. A key range is charged the segments that
start in it: successive ranges charge each segment once, and where the parts are one sorted run
cut at their own index keys a range holds exactly what it is charged. Where parts overlap in
keys a range also holds some rows of the segments that started before it, and fewer of those
that run past its end. Parts without a key index (inline, or written before indexes) are
charged nothing.

Cuts are keys of the parts' indexes: a range can be cut no finer than they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.keyrange import Key, decode_keys, rank
from persist.core.shard.types import PartRef

__all__ = ["RowBounds", "parts_in_key_range", "segment_rows"]


def segment_rows(rows: int, segments: int) -> np.ndarray:
    """The rows of each segment of a part of ``rows`` rows whose index has ``segments + 1``
    keys."""
    starts = np.arange(segments + 1, dtype=np.int64) * rows // segments
    return np.diff(starts)


def _indexes(parts: Sequence[PartRef], schema: pa.Schema) -> list[pa.Table]:
    return [decode_keys(p.key_index, schema) for p in parts]


def parts_in_key_range(
    parts: Sequence[PartRef], schema: pa.Schema, lower: Key | None, upper: Key | None
) -> list[PartRef]:
    """The parts of ``parts`` (in their order) that may hold keys in ``[lower, upper)`` (None:
    unbounded): those whose first and last keys (their index's first and last) reach into it,
    and every part without a key index."""
    indexed = [p for p in parts if p.key_index]
    if (lower is None and upper is None) or not indexed:
        return list(parts)
    indexes = _indexes(indexed, schema)
    meets = np.ones(len(indexed), dtype=bool)
    if lower is not None:
        lasts = pa.concat_tables([ix.slice(ix.num_rows - 1, 1) for ix in indexes])
        meets &= rank(lower, lasts) >= 1  # lower <= last key
    if upper is not None:
        firsts = pa.concat_tables([ix.slice(0, 1) for ix in indexes])
        meets &= rank(upper, firsts) == 0  # first key < upper
    dropped = {id(p) for p, m in zip(indexed, meets, strict=True) if not m}
    return [p for p in parts if id(p) not in dropped]


class RowBounds:
    """What ``parts`` (the parts that may hold updates at times in ``[lower, upper)``) tell of
    how those updates spread over times and keys, by their row counts, times and key indexes
    (``schema``: the data columns).

    The same holds of the contents as of ``upper - 1`` when ``lower`` is 0 (the snapshot's
    parts are those that may hold times below ``upper``): a snapshot has at most as many rows
    as the updates it consolidates.
    """

    def __init__(self, parts: Sequence[PartRef], schema: pa.Schema, lower: int, upper: int) -> None:
        self.parts = list(parts)
        self.schema = schema
        self.lower = lower
        self.upper = upper

    @property
    def rows(self) -> int:
        """At least as many as the updates in the range: the parts' rows."""
        return sum(p.rows for p in self.parts)

    def between(self, lower: int, upper: int) -> RowBounds:
        """The bounds of the times ``[lower, upper)`` (within this range): the parts that may
        hold some of them."""
        parts = [p for p in self.parts if p.max_time >= lower and p.min_time < upper]
        return RowBounds(parts, self.schema, lower, upper)

    def _starts(self) -> list[tuple[int, int]]:
        """(the first time of the range each part may hold, its rows), by that time."""
        return sorted((max(p.min_time, self.lower), p.rows) for p in self.parts)

    def frontier_within(self, max_rows: int) -> int:
        """The largest frontier ``e`` in ``[lower, upper]`` such that the updates at times in
        ``[lower, e)`` are at most ``max_rows`` (by the rows of the parts that may hold them).
        ``lower`` when the parts holding ``lower`` itself are already more."""
        total = 0
        for start, rows in self._starts():
            total += rows
            if total > max_rows:
                return min(self.upper, start)
        return self.upper

    def next_frontier(self) -> int:
        """The frontier after ``lower`` up to which the times hold no part beyond those
        that may hold ``lower`` itself: the smallest time range that parts' times can't cut."""
        later = [start for start, _ in self._starts() if start > self.lower]
        return min([self.upper, *later])

    def key_within(self, lower: Key | None, max_rows: int) -> tuple[Key | None, int]:
        """A key ``cut`` above ``lower`` (None: -infinity) and the rows charged to the keys in
        ``[lower, cut)``: those of the index segments that start in it. The cut is the largest
        index key whose charge is at most ``max_rows``; when even the smallest cut that charges
        some rows charges more, that one, so that each cut moves on. ``cut`` None: every key from
        ``lower`` on, when their charge is at most ``max_rows`` or no index key above ``lower``
        charges anything.

        The rows of ``[lower, cut)`` are at most the charge, plus each part's rows at or above
        ``lower`` in the segment that holds ``lower`` without starting there (none when
        ``lower`` is where the part's segments were cut, as when it is the previous cut of
        the same parts), plus the rows of parts without a key index. Successive cuts charge
        each segment once, and there are as many cuts as needed to charge every segment.
        """
        indexed = [p for p in self.parts if p.key_index]
        if not indexed:
            return None, 0
        indexes = _indexes(indexed, self.schema)
        los = pa.concat_tables([ix.slice(0, ix.num_rows - 1) for ix in indexes])
        counts = np.concatenate(
            [segment_rows(p.rows, ix.num_rows - 1) for p, ix in zip(indexed, indexes, strict=True)]
        )
        order = pc.sort_indices(los, sort_keys=[(n, "ascending") for n in los.column_names])
        los = los.take(order)
        counts = counts[order.to_numpy()]
        # below[j]: the rows of the segments before sorted position j.
        below = np.concatenate([[0], np.cumsum(counts)])
        if lower is None:
            before = at_or_before = 0
        else:
            at_or_before = int(rank(los, lower)[0])  # segments starting at or below lower
            before = int(np.count_nonzero(rank(lower, los) == 0))  # ... strictly below it
        # Cutting at the first of equal keys j charges the segments starting in [lower, j).
        charge = below[:-1] - below[before]
        total = int(below[-1] - below[before])
        if total <= max_rows:
            return None, total
        same = rank(los, los)
        first = np.ones(los.num_rows, dtype=bool)
        first[1:] = same[1:] != same[:-1]
        above = np.arange(los.num_rows) >= at_or_before
        useful = np.flatnonzero(first & above & (charge > 0))
        if len(useful) == 0:
            return None, total
        fits = useful[charge[useful] <= max_rows]
        j = int(fits[-1]) if len(fits) else int(useful[0])
        return los.take([j]), int(charge[j])
