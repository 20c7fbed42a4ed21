"""Schema evolution through a real local Spark: both read paths show the shard's current schema
(rows of earlier versions shown in it), consolidation across versions is exact before and after
compaction, a DataFrame loaded or a stream started before an evolution keeps its schema, and
batch writes evolve the shard only with mergeSchema."""

from __future__ import annotations

import asyncio
import datetime
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

import persist
import persist.spark
from persist.spark._offsets import Position
from tests.spark.conftest import Location, times

# Every write its own part in blob (the native path reads the files of each version), and no
# compaction until a test asks for it (maintain rewrites even two parts).
CONFIG = persist.PersistConfig(
    inline_writes_max_bytes=0, compaction_enabled=False, compaction_min_parts=1
)

V0 = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("x", pa.int32()),
        pa.field("secret", pa.string()),
    ]
)
# Version 1: name renamed label, extra added.
V1 = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("label", pa.string()),
        pa.field("x", pa.int32()),
        pa.field("secret", pa.string()),
        pa.field("extra", pa.string()),
    ]
)
# Version 2: x widened to int64, secret dropped.
V2 = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("label", pa.string()),
        pa.field("x", pa.int64()),
        pa.field("extra", pa.string()),
    ]
)
BIG = 2**40


def table(schema: pa.Schema, rows: list[dict[str, Any]], t: int, diff: int = 1) -> pa.Table:
    cols: dict[str, Any] = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in schema}
    cols["_time"] = times([t] * len(rows))
    cols["_diff"] = pa.array([diff] * len(rows), pa.int64())
    return pa.table(cols)


def v0_row(i: int) -> dict[str, Any]:
    return {"id": i, "name": f"n{i}", "x": i, "secret": f"s{i}"}


def v1_row(i: int, extra: str | None) -> dict[str, Any]:
    return {"id": i, "label": f"n{i}", "x": i, "secret": f"s{i}", "extra": extra}


def run(loc: Location, fn: Callable[[persist.PersistClient], Awaitable[Any]]) -> Any:
    """``await fn(client)`` on a fresh client of ``loc`` with ``CONFIG``."""

    async def main() -> Any:
        async with await persist.connect(loc.blob, loc.consensus, config=CONFIG) as client:
            return await fn(client)

    return asyncio.run(main())


def three_versions(loc: Location) -> str:
    """A shard with parts of versions 0, 1 and 2 (a writer at version 0 writing last)."""
    shard = str(persist.ShardId.new())

    async def go(client: persist.PersistClient) -> None:
        w0 = await client.open_writer(shard, V0)
        await w0.compare_and_append(table(V0, [v0_row(i) for i in range(200)], 0), 0, 1)
        assert await client.evolve_schema(shard, V1, renames={"name": "label"}) == 1
        w1 = await client.open_writer(shard, V1)
        # Retractions of version-0 rows, null in the added field: they cancel.
        out = table(V1, [v1_row(i, None) for i in range(50)], 1, -1)
        new = table(V1, [v1_row(i, f"e{i}") for i in range(200, 250)], 1)
        await w1.compare_and_append(pa.concat_tables([out, new]), 1, 2)
        assert await client.evolve_schema(shard, V2) == 2
        w2 = await client.open_writer(shard, V2)
        big = [{"id": i, "label": f"n{i}", "x": BIG + i, "extra": "f"} for i in range(250, 300)]
        # Retractions of version-1 rows (whose secret is dropped since): they cancel.
        back = [{"id": i, "label": f"n{i}", "x": i, "extra": f"e{i}"} for i in range(200, 210)]
        await w2.compare_and_append(
            pa.concat_tables([table(V2, big, 2), table(V2, back, 2, -1)]), 2, 3
        )
        # A writer opened at version 0 keeps writing.
        await w0.compare_and_append(table(V0, [v0_row(i) for i in range(300, 310)], 3), 3, 4)
        for w in (w0, w1, w2):
            await w.expire()
        plan = await client.plan_scan(shard)
        assert not plan.uniform  # the premise: files of three versions
        assert {p.schema_version for p in plan.scan.parts} == {0, 1, 2}  # type: ignore[union-attr]
        await plan.release()

    run(loc, go)
    return shard


EXPECTED = Counter(
    [
        *((i, f"n{i}", i, None) for i in range(50, 200)),
        *((i, f"n{i}", i, f"e{i}") for i in range(210, 250)),
        *((i, f"n{i}", BIG + i, "f") for i in range(250, 300)),
        *((i, f"n{i}", i, None) for i in range(300, 310)),
    ]
)


def rows(df: Any) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r) for r in df.collect())


def both(spark: Any, loc: Location, shard: str, **options: Any) -> tuple[Any, Any]:
    verified = spark.read.format("persist").options(**loc.options(shard, **options)).load()
    return persist.spark.read(spark, **loc.options(shard, **options)), verified


