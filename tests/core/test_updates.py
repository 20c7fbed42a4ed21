"""Arrow kernels: validation, consolidation and merging, against plain-Python models."""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from persist.core.arrow import shaping
from persist.core.arrow import updates as up
from persist.errors import IntegrityError, InvalidUsage

SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string())])

rows_st = st_.lists(
    st_.tuples(
        st_.one_of(st_.none(), st_.integers(-3, 3)),
        st_.one_of(st_.none(), st_.sampled_from(["", "a", "b", "é"])),
        st_.integers(0, 4),
        st_.integers(-2, 2),
    ),
    max_size=40,
)


def table(rows: list[tuple[int | None, str | None, int, int]]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array([r[0] for r in rows], pa.int64()),
            "s": pa.array([r[1] for r in rows], pa.string()),
            "_time": pa.array([r[2] for r in rows], pa.uint64()),
            "_diff": pa.array([r[3] for r in rows], pa.int64()),
        },
        schema=up.full_schema(SCHEMA),
    )


def model(
    rows: list[tuple[int | None, str | None, int, int]], as_of: int | None = None
) -> Counter[tuple[object, ...]]:
    out: Counter[tuple[object, ...]] = Counter()
    for k, s, t, d in rows:
        if as_of is not None:
            if t > as_of:
                continue
            t = as_of
        out[(k, s, t)] += d
    return Counter({key: v for key, v in out.items() if v != 0})


def as_counter(t: pa.Table) -> Counter[tuple[object, ...]]:
    out: Counter[tuple[object, ...]] = Counter()
    for r in t.to_pylist():
        key = (r["k"], r["s"], r["_time"])
        assert key not in out, "a consolidated table holds each row once"
        assert r["_diff"] != 0
        out[key] = r["_diff"]
    return out


@given(rows_st)
def test_sort_consolidate_matches_model(
    rows: list[tuple[int | None, str | None, int, int]],
) -> None:
    got = up.sort_consolidate(table(rows), ["k", "s", "_time"])
    assert as_counter(got) == model(rows)
    assert_sorted(got, ["k", "s", "_time"])


def assert_sorted(t: pa.Table, keys: list[str]) -> None:
    order = pc.sort_indices(t, sort_keys=[(k, "ascending") for k in keys]).to_pylist()
    assert order == list(range(t.num_rows))


@given(
    st_.lists(st_.integers(-50, 50), unique=True, max_size=30).map(sorted),
    st_.data(),
)
def test_sort_consolidate_of_input_in_key_order(keys: list[int], data: st_.DataObject) -> None:
    """The fast path for updates already in (strictly ascending) key order."""
    rows = [
        (k, data.draw(st_.sampled_from([None, "a", "b"])), data.draw(st_.integers(0, 4)), d)
        for k, d in zip(
            keys,
            data.draw(st_.lists(st_.integers(-2, 2), min_size=len(keys), max_size=len(keys))),
            strict=True,
        )
    ]
    got = up.sort_consolidate(table(rows), ["k", "s", "_time"])
    assert as_counter(got) == model(rows)
    assert_sorted(got, ["k", "s", "_time"])


