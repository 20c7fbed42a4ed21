"""Batch reads through a real local Spark: exact key-range splits, time travel, pushdown."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

import persist
import persist.plan
import persist.spark
import persist.spark._read as spark_read
from persist.spark import PersistDataSource
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


def test_filters_are_exact_and_pushed_only_where_they_cannot_leak(
    spark: Any, loc: Location
) -> None:
    shard, expected = make_shard(loc)
    df = spark.read.format("persist").options(**loc.options(shard, splits=2)).load()
    picked = df.filter((F.col("k") < 100) & F.col("v").isin("v10", "v20", "v21", "v5000"))
    plan = picked._jdf.queryExecution().executedPlan().toString()
    # Spark 4.3 keeps the first read plan on the relation: there persist pushes nothing and
    # Spark filters; where each scan is planned anew, persist takes the comparisons.
    pushes = persist.spark._scoped_read_plans(spark)
    assert ("Filter" not in plan.replace("RuntimeFilters", "")) == pushes, plan
    got = Counter((r.k, r.v) for r in picked.collect())
    want = Counter(
        {kv: m for kv, m in expected.items() if kv[0] < 100 and kv[1] in ("v10", "v20", "v21")}
    )
    assert got == want and got


def test_a_query_never_depends_on_an_earlier_one(spark: Any, loc: Location) -> None:
    shard, expected = make_shard(loc)
    total = sum(expected.values())
    df = spark.read.format("persist").options(**loc.options(shard, splits=3)).load()
    assert df.where("k < 10").count() == sum(m for (k, _), m in expected.items() if k < 10)
    assert df.count() == total
    assert df.where("v = 'v5'").count() == expected[(5, "v5")]
    df.createOrReplaceTempView("persist_reused")
    assert spark.sql("select count(*) from persist_reused where k >= 3000").first()[0] == sum(
        m for (k, _), m in expected.items() if k >= 3000
    )
    assert spark.sql("select count(*) from persist_reused").first()[0] == total

    # The DataFrame's snapshot is pinned when it is loaded: an append after that is seen by a
    # DataFrame loaded again, never by this one.
    async def append(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(pa.table(_rows([N]) | {"_time": times([3])}), 3, 4)
        await write.expire()

    loc.run(append)
    assert df.count() == total
    assert df.where("k = 6000").count() == 0
    again = spark.read.format("persist").options(**loc.options(shard)).load()
    assert again.count() == total + 1 and again.where("k = 6000").count() == 1


def test_a_reused_dataframe_outliving_its_lease_reads_its_snapshot_or_fails_clearly(
    spark: Any, loc: Location
) -> None:
    shard, expected = make_shard(loc)
    loc.run(lambda c: c.set_retention(shard, None))  # readers alone hold its history
    total = sum(expected.values())
    df = spark.read.format("persist").options(**loc.options(shard, lease_duration_s=0.5)).load()
    assert df.count() == total

    async def lapse(client: persist.PersistClient, since: int | None = None) -> None:
        # Commits judge leases: one after the lease ran out expires the scan's reader.
        write = await client.open_writer(shard, SCHEMA)
        nothing = pa.table(_rows([]) | {"_time": times([])}).cast(
            SCHEMA.append(pa.field("_time", pa.uint64()))
        )
        for _ in range(100):
            await asyncio.sleep(0.1)
            upper = write.upper
            await write.compare_and_append(nothing, upper, upper)
            if (await client.inspect(shard))["readers"] == 0:
                break
        await write.expire()
        if since is not None:
            read = await client.open_leased_reader(shard)
            await read.downgrade_since(since)
            await read.expire()

    loc.run(lapse)
    assert loc.run(lambda c: c.inspect(shard))["readers"] == 0
    assert df.count() == total  # held again by the tasks: the same snapshot (as of 2)
    loc.run(lambda c: lapse(c, since=3))  # no reader holds 2 any more: the since passes it
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: the snapshot of shard .* as of 2"):
        df.count()


def test_default_splits_keep_the_session_cores_busy(spark: Any, loc: Location) -> None:
    # About 20 MB of parts: one split by size (128 MiB each), two by the session's cores.
    shard = str(persist.ShardId.new())
    rows = 200_000

    async def fill(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        keys = pa.array(range(rows), pa.int64())
        noise = pa.array([os.urandom(48).hex() for _ in range(rows)])
        await write.compare_and_append(
            pa.table({"k": keys, "v": noise, "_time": pa.array([0] * rows, pa.uint64())}), 0, 1
        )
        await write.expire()

    loc.run(fill)
    assert loc.run(lambda c: c.inspect(shard))["bytes"] > 2 * persist.plan.MIN_SPLIT_BYTES
    df = spark.read.format("persist").options(**loc.options(shard)).load()
    assert spark.sparkContext.defaultParallelism == 2
    assert df.rdd.getNumPartitions() == 2
    assert df.count() == rows


def test_splits_stay_readable_while_appends_and_maintenance_run(spark: Any, loc: Location) -> None:
    """Every task resumes the scan's reader; the resumed handles must keep holding the state
    version the splits name while compaction and garbage collection run next to the scan."""
    shard = str(persist.ShardId.new())
    config = persist.PersistConfig(inline_writes_max_bytes=0)
    stop = threading.Event()

    async def append(client: persist.PersistClient, t: int) -> None:
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(
            pa.table(_rows(list(range(t * 100, t * 100 + 100))) | {"_time": times([t] * 100)}),
            t,
            t + 1,
        )
        await write.expire()

    async def churn() -> None:
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            t = 40
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                await append(client, t)
                await client.maintain(shard)
                t += 1

    async def fill() -> None:
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            for t in range(40):
                await append(client, t)

    asyncio.run(fill())
    df = spark.read.format("persist").options(**loc.options(shard, as_of=39, splits=8)).load()
    want = Counter((k, f"v{k}") for k in range(4000))
    background = threading.Thread(target=lambda: asyncio.run(churn()))
    background.start()
    try:
        for _ in range(3):  # the same splits each time (the DataFrame keeps its plan)
            assert Counter((r.k, r.v) for r in df.collect()) == want
            time.sleep(0.5)
    finally:
        stop.set()
        background.join()
    assert loc.run(lambda c: c.frontiers(shard))[1] > 45  # the churn ran


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
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: row .*'k': 7.* negative") as info:
        spark.read.format("persist").options(**loc.options(shard)).load().collect()
    # A task's error: Spark's words, then the persist line, with no Python traceback.
    assert "Traceback" not in str(info.value)
    assert re.search(r"^persist\.InvalidUsage: row ", str(info.value), re.MULTILINE)
    rows = spark.read.format("persist").options(**loc.options(shard, mode="updates")).load()
    assert [(r.k, r._diff) for r in rows.collect()] == [(7, -2)]


def test_bad_reads_are_invalid_usage(spark: Any, loc: Location) -> None:
    shard, _ = make_shard(loc)

    async def hold_since(client: persist.PersistClient) -> None:
        await client.set_retention(shard, None)  # readers alone: the reader moves the since
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
        # The persist line comes first, right after Spark's own words; no Python traceback.
        first = str(info.value).splitlines()[0]
        assert re.match(r"\[PYTHON_DATA_SOURCE_ERROR\] [^:]*: persist\.InvalidUsage: ", first)
        assert "Traceback" not in str(info.value)
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: a streaming read needs"):
        spark.readStream.format("persist").options(**base).load().writeStream.format(
            "console"
        ).start().processAllAvailable()
    assert loc.run(lambda c: c.frontiers(shard)) == before


def test_a_large_batch_read_says_once_that_the_native_read_is_faster(
    loc: Location, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shard, _ = make_shard(loc)

    def plan() -> None:
        # What Spark asks the source on the driver when a batch read is planned.
        source = PersistDataSource(loc.options(shard))
        assert source.reader(source.schema()).partitions()

    monkeypatch.setattr(spark_read, "_hinted", False)
    with caplog.at_level(logging.INFO, logger="persist.spark.hint"):
        plan()  # a few KiB of parts: no hint
        assert not caplog.records
        monkeypatch.setattr(spark_read, "HINT_BYTES", 1)
        plan()
        plan()
    (hint,) = caplog.records
    assert (hint.name, hint.levelno) == ("persist.spark.hint", logging.INFO)
    assert shard in hint.getMessage()
    assert "persist.spark.read(spark, shard=" in hint.getMessage()


_FRESH_SESSION = """
import asyncio, json, os, sys
import pyarrow as pa
import persist
from pyspark.sql import SparkSession