def test_both_paths_show_parts_of_three_versions_in_the_current_schema(
    spark: Any, loc: Location
) -> None:
    shard = three_versions(loc)
    native, verified = both(spark, loc, shard)
    try:
        for df in (native, verified):
            assert df.schema.names == ["id", "label", "x", "extra"]
            assert df.schema["x"].dataType == LongType()  # widened
            assert rows(df) == EXPECTED
        updates = [
            persist.spark.read(spark, **loc.options(shard, mode="updates")),
            spark.read.format("persist").options(**loc.options(shard, mode="updates")).load(),
        ]
        for df in updates:
            assert rows(df) == Counter({(*r, 3, 1) for r in EXPECTED})
        # Time travel to before the evolutions: still the current schema.
        old, old_verified = both(spark, loc, shard, as_of=0)
        for df in (old, old_verified):
            assert df.schema.names == ["id", "label", "x", "extra"]
            assert rows(df) == Counter((i, f"n{i}", i, None) for i in range(200))
    finally:
        persist.spark.release(native)


def test_an_insert_and_its_retraction_at_another_version_cancel(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    added = pa.schema([*V0, pa.field("extra", pa.string())])

    async def fill(client: persist.PersistClient) -> None:
        w0 = await client.open_writer(shard, V0)
        await w0.compare_and_append(table(V0, [v0_row(i) for i in range(100)], 0), 0, 1)
        await client.evolve_schema(shard, added)
        w1 = await client.open_writer(shard, added)
        gone = [{**v0_row(i), "extra": None} for i in range(100)]
        await w1.compare_and_append(table(added, gone, 1, -1), 1, 2)
        for w in (w0, w1):
            await w.expire()

    run(loc, fill)

    def read_both(*modes: str) -> None:
        for mode in modes:
            native, verified = both(spark, loc, shard, mode=mode)
            try:
                assert native.schema.names[:5] == verified.schema.names[:5] == added.names
                assert rows(native) == rows(verified) == Counter()
            finally:
                persist.spark.release(native)

    read_both("contents", "updates")

    async def compact(client: persist.PersistClient) -> bool:
        await client.maintain(shard)
        plan = await client.plan_scan(shard)
        await plan.release()
        return plan.uniform

    # Compaction merged the parts of both versions into the current one.
    assert run(loc, compact)
    read_both("contents")


def test_a_dataframe_keeps_the_schema_it_was_loaded_with(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())

    async def fill(client: persist.PersistClient) -> None:
        w0 = await client.open_writer(shard, V0)
        await w0.compare_and_append(table(V0, [v0_row(i) for i in range(20)], 0), 0, 1)
        await w0.expire()

    run(loc, fill)
    native, verified = both(spark, loc, shard)

    async def evolve(client: persist.PersistClient) -> None:
        await client.evolve_schema(shard, V1, renames={"name": "label"})
        w1 = await client.open_writer(shard, V1)
        await w1.compare_and_append(table(V1, [v1_row(5, "e5")], 1), 1, 2)
        await w1.expire()

    run(loc, evolve)
    try:
        # Loaded before the evolution: version 0's columns, as of the load's snapshot (the
        # persist path planned its splits only now, after the evolution).
        want = Counter((i, f"n{i}", i, f"s{i}") for i in range(20))
        for df in (native, verified):
            assert df.schema.names == V0.names
            assert rows(df) == want
    finally:
        persist.spark.release(native)
    # Loaded anew: the current schema.
    again, again_verified = both(spark, loc, shard)
    try:
        for df in (again, again_verified):
            assert df.schema.names == V1.names
            assert rows(df)[(5, "n5", 5, "s5", "e5")] == 1
    finally:
        persist.spark.release(again)


def test_merge_schema_adds_a_column_and_widens_one(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    first = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("x", pa.int32()),
            pa.field("u", pa.uint32()),
            pa.field("ts", pa.timestamp("ms", tz="UTC")),
        ]
    )
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)

    async def fill(client: persist.PersistClient) -> None:
        w = await client.open_writer(shard, first)
        start = table(first, [{"id": 1, "x": 1, "u": 7, "ts": when}], 0)
        await w.compare_and_append(start, 0, 1)
        await w.expire()

    run(loc, fill)
    spark_types = StructType(
        [
            StructField("id", LongType(), False),
            StructField("x", LongType()),  # bigint where the shard has int32
            StructField("u", LongType()),  # as Spark shows uint32: no change
            StructField("ts", TimestampType()),  # microseconds: Spark's own, no change
            StructField("note", StringType()),  # new
        ]
    )
    df = spark.createDataFrame([(2, 2**35, 8, when, "hello")], spark_types)
    options = loc.options(shard)

    # Without the option: refused, naming the column and the option; nothing changes.
    with pytest.raises(Exception, match=r"persist\.InvalidUsage.*\['note'\].*mergeSchema"):
        df.write.format("persist").options(**options).mode("append").save()
    assert len(run(loc, lambda c: c.schemas(shard))) == 1

    df.write.format("persist").options(**options, mergeSchema="true").mode("append").save()
    schemas = run(loc, lambda c: c.schemas(shard))
    assert [v for v, _ in schemas] == [0, 1]
    current = schemas[-1][1]
    assert current.names == ["id", "x", "u", "ts", "note"]
    assert current.field("x").type == pa.int64()  # widened
    assert current.field("u").type == pa.uint32()  # kept: Spark's bigint is its own view of it
    assert current.field("ts").type == pa.timestamp("ms", tz="UTC")
    assert current.field("note").nullable
    read = spark.read.format("persist").options(**options).load()
    assert sorted((r.id, r.x, r.u, r.note) for r in read.collect()) == [
        (1, 1, 7, None),
        (2, 2**35, 8, "hello"),
    ]

    # A DataFrame the shard takes already: no new version.
    read.write.format("persist").options(**options, mergeSchema="true").mode("append").save()
    assert len(run(loc, lambda c: c.schemas(shard))) == 2

    # mergeSchema never drops a column: a DataFrame without one is refused, naming it.
    fewer = spark.createDataFrame([(3, 3)], "id bigint, x bigint")
    with pytest.raises(Exception, match=r"persist\.InvalidUsage.*\['u', 'ts', 'note'\]"):
        fewer.write.format("persist").options(**options, mergeSchema="true").mode("append").save()
    assert len(run(loc, lambda c: c.schemas(shard))) == 2