@given(
    st_.sampled_from([pa.int8(), pa.uint64(), pa.float32(), pa.float64()]),
    st_.lists(
        st_.one_of(st_.none(), st_.sampled_from([-1.0, -0.0, 0.0, 1.0, 2.0, math.nan])),
        max_size=6,
    ),
    st_.integers(1, 3),
)
def test_strictly_ascending_agrees_with_the_order_kernels(
    kind: pa.DataType, values: list[float | None], chunks: int
) -> None:
    """The numpy path for numbers says what ``pc.less`` says, NaNs, -0.0 and nulls included."""
    if not pa.types.is_floating(kind):
        values = [v for v in values if v is None or (not math.isnan(v) and v >= 0)]
    arr = pa.array(values, pa.float64()).cast(kind)
    step = -(-len(arr) // chunks) or 1
    column = pa.chunked_array([arr.slice(i, step) for i in range(0, len(arr), step)], kind)
    n = len(column)
    by_kernel = column.null_count == 0 and all(
        pc.less(column.slice(0, n - 1), column.slice(1)).to_pylist()
    )
    assert up.strictly_ascending(column) == by_kernel


@settings(max_examples=200)
@given(st_.lists(rows_st, min_size=1, max_size=5), st_.integers(0, 4))
def test_merge_consolidate_at_as_of_matches_model(
    parts: list[list[tuple[int | None, str | None, int, int]]], as_of: int
) -> None:
    tables = [
        up.advance_times(up.sort_consolidate(table(p), ["k", "s", "_time"]), as_of) for p in parts
    ]
    got = up.merge_consolidate([up.full_schema(SCHEMA).empty_table(), *tables], ["k", "s"])
    assert as_counter(got) == model([r for p in parts for r in p], as_of)


def test_merge_of_disjoint_sorted_parts_takes_the_linear_path() -> None:
    a = table([(1, "a", 0, 1), (2, "a", 0, 1)])
    b = table([(2, "a", 0, 1), (5, "b", 0, 1)])
    c = table([(7, "c", 0, 1)])
    assert up._chain_order([c, a, b], ["k", "s"]) == [1, 2, 0]
    assert (
        up._chain_order(
            [table([(1, "a", 0, 1), (9, "a", 0, 1)]), table([(5, "a", 0, 1)])], ["k", "s"]
        )
        is None
    )
    merged = up.merge_consolidate([c, a, b], ["k", "s", "_time"])
    assert merged.column("k").to_pylist() == [1, 2, 5, 7]
    assert merged.column("_diff").to_pylist() == [1, 2, 1, 1]


@settings(max_examples=200)
@given(st_.lists(rows_st, min_size=1, max_size=5))
def test_merge_of_distinct_rows_orders_them_as_a_consolidation_would(
    parts: list[list[tuple[int | None, str | None, int, int]]],
) -> None:
    """With ``distinct`` (no row twice, no zero diff: what ``core.read.scan.distinct_rows`` proves
    of a snapshot's parts), tables that chain are concatenated in key order, not compared row
    by row: the same table as the consolidation's."""
    keys = ["k", "s"]
    # One time per table and disjoint key ranges: cut one consolidated table into pieces.
    whole = up.advance_times(up.sort_consolidate(table([r for p in parts for r in p]), keys), 0)
    cuts = sorted({min(len(p), whole.num_rows) for p in parts})
    pieces = [
        whole.slice(a, b - a) for a, b in zip([0, *cuts], [*cuts, whole.num_rows], strict=True)
    ]
    pieces.reverse()
    got = up.merge_consolidate(pieces, keys, distinct=True)
    assert got.equals(up.merge_consolidate(pieces, keys))


def ok(**cols: object) -> dict[str, object]:
    base: dict[str, object] = {"k": [1], "s": ["x"], "_time": pa.array([5], pa.uint64())}
    base.update(cols)
    return base


@pytest.mark.parametrize(
    ("data", "lower", "upper", "message"),
    [
        (ok(_time=pa.array([4], pa.uint64())), 5, 10, "outside"),
        (ok(_time=pa.array([10], pa.uint64())), 5, 10, "outside"),
        (ok(_time=pa.array([-1], pa.int64())), 0, 10, "negative"),
        (ok(_time=pa.array([1.5], pa.float64())), 0, 10, "unsigned integer"),
        (ok(_time=pa.array([None], pa.uint64())), 0, 10, "nulls"),
        (ok(_diff=pa.array([None], pa.int64())), 0, 10, "nulls"),
        (ok(_diff=pa.array([2**63], pa.uint64())), 0, 10, "int64"),
        (ok(_extra=[1]), 0, 10, "reserved"),
        (ok(other=[1]), 0, 10, "schema lacks"),
        ({"k": [1], "_time": pa.array([5], pa.uint64())}, 0, 10, "lack"),
        (ok(k=pa.array([1.0], pa.float64())), 0, 10, "type double"),
        (ok(k=pa.array([1], pa.uint64())), 0, 10, "type uint64"),
    ],
)
def test_bad_updates_are_refused(
    data: dict[str, object], lower: int, upper: int, message: str
) -> None:
    with pytest.raises(InvalidUsage, match=message):
        shaping.prepare_updates(pa.table(data), SCHEMA, lower, upper)


def test_updates_are_normalised() -> None:
    t = pa.table({"_time": pa.array([5, 6], pa.int32()), "s": ["x", "y"], "k": [1, 2]})
    out = shaping.prepare_updates(t, SCHEMA, 5, None)
    assert out.schema == up.full_schema(SCHEMA)
    assert out.column("_diff").to_pylist() == [1, 1]
    with pytest.raises(InvalidUsage, match=r"pyarrow\.Table"):
        shaping.prepare_updates({"k": [1]}, SCHEMA, 0, 1)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (pa.schema([("_k", pa.int64())]), "reserved"),
        (pa.schema([]), "at least one"),
        (pa.schema([("a", pa.int64()), ("a", pa.int64())]), "duplicate"),
        (pa.schema([("a", pa.list_(pa.int64()))]), "can't sort"),
        (pa.schema([("a", pa.binary(0))]), "can't store"),
        ("not a schema", "pyarrow.Schema"),
    ],
)
def test_bad_schemas_are_refused(schema: object, message: str) -> None:
    with pytest.raises(InvalidUsage, match=message):
        up.check_schema(schema)


