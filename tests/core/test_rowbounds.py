"""Row bounds (``core.read.rowbounds``): what the parts' row counts, times and key indexes say of how many
updates a range holds, checked against a brute-force count of the parts' actual rows."""

from __future__ import annotations

import math

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.core.arrow.keyrange import (
    INDEX_BYTES,
    decode_keys,
    encode_keys,
    key_index,
    slice_range,
)
from persist.core.arrow.updates import DIFF, TIME, sort_consolidate
from persist.core.read.rowbounds import RowBounds, parts_in_key_range, segment_rows
from persist.core.shard.types import PartRef

from .test_keyrange import KEYS, SCHEMA, rows, sorted_part, table_of

INTS = pa.schema([("k", pa.int64())])


def int_part(keys: list[int], time: int = 0) -> pa.Table:
    t = pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            TIME: pa.array([time] * len(keys), pa.uint64()),
            DIFF: pa.array([1] * len(keys), pa.int64()),
        }
    )
    return sort_consolidate(t, ["k", TIME])


def ref(name: str, part: pa.Table, samples: int, indexed: bool = True, t: int = 0) -> PartRef:
    kix = encode_keys(key_index(part, ["k"], samples * INDEX_BYTES)) if indexed else b""
    return PartRef(name, part.num_rows, 100, "x", t, t, 0, b"" if kix else b"i", kix)


def key(k: int) -> pa.Table:
    return pa.table({"k": pa.array([k], pa.int64())})


def as_int(k: pa.Table | None) -> float:
    return math.inf if k is None else k.column(0)[0].as_py()