def test_a_running_stream_keeps_its_schema_and_a_new_one_shows_the_current(
    spark: Any, loc: Location, tmp_path: Path
) -> None:
    shard = str(persist.ShardId.new())
    v0 = pa.schema([pa.field("k", pa.int64()), pa.field("v", pa.string())])
    v1 = pa.schema([pa.field("k", pa.int64()), pa.field("w", pa.string())])  # v dropped, w added

    async def fill(client: persist.PersistClient) -> None:
        w = await client.open_writer(shard, v0)
        rows0 = [{"k": k, "v": f"v{k}"} for k in range(10)]
        await w.compare_and_append(table(v0, rows0, 0), 0, 1)
        await w.expire()

    run(loc, fill)

    def start(name: str) -> Any:
        return (
            spark.readStream.format("persist")
            .options(**loc.options(shard, mode="updates"))
            .load()
            .writeStream.format("memory")
            .queryName(name)
            .option("checkpointLocation", str(tmp_path / name))
            .start()
        )

    old = start("evo_old")
    try:
        old.processAllAvailable()

        async def evolve(client: persist.PersistClient) -> None:
            await client.evolve_schema(shard, v1)
            w = await client.open_writer(shard, v1)
            await w.compare_and_append(table(v1, [{"k": 10, "w": "w10"}], 1), 1, 2)
            await w.expire()

        run(loc, evolve)
        old.processAllAvailable()
        got = spark.table("evo_old")
        assert got.schema.names == ["k", "v", "_time", "_diff"]
        # The row written at version 1 is shown in version 0's columns: v null. Version 0's v
        # values are dropped since: no reader is shown them any more, this stream's neither.
        assert sorted(tuple(r) for r in got.collect() if r._time == 1) == [(10, None, 1, 1)]
    finally:
        old.stop()

    new = start("evo_new")
    try:
        new.processAllAvailable()
        got = spark.table("evo_new")
        assert got.schema.names == ["k", "w", "_time", "_diff"]
        assert sorted(tuple(r) for r in got.collect()) == [
            *((k, None, 1, 1) for k in range(10)),
            (10, "w10", 1, 1),
        ]
    finally:
        new.stop()


def test_a_key_offset_of_another_schema_version_is_refused() -> None:
    key = bytes.fromhex("abcd")
    # Offsets checkpointed before versions carry none: read in the stream's version.
    legacy = Position.parse({"frontier": 3, "until": 5, "key": key.hex()})
    assert legacy.in_version(2) == Position(3, 5, key, 2)
    recorded = Position(3, 5, key, 2).to_offset()
    assert recorded == {"frontier": 3, "until": 5, "key": key.hex(), "version": 2}
    assert Position.parse(recorded).in_version(2) == Position(3, 5, key, 2)
    with pytest.raises(persist.InvalidUsage, match=r"schema version 2 .* now in version 3"):
        Position.parse(recorded).in_version(3)
    # A frontier is in no version's columns.
    assert Position(7).in_version(3).to_offset() == {"frontier": 7}
