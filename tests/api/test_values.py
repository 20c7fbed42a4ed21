"""Values through the public API, on every location: float rows compare as values (NaN equals
NaN), every type a shard accepts reads back exactly (type and value), and summed diffs never
wrap around int64."""

from __future__ import annotations

import decimal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist

from .conftest import Connect

I64 = 2**63
DAY_MS = 86_400_000


def bits64(pattern: int) -> float:
    return float(np.array([pattern], np.uint64).view(np.float64)[0])


def floats(values: list[float | None], t: pa.DataType) -> pa.Array:
    """``values`` as a float array, NaN payloads and signs kept (numpy, not Python, converts)."""
    dtype = np.float32 if t == pa.float32() else np.float64
    data = np.array([0.0 if v is None else v for v in values], np.float64).astype(dtype)
    return pa.array(data, t, mask=np.array([v is None for v in values]))


def with_time(data: dict[str, pa.Array], schema: pa.Schema, time: int, diff: int) -> pa.Table:
    n = len(next(iter(data.values())))
    return pa.table(
        {
            **data,
            "_time": pa.array([time] * n, pa.uint64()),
            "_diff": pa.array([diff] * n, pa.int64()),
        },
        schema=pa.schema(
            [
                *schema,
                pa.field("_time", pa.uint64(), nullable=False),
                pa.field("_diff", pa.int64(), nullable=False),
            ]
        ),
    )


# --- NaN ------------------------------------------------------------------------------------

NAN = float("nan")
NAN_PAYLOAD = bits64(0x7FF8_0000_0000_0001)
NEG_NAN = bits64(0xFFF8_0000_0000_0000)


@pytest.mark.parametrize("float_type", [pa.float32(), pa.float64()])
async def test_nan_rows_consolidate(connect: Connect, float_type: pa.DataType) -> None:
    # No merges before since passes every write: then maintain merges (and consolidates) all,
    # rewriting even a few parts.
    client = await connect(compaction_enabled=False, compaction_min_parts=1)
    # Floats first and last among the sort keys, both nullable.
    schema = pa.schema([("x", float_type), ("k", pa.int64()), ("y", float_type)])
    write, read = await client.open(persist.ShardId.new(), schema)
    inserted = {
        "x": floats([NAN, 1.0, NAN, None, -0.0, NAN], float_type),
        "k": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
        "y": floats([1.0, NAN, None, NAN, 0.0, NAN], float_type),
    }
    # The same rows, with other NaN payloads and signs (and the zeros' signs swapped).
    retracted = {
        "x": floats([NAN_PAYLOAD, 1.0, NEG_NAN, None, 0.0, NEG_NAN], float_type),
        "k": pa.array([1, 2, 3, 4, 5, 6], pa.int64()),
        "y": floats([1.0, NEG_NAN, None, NAN_PAYLOAD, -0.0, NAN_PAYLOAD], float_type),
    }
    await write.compare_and_append(with_time(inserted, schema, 0, 1), 0, 1)
    await write.compare_and_append(with_time(retracted, schema, 1, -1), 1, 2)
    # Twice the same NaN row in one write is one row of multiplicity 2.
    twice = {k: v.take([0, 0]) for k, v in inserted.items()}
    await write.compare_and_append(with_time(twice, schema, 2, 1), 2, 3)

    assert (await read.snapshot_and_fetch(0)).num_rows == 6
    assert (await read.snapshot_and_fetch(1)).num_rows == 0
    at2 = await read.snapshot_and_fetch(2)
    assert at2.column("k").to_pylist() == [1] and at2.column("_diff").to_pylist() == [2]
    changes = await _events(read, 0, 3)
    assert sum(t.num_rows for t in changes) == 7  # six retractions, one row of diff 2

    await read.downgrade_since(2)
    await client.maintain(write.shard_id)
    at2 = await read.snapshot_and_fetch(2)
    assert at2.column("k").to_pylist() == [1] and at2.column("_diff").to_pylist() == [2]
    # Compaction merged the three batches at since 2, so it consolidated them too.
    info = await client.inspect(write.shard_id)
    assert (info["batches"], info["rows"]) == (1, 1)


