"""Key ranges (``core.arrow.keyrange``, ``core.read.queries.key_ranges``): cuts follow pyarrow's sort exactly,
for hostile values too, and ranges of a snapshot's parts take every row exactly once."""

from __future__ import annotations

import math
import struct

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.core.arrow.keyrange import (
    INDEX_BYTES,
    count_below,
    cut_keys,
    decode_keys,
    encode_keys,
    key_index,
    rank,
    slice_range,
)
from persist.core.arrow.updates import DIFF, TIME, sort_consolidate
from persist.core.read.queries import key_ranges
from persist.core.shard.types import PartRef

SCHEMA = pa.schema([("f", pa.float64()), ("s", pa.string())])
KEYS = ["f", "s"]

floats = st.sampled_from([None, -math.inf, -1.5, -0.0, 0.0, 2.0, math.inf, math.nan, -math.nan])
strings = st.sampled_from([None, "", "a", "ab", "b", "é"])
rows = st.lists(st.tuples(floats, strings), max_size=40)


def table_of(keys: list[tuple[float | None, str | None]]) -> pa.Table:
    return pa.table(
        {
            "f": pa.array([k[0] for k in keys], pa.float64()),
            "s": pa.array([k[1] for k in keys], pa.string()),
        }
    )


def sorted_part(keys: list[tuple[float | None, str | None]], times: list[int]) -> pa.Table:
    t = table_of(keys)
    t = t.append_column(TIME, pa.array(times, pa.uint64()))
    t = t.append_column(DIFF, pa.array([1] * len(keys), pa.int64()))
    return sort_consolidate(t, [*KEYS, TIME])


def exactly(t: pa.Table) -> list[tuple[object, ...]]:
    """The rows of ``t``, floats by their bits (NaN equals itself, -0.0 is not 0.0)."""
    cols = []
    for c in t.columns:
        if pa.types.is_floating(c.type):
            cols.append([None if v is None else struct.pack("<d", v) for v in c.to_pylist()])
        else:
            cols.append(c.to_pylist())
    return list(zip(*cols, strict=True))


@given(rows, st.tuples(floats, strings))
def test_count_below_agrees_with_the_sort(keys: list, key: tuple) -> None:
    part = sorted_part(keys, [1] * len(keys))
    k = table_of([key])
    # Rows strictly below the key: put the key first in a stable sort; it lands after them.
    both = pa.concat_tables([k, part.select(KEYS)])
    order = pc.sort_indices(both, sort_keys=[("f", "ascending"), ("s", "ascending")]).to_pylist()
    assert count_below(part, k) == order.index(0)
    assert count_below(part, None) == part.num_rows


@given(rows, st.lists(st.tuples(floats, strings), min_size=1, max_size=4))
def test_ranges_between_sorted_cuts_take_every_row_once(keys: list, cut_rows: list) -> None:
    part = sorted_part(keys, list(range(len(keys))))
    cand = table_of(cut_rows)
    cuts = cut_keys(cand, np.ones(len(cut_rows)), len(cut_rows) + 1)
    bounds = [None, *cuts, None]
    pieces = [slice_range(part, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    assert sum(p.num_rows for p in pieces) == part.num_rows
    assert exactly(pa.concat_tables(pieces)) == exactly(part)
    # rank says which piece each row went to.
    if cuts:
        where = rank(pa.concat_tables(cuts), part.select(KEYS))
        expected = np.concatenate([np.full(p.num_rows, i) for i, p in enumerate(pieces)])
        assert where.tolist() == expected.tolist()


@given(rows)
def test_a_key_index_round_trips_exactly(keys: list) -> None:
    part = sorted_part(keys or [(None, None)], [1] * max(1, len(keys)))
    index = key_index(part, KEYS, 6 * INDEX_BYTES)
    back = decode_keys(encode_keys(index), SCHEMA)
    assert back.num_rows == min(6, part.num_rows) + 1
    assert exactly(back) == exactly(index)  # bit for bit: -0.0 stays -0.0, NaN stays NaN


def part_ref(key: str, part: pa.Table, samples: int, size: int = 100) -> PartRef:
    kix = encode_keys(key_index(part, KEYS, samples * INDEX_BYTES))
    return PartRef(key, part.num_rows, size, "x", 0, 0, 0, b"", kix)


@settings(max_examples=200)
@given(st.lists(rows, min_size=1, max_size=5), st.integers(1, 6), st.integers(1, 20))
def test_key_ranges_give_each_row_to_one_range_holding_its_parts(
    parts_keys: list, n: int, samples: int
) -> None:
    parts = [sorted_part(k, [i] * len(k)) for i, k in enumerate(parts_keys) if k]
    refs = [part_ref(f"p{i}", p, samples) for i, p in enumerate(parts)]
    by_key = dict(zip([r.key for r in refs], parts, strict=True))
    ranges = key_ranges(refs, SCHEMA, n)
    assert len(ranges) == n
    for p, ref in zip(parts, refs, strict=True):
        taken = 0
        for r in ranges:
            got = slice_range(p, r.lower, r.upper)
            if got.num_rows:
                assert ref in r.parts, "a range left out a part holding some of its keys"
            taken += got.num_rows
        assert taken == p.num_rows
    for r in ranges:
        for ref in r.parts:
            assert ref.key in by_key


def test_key_ranges_balance_by_bytes() -> None:
    # One big sorted part indexed by 8 keys: 4 ranges of 2 eighths each.
    keys = [(float(i), "x") for i in range(800)]
    part = sorted_part(keys, [1] * 800)
    ref = part_ref("big", part, 8, size=8_000)
    ranges = key_ranges([ref], SCHEMA, 4)
    sizes = [slice_range(part, r.lower, r.upper).num_rows for r in ranges]
    assert sizes == [200, 200, 200, 200]


def test_parts_without_an_index_go_to_every_range() -> None:
    keys = [(float(i), "x") for i in range(100)]
    indexed = part_ref("big", sorted_part(keys, [1] * 100), 10)
    bare = PartRef("inline", 1, 10, "x", 0, 0, 0, b"data")
    ranges = key_ranges([indexed, bare], SCHEMA, 3)
    assert all(bare in r.parts for r in ranges)
    assert [r.lower is None for r in ranges] == [True, False, False]
    assert [r.upper is None for r in ranges] == [False, False, True]


def test_without_indexed_parts_every_key_is_in_the_first_range() -> None:
    bare = PartRef("inline", 1, 10, "x", 0, 0, 0, b"data")
    ranges = key_ranges([bare], SCHEMA, 3)
    assert ranges[0].parts == [bare] and ranges[0].lower is None and ranges[0].upper is None
    assert ranges[1].parts == [] and ranges[2].parts == []