schema = pa.schema([("k", pa.int64()), ("v", pa.string())])
shard, copy = str(persist.ShardId.new()), str(persist.ShardId.new())


async def fill():
    async with await persist.connect() as client:  # ./persist-data, in this directory
        write = await client.open_writer(shard, schema)
        rows = {"k": list(range(100)), "v": [f"v{k}" for k in range(100)]}
        await write.compare_and_append(pa.table(rows | {"_time": pa.array([0] * 100, pa.uint64())}), 0, 1)
        await write.expire()


async def rows_of(shard_id):
    async with await persist.connect() as client:
        read = await client.open_leased_reader(shard_id)
        return (await read.snapshot_and_fetch(0)).num_rows


asyncio.run(fill())
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.bindAddress", "127.0.0.1")
    .getOrCreate()
)
# No register(), no location options, no PERSIST_* variables: found by pyspark's lookup, and
# every task uses the location the driver resolved.
df = spark.read.format("persist").option("shard", shard).option("pushdown", "true").load()
plan = df.where("k < 10")._jdf.queryExecution().executedPlan().toString()
out = {"where": df.where("k < 10").count(), "all": df.count(), "filter_in_spark": "Filter" in plan}
df.write.format("persist").option("shard", copy).option("time", "0").mode("append").save()
out["copied"] = asyncio.run(rows_of(copy))
spark.stop()
print("RESULT " + json.dumps(out))
"""


def test_a_fresh_session_elsewhere_finds_the_source_and_the_driver_location(
    tmp_path: Path,
) -> None:
    script = tmp_path / "session.py"
    script.write_text(_FRESH_SESSION)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    env |= {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and result, done.stderr[-3000:]
    got = json.loads(result[0].removeprefix("RESULT "))
    # Spark 4.3 keeps the first read plan: pushdown is not taken there, and nothing leaks.
    assert got == {"where": 10, "all": 100, "filter_in_spark": True, "copied": 100}
    assert (tmp_path / "persist-data" / "consensus.db").exists()


def test_the_tasks_use_the_location_the_driver_resolved(tmp_path: Path) -> None:
    """What a task gets is the pickled reader or writer: its locations are the driver's, made
    absolute there, whatever the task's own directory or environment says."""
    from pyspark import cloudpickle  # pyspark's own pickler for sources

    from persist.spark._options import parse_options

    shard = str(persist.ShardId.new())
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        options = parse_options({"shard": shard})
    finally:
        os.chdir(here)
    assert options.blob == (tmp_path / "persist-data" / "blob").as_uri()
    assert options.consensus == f"sqlite://{tmp_path / 'persist-data' / 'consensus.db'}"
    elsewhere = tmp_path / "task"
    elsewhere.mkdir()
    probe = (
        "import pickle, sys; o = pickle.loads(sys.stdin.buffer.read()); "
        "print(o.blob); print(o.consensus)"
    )
    env = os.environ | {"PERSIST_BLOB_URI": "file:///nowhere", "PERSIST_CONSENSUS_URI": "x"}
    seen = (
        subprocess.run(
            [sys.executable, "-c", probe],
            input=cloudpickle.dumps(options),
            cwd=elsewhere,
            env=env,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split()
    )
    assert seen == [options.blob, options.consensus]
    with pytest.raises(persist.InvalidUsage, match="option blob: 'mem://x' lives in one process"):
        parse_options({"shard": shard, "blob": "mem://x"})