@pytest.mark.parametrize("float_type", [pa.float32(), pa.float64()])
async def test_nan_rows_cancel_in_merges_of_many_parts(
    connect: Connect, float_type: pa.DataType
) -> None:
    # Parts of a few rows each: merges stream them, cutting at rows that may hold NaN.
    client = await connect(compaction_enabled=False, part_target_bytes=64)
    schema = pa.schema([("x", float_type), ("k", pa.int64())])
    write, read = await client.open(persist.ShardId.new(), schema)
    xs: list[float | None] = [NAN, -0.0, 1.0, None, NAN_PAYLOAD, 0.0, NEG_NAN, NAN]
    inserted = {
        "x": floats([xs[i % 8] for i in range(48)], float_type),
        "k": pa.array([i % 3 for i in range(48)], pa.int64()),
    }
    # Each row's twin: another NaN for a NaN, the other zero for a zero.
    swapped: list[float | None] = [NEG_NAN, 0.0, 1.0, None, NAN, -0.0, NAN_PAYLOAD, NAN_PAYLOAD]
    retracted = {
        "x": floats([swapped[i % 8] for i in range(48)], float_type),
        "k": pa.array([i % 3 for i in range(48)], pa.int64()),
    }
    # Written in sort order, each write's parts are one sorted run: merges stream them.
    order = [("x", "ascending"), ("k", "ascending")]
    await write.compare_and_append(with_time(inserted, schema, 0, 1).sort_by(order), 0, 1)
    await write.compare_and_append(with_time(retracted, schema, 1, -1).sort_by(order), 1, 2)
    info = await client.inspect(write.shard_id)
    assert info["parts"] > 4
    assert (await read.snapshot_and_fetch(0)).num_rows == 12  # NaN, 0, 1, null x 3 keys
    assert (await read.snapshot_and_fetch(1)).num_rows == 0
    await read.downgrade_since(1)
    await client.maintain(write.shard_id)
    assert (await read.snapshot_and_fetch(1)).num_rows == 0
    assert (await client.inspect(write.shard_id))["rows"] == 0


async def _events(read: persist.ReadHandle, as_of: int, until: int) -> list[pa.Table]:
    out: list[pa.Table] = []
    async for ev in read.listen(as_of):
        if ev.updates.num_rows:
            out.append(ev.updates)
        if ev.upper is None or ev.upper >= until:
            return out
    return out


# --- types ------------------------------------------------------------------------------------


def raw(values: list[int], storage: pa.DataType, t: pa.DataType) -> pa.Array:
    return pa.array(values, storage).view(t)


def ints(t: pa.DataType) -> pa.Array:
    width = t.bit_width
    if pa.types.is_signed_integer(t):
        return pa.array([-(2 ** (width - 1)), 0, 2 ** (width - 1) - 1], t)
    return pa.array([0, 1, 2**width - 1], t)


_TS_S = 9_223_372_036_854_775  # timestamp[s] values Parquet (in ms) can hold
_TIME32_S = 2_147_483  # time32[s] values Parquet (in ms) can hold

# Every type a shard accepts, with extreme values.
VALUES: dict[str, pa.Array] = {
    **{str(t): ints(t) for t in [pa.int8(), pa.int16(), pa.int32(), pa.int64()]},
    **{str(t): ints(t) for t in [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]},
    "float32": pa.array([-3.5, 0.0, 3.4e38], pa.float32()),
    "float64": pa.array([-np.inf, 5e-324, 1.7e308]),
    "bool": pa.array([True, False, True]),
    "string": pa.array(["", "é", "x" * 100]),
    "large_string": pa.array(["", "a", "b"], pa.large_string()),
    "binary": pa.array([b"", b"\x00", b"\xff" * 20]),
    "large_binary": pa.array([b"", b"\x00", b"z"], pa.large_binary()),
    "fixed_size_binary": pa.array([b"abc", b"\x00\x00\x00", b"\xff\xff\xff"], pa.binary(3)),
    "decimal128(10,2)": pa.array(
        [decimal.Decimal("-99999999.99"), decimal.Decimal("0.01"), decimal.Decimal("1.5")],
        pa.decimal128(10, 2),
    ),
    "decimal128(38,0)": pa.array(
        [decimal.Decimal(-(10**38) + 1), decimal.Decimal(0), decimal.Decimal(10**38 - 1)],
        pa.decimal128(38, 0),
    ),
    "decimal256(76,5)": pa.array(
        [decimal.Decimal("-1.5"), decimal.Decimal(0), decimal.Decimal(10**70) / 3],
        pa.decimal256(76, 5),
    ),
    "date32": raw([-(2**31), 0, 2**31 - 1], pa.int32(), pa.date32()),
    "date64": raw([-(2**31) * DAY_MS, 3 * DAY_MS, (2**31 - 1) * DAY_MS], pa.int64(), pa.date64()),
    "time32[s]": raw([-_TIME32_S, 86_399, _TIME32_S], pa.int32(), pa.time32("s")),
    "time32[ms]": raw([-(2**31), 86_399_999, 2**31 - 1], pa.int32(), pa.time32("ms")),
    "time64[us]": raw([-(2**63), 1, 2**63 - 1], pa.int64(), pa.time64("us")),
    "time64[ns]": raw([-(2**63), 1, 2**63 - 1], pa.int64(), pa.time64("ns")),
    **{
        f"timestamp[s,{tz}]": raw([-_TS_S, 1, _TS_S], pa.int64(), pa.timestamp("s", tz))
        for tz in [None, "UTC", "+05:30", "Europe/Paris"]
    },
    **{
        f"timestamp[{unit},{tz}]": raw([-(2**63), 1, 2**63 - 1], pa.int64(), pa.timestamp(unit, tz))
        for unit in ["ms", "us", "ns"]
        for tz in [None, "UTC", "Europe/Paris"]
    },
    **{
        f"duration[{unit}]": raw([-(2**63), 0, 2**63 - 1], pa.int64(), pa.duration(unit))
        for unit in ["s", "ms", "us", "ns"]
    },
}
WIDE = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        *(pa.field(name, values.type) for name, values in VALUES.items()),
    ]
)