def test_part_checksum_is_verified() -> None:
    t = table([(1, "a", 0, 1)])
    data = up.encode_part(t)
    assert up.decode_part(data, up.checksum(data), "k").equals(t)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(IntegrityError, match="checksum"):
        up.decode_part(bytes(flipped), up.checksum(data), "k")
    with pytest.raises(IntegrityError, match="Parquet"):
        junk = b"not parquet"
        up.decode_part(junk, up.checksum(junk), "k")


def test_parts_with_the_older_sha256_checksum_still_verify() -> None:
    t = table([(1, "a", 0, 1)])
    data = up.encode_part(t)
    assert up.checksum(data).startswith("crc32:")
    legacy = hashlib.sha256(data).hexdigest()[:32]
    assert up.decode_part(data, legacy, "k").equals(t)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    with pytest.raises(IntegrityError, match="checksum"):
        up.decode_part(bytes(flipped), legacy, "k")
    with pytest.raises(IntegrityError, match="checksum"):
        up.decode_part(data, "crc32:00000000", "k")


# --- floats: rows compare as values (NaN equals NaN, -0.0 equals 0.0, null equals null) -------

NAN_PAYLOAD = float(np.array([0x7FF8_0000_0000_0001], np.uint64).view(np.float64)[0])
NEG_NAN = float(np.array([0xFFF8_0000_0000_0000], np.uint64).view(np.float64)[0])
floats_st = st_.sampled_from([None, 0.0, -0.0, 1.5, -1.5, math.inf, math.nan, NAN_PAYLOAD, NEG_NAN])
FloatRow = tuple[float | None, float | None, int | None, int, int]
float_rows_st = st_.lists(
    st_.tuples(
        floats_st,
        floats_st,
        st_.one_of(st_.none(), st_.integers(0, 2)),
        st_.integers(0, 2),
        st_.integers(-2, 2),
    ),
    max_size=40,
)
# The data columns of the float tables, in every order: NaN handling must not depend on where
# the float column sits among the sort keys.
FLOAT_COLUMNS = {"x": pa.float64(), "f": pa.float32(), "k": pa.int64()}
column_orders_st = st_.permutations(list(FLOAT_COLUMNS))


def canonical(x: float | None) -> object:
    """A float as a value of a set of rows: every NaN is one value, and -0.0 is 0.0."""
    if x is None or math.isnan(x):
        return x if x is None else "nan"
    return x + 0.0


def float_table(rows: list[FloatRow], order: list[str]) -> pa.Table:
    values = {
        "x": [r[0] for r in rows],
        "f": [r[1] for r in rows],
        "k": [r[2] for r in rows],
    }
    schema = up.full_schema(pa.schema([(c, FLOAT_COLUMNS[c]) for c in order]))
    return pa.table(
        {
            **{c: pa.array(values[c], FLOAT_COLUMNS[c]) for c in order},
            "_time": pa.array([r[3] for r in rows], pa.uint64()),
            "_diff": pa.array([r[4] for r in rows], pa.int64()),
        },
        schema=schema,
    )


def float_model(rows: list[FloatRow], as_of: int | None = None) -> Counter[tuple[object, ...]]:
    out: Counter[tuple[object, ...]] = Counter()
    for x, f, k, t, d in rows:
        if as_of is not None:
            if t > as_of:
                continue
            t = as_of
        out[(canonical(x), canonical(f), k, t)] += d
    return Counter({key: v for key, v in out.items() if v != 0})


def float_counter(t: pa.Table) -> Counter[tuple[object, ...]]:
    out: Counter[tuple[object, ...]] = Counter()
    for r in t.to_pylist():
        key = (canonical(r["x"]), canonical(r["f"]), r["k"], r["_time"])
        assert key not in out, f"row {key} twice: a consolidated table holds each row once"
        assert r["_diff"] != 0
        out[key] = r["_diff"]
    return out


@settings(max_examples=300)
@given(float_rows_st, column_orders_st)
def test_sort_consolidate_treats_nan_as_one_value(rows: list[FloatRow], order: list[str]) -> None:
    keys = [*order, "_time"]
    got = up.sort_consolidate(float_table(rows, order), keys)
    assert float_counter(got) == float_model(rows)
    assert_sorted(got, keys)


