"""core.arrow.shaping: the edge check refuses exactly what shaping refuses, and what it lets through
shapes together."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from persist.core.arrow.shaping import EdgeCheck, rows_schema, shape_rows, shape_updates
from persist.errors import InvalidUsage

SHARD = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        pa.field("v", pa.string()),
        pa.field("d", pa.date64()),
    ]
)
DAY = 86_400_000


@st.composite
def writes(draw: st.DrawFn) -> pa.RecordBatch:
    """A write as a hostile client might build it: the shard's columns or not, right types or
    not, nulls anywhere, odd ``_diff`` and ``_time`` columns, dates that are not whole days."""
    n = draw(st.integers(0, 4))
    # Equal rows (their diffs are summed when consolidated), or any rows.
    same = draw(st.booleans())

    def rows(values: st.SearchStrategy[object]) -> list[object]:
        if same:
            return [draw(values)] * n
        return draw(st.lists(values, min_size=n, max_size=n))

    cols: dict[str, pa.Array] = {}
    if draw(st.integers(0, 9)):
        ktype = draw(st.sampled_from([pa.int64(), pa.int64(), pa.int32(), pa.float64()]))
        ks = rows(st.one_of(st.none(), st.integers(-5, 5)))
        cols["k"] = pa.array(ks, ktype)
    if draw(st.integers(0, 9)):
        cols["v"] = pa.array(rows(st.one_of(st.none(), st.text(max_size=2))))
    if draw(st.integers(0, 9)):
        days = rows(st.one_of(st.none(), st.integers(-3, 3)))
        off = draw(st.sampled_from([0, 0, 0, 1]))
        cols["d"] = pa.array([None if x is None else x * DAY + off for x in days], pa.date64())
    if draw(st.booleans()):
        dtype = draw(st.sampled_from([pa.int64(), pa.int8(), pa.uint64(), pa.string()]))
        big = [2**62, 2**63 - 1, -(2**62), 2**64 - 1]
        values = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(big))
        raw = rows(values)
        try:
            cols["_diff"] = (
                pa.array(raw, dtype)
                if dtype != pa.string()
                else pa.array([None if x is None else str(x) for x in raw])
            )
        except (OverflowError, pa.ArrowInvalid):
            cols["_diff"] = pa.array([1] * n, pa.int64())
    if not draw(st.integers(0, 9)):
        cols["_time"] = pa.array([0] * n, pa.uint64())
    if not draw(st.integers(0, 14)):
        cols["extra"] = pa.array([1] * n)
    names = list(cols)
    if names and draw(st.booleans()):
        names = draw(st.permutations(names))
    if not names:
        return pa.record_batch([pa.array([1] * n)], names=["other"])
    return pa.record_batch([cols[c] for c in names], names=names)


def _refused(fn: object, *args: object, **kwargs: object) -> str | None:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except InvalidUsage as exc:
        return str(exc)
    return None


_OVERFLOW = pa.record_batch(
    [
        pa.array([1, 1], pa.int64()),
        pa.array(["a", "a"]),
        pa.array([DAY, DAY], pa.date64()),
        pa.array([2**62, 2**62], pa.int64()),
    ],
    names=["k", "v", "d", "_diff"],
)


@settings(max_examples=500, deadline=None)
@given(batches=st.lists(writes(), min_size=1, max_size=6))
@example(batches=[_OVERFLOW])  # equal rows whose diffs sum past int64: rare to draw
# Two writes, each fine, whose equal rows would sum past int64 were they one write: they get
# two LSNs, so shaping them together must not refuse them (hypothesis found this once).
@example(batches=[_OVERFLOW.slice(0, 1), _OVERFLOW.slice(1, 1)])
def test_the_edge_check_refuses_exactly_what_shaping_refuses(
    batches: list[pa.RecordBatch],
) -> None:
    check = EdgeCheck(SHARD)
    accepted = []
    for batch in batches:
        at_edge = _refused(check, batch)
        shaped = _refused(shape_updates, batch, SHARD, time=0, keep_time=False)
        assert (at_edge is None) == (shaped is None), (batch.schema, at_edge, shaped)
        if at_edge is None:
            accepted.append(batch)
    # What the edge let through, shaped together (many writes of several schemas at once, as
    # the WAL and a group commit do), holds every row in order, typed as the shard's rows.
    rows = shape_rows(accepted, SHARD)
    assert rows.schema == rows_schema(SHARD)
    assert rows.num_rows == sum(b.num_rows for b in accepted)
    expected = [r["k"] for b in accepted for r in b.to_pylist()]
    assert rows.column("k").to_pylist() == expected


def test_schema_problems_are_found_once_per_schema() -> None:
    check = EdgeCheck(SHARD)
    bad = pa.record_batch([pa.array([1], pa.int32())], names=["k"])
    with pytest.raises(InvalidUsage, match="lack column"):
        check(bad)
    with pytest.raises(InvalidUsage, match="lack column"):
        check(bad)  # the cached refusal, raised again
    ok = pa.record_batch(
        [pa.array([None], pa.int64()), pa.array(["x"]), pa.array([DAY], pa.date64())],
        names=["k", "v", "d"],
    )
    with pytest.raises(InvalidUsage, match="not nullable"):
        check(ok)  # the same schema as a good write: the values are checked every time


def _at(values: list[int | None], unit: str, tz: str | None = None) -> pa.Table:
    return pa.table({"t": pa.array(values, pa.timestamp(unit, tz)), "_time": [0] * len(values)})


def test_a_coarser_timestamp_unit_is_taken_and_converted() -> None:
    shard = pa.schema([("t", pa.timestamp("us", "UTC"))])
    got = shape_updates(_at([1_700_000_000, None, -1], "s", "Etc/UTC"), shard)
    assert got.schema.field("t").type == pa.timestamp("us", "UTC")
    micros = got.column("t").cast(pa.int64()).to_pylist()
    assert micros == [1_700_000_000_000_000, None, -1_000_000]
    got = shape_updates(_at([1_700_000_000_123], "ms", "UTC"), shard)
    assert got.column("t").cast(pa.int64()).to_pylist() == [1_700_000_000_123_000]


@pytest.mark.parametrize(
    ("data", "shard_type", "why"),
    [
        # Finer data into a coarser column: refused by type, even for whole seconds.
        (_at([1_500_000_000], "ns"), pa.timestamp("s"), "finer"),
        (_at([2_000_000_000_000_000_000], "ns"), pa.timestamp("s"), "finer"),
        (_at([0], "s"), pa.timestamp("us", "UTC"), "time zone"),
        (_at([0], "s", "UTC"), pa.timestamp("us"), "time zone"),
        (_at([0], "s", "UTC"), pa.timestamp("us", "Europe/Paris"), "time zone"),
        # Beyond the year 2262, nanoseconds overflow int64.
        (_at([10_000_000_000], "s"), pa.timestamp("ns"), "out of the range"),
    ],
    ids=["ns-to-s", "ns-to-s-whole", "naive-to-utc", "utc-to-naive", "zones", "s-to-ns-2286"],
)
def test_timestamps_that_would_change_are_refused_saying_why(
    data: pa.Table, shard_type: pa.DataType, why: str
) -> None:
    with pytest.raises(InvalidUsage, match=why) as info:
        shape_updates(data, pa.schema([("t", shard_type)]))
    text = str(info.value)
    assert "'t'" in text and str(shard_type) in text and str(data.schema.field("t").type) in text
