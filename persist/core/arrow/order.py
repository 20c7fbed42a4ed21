"""The sort order of updates, and what it lets a merge and a read cut without sorting.

Parts are sorted by (data columns..., ``_time``) (see ``updates``). A row is compared as a
one-row table of those keys, ordered exactly as ``pc.sort_indices`` orders them, so every cut
made here agrees with the sorts that made the parts. Pure and vectorized like ``updates``: no
I/O, no clock, no per-row Python beyond a binary search's log(n) probes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.updates import merge_consolidate

__all__ = ["count_le", "is_one_run", "row_le", "smallest_last", "take_final"]


def _ascending(keys: Sequence[str]) -> list[tuple[str, str]]:
    return [(k, "ascending") for k in keys]


def row_le(a: pa.Table, b: pa.Table, keys: Sequence[str]) -> bool:
    """Whether the one-row table ``a`` sorts at or before the one-row table ``b``."""
    pair = pa.concat_tables([a.select(keys), b.select(keys)])
    return bool(pc.sort_indices(pair, sort_keys=_ascending(keys)).to_pylist() == [0, 1])


def count_le(table: pa.Table, row: pa.Table, keys: Sequence[str]) -> int:
    """How many leading rows of the sorted ``table`` sort at or before ``row`` (binary search)."""
    lo, hi = 0, table.num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if row_le(table.slice(mid, 1), row, keys):
            lo = mid + 1
        else:
            hi = mid
    return lo


def smallest_last(tables: Sequence[pa.Table], keys: Sequence[str]) -> int:
    """The index of the (non-empty, sorted) table whose last row sorts first."""
    lasts = pa.concat_tables([t.select(keys).slice(t.num_rows - 1, 1) for t in tables])
    first: int = pc.sort_indices(lasts, sort_keys=_ascending(keys))[0].as_py()
    return first


def is_one_run(bounds: Sequence[pa.Table], keys: Sequence[str]) -> bool:
    """Whether sorted pieces, in order, form one sorted run: each ends at or before the next
    starts. ``bounds`` holds rows of each piece (tables of ``keys``), in its order, its first
    and last among them: the rows between sit between those two and change nothing."""
    if len(bounds) <= 1:
        return True
    rows = pa.concat_tables([b.select(keys) for b in bounds])
    order = pc.sort_indices(rows, sort_keys=_ascending(keys)).to_numpy()
    return bool(np.array_equal(order, np.arange(len(order))))


def take_final(
    buffers: list[pa.Table | None], waiting: Sequence[int], keys: Sequence[str]
) -> pa.Table | None:
    """Takes from every buffer (the sorted, not yet merged head of a run) the rows that no row
    still to be read can precede, and returns them merged and consolidated.

    ``waiting``: the runs that have parts left to read; their buffers are non-empty. The frontier
    is the smallest last row among them: rows at or before it are final. ``buffers`` keeps the
    rest of each run. None when nothing is final yet.
    """
    candidates = [buffers[i] for i in waiting]
    assert all(c is not None and c.num_rows for c in candidates)
    j = waiting[smallest_last([c for c in candidates if c is not None], keys)]
    frontier_run = buffers[j]
    assert frontier_run is not None
    frontier = frontier_run.slice(frontier_run.num_rows - 1, 1)
    pieces: list[pa.Table] = []
    for i, buf in enumerate(buffers):
        if buf is None or buf.num_rows == 0:
            continue
        n = buf.num_rows if i == j else count_le(buf, frontier, keys)
        if n:
            pieces.append(buf.slice(0, n))
            buffers[i] = buf.slice(n)
    if not pieces:
        return None
    return merge_consolidate(pieces, keys)
