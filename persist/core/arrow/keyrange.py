"""Key ranges of a shard's sort order: the key index of a part, cuts, and ranges of sorted parts.

A *key* is a row's data columns. Parts are sorted by (data columns, ``_time``), so all the updates
of a row sit together in every part, and a range of keys ``[lower, upper)`` takes all of a row's
updates or none of them. That is what makes a split cut by key range exact on its own, wherever
a row's inserts and retractions were written.

Keys are compared by pyarrow's own sort (``pc.sort_indices``, which is stable): the order parts
were sorted in, for every type a shard may hold (nulls last, NaN after every number, -0.0 tied
with 0.0), with no comparison of our own to drift from it.

A part records a *key index*: keys at evenly spaced rows of it, then its last key, as an Arrow IPC
record batch of the data columns. It locates the part in key order, and says how its rows spread
over keys, without reading it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import IntegrityError

__all__ = [
    "INDEX_BYTES",
    "INDEX_KEYS",
    "ROW_GROUP_BYTES",
    "Key",
    "count_below",
    "cut_keys",
    "decode_keys",
    "encode_keys",
    "key_index",
    "key_index_rows",
    "rank",
    "row_group_rows",
    "slice_range",
]

# Decoded bytes per row group of a part: a key range reads whole row groups of the parts it
# straddles, so this bounds what a split reads beyond its range (per part, at each end).
ROW_GROUP_BYTES = 1 << 20

# A part's key index holds one key per this many decoded bytes, up to ``INDEX_KEYS``: planning
# balances splits by them, at a few hundred bytes of state per big part.
INDEX_BYTES = 256 << 10
INDEX_KEYS = 16
# Even a small part samples a few keys: a snapshot of a few small parts whose keys overlap
# (every append covering the whole key space) still cuts into balanced splits.
MIN_INDEX_KEYS = 4

# A key: a one-row table of the data columns. None stands for no bound.
Key: TypeAlias = pa.Table


def row_group_rows(rows: int, nbytes: int) -> int:
    """Rows per row group for a part of ``rows`` rows and ``nbytes`` decoded bytes."""
    groups = max(1, -(-nbytes // ROW_GROUP_BYTES))
    return max(1, -(-rows // groups))


def key_index(part: pa.Table, names: Sequence[str], nbytes: int) -> pa.Table:
    """The key index of the sorted ``part`` (``nbytes`` decoded): the keys at evenly spaced
    rows, one per ``INDEX_BYTES`` of it (at least ``MIN_INDEX_KEYS``, at most ``INDEX_KEYS``) and
    the last key (the rows ``key_index_rows`` names)."""
    return part.select(list(names)).take(key_index_rows(part.num_rows, nbytes))


def key_index_rows(rows: int, nbytes: int) -> pa.Array:
    """The rows (ascending, the first and the last among them) whose keys make the key index of
    a part of ``rows`` rows (at least one) and ``nbytes`` decoded bytes. Key ``i`` of ``k``
    samples starts the ``i``-th ``k``-th of the part's rows."""
    k = max(1, min(INDEX_KEYS, max(MIN_INDEX_KEYS, nbytes // INDEX_BYTES), rows))
    return pa.array([*(i * rows // k for i in range(k)), rows - 1], pa.int64())


def encode_keys(keys: pa.Table) -> bytes:
    """Arrow IPC bytes of a table of keys (its schema is not included: the shard knows it)."""
    (rb,) = keys.combine_chunks().to_batches()  # keys are never empty: one batch
    return rb.serialize().to_pybytes()  # type: ignore[no-any-return]


def decode_keys(data: bytes, schema: pa.Schema) -> pa.Table:
    """The keys ``encode_keys`` encoded, with the data columns ``schema``."""
    try:
        rb = pa.ipc.read_record_batch(pa.py_buffer(data), schema)
    except (pa.ArrowException, ValueError) as exc:
        raise IntegrityError(f"a part's key index does not decode: {exc}") from exc
    return pa.Table.from_batches([rb], schema=schema)


def _sort_keys(names: Sequence[str]) -> list[tuple[str, str]]:
    return [(n, "ascending") for n in names]


def _below(row: pa.Table, key: Key) -> bool:
    """Whether the one-row table ``row`` sorts strictly before ``key``."""
    # Stable sort of [key, row]: row moves first only when it is strictly smaller.
    both = pa.concat_tables([key, row])
    first = pc.sort_indices(both, sort_keys=_sort_keys(key.column_names))[0].as_py()
    return bool(first == 1)


def count_below(part: pa.Table, key: Key | None) -> int:
    """How many rows of ``part`` (sorted by ``key``'s columns first) sort before ``key``
    (None: past every row). A binary search: a few dozen tiny sorts, whatever the part's size."""
    n: int = part.num_rows
    if key is None:
        return n
    keys = part.select(key.column_names)
    key = key.cast(keys.schema)
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if _below(keys.slice(mid, 1), key):
            lo = mid + 1
        else:
            hi = mid
    return lo


def slice_range(part: pa.Table, lower: Key | None, upper: Key | None) -> pa.Table:
    """The rows of the sorted ``part`` whose key lies in ``[lower, upper)``."""
    start = 0 if lower is None else count_below(part, lower)
    end = count_below(part, upper)
    if start == 0 and end == part.num_rows:
        return part
    return part.slice(start, max(0, end - start))


def rank(cuts: pa.Table, keys: pa.Table) -> np.ndarray:
    """For each row of ``keys``: how many rows of ``cuts`` (sorted) sort at or before it, i.e. the
    index of the range ``[cut[i-1], cut[i])`` it falls in. One sort of both tables together."""
    if cuts.num_rows == 0 or keys.num_rows == 0:
        return np.zeros(keys.num_rows, dtype=np.int64)
    names = cuts.column_names
    keys = keys.select(names).cast(cuts.schema)
    tag = "__persist_is_key"
    both = pa.concat_tables(
        [
            cuts.append_column(tag, pa.array(np.zeros(cuts.num_rows, np.int8))),
            keys.append_column(tag, pa.array(np.ones(keys.num_rows, np.int8))),
        ]
    )
    # A key equal to a cut comes after it: it belongs to the range that cut opens.
    order = pc.sort_indices(both, sort_keys=[*_sort_keys(names), (tag, "ascending")]).to_numpy()
    is_cut = order < cuts.num_rows
    cuts_so_far = np.cumsum(is_cut)
    out = np.empty(keys.num_rows, dtype=np.int64)
    at_key = ~is_cut
    out[order[at_key] - cuts.num_rows] = cuts_so_far[at_key]
    return out


def cut_keys(candidates: pa.Table, weights: np.ndarray, n: int) -> list[Key]:
    """``n - 1`` ascending keys from ``candidates`` that cut them into ``n`` ranges of about equal
    total ``weights``. Equal cuts (few distinct keys) leave empty ranges between them."""
    if n <= 1:
        return []
    if candidates.num_rows == 0:
        return []
    order = pc.sort_indices(candidates, sort_keys=_sort_keys(candidates.column_names)).to_numpy()
    w = np.asarray(weights, dtype=np.float64)[order]
    before = np.cumsum(w) - w  # weight sorting before each candidate
    total = float(w.sum())
    cuts: list[Key] = []
    for j in range(1, n):
        i = int(np.searchsorted(before, total * j / n, side="left"))
        i = min(i, len(order) - 1)
        cuts.append(candidates.slice(int(order[i]), 1))
    return cuts
