"""The handles Spark's driver registers for a job and hands to its tasks (a scan's reader, a
write's writer) outlive the driver's planning client, whose close expires what it keeps."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

import persist
from tests.spark.conftest import Location, times

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def test_a_scans_reader_outlives_the_planning_client(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())

    async def fill(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        rows = {"k": [1, 2, 3], "v": ["a", "b", "c"], "_time": times([0, 0, 0])}
        await write.compare_and_append(pa.table(rows), 0, 1)
        await write.expire()

    loc.run(fill)
    df = spark.read.format("persist").options(**loc.options(shard, splits=2)).load()
    assert df.count() == 3
    # The planning client is closed; its reader is the job's, held for the lease after the
    # last task (as spark.md says), not expired with the client.
    assert loc.run(lambda c: c.inspect(shard))["readers"] == 1


def test_a_writes_writer_outlives_the_planning_client(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    df = spark.createDataFrame([(1, "a"), (2, "b")], "k long, v string").repartition(2)
    df.write.format("persist").options(**loc.options(shard)).mode("append").save()
    got = spark.read.format("persist").options(**loc.options(shard)).load()
    assert sorted((r.k, r.v) for r in got.collect()) == [(1, "a"), (2, "b")]
    assert loc.run(lambda c: c.inspect(shard))["writers"] == 0  # the commit expired it
