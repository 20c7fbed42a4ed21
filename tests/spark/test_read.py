"""Batch reads through a real local Spark: exact key-range splits, time travel, pushdown."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

import persist
from tests.spark.conftest import Location, times

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])
N = 6000


def _rows(keys: list[int]) -> dict[str, Any]:
    return {"k": keys, "v": [f"v{k}" for k in keys]}


def make_shard(loc: Location) -> tuple[str, Counter[tuple[int, str]]]:
    """Three appends (three parts): inserts at 0, retractions of every third key at 1, inserts of
    every fifth key at 2. Returns the shard and its contents as of 2."""
    shard = str(persist.ShardId.new())

    async def fill(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        keys = list(range(N))
        third = keys[::3]
        fifth = keys[::5]
        await write.compare_and_append(pa.table(_rows(keys) | {"_time": times([0] * N)}), 0, 1)
        await write.compare_and_append(
            pa.table(
                _rows(third)
                | {
                    "_time": times([1] * len(third)),
                    "_diff": pa.array([-1] * len(third), pa.int64()),
                }
            ),
            1,
            2,
        )
        await write.compare_and_append(
            pa.table(_rows(fifth) | {"_time": times([2] * len(fifth))}), 2, 3
        )
        await write.expire()

    loc.run(fill)
    expected: Counter[tuple[int, str]] = Counter()
    for k in range(N):
        m = 1 - (k % 3 == 0) + (k % 5 == 0)
        if m:
            expected[(k, f"v{k}")] = m
    return shard, expected


def test_splits_are_exact_on_their_own(spark: Any, loc: Location) -> None:
    shard, expected = make_shard(loc)
    df = spark.read.format("persist").options(**loc.options(shard, splits=4)).load()
    assert df.rdd.getNumPartitions() == 4
    rows = df.withColumn("p", F.spark_partition_id()).collect()
    assert Counter((r.k, r.v) for r in rows) == expected
    # Every key (with all its updates) is read by exactly one partition.
    owner: dict[int, int] = {}
    for r in rows:
        assert owner.setdefault(r.k, r.p) == r.p
    assert len(set(owner.values())) == 4

    updates = (
        spark.read.format("persist")
        .options(**loc.options(shard, splits=4, mode="updates"))
        .load()
        .withColumn("p", F.spark_partition_id())
        .collect()
    )
    assert {(r.k, r.v): r._diff for r in updates} == dict(expected)
    assert len(updates) == len(expected)  # consolidated within each partition
    assert {r._time for r in updates} == {2}
    assert [
        f.dataType.simpleString()
        for f in spark.read.format("persist")
        .options(**loc.options(shard, mode="updates"))
        .load()
        .schema.fields
    ] == ["bigint", "string", "bigint", "bigint"]


def test_time_travel_and_default_splits(spark: Any, loc: Location) -> None:
    shard, _ = make_shard(loc)
    df = spark.read.format("persist").options(**loc.options(shard, as_of=0)).load()
    assert df.rdd.getNumPartitions() == 1  # one per 128 MiB, at least 1
    assert sorted(r.k for r in df.collect()) == list(range(N))
    at1 = spark.read.format("persist").options(**loc.options(shard, as_of=1)).load().count()
    assert at1 == N - len(range(0, N, 3))


def test_filters_are_pushed_and_exact(spark: Any, loc: Location) -> None:
    shard, expected = make_shard(loc)
    df = spark.read.format("persist").options(**loc.options(shard, splits=2)).load()
    picked = df.filter((F.col("k") < 100) & F.col("v").isin("v10", "v20", "v21", "v5000"))
    plan = picked._jdf.queryExecution().executedPlan().toString()
    assert "Filter" not in plan.replace("RuntimeFilters", ""), plan
    got = Counter((r.k, r.v) for r in picked.collect())
    want = Counter(
        {kv: m for kv, m in expected.items() if kv[0] < 100 and kv[1] in ("v10", "v20", "v21")}
    )
    assert got == want and got


def test_an_empty_shard_reads_empty(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())

    async def create(client: persist.PersistClient) -> None:
        await (await client.open_writer(shard, SCHEMA)).expire()

    loc.run(create)  # upper 0: no default as_of, nothing to read
    df = spark.read.format("persist").options(**loc.options(shard)).load()
    assert df.collect() == [] and df.columns == ["k", "v"]


def test_negative_multiplicity_fails_contents(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())

    async def fill(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        table = pa.table(_rows([7]) | {"_time": times([0]), "_diff": pa.array([-2], pa.int64())})
        await write.compare_and_append(table, 0, 1)

    loc.run(fill)
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: row .*'k': 7.* negative"):
        spark.read.format("persist").options(**loc.options(shard)).load().collect()
    rows = spark.read.format("persist").options(**loc.options(shard, mode="updates")).load()
    assert [(r.k, r._diff) for r in rows.collect()] == [(7, -2)]


def test_bad_reads_are_invalid_usage(spark: Any, loc: Location) -> None:
    shard, _ = make_shard(loc)

    async def hold_since(client: persist.PersistClient) -> None:
        read = await client.open_leased_reader(shard)
        await read.downgrade_since(1)

    loc.run(hold_since)
    before = loc.run(lambda c: c.frontiers(shard))
    base = loc.options(shard)
    bad: list[dict[str, str]] = [
        {k: v for k, v in base.items() if k != "shard"},
        base | {"shard": "not-a-shard"},
        base | {"shard": str(persist.ShardId.new())},  # no such shard
        base | {"mode": "rows"},
        base | {"splits": "0"},
        base | {"colour": "blue"},
        base | {"as_of": "3"},  # the upper
        base | {"as_of": "0"},  # below the since
        base | {"as_of": "-1"},
    ]
    for options in bad:
        with pytest.raises(Exception, match=r"persist\.InvalidUsage: ") as info:
            spark.read.format("persist").options(**options).load().collect()
        assert "Traceback" in str(info.value) or "persist.InvalidUsage" in str(info.value)
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: a streaming read needs"):
        spark.readStream.format("persist").options(**base).load().writeStream.format(
            "console"
        ).start().processAllAvailable()
    assert loc.run(lambda c: c.frontiers(shard)) == before


def test_the_static_source_is_found_and_pushes_only_when_asked(loc: Location) -> None:
    import pkgutil

    from pyspark.sql.datasource import DataSource, DataSourceReader

    import pyspark_persist

    # pyspark's lookup: top-level modules named pyspark_* with a DataSource DefaultSource.
    assert "pyspark_persist" in {m.name for m in pkgutil.iter_modules()}
    assert issubclass(pyspark_persist.DefaultSource, DataSource)
    assert pyspark_persist.DefaultSource.name() == "persist"
    shard, _ = make_shard(loc)
    source = pyspark_persist.DefaultSource(loc.options(shard))
    plain = source.reader(source.schema())
    # Spark refuses a pushFilters reader while the session's pushdown conf is off (its default).
    assert type(plain).pushFilters is DataSourceReader.pushFilters
    pushing = pyspark_persist.DefaultSource(loc.options(shard, pushdown="true"))
    assert type(pushing.reader(pushing.schema())).pushFilters is not DataSourceReader.pushFilters