def segments(p: PartRef) -> list[tuple[int, int, int]]:
    """(first key, last key, rows) of each segment of ``p``'s index, by brute force."""
    ix = decode_keys(p.key_index, INTS).column(0).to_pylist()
    k = len(ix) - 1
    return [(ix[i], ix[i + 1], (i + 1) * p.rows // k - i * p.rows // k) for i in range(k)]


part_keys = st.lists(st.integers(0, 60), min_size=1, max_size=30, unique=True)
layouts = st.lists(st.tuples(part_keys, st.integers(1, 20), st.booleans()), min_size=1, max_size=5)


@settings(max_examples=300)
@given(layouts, st.one_of(st.none(), st.integers(-1, 62)), st.integers(1, 40))
def test_a_key_cut_charges_the_segments_it_starts_and_is_the_largest_within_the_limit(
    layout: list[tuple[list[int], int, bool]], lower: int | None, max_rows: int
) -> None:
    tables = [int_part(sorted(ks)) for ks, _, _ in layout]
    specs = zip(tables, layout, strict=True)
    refs = [ref(f"p{i}", t, s, ix) for i, (t, (_, s, ix)) in enumerate(specs)]
    lo = -math.inf if lower is None else lower
    cut, charge = RowBounds(refs, INTS, 0, 1).key_within(
        None if lower is None else key(lower), max_rows
    )
    hi = as_int(cut)
    assert hi > lo

    segs = [s for r in refs if r.key_index for s in segments(r)]

    def charged(c: float) -> int:
        return sum(n for first, _, n in segs if lo <= first < c)

    # What a range reads beyond its charge: the rows from lower on of the segments that hold
    # lower but start below it, and those of parts without an index.
    carried = sum(
        sum(1 for k in t.column("k").to_pylist() if k >= lo and k < hi)
        for r, t in zip(refs, tables, strict=True)
        if not r.key_index
    )
    for r, t in zip(refs, tables, strict=True):
        if not r.key_index:
            continue
        keys = t.column("k").to_pylist()
        at = 0
        for first, _, n in segments(r):
            if first < lo:
                carried += sum(1 for k in keys[at : at + n] if lo <= k < hi)
            at += n
    actual = sum(sum(1 for k in t.column("k").to_pylist() if lo <= k < hi) for t in tables)
    assert actual <= charge + carried

    # A cut worth making lies above lower and charges some rows.
    useful = sorted({f for f, _, _ in segs if f > lo and charged(f) > 0})
    if cut is None:
        assert charge == charged(math.inf)
        assert charge <= max_rows or not useful
        return
    assert hi in useful and charge == charged(hi)
    if charge > max_rows:
        assert hi == useful[0]  # the smallest step there is
    else:
        # The largest cut within the limit, and taking everything would not be.
        assert all(charged(c) > max_rows for c in useful if c > hi)
        assert charged(math.inf) > max_rows


def test_cuts_after_compaction_charge_a_coarse_segment_once() -> None:
    # The keys were cut at 300 while finer parts held them; then compaction rewrote them into one
    # part of 4 segments of 250 rows. The segment holding 300 is not charged again (else every
    # later cut would have to fit beside it), so cuts go on by the segments they start.
    part = int_part(list(range(1000)))
    bounds = RowBounds([ref("merged", part, 1)], INTS, 0, 1)
    for limit in (300, 100):
        cut, charge = bounds.key_within(key(300), limit)
        assert as_int(cut) == 750 and charge == 250  # the segment starting at 500
        # Read: the charge plus the carried rows 300..499 of the segment starting at 250.
        assert slice_range(part, key(300), cut).num_rows == 450
    cut, charge = bounds.key_within(key(750), 300)
    assert cut is None and charge == 250


def test_segments_are_the_key_index_rows() -> None:
    part = int_part(list(range(10)))
    r = ref("p", part, 1)  # at least 4 keys sampled: rows 0, 2, 5, 7, then the last
    assert decode_keys(r.key_index, INTS).column(0).to_pylist() == [0, 2, 5, 7, 9]
    assert segment_rows(10, 4).tolist() == [2, 3, 2, 3]


def test_a_big_part_is_cut_into_steps_of_its_segments() -> None:
    part = int_part(list(range(1000)))
    r = ref("p", part, 16)  # 16 segments of 62 or 63 rows
    bounds = RowBounds([r], INTS, 0, 1)
    lower: pa.Table | None = None
    batches = []
    for _ in range(100):
        cut, n = bounds.key_within(lower, 200)
        taken = slice_range(part, lower, cut).num_rows
        assert taken == n <= 200  # one sorted part cut at its own index keys
        batches.append(taken)
        if cut is None:
            break
        lower = cut
    assert sum(batches) == 1000 and len(batches) >= 5


time_parts = st.lists(
    st.tuples(st.integers(0, 20), st.integers(0, 5), st.integers(1, 10)), min_size=0, max_size=8
)


@settings(max_examples=300)
@given(time_parts, st.integers(0, 10), st.integers(1, 15), st.integers(1, 30))
def test_a_frontier_bounds_the_parts_before_it_and_is_the_largest(
    spec: list[tuple[int, int, int]], lower: int, width: int, max_rows: int
) -> None:
    upper = lower + width
    refs = [PartRef(f"p{i}", n, 1, "x", t, t + d, 0) for i, (t, d, n) in enumerate(spec)]
    inside = [p for p in refs if p.max_time >= lower and p.min_time < upper]
    bounds = RowBounds(refs, INTS, 0, 100).between(lower, upper)
    assert sorted(p.key for p in bounds.parts) == sorted(p.key for p in inside)

    def rows_below(e: int) -> int:
        return sum(p.rows for p in inside if p.min_time < e)

    e = bounds.frontier_within(max_rows)
    assert lower <= e <= upper
    if e > lower:
        assert rows_below(e) <= max_rows
    if e < upper:
        assert rows_below(e + 1) > max_rows
    g = bounds.next_frontier()
    assert lower < g <= upper
    # [lower, g) holds only the parts that may hold lower itself.
    assert {p.key for p in inside if p.min_time < g} == {
        p.key for p in inside if p.min_time <= lower
    }


@settings(max_examples=200)
@given(
    st.lists(rows, min_size=1, max_size=4),
    st.one_of(st.none(), st.tuples(rows.filter(bool).map(lambda r: r[0]))),
    st.one_of(st.none(), st.tuples(rows.filter(bool).map(lambda r: r[0]))),
)
def test_parts_left_out_of_a_key_range_hold_none_of_its_keys(
    parts_keys: list, lower: tuple | None, upper: tuple | None
) -> None:
    parts = [sorted_part(k, [i] * len(k)) for i, k in enumerate(parts_keys) if k]
    refs = [
        PartRef(f"p{i}", p.num_rows, 1, "x", 0, 0, 0, b"", encode_keys(key_index(p, KEYS, 1)))
        for i, p in enumerate(parts)
    ]
    lo = None if lower is None else table_of([lower[0]])
    hi = None if upper is None else table_of([upper[0]])
    kept = {r.key for r in parts_in_key_range(refs, SCHEMA, lo, hi)}
    for r, p in zip(refs, parts, strict=True):
        if slice_range(p, lo, hi).num_rows:
            assert r.key in kept


def test_parts_whose_keys_all_lie_outside_a_range_are_left_out() -> None:
    refs = [ref(f"p{i}", int_part(list(range(10 * i, 10 * i + 10))), 4) for i in range(5)]
    bare = PartRef("inline", 3, 1, "x", 0, 0, 0, b"i")
    kept = parts_in_key_range([*refs, bare], INTS, key(15), key(30))
    assert [p.key for p in kept] == ["p1", "p2", "inline"]
    assert parts_in_key_range(refs, INTS, None, None) == refs
