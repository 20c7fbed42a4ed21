"""Batch writes through a real local Spark: one commit for the whole job, or nothing."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark import TaskContext
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSourceWriter
from pyspark.sql.types import StructType

import persist
from persist.spark import PersistDataSource
from persist.spark._options import parse_options
from persist.spark._runtime import run
from persist.spark._write import BatchWriter, Job, Written, plan_write
from tests.spark.conftest import Location, times

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def contents(loc: Location, shard: str, as_of: int | None = None) -> Counter[tuple[int, str, int]]:
    async def read(client: persist.PersistClient) -> Any:
        _, upper = await client.frontiers(shard)
        r = await client.open_leased_reader(shard)
        try:
            return await r.snapshot_and_fetch(upper - 1 if as_of is None else as_of)
        finally:
            await r.expire()

    t = loc.run(read)
    return Counter(
        {
            (k, v, int(t["_time"][0].as_py())): d
            for k, v, d in zip(
                t["k"].to_pylist(), t["v"].to_pylist(), t["_diff"].to_pylist(), strict=True
            )
        }
    )


def part_keys(loc: Location, shard: str) -> set[str]:
    """Blobs that hold data written by writers of ``shard`` (committed or not)."""
    return {k for k in loc.blob_keys() if k.startswith(f"{shard}/w/")}


def writers(loc: Location, shard: str) -> int:
    return int(loc.run(lambda c: c.inspect(shard))["writers"])


def test_write_appends_all_tasks_in_one_commit(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    df = spark.range(0, 3000, numPartitions=3).selectExpr("id as k", "concat('v', id) as v")
    df.write.format("persist").options(**loc.options(shard)).mode("append").save()
    seqno_after_first = loc.run(lambda c: c.inspect(shard))
    assert loc.run(lambda c: c.frontiers(shard))[1] == 1
    assert sum(contents(loc, shard).values()) == 3000
    assert writers(loc, shard) == 0  # the job's writer was expired; no task left one
    # _time and _diff columns: retract 10 rows at time 5, upper from max(_time) + 1.
    retract = spark.range(0, 10).selectExpr(
        "id as k",
        "concat('v', id) as v",
        "cast(5 as bigint) as _time",
        "cast(-1 as bigint) as _diff",
    )
    retract.write.format("persist").options(**loc.options(shard)).mode("append").save()
    assert loc.run(lambda c: c.frontiers(shard))[1] == 6
    now = contents(loc, shard)
    assert sum(now.values()) == 2990 and (3, "v3", 5) not in now
    assert seqno_after_first["batches"] >= 1
    # Tasks with no rows write nothing; a job with no rows still moves the upper by one.
    empty = (
        spark.range(0, 8, numPartitions=4)
        .filter("id > 100")
        .selectExpr("id as k", "concat('v', id) as v")
    )
    empty.write.format("persist").options(**loc.options(shard)).mode("append").save()
    assert loc.run(lambda c: c.frontiers(shard))[1] == 7
    assert contents(loc, shard, 6) == Counter({(k, v, 6): d for (k, v, _), d in now.items()})


def test_a_conditional_job_runs_once(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    df = spark.range(0, 100, numPartitions=2).selectExpr("id as k", "concat('v', id) as v")
    opts = loc.options(shard, expected_upper=0, new_upper=10, time=4)
    df.write.format("persist").options(**opts).mode("append").save()
    assert loc.run(lambda c: c.frontiers(shard))[1] == 10
    landed = contents(loc, shard)
    keys = part_keys(loc, shard)
    with pytest.raises(
        Exception, match=r"persist\.UpperMismatch: expected upper 0 but the shard upper is 10"
    ):
        df.write.format("persist").options(**opts).mode("append").save()
    assert contents(loc, shard) == landed
    assert part_keys(loc, shard) == keys  # the rerun left nothing behind
    assert writers(loc, shard) == 0


def test_a_failed_task_changes_nothing(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    spark.range(0, 50).selectExpr("id as k", "concat('v', id) as v").write.format(
        "persist"
    ).options(**loc.options(shard)).mode("append").save()
    before = (loc.run(lambda c: c.frontiers(shard)), contents(loc, shard), part_keys(loc, shard))
    # Four tasks; the one holding id 3500 fails after the others may have written their batches.
    boom = spark.range(0, 4000, numPartitions=4).selectExpr(
        "id as k",
        "case when id = 3500 then raise_error('task failed on purpose') else concat('v', id) end as v",
    )
    with pytest.raises(Exception, match="task failed on purpose"):
        boom.write.format("persist").options(**loc.options(shard)).mode("append").save()
    after = (loc.run(lambda c: c.frontiers(shard)), contents(loc, shard), part_keys(loc, shard))
    assert after == before
    assert writers(loc, shard) == 0


def test_a_commit_that_finds_the_upper_moved_deletes_its_batches(loc: Location) -> None:
    # The writer's own protocol, without Spark's scheduling: plan, a task writes, another writer
    # moves the upper, the commit refuses and deletes what the task wrote.
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    shard = str(persist.ShardId.new())
    options = parse_options(loc.options(shard))
    df_schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    job = run(plan_write(options, df_schema, streaming=False))
    writer = BatchWriter(job)
    # Big enough to be written to blob, not kept inline in the batch.
    rows = pa.record_batch({"k": pa.array(range(2000), pa.int64()), "v": ["a"] * 2000})
    message = writer.write(iter([rows]))
    assert part_keys(loc, shard)

    async def move(client: persist.PersistClient) -> None:
        w = await client.open_writer(shard)
        await w.compare_and_append(pa.table({"k": [9], "v": ["z"], "_time": times([0])}), 0, 1)
        await w.expire()

    loc.run(move)
    committed = part_keys(loc, shard)
    with pytest.raises(persist.UpperMismatch):
        writer.commit([message])
    assert part_keys(loc, shard) < committed  # the job's batch is gone, the other's stays
    assert contents(loc, shard) == Counter({(9, "z", 0): 1})
    assert writers(loc, shard) == 0


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "lost"])
@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "stream"])
def test_a_commit_whose_outcome_was_unknown_is_settled_by_the_state(
    loc: Location, monkeypatch: pytest.MonkeyPatch, landed: bool, streaming: bool
) -> None:
    """The append raises an indeterminate ``ExternalError``: if it landed all the same the
    commit succeeds (its parts stay: they are the shard's now), else it fails with that error
    and deletes what the tasks wrote. It once failed with "was appended; it can't be deleted"."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from persist.spark._write import StreamWriter

    append = persist.WriteHandle.compare_and_append_batch

    async def unknown(self: persist.WriteHandle, *args: Any, **kwargs: Any) -> None:
        if landed:
            await append(self, *args, **kwargs)
        raise persist.ExternalError("the connection dropped", determinate=False)

    shard = str(persist.ShardId.new())
    options = parse_options(loc.options(shard))
    df_schema = StructType([StructField("k", LongType()), StructField("v", StringType())])
    job = run(plan_write(options, df_schema, streaming=streaming))
    writer: Any = StreamWriter(job) if streaming else BatchWriter(job)
    rows = pa.record_batch({"k": pa.array(range(2000), pa.int64()), "v": ["a"] * 2000})
    if streaming:
        monkeypatch.setattr("persist.spark._write._batch_id", lambda: 0)
    message = writer.write(iter([rows]))
    written = part_keys(loc, shard)
    assert written
    monkeypatch.setattr(persist.WriteHandle, "compare_and_append_batch", unknown)
    commit = (
        (lambda: writer.commit([message], 0)) if streaming else (lambda: writer.commit([message]))
    )
    if landed:
        commit()
        assert contents(loc, shard) == Counter({(k, "a", 0): 1 for k in range(2000)})
        assert part_keys(loc, shard) == written
    else:
        with pytest.raises(persist.ExternalError, match="the connection dropped"):
            commit()
        assert not part_keys(loc, shard) & written
        assert loc.run(lambda c: c.frontiers(shard))[1] == 0


def test_bad_writes_are_invalid_usage(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    ok = spark.range(0, 20).selectExpr("id as k", "concat('v', id) as v")
    ok.write.format("persist").options(**loc.options(shard)).mode("append").save()
    before = (loc.run(lambda c: c.frontiers(shard)), part_keys(loc, shard))
    cases = [
        (ok, loc.options(shard), "overwrite"),
        (ok.withColumn("extra", F.lit(1)), loc.options(shard), "append"),
        (ok.drop("v"), loc.options(shard), "append"),
        (ok, loc.options(shard, time=0), "append"),  # below the upper (1)
        (ok, loc.options(shard, new_upper=3, time=3), "append"),  # not below new_upper
        (
            ok.withColumn("_time", F.lit(9).cast("bigint")),
            loc.options(shard, new_upper=5),
            "append",
        ),
        (ok, loc.options(shard, expected_upper="x"), "append"),
        (ok, {k: v for k, v in loc.options(shard).items() if k != "shard"}, "append"),
    ]
    for df, options, mode in cases:
        with pytest.raises(Exception, match=r"persist\.InvalidUsage: "):
            df.write.format("persist").options(**options).mode(mode).save()
    # Spark refuses these modes for every Python source before persist is asked, and its
    # message recommends "Overwrite": the error must say what persist takes.
    for mode in (None, "errorifexists", "ignore"):
        with pytest.raises(persist.InvalidUsage, match=r'write with \.mode\("append"\)') as e:
            ok.write.format("persist").options(**loc.options(shard)).mode(mode).save()
        assert "Overwrite" not in str(e.value)
    assert (loc.run(lambda c: c.frontiers(shard)), part_keys(loc, shard)) == before
    assert writers(loc, shard) == 0


# A pool must outlive every buffer it allocated (a buffer kept past its task by mistake too).
_POOLS: list[pa.MemoryPool] = []


class _ProbedWriter(BatchWriter):
    """A ``BatchWriter`` whose tasks record the most of their input they held at once: each
    batch Spark hands over is copied into a pool of the task's own, whose peak says how much of
    it was alive at any time (the copies are all the task has of its rows)."""

    def __init__(self, job: Job, out: str) -> None:
        super().__init__(job)
        self._out = out

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        pool = pa.proxy_memory_pool(pa.default_memory_pool())
        _POOLS.append(pool)
        given = largest = 0

        def copied() -> Iterator[pa.RecordBatch]:
            nonlocal given, largest
            for b in iterator:
                mine = pc.take(b, pa.array(np.arange(b.num_rows)), memory_pool=pool)
                given += mine.nbytes
                largest = max(largest, mine.nbytes)
                yield mine

        message = super().write(copied())
        ctx = TaskContext.get()
        assert ctx is not None
        parts = persist.Batch.from_bytes(message.batch).hollow.parts if message.batch else ()
        record = {
            "peak": pool.max_memory(),
            "given": given,
            "largest": largest,
            "parts": [p.nbytes for p in parts],
            "sizes": [p.size for p in parts],
        }
        name = f"task-{ctx.partitionId()}-{ctx.attemptNumber()}.json"
        Path(self._out, name).write_text(json.dumps(record))
        return message


class _ProbedSource(PersistDataSource):
    """``persist`` with probed tasks; option ``path``: where they leave their records."""

    @classmethod
    def name(cls) -> str:
        return "persist_probed"

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        job = run(plan_write(self._options, schema, streaming=False))
        return _ProbedWriter(job, self.options["path"])


def _probed_write(spark: Any, df: Any, options: dict[str, str], probe: Path) -> list[Any]:
    """Writes ``df`` through probed tasks; their records, in partition order."""
    spark.dataSource.register(_ProbedSource)
    probe.mkdir()
    df.write.format("persist_probed").options(**options, path=str(probe)).mode("append").save()
    return [json.loads(p.read_text()) for p in sorted(probe.iterdir())]


def test_a_task_holds_about_a_part_whatever_it_writes(
    spark: Any, loc: Location, tmp_path: Path
) -> None:
    shard = str(persist.ShardId.new())
    target = 2 << 20
    n = 200_000
    pad = "x" * 300
    # One task gets every row: ~60 MiB, rows that encode to a few bytes each.
    df = spark.range(0, n, numPartitions=1).selectExpr("id as k", f"concat('{pad}', id) as v")
    options = loc.options(shard, part_target_bytes=target)
    (record,) = _probed_write(spark, df, options, tmp_path / "probe")
    assert record["given"] > 20 * target
    # The task wrote its rows in parts as they came: rows that compress this well make parts
    # of at most 4 times the target in memory (docs/spark.md)...
    assert len(record["parts"]) >= 5
    assert max(record["parts"]) < 4 * target + 2 * record["largest"]
    # ...so it never held more of them than a part's worth (less one batch), the rows that made
    # it one and the next rows coming in: nowhere near all it was given.
    assert record["peak"] < 4 * target + 3 * record["largest"], record
    assert record["peak"] < record["given"] / 4
    assert contents(loc, shard) == Counter({(k, f"{pad}{k}", 0): 1 for k in range(n)})
    assert writers(loc, shard) == 0


def test_parts_are_cut_by_what_they_encode_to(spark: Any, loc: Location, tmp_path: Path) -> None:
    shard = str(persist.ShardId.new())
    target = 4 << 20
    n = 600_000
    # Rows that encode to about two thirds of their size in memory (hex digests do not
    # compress much): one task, about 6 parts' worth.
    df = spark.range(0, n, numPartitions=1).selectExpr("id as k", "md5(cast(id as string)) as v")
    options = loc.options(shard, part_target_bytes=target)
    (record,) = _probed_write(spark, df, options, tmp_path / "probe")
    full = list(zip(record["sizes"], record["parts"], strict=True))[:-1]
    assert len(full) >= 4
    for size, nbytes in full:
        # Each part (but the last, the rest) encodes to about the target...
        assert 0.75 * target <= size <= 1.5 * target, record
        # ...and holds more than that in memory: the size in memory does not cut them.
        assert nbytes > 1.2 * target, record
    assert sum(contents(loc, shard).values()) == n


def test_a_fresh_write_makes_about_one_part_per_task(
    spark: Any, loc: Location, tmp_path: Path
) -> None:
    shard = str(persist.ShardId.new())
    n, tasks = 2_000_000, 2
    # ~40 MiB of updates per task in memory, which encode to well under the default target
    # (64 MiB): as Spark's own writer makes one file of each task's rows, persist makes one part.
    df = spark.range(0, n, numPartitions=tasks).selectExpr(
        "id as k", "id % 100 as g", "rand(7) * 1000 as v"
    )
    records = _probed_write(spark, df, loc.options(shard), tmp_path / "probe")
    assert len(records) == tasks
    assert all(len(r["sizes"]) == 1 for r in records), records
    assert all(r["parts"][0] > 16 << 20 for r in records), records
    info = loc.run(lambda c: c.inspect(shard))
    # What the tasks wrote is what the shard holds (maintenance may only merge it further).
    assert 1 <= info["parts"] <= tasks
    assert info["rows"] == n


def test_a_task_that_fails_after_writing_parts_deletes_them(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())
    spark.range(0, 50).selectExpr("id as k", "concat('v', id) as v").write.format(
        "persist"
    ).options(**loc.options(shard)).mode("append").save()
    before = (loc.run(lambda c: c.frontiers(shard)), contents(loc, shard), part_keys(loc, shard))
    pad = "x" * 100
    # One task of ~12 MiB in parts of 256 KiB: it has written many parts when it meets the
    # bad row among its last ones (a time not below new_upper; then one below the upper).
    for bad_time in (10, 0):
        df = spark.range(0, 100_000, numPartitions=1).selectExpr(
            "id as k",
            f"concat('{pad}', id) as v",
            f"case when id = 95000 then cast({bad_time} as bigint) else cast(1 as bigint) end"
            " as _time",
        )
        options = loc.options(shard, new_upper=10, part_target_bytes=256 << 10)
        with pytest.raises(Exception, match=r"persist\.InvalidUsage: "):
            df.write.format("persist").options(**options).mode("append").save()
        after = (
            loc.run(lambda c: c.frontiers(shard)),
            contents(loc, shard),
            part_keys(loc, shard),
        )
        assert after == before
        assert writers(loc, shard) == 0


def test_spark_appends_to_a_shard_with_not_null_fields_made_in_python(
    spark: Any, loc: Location
) -> None:
    # Spark makes every column nullable and uses its own types (int, decimal(12,2) as given,
    # timestamps in UTC): a shard made in Python with NOT NULL fields takes them, since the
    # data holds no null and no value changes.
    import datetime
    from decimal import Decimal

    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("name", pa.string(), nullable=False),
            pa.field("price", pa.decimal128(12, 2), nullable=False),
            ("at", pa.timestamp("us", "UTC")),
        ]
    )
    shard = str(persist.ShardId.new())

    async def create(client: persist.PersistClient) -> None:
        await (await client.open_writer(shard, schema)).expire()

    loc.run(create)
    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    df = spark.createDataFrame(
        [(1, "ada", Decimal("3.50"), at), (2, "bob", Decimal("1.25"), None)],
        "id int, name string, price decimal(12,2), at timestamp",
    )
    df.write.format("persist").options(**loc.options(shard)).mode("append").save()
    table = loc.run(lambda c: _snapshot(c, shard))
    assert sorted(table.column("name").to_pylist()) == ["ada", "bob"]
    assert table.schema.field("id").type == pa.int64() and not table.schema.field("id").nullable
    bad = spark.createDataFrame([(3, None, Decimal("1.00"), None)], df.schema)
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: .*'name' is not nullable"):
        bad.write.format("persist").options(**loc.options(shard)).mode("append").save()


async def _snapshot(client: persist.PersistClient, shard: str) -> pa.Table:
    read = await client.open_leased_reader(shard)
    try:
        return await read.snapshot_and_fetch((await client.frontiers(shard))[1] - 1)
    finally:
        await read.expire()
