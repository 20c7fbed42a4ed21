"""Streaming through a real local Spark: micro-batches between frontiers, exactly once across a
restart from the checkpoint, in both directions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

import persist
from persist.spark._options import parse_options
from persist.spark._runtime import run
from persist.spark._write import StreamWriter, Written, plan_write
from tests.spark.conftest import Location, times
from tests.spark.test_write import contents, part_keys

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def append(loc: Location, shard: str, keys: list[int], diff: int, t: int) -> None:
    async def go(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, SCHEMA)
        table = pa.table(
            {
                "k": keys,
                "v": [f"v{k}" for k in keys],
                "_time": times([t] * len(keys)),
                "_diff": pa.array([diff] * len(keys), pa.int64()),
            }
        )
        await write.compare_and_append(table, t, t + 1)
        await write.expire()

    loc.run(go)


def consolidated(rows: list[Any]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        out[(r.k, r.v, r._time)] += r._diff
    return +out  # zeros dropped


def run_stream(spark: Any, query: Any) -> None:
    q = query.start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()


def test_stream_read_is_exact_across_a_restart(spark: Any, loc: Location, tmp_path: Path) -> None:
    shard = str(persist.ShardId.new())
    append(loc, shard, list(range(0, 300)), +1, 0)
    append(loc, shard, list(range(0, 300, 2)), -1, 1)  # upper 2: the stream starts as of 1
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def query() -> Any:
        return (
            spark.readStream.format("persist")
            .options(**loc.options(shard, mode="updates", splits=2))
            .load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(ckpt))
        )

    run_stream(spark, query())
    first = spark.read.parquet(str(out)).collect()
    assert consolidated(first) == Counter({(k, f"v{k}", 1): 1 for k in range(1, 300, 2)})
    append(loc, shard, list(range(0, 10)), +1, 2)
    append(loc, shard, list(range(1, 10, 2)), -1, 3)
    run_stream(spark, query())  # restarts from the checkpoint
    rows = spark.read.parquet(str(out)).collect()
    want = Counter({(k, f"v{k}", 1): 1 for k in range(1, 300, 2)})
    want.update({(k, f"v{k}", 2): 1 for k in range(10)})
    want.update({(k, f"v{k}", 3): -1 for k in range(1, 10, 2)})
    got: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        got[(r.k, r.v, r._time)] += r._diff
    assert got == want  # nothing lost, nothing repeated
    # The queries' readers hold the since at most at their committed frontier - 1 (Spark commits
    # a micro-batch's end to the source when the next one starts, so the last is not yet).
    since, upper = loc.run(lambda c: c.frontiers(shard))
    assert upper == 4 and since is not None and since <= 3


def test_stream_write_is_exactly_once_across_a_restart(
    spark: Any, loc: Location, tmp_path: Path
) -> None:
    source, sink = str(persist.ShardId.new()), str(persist.ShardId.new())
    append(loc, source, list(range(0, 200)), +1, 0)
    ckpt = tmp_path / "ckpt"

    def query() -> Any:
        return (
            spark.readStream.format("persist")
            .options(**loc.options(source, mode="updates"))
            .load()
            .drop("_time")
            .writeStream.format("persist")
            .options(**loc.options(sink, time_offset=100))
            .option("checkpointLocation", str(ckpt))
        )

    run_stream(spark, query())
    assert loc.run(lambda c: c.frontiers(sink))[1] == 101  # batch 0 at time 100
    append(loc, source, list(range(0, 50)), -1, 1)
    append(loc, source, list(range(500, 520)), +1, 2)
    run_stream(spark, query())
    upper = loc.run(lambda c: c.frontiers(sink))[1]
    assert upper is not None and upper > 101
    got = Counter({(k, v): d for (k, v, _), d in contents(loc, sink).items()})
    want = Counter({(k, f"v{k}"): 1 for k in [*range(50, 200), *range(500, 520)]})
    assert got == want
    assert int(loc.run(lambda c: c.inspect(source))["writers"]) == 0


def test_a_replayed_batch_id_commits_nothing(loc: Location) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    shard = str(persist.ShardId.new())
    df_schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    job = run(
        plan_write(parse_options(loc.options(shard, time_offset=7)), df_schema, streaming=True)
    )
    writer = StreamWriter(job)

    async def write_batch(client: persist.PersistClient, t: int) -> Written:
        w = await client.resume_writer(shard, job.writer_id)
        n = 2000  # to blob, not inline
        table = pa.table({"k": list(range(n)), "v": ["x"] * n, "_time": times([t] * n)})
        batch = await w.batch(table, t, t + 1)
        return Written(batch.to_bytes(), t + 1)

    first = loc.run(lambda c: write_batch(c, 7 + 3))
    writer.commit([first], 3)
    assert loc.run(lambda c: c.frontiers(shard))[1] == 11
    landed, keys = contents(loc, shard), part_keys(loc, shard)
    replay = loc.run(lambda c: write_batch(c, 7 + 3))
    assert part_keys(loc, shard) > keys
    writer.commit([replay], 3)  # the same batch id again, as after a restart
    assert loc.run(lambda c: c.frontiers(shard))[1] == 11
    assert contents(loc, shard) == landed
    assert part_keys(loc, shard) == keys  # the replayed batch was deleted