@settings(max_examples=200)
@given(st_.lists(float_rows_st, min_size=1, max_size=4), column_orders_st, st_.integers(0, 2))
def test_merge_consolidate_treats_nan_as_one_value(
    parts: list[list[FloatRow]], order: list[str], as_of: int
) -> None:
    keys = [*order, "_time"]
    tables = [up.sort_consolidate(float_table(p, order), keys) for p in parts]
    merged = up.merge_consolidate(tables, keys)
    assert float_counter(merged) == float_model([r for p in parts for r in p])
    assert_sorted(merged, keys)
    at = up.merge_consolidate([up.advance_times(t, as_of) for t in tables], order)
    assert float_counter(at) == float_model([r for p in parts for r in p], as_of)


@pytest.mark.parametrize("nan", [math.nan, NAN_PAYLOAD, NEG_NAN])
@pytest.mark.parametrize("float_type", [pa.float32(), pa.float64()])
def test_an_insert_and_retraction_of_a_nan_row_cancel(nan: float, float_type: pa.DataType) -> None:
    schema = pa.schema([("k", pa.int64()), ("x", float_type)])
    t = pa.table(
        {
            "k": [1, 1, 1, 1],
            "x": pa.array([math.nan, 2.0, nan, math.nan], float_type),
            "_time": pa.array([0, 0, 0, 0], pa.uint64()),
            "_diff": pa.array([1, 1, -1, 1], pa.int64()),
        },
        schema=up.full_schema(schema),
    )
    keys = ["k", "x", "_time"]
    got = up.sort_consolidate(t, keys)
    assert got.column("x").to_pylist()[0] == 2.0 and math.isnan(got.column("x")[1].as_py())
    assert got.column("_diff").to_pylist() == [1, 1]
    assert up.sort_consolidate(t.slice(2), keys).num_rows == 0
    # The insert in one part, its retraction (another NaN) in another.
    a = up.sort_consolidate(t.slice(0, 2), keys)
    b = up.sort_consolidate(t.slice(2, 1), keys)
    merged = up.merge_consolidate([a, b], keys)
    assert merged.column("x").to_pylist() == [2.0] and merged.column("_diff").to_pylist() == [1]


# --- types Parquet has no exact counterpart for: read back as written, or refused on write ------

DAY_MS = 86_400_000


def one_column(values: pa.Array) -> pa.Table:
    n = len(values)
    schema = up.full_schema(pa.schema([("c", values.type)]))
    return pa.table(
        {
            "c": values,
            "_time": pa.array(range(n), pa.uint64()),
            "_diff": pa.array([1] * n, pa.int64()),
        },
        schema=schema,
    )


def raw(values: list[int | None], storage: pa.DataType, t: pa.DataType) -> pa.Array:
    return pa.array(values, storage).view(t)


STORABLE_EDGES = [
    raw([-(2**31) * DAY_MS, 3 * DAY_MS, (2**31 - 1) * DAY_MS, None], pa.int64(), pa.date64()),
    raw([-2_147_483, 0, 86_399, 2_147_483, None], pa.int32(), pa.time32("s")),
    *(
        raw([-9_223_372_036_854_775, -1, 0, 9_223_372_036_854_775, None], pa.int64(), ts)
        for ts in [pa.timestamp("s"), pa.timestamp("s", "UTC"), pa.timestamp("s", "+05:30")]
    ),
]


@pytest.mark.parametrize("values", STORABLE_EDGES, ids=lambda v: str(v.type))
def test_parts_decode_to_the_types_they_were_written_with(values: pa.Array) -> None:
    t = shaping.prepare_updates(one_column(values), pa.schema([("c", values.type)]), 0, None)
    data = up.encode_part(t)
    assert up.decode_part(data, up.checksum(data), "k").equals(t)
    full = up.full_schema(pa.schema([("c", values.type)]))
    assert up.decode_part(data, up.checksum(data), "k", schema=full).equals(t)