def wide_rows(ids: list[int]) -> dict[str, pa.Array]:
    """Rows ``ids``: row i holds value ``i % 3`` of every type, or null where ``i % 4 == 3``."""
    out: dict[str, pa.Array] = {"id": pa.array(ids, pa.int64())}
    for name, values in VALUES.items():
        picked = values.take(pa.array([i % 3 for i in ids]))
        nulls = pa.array([i % 4 == 3 for i in ids])
        out[name] = pc.if_else(nulls, pa.nulls(len(ids), values.type), picked)
    return out


def by_id(table: pa.Table) -> pa.Table:
    return table.sort_by("id").combine_chunks()


async def test_every_accepted_type_reads_back_exactly(connect: Connect) -> None:
    # maintain merges (rewrites even two parts), below
    client = await connect(compaction_enabled=False, compaction_min_parts=1)
    write, read = await client.open(persist.ShardId.new(), WIDE)
    # Two batches of 12 updates: maintain merges them into one.
    await write.compare_and_append(with_time(wide_rows(list(range(12))), WIDE, 0, 1), 0, 1)
    added = list(range(12, 21))
    retracted = with_time(wide_rows([0, 5, 7]), WIDE, 1, -1)
    await write.compare_and_append(
        pa.concat_tables([retracted, with_time(wide_rows(added), WIDE, 1, 1)]), 1, 2
    )
    want = by_id(with_time(wide_rows([i for i in range(21) if i not in (0, 5, 7)]), WIDE, 1, 1))
    full = want.schema

    got = await read.snapshot_and_fetch(1)
    assert got.schema == full
    assert by_id(got).equals(want)

    # The same through portable splits, in another client.
    other = await connect()
    [split] = await read.snapshot(1)
    assert by_id(await other.fetch_split(persist.Split.from_bytes(split.to_bytes()))).equals(want)
    for split in await read.snapshot(1, num_splits=2):
        assert (await other.fetch_split(split)).schema == full

    # And through listen.
    [changes] = await _events(read, 0, 2)
    assert changes.schema == full
    assert by_id(changes.filter(pc.equal(pc.field("_diff"), -1))).equals(by_id(retracted))

    # A snapshot can be written back as it is.
    copy_w, copy_r = await client.open(persist.ShardId.new(), WIDE)
    await copy_w.compare_and_append(got, 0, 2)
    assert by_id(await copy_r.snapshot_and_fetch(1)).equals(want)

    # Compaction decodes, merges and re-encodes the parts: the values survive that too.
    await read.downgrade_since(1)
    assert (await client.maintain(write.shard_id))["merges"] == 1
    assert (await client.inspect(write.shard_id))["batches"] == 1
    compacted = await read.snapshot_and_fetch(1)
    assert compacted.schema == full
    assert by_id(compacted).equals(want)


def _newer(name: str, *args: object) -> list[pa.DataType]:
    """The type ``pa.<name>(*args)``, if this pyarrow has it."""
    make = getattr(pa, name, None)
    return [] if make is None else [make(*args)]


# Stored as their plain values (core.arrow.casts): taken at open, as the plain type.
PLAIN_VALUES = {
    pa.string_view(): pa.string(),
    pa.binary_view(): pa.binary(),
    pa.dictionary(pa.int32(), pa.string()): pa.string(),
    pa.dictionary(pa.int8(), pa.large_binary()): pa.large_binary(),
}

REFUSED_TYPES = [
    pa.float16(),
    *_newer("decimal32", 7, 2),
    *_newer("decimal64", 15, 2),
    pa.month_day_nano_interval(),
    pa.null(),
    pa.list_(pa.int64()),
    pa.struct([("a", pa.int64())]),
    *_newer("uuid"),
    pa.binary(0),  # sorts and compares, but the Parquet writer refuses it
]


