"""Arrow kernels: validation, consolidation and merging, against plain-Python models."""

from __future__ import annotations

import hashlib
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from persist.core import updates as up
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
        (ok(k=pa.array([1], pa.int32())), 0, 10, "type int32"),
    ],
)
def test_bad_updates_are_refused(
    data: dict[str, object], lower: int, upper: int, message: str
) -> None:
    with pytest.raises(InvalidUsage, match=message):
        up.prepare_updates(pa.table(data), SCHEMA, lower, upper)


def test_updates_are_normalised() -> None:
    t = pa.table({"_time": pa.array([5, 6], pa.int32()), "s": ["x", "y"], "k": [1, 2]})
    out = up.prepare_updates(t, SCHEMA, 5, None)
    assert out.schema == up.full_schema(SCHEMA)
    assert out.column("_diff").to_pylist() == [1, 1]
    with pytest.raises(InvalidUsage, match=r"pyarrow\.Table"):
        up.prepare_updates({"k": [1]}, SCHEMA, 0, 1)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (pa.schema([("_k", pa.int64())]), "reserved"),
        (pa.schema([]), "at least one"),
        (pa.schema([("a", pa.int64()), ("a", pa.int64())]), "duplicate"),
        (pa.schema([("a", pa.list_(pa.int64()))]), "can't sort"),
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