def test_parts_written_before_decode_to_the_shard_schema() -> None:
    """Parts written by older versions hold date32 / ms where the shard says date64 / s."""
    schema = pa.schema([("d", pa.date64()), ("s", pa.time32("s")), ("t", pa.timestamp("s"))])
    old = pa.table(
        {
            "d": pa.array([3], pa.date32()),
            "s": pa.array([5000], pa.int32()).view(pa.time32("ms")),
            "t": pa.array([7000], pa.int64()).view(pa.timestamp("ms")),
            "_time": pa.array([0], pa.uint64()),
            "_diff": pa.array([1], pa.int64()),
        }
    )
    data = up.encode_part(old)
    got = up.decode_part(data, up.checksum(data), "k", schema=up.full_schema(schema))
    assert got.schema == up.full_schema(schema)
    assert got.column("d").cast(pa.int64()).to_pylist() == [3 * DAY_MS]
    assert got.column("s").cast(pa.int32()).to_pylist() == [5]
    assert got.column("t").cast(pa.int64()).to_pylist() == [7]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (raw([DAY_MS + 5], pa.int64(), pa.date64()), "whole number of days"),
        (raw([-1], pa.int64(), pa.date64()), "whole number of days"),
        (raw([2**31 * DAY_MS], pa.int64(), pa.date64()), "out of the range"),
        (raw([2_147_484], pa.int32(), pa.time32("s")), "out of the range"),
        (raw([-2_147_484], pa.int32(), pa.time32("s")), "out of the range"),
        (raw([2**62], pa.int64(), pa.timestamp("s", "UTC")), "out of the range"),
        (raw([-(2**63)], pa.int64(), pa.timestamp("s")), "out of the range"),
    ],
    ids=lambda v: str(getattr(v, "type", v)),
)
def test_values_parquet_would_change_are_refused(values: pa.Array, message: str) -> None:
    with pytest.raises(InvalidUsage, match=message):
        shaping.prepare_updates(one_column(values), pa.schema([("c", values.type)]), 0, None)


# --- diffs: a sum that does not fit in int64 is an error, never a wrapped number ---------------

I64 = 2**63
DiffRow = tuple[int, int, int]
huge_diffs_st = st_.one_of(
    st_.sampled_from([2**62, -(2**62), I64 - 1, -I64, 1, -1, 0]), st_.integers(-I64, I64 - 1)
)
diff_rows_st = st_.lists(
    st_.tuples(st_.integers(0, 2), st_.integers(0, 1), huge_diffs_st), max_size=30
)


def diff_table(rows: list[DiffRow]) -> pa.Table:
    schema = pa.schema([("k", pa.int64())])
    return pa.table(
        {
            "k": pa.array([r[0] for r in rows], pa.int64()),
            "_time": pa.array([r[1] for r in rows], pa.uint64()),
            "_diff": pa.array([r[2] for r in rows], pa.int64()),
        },
        schema=up.full_schema(schema),
    )


def exact_sums(rows: list[DiffRow], as_of: int | None = None) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for k, t, d in rows:
        key = (k, t if as_of is None else as_of)
        out[key] = out.get(key, 0) + d
    return {key: v for key, v in out.items() if v != 0}


def fits(sums: dict[tuple[int, int], int]) -> bool:
    return all(-I64 <= v < I64 for v in sums.values())


@settings(max_examples=300)
@given(diff_rows_st)
def test_consolidation_raises_instead_of_wrapping(rows: list[DiffRow]) -> None:
    want = exact_sums(rows)
    if not fits(want):
        with pytest.raises(up.DiffOverflow):
            up.sort_consolidate(diff_table(rows), ["k", "_time"])
        return
    got = up.sort_consolidate(diff_table(rows), ["k", "_time"])
    assert {(r["k"], r["_time"]): r["_diff"] for r in got.to_pylist()} == want


@settings(max_examples=200)
@given(st_.lists(diff_rows_st, min_size=1, max_size=4))
def test_merging_raises_instead_of_wrapping(parts: list[list[DiffRow]]) -> None:
    tables = []
    for p in parts:
        if not fits(exact_sums(p)):
            return
        tables.append(up.advance_times(up.sort_consolidate(diff_table(p), ["k", "_time"]), 1))
    want = exact_sums([r for p in parts for r in p], 1)
    if not fits(want):
        with pytest.raises(up.DiffOverflow):
            up.merge_consolidate(tables, ["k"])
        return
    got = up.merge_consolidate(tables, ["k"])
    assert {(r["k"], r["_time"]): r["_diff"] for r in got.to_pylist()} == want


@pytest.mark.parametrize(
    "diffs",
    [[2**62] * 4, [I64 - 1, 1], [-I64, -1], [2**62, 2**62], [-(2**62)] * 3],
)
def test_overflowing_sums_are_refused(diffs: list[int]) -> None:
    t = diff_table([(1, 0, d) for d in diffs])
    with pytest.raises(up.DiffOverflow, match="int64") as info:
        up.sort_consolidate(t, ["k", "_time"])
    assert isinstance(info.value, InvalidUsage)


def test_sums_that_fit_are_exact_even_when_partial_sums_do_not() -> None:
    t = diff_table([(1, 0, 2**62), (1, 0, 2**62), (1, 0, -(2**62)), (2, 0, -I64), (2, 0, I64 - 1)])
    got = up.sort_consolidate(t, ["k", "_time"])
    assert got.column("_diff").to_pylist() == [2**62, -1]
