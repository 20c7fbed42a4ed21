"""Streaming through a real local Spark: micro-batches between frontiers, exactly once across a
restart from the checkpoint, in both directions."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

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


# --- read limits ---------------------------------------------------------------------------------

LIMIT = 1000


def wide(k: int) -> str:
    """A value of about 1 KiB: a part's key index then samples a key per 256 rows or fewer (one
    per 256 KiB, up to 16), whatever compaction makes of the parts."""
    return f"v{k}" + "." * 1000


def append_wide(loc: Location, shard: str, keys: list[int], diff: int, t: int) -> None:
    """An append of ``wide`` rows, in parts of 256 KiB (about 250 rows) in blob."""

    async def go() -> None:
        config = persist.PersistConfig(
            inline_writes_max_bytes=0, compaction_enabled=False, part_target_bytes=256 << 10
        )
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            write = await client.open_writer(shard, SCHEMA)
            table = pa.table(
                {
                    "k": pa.array(keys, pa.int64()),
                    "v": [wide(k) for k in keys],
                    "_time": times([t] * len(keys)),
                    "_diff": pa.array([diff] * len(keys), pa.int64()),
                }
            )
            await write.compare_and_append(table, t, t + 1)
            await write.expire()

    asyncio.run(go())


class Batches:
    """What a ``foreachBatch`` sink saw: every attempt's rows by batch id."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.attempts: dict[int, list[Counter[tuple[Any, ...]]]] = {}
        self.sizes: dict[int, int] = {}
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def __call__(self, df: Any, batch_id: int) -> None:
        rows = Counter((r.k, r.v == wide(r.k), r._time, r._diff) for r in df.collect())
        with self.lock:
            if batch_id == self.fail_at:
                self.fail_at = None
                raise RuntimeError(f"the sink fails batch {batch_id}")
            self.attempts.setdefault(batch_id, []).append(rows)
            self.sizes[batch_id] = rows.total()
            self.changed.notify_all()

    def wait_for(self, n: int) -> None:
        """Until ``n`` batches have landed (bounded: a stuck query fails the test)."""
        with self.lock:
            assert self.changed.wait_for(lambda: len(self.attempts) >= n, timeout=300)


def test_a_row_limit_cuts_the_snapshot_and_a_big_time_and_stays_exact_across_restarts(
    spark: Any, loc: Location, tmp_path: Path
) -> None:
    shard = str(persist.ShardId.new())
    append_wide(loc, shard, list(range(6000)), +1, 0)
    append_wide(loc, shard, list(range(0, 6000, 7)), -1, 1)  # the stream starts as of 1
    ckpt = tmp_path / "ckpt"
    sink = Batches(fail_at=2)

    def query() -> Any:
        return (
            spark.readStream.format("persist")
            .options(**loc.options(shard, mode="updates", maxRowsPerTrigger=LIMIT))
            .load()
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(ckpt))
        )

    # 1: batch 2 fails in the sink after its offsets were logged; the query stops there.
    q = query().start()
    try:
        sink.wait_for(1)
        assert sink.sizes[0] <= 2 * LIMIT, f"the first micro-batch took {sink.sizes[0]} rows"
        with pytest.raises(Exception, match="the sink fails batch 2"):
            q.awaitTermination(300)
    finally:
        q.stop()
    assert sorted(sink.attempts) == [0, 1]
    # A single time of more rows than the limit, appended while the stream is under way.
    append_wide(loc, shard, list(range(10_000, 12_500)), +1, 2)
    # 2: restarted from the checkpoint (batch 2 is replayed), stopped in the middle, more appends.
    q = query().start()
    try:
        sink.wait_for(4)
        append_wide(loc, shard, list(range(10_000, 10_100)), -1, 3)
        sink.wait_for(6)
    finally:
        q.stop()
    append_wide(loc, shard, list(range(20_000, 20_010)), +1, 4)
    # 3: restarted again, run to the upper seen at its start.
    q = query().trigger(availableNow=True).start()
    try:
        assert q.awaitTermination(300)
    finally:
        q.stop()

    want: Counter[tuple[Any, ...]] = Counter()
    want.update({(k, True, 1): 1 for k in range(6000) if k % 7})
    want.update({(k, True, 2): 1 for k in range(10_000, 12_500)})
    want.update({(k, True, 3): -1 for k in range(10_000, 10_100)})
    want.update({(k, True, 4): 1 for k in range(20_000, 20_010)})
    ids = sorted(sink.attempts)
    assert ids == list(range(len(ids)))
    got: Counter[tuple[Any, ...]] = Counter()
    for b in ids:
        first, *again = sink.attempts[b]
        assert all(a == first for a in again)  # a batch replayed after a restart: the same rows
        for (k, ok, t, d), n in first.items():
            got[(k, ok, t)] += d * n
    assert {u: d for u, d in got.items() if d} == want  # nothing lost, nothing repeated
    sizes = [sink.sizes[b] for b in ids]
    # The limit, plus at most a key-index segment (here <= 375 rows) of each part that holds a
    # batch's start key where the batches before were cut by other parts' keys.
    assert max(sizes) <= 2 * LIMIT, sizes
    at = [{t for _, _, t, _ in sink.attempts[b][0]} for b in ids]
    snapshot = [n for n, ts in zip(sizes, at, strict=True) if ts == {1}]
    assert 6 <= len(snapshot) <= 12 and sum(snapshot) == 5142, sizes  # not one batch of 5142
    assert sum(1 for ts in at if 2 in ts) >= 3, sizes  # 2500 rows at one time, cut by key
    assert len(sizes) <= 25, sizes  # parts spanning more than a batch's times add a few
    since, upper = loc.run(lambda c: c.frontiers(shard))
    assert upper == 5 and since is not None and since <= 4