async def test_types_that_can_not_be_stored_exactly_are_refused_at_open(
    client: persist.PersistClient,
) -> None:
    for t in REFUSED_TYPES:
        with pytest.raises(persist.InvalidUsage, match="type"):
            await client.open(persist.ShardId.new(), pa.schema([("c", t)]))
    for t, plain in PLAIN_VALUES.items():
        write, _ = await client.open(persist.ShardId.new(), pa.schema([("c", t)]))
        assert write.schema == pa.schema([("c", plain)])


@pytest.mark.parametrize(
    "values",
    [
        raw([DAY_MS + 1], pa.int64(), pa.date64()),
        raw([2**31 * DAY_MS], pa.int64(), pa.date64()),
        raw([_TIME32_S + 1], pa.int32(), pa.time32("s")),
        raw([-_TS_S - 1], pa.int64(), pa.timestamp("s", "UTC")),
        raw([_TS_S + 1], pa.int64(), pa.timestamp("s")),
    ],
    ids=lambda v: str(v.type),
)
async def test_values_that_would_not_read_back_exactly_are_refused(
    client: persist.PersistClient, values: pa.Array
) -> None:
    schema = pa.schema([("c", values.type)])
    write, _ = await client.open(persist.ShardId.new(), schema)
    with pytest.raises(persist.InvalidUsage):
        await write.compare_and_append(with_time({"c": values}, schema, 0, 1), 0, 1)
    assert await write.fetch_recent_upper() == 0
    assert (await client.inspect(write.shard_id))["batches"] == 0


# --- diffs ------------------------------------------------------------------------------------

KEYED = pa.schema([("k", pa.int64())])


def diffs(keys: list[int], time: int, values: list[int]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "_time": pa.array([time] * len(keys), pa.uint64()),
            "_diff": pa.array(values, pa.int64()),
        }
    )


@pytest.mark.parametrize("values", [[2**62] * 4, [I64 - 1, 1], [-I64, -1]])
async def test_a_write_whose_diffs_overflow_is_refused(
    client: persist.PersistClient, values: list[int]
) -> None:
    write, read = await client.open(persist.ShardId.new(), KEYED)
    with pytest.raises(persist.InvalidUsage, match="int64"):
        await write.compare_and_append(diffs([1] * len(values), 0, values), 0, 1)
    assert await write.fetch_recent_upper() == 0
    info = await client.inspect(write.shard_id)
    assert (info["batches"], info["parts"]) == (0, 0)
    # Sums that fit are exact, however their partial sums wrap.
    await write.compare_and_append(diffs([1, 1, 1], 0, [2**62, 2**62, -(2**62)]), 0, 1)
    assert (await read.snapshot_and_fetch(0)).column("_diff").to_pylist() == [2**62]


async def test_reads_and_merges_whose_diffs_overflow_fail_rather_than_wrap(
    connect: Connect,
) -> None:
    # maintain merges (rewrites even two parts), below
    client = await connect(compaction_enabled=False, compaction_min_parts=1)
    write, read = await client.open(persist.ShardId.new(), KEYED)
    # Two batches of one update each: the spine merges them.
    await write.compare_and_append(diffs([1], 0, [2**62]), 0, 1)
    await write.compare_and_append(diffs([1], 1, [2**62]), 1, 2)
    assert (await read.snapshot_and_fetch(0)).column("_diff").to_pylist() == [2**62]
    with pytest.raises(persist.InvalidUsage, match="int64"):
        await read.snapshot_and_fetch(1)
    # Each time on its own fits: listen delivers them.
    [changes] = await _events(read, 0, 2)
    assert changes.column("_diff").to_pylist() == [2**62]

    # Merging the two batches at since 1 would overflow: the merge is abandoned.
    await read.downgrade_since(1)
    assert (await client.maintain(write.shard_id))["merges"] == 0
    assert (await client.inspect(write.shard_id))["batches"] == 2
    with pytest.raises(persist.InvalidUsage, match="int64"):
        await read.snapshot_and_fetch(1)

    # A retraction brings the sum back in range: reads are exact again, before and after
    # maintenance (which still can't merge the first two batches on their own).
    await write.compare_and_append(diffs([1, 2], 2, [-(2**62), 5]), 2, 3)
    assert (await read.snapshot_and_fetch(2)).column("_diff").to_pylist() == [2**62, 5]
    await read.downgrade_since(2)
    await client.maintain(write.shard_id)
    assert (await read.snapshot_and_fetch(2)).column("_diff").to_pylist() == [2**62, 5]
