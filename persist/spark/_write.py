"""Writing shards from Spark: tasks write batches, one commit makes them visible.

The job's writer is registered when Spark plans the write, with a long lease (option
``lease_duration_s``, default a day) that every task renews: a job of any length commits what its
tasks wrote. Tasks write under that writer (``PersistClient.resume_writer``), so none leaves a
writer of its own behind; the commit (or abort) expires it. Its uncommitted parts are garbage
collected once it is gone, so a job that died before committing leaves nothing for good.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

import persist
import persist.spark._runtime as rt
from persist.core.arrow.casts import lossless
from persist.core.arrow.shaping import shape_updates
from persist.core.arrow.updates import DIFF, TIME, encode_part
from persist.errors import InvalidUsage, SchemaChanged, UpperMismatch
from persist.spark._options import Options
from persist.spark._types import shard_schema_of, spark_schema

__all__ = ["BatchWriter", "StreamWriter", "merged_schema", "plan_write"]

# A write job's writer lasts this long without a heartbeat (each task gives it one).
JOB_LEASE_S = 24 * 3600.0
_MAX_TIME = 2**63 - 1
# How often a mergeSchema evolution is planned anew when another evolution beat it.
_MERGE_TRIES = 10
# A task's parts encode to about option part_target_bytes, by default the client's.
_PART_TARGET_BYTES = persist.PersistConfig().part_target_bytes
# Spark hands a task its rows in Arrow batches of 10,000 rows (by default): they are shaped and
# added at least this many bytes at a time (or a quarter of a part, if less), not with a few
# hundred microseconds of calls per batch.
_GROUP_BYTES = 4 << 20
# A task's first rows, at least this many bytes of them, are encoded to learn what its rows
# encode to.
_SAMPLE_BYTES = 2 << 20
# A task holds at most this many times part_target_bytes in memory for a part, however small
# its rows encode: a part of rows that compress 50x is smaller than the target instead.
_HELD_MAX = 4
# PersistConfig's bound on its int settings.
_MAX_CONFIG_INT = 2**40


@dataclass(frozen=True)
class Written(WriterCommitMessage):
    """What a task wrote: its batch (``Batch.to_bytes``; empty if it had no rows) and the
    upper its times need."""

    batch: bytes
    upper: int


@dataclass(frozen=True)
class Job:
    """What the driver settled when it planned the write."""

    options: Options
    schema: pa.Schema  # the shard's
    writer_id: str
    expected_upper: int
    new_upper: int | None
    time: int  # of rows without _time


def _check_columns(names: Sequence[str], schema: pa.Schema, *, streaming: bool) -> None:
    if streaming and TIME in names:
        raise InvalidUsage(
            "a streaming write can't carry _time: micro-batch b is written at time_offset + b"
        )
    given = set(names) - {TIME, DIFF}
    extra = sorted(given - set(schema.names))
    missing = sorted(set(schema.names) - given)
    if extra or missing:
        hint = (
            f'; .option("mergeSchema", "true") adds {extra} to the shard first'
            if extra and not missing
            else '; .option("mergeSchema", "true") adds columns to the shard and widens '
            "types, it never drops one (client.evolve_schema does)"
        )
        raise InvalidUsage(
            f"the DataFrame's columns are not the shard's {schema.names}: "
            f"extra {extra}, missing {missing}{hint}"
        )


def merged_schema(shard: pa.Schema, df_schema: StructType) -> pa.Schema:
    """The shard's schema evolved to take a DataFrame of ``df_schema`` (option mergeSchema):
    each DataFrame column the shard lacks added (nullable, in the DataFrame's order, after the
    shard's), and a shard column widened to the DataFrame's type where that is a lossless
    widening of it. A column whose Spark type is the shard's already (an unsigned integer
    Spark shows wider, a timestamp in another unit) or whose type casts into the shard's
    without loss is left as it is. ``InvalidUsage`` naming the columns when the DataFrame
    lacks some of the shard's: mergeSchema never drops one."""
    given = shard_schema_of(df_schema)
    missing = [n for n in shard.names if n not in given.names]
    if missing:
        raise InvalidUsage(
            f"the DataFrame lacks the shard's columns {missing}: mergeSchema adds columns and "
            "widens types, it never drops one (client.evolve_schema does)"
        )
    shown = spark_schema(shard, updates=False)
    fields = []
    for field, spark_field in zip(shard, shown, strict=True):
        theirs = given.field(field.name).type
        if spark_field.dataType == df_schema[field.name].dataType or lossless(theirs, field.type):
            fields.append(field)
        elif lossless(field.type, theirs):
            fields.append(field.with_type(theirs))
        else:
            fields.append(field)  # the write's cast takes each value that fits, or says which
    fields += [f.with_nullable(True) for f in given if f.name not in shard.names]
    return pa.schema(fields)


async def _merge(client: persist.PersistClient, shard: str, df_schema: StructType) -> pa.Schema:
    """Evolves the shard to take ``df_schema`` (``merged_schema``), in one commit unless it
    takes it already; returns the schema the write opens its writer with. Another evolution
    racing it is read and merged with anew."""
    for _ in range(_MERGE_TRIES):
        version, current = (await client.schemas(shard))[-1]
        target = merged_schema(current, df_schema)
        if target.equals(current):
            return current
        try:
            await client.evolve_schema(shard, target, expected_version=version)
        except SchemaChanged:
            continue
        return target
    raise InvalidUsage(
        f"mergeSchema: the schema of shard {shard} kept changing under the write "
        f"({_MERGE_TRIES} tries); try again"
    )


class _Updates:
    """Spark's Arrow rows as persist updates: the shard's columns and types (Spark hands over its
    own types: each column is cast to the shard's if no value changes), ``_time`` (its column,
    else ``time``) and ``_diff`` (its column, else 1).

    A filled column is a slice of one array of its value, made once per task (and again when
    more rows come at once): a column of one value costs no memory per row, where a new array
    per batch would be written, page by page, 16 bytes a row."""

    def __init__(self, schema: pa.Schema, time: int) -> None:
        self._schema = schema
        self._time = time
        self._times = pa.array([], pa.uint64())
        self._ones = pa.array([], pa.int64())

    def __call__(self, rows: pa.Table) -> pa.Table:
        n = rows.num_rows
        if len(self._ones) < n:
            self._times = pa.array(np.full(n, self._time, np.uint64))
            self._ones = pa.array(np.ones(n, np.int64))
        if TIME not in rows.schema.names:
            rows = rows.append_column(TIME, self._times.slice(0, n))
        if DIFF not in rows.schema.names:
            rows = rows.append_column(DIFF, self._ones.slice(0, n))
        return shape_updates(rows, self._schema, safe_casts=True)


def _check_times(lo: int, hi: int, lower: int, upper: int | None) -> int:
    """``hi``, when the times ``lo..hi`` of updates lie in ``[lower, upper)`` (else
    ``InvalidUsage``) and leave room for an upper above them."""
    if lo < lower or (upper is not None and hi >= upper):
        raise InvalidUsage(
            f"_time {lo if lo < lower else hi} is not within [{lower}, "
            f"{'unbounded' if upper is None else upper})"
        )
    if hi >= _MAX_TIME:
        raise InvalidUsage(f"_time {hi} leaves no room for an upper above it")
    return hi


def _max_time(updates: pa.Table, lower: int, upper: int | None) -> int:
    """The greatest time of ``updates``, checked by ``_check_times``."""
    mm = pc.min_max(updates.column(TIME))
    return _check_times(int(mm["min"].as_py()), int(mm["max"].as_py()), lower, upper)


class _Groups:
    """Spark's batches with rows, as tables of at least ``limit`` bytes (the last: the rest)."""

    def __init__(self, batches: Iterator[pa.RecordBatch], limit: int) -> None:
        self._batches = batches
        self.limit = limit

    def __iter__(self) -> _Groups:
        return self

    def __next__(self) -> pa.Table:
        group: list[pa.RecordBatch] = []
        size = 0
        for batch in self._batches:
            if batch.num_rows:
                group.append(batch)
                size += batch.nbytes
            # Else it would stay alive while Spark makes the next.
            del batch
            if size >= self.limit:
                break
        if not group:
            raise StopIteration
        return pa.Table.from_batches(group)


def _part_bytes(updates: pa.Table, target: int) -> int:
    """How many bytes in memory of updates like ``updates`` encode to about ``target`` bytes (at
    least ``target``, at most ``_HELD_MAX`` times it), judged by how their first
    ``_SAMPLE_BYTES`` encode. A sample of a few MiB encodes a little larger for its size than a
    whole part (a dictionary and a footer of its own): parts come out a little under the
    target."""
    rows = max(1, updates.num_rows * _SAMPLE_BYTES // max(1, updates.nbytes))
    sample = updates.slice(0, rows)
    ratio = sample.nbytes / max(1, len(encode_part(sample)))
    return min(int(target * min(max(ratio, 1.0), _HELD_MAX)), _MAX_CONFIG_INT)


def _next_updates(groups: _Groups, shaped: _Updates) -> pa.Table | None:
    group = next(groups, None)
    return None if group is None else shaped(group)


@contextlib.contextmanager
def _task_client(o: Options, part_bytes: int) -> Iterator[persist.PersistClient]:
    """A client of the job's location whose writes cut parts of ``part_bytes`` in memory and
    encode them one at a time: a task has one core, as Spark's own writer does (Spark's tasks
    are the parallelism; more encoding threads only contend for it)."""
    config = persist.PersistConfig(part_target_bytes=part_bytes, io_concurrency=1)
    client = rt.run(persist.connect(o.blob, o.consensus, config=config))
    try:
        yield client
    finally:
        # Stops the heartbeats of the writer it resumed, without expiring it: it is the job's.
        rt.run(client.close())


def _write_task(
    job: Job, batches: Iterator[pa.RecordBatch], time: int, upper: int | None
) -> Written:
    """Writes a task's rows as one batch under the job's writer; ``upper`` None: just above its
    times. The rows go to blob as Spark hands them over, in parts that encode to about
    ``part_target_bytes`` (what the task's first rows encode to says how many rows that is): a
    task holds about one part's rows (at most ``_HELD_MAX`` times the target in memory) and a
    few of Spark's Arrow batches, whatever its partition's size. A task that fails deletes what
    it wrote."""
    o = job.options
    groups = _Groups(batches, _SAMPLE_BYTES)
    first = next(groups, None)
    if first is None:
        return Written(b"", job.expected_upper)  # no row: nothing is written
    lower = job.expected_upper
    timed = TIME in first.schema.names
    # Rows without _time are all at ``time``: checked once, not per row.
    hi = -1 if timed else _check_times(time, time, lower, upper)
    shaped = _Updates(job.schema, time)
    updates: pa.Table | None = shaped(first)
    del first
    part_bytes = _part_bytes(updates, o.part_target_bytes or _PART_TARGET_BYTES)
    groups.limit = min(_GROUP_BYTES, part_bytes // 4)
    with _task_client(o, part_bytes) as client:
        write = rt.run(client.resume_writer(o.shard, job.writer_id))
        builder = write.batch_builder(lower, upper)
        try:
            while updates is not None:
                if timed:
                    hi = max(hi, _max_time(updates, lower, upper))
                rt.run(builder.add(updates))
                # Else they would stay alive while Spark makes the next rows.
                updates = None
                updates = _next_updates(groups, shaped)
            batch_upper = hi + 1 if upper is None else upper
            written = rt.run(builder.finish(batch_upper))
        except BaseException:
            rt.run(builder.discard())
            raise
        return Written(written.to_bytes(), batch_upper)


def _written(messages: Sequence[WriterCommitMessage | None]) -> list[Written]:
    return [m for m in messages if isinstance(m, Written)]


def _batches(messages: Sequence[WriterCommitMessage | None]) -> list[persist.Batch]:
    return [persist.Batch.from_bytes(m.batch) for m in _written(messages) if m.batch]


async def _delete(client: persist.PersistClient, batches: list[persist.Batch]) -> None:
    for b in batches:
        await client.delete_batch(b)


async def _landed(client: persist.PersistClient, batches: list[persist.Batch]) -> bool:
    """After a commit that raised: whether its batches were appended all the same (an append
    whose outcome was unknown, that landed; it appends all of them or none), else deletes
    their data."""
    for b in batches:
        if await client.batch_appended(b):
            return True
    await _delete(client, batches)
    return False


async def _expire(client: persist.PersistClient, job: Job) -> None:
    try:
        write = await client.resume_writer(job.options.shard, job.writer_id)
    except persist.LeaseExpired:
        return
    await write.expire()


async def plan_write(options: Options, df_schema: StructType, *, streaming: bool) -> Job:
    """Settles a write on the driver: creates the shard if it is missing (else, with option
    mergeSchema, evolves it to take the DataFrame's columns), checks the columns, resolves the
    bounds and registers the job's writer."""
    o = options
    given = shard_schema_of(df_schema)
    lease = o.lease_duration_s or JOB_LEASE_S
    async with await persist.connect(o.blob, o.consensus) as client:
        if not o.shard:
            o = await _named(client, o, given)
        try:
            schema: pa.Schema | None = await client.shard_schema(o.shard)
        except InvalidUsage:
            schema = None  # a missing shard is created with the DataFrame's schema
        if schema is not None and o.merge_schema:
            # The writer opens at the version that takes the DataFrame, even if the shard
            # evolved again meanwhile (its rows are shown in every later version).
            schema = await _merge(client, o.shard, df_schema)
        if schema is not None:
            _check_columns(df_schema.names, schema, streaming=streaming)
        write = await client.open_writer(
            o.shard, given if schema is None else schema, "spark write", lease_duration_s=lease
        )
        _check_columns(df_schema.names, write.schema, streaming=streaming)
        upper = await write.fetch_recent_upper()
        if upper is None:
            await write.expire()
            raise InvalidUsage(f"shard {o.shard} is finished: nothing can be written to it")
        expected = upper if o.expected_upper is None else o.expected_upper
        if not streaming and expected != upper:
            await write.expire()
            raise UpperMismatch(expected, upper)
        time = expected if o.time is None else o.time
        if o.new_upper is not None and o.new_upper <= expected:
            await write.expire()
            raise InvalidUsage(f"new_upper {o.new_upper} must be above expected_upper {expected}")
        if not streaming and (time < expected or (o.new_upper is not None and time >= o.new_upper)):
            await write.expire()
            raise InvalidUsage(f"time {time} is not within [{expected}, {o.new_upper})")
        # The job's now: its tasks resume it and its commit or abort expires it, so closing
        # this client must not.
        write.detach()
        return Job(o, write.schema, write.writer_id, expected, o.new_upper, time)


async def _named(client: persist.PersistClient, o: Options, schema: pa.Schema) -> Options:
    """``o`` writing to a new shard named ``o.name`` (created with ``schema``), or to the shard
    a racing job created under that name first."""
    assert o.name is not None
    try:
        sid = await client.create_shard(o.name, schema)
    except InvalidUsage:
        sid = await client.shard_id(o.name)  # taken meanwhile: that shard it is
    return dataclasses.replace(o, shard=str(sid))


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("persist").mode("append")``: all tasks' batches in one
    ``compare_and_append_batch(expected_upper, new_upper)``, or nothing."""

    def __init__(self, job: Job) -> None:
        self._job = job

    @rt.presented
    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        return _write_task(self._job, iterator, self._job.time, self._job.new_upper)

    @rt.presented
    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rt.run(self._commit(messages))

    async def _commit(self, messages: list[WriterCommitMessage | None]) -> None:
        job = self._job
        o = job.options
        batches = _batches(messages)
        new_upper = job.new_upper
        if new_upper is None:
            new_upper = max([job.expected_upper + 1, *(m.upper for m in _written(messages))])
        async with await persist.connect(o.blob, o.consensus) as client:
            try:
                write = await client.resume_writer(o.shard, job.writer_id)
                try:
                    await write.compare_and_append_batch(batches, job.expected_upper, new_upper)
                finally:
                    await write.expire()
            except BaseException as exc:
                if await _landed(client, batches) and isinstance(exc, Exception):
                    return  # the job's rows are in: it succeeded, whatever the error said
                raise

    @rt.presented
    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        rt.run(self._abort(messages))

    async def _abort(self, messages: list[WriterCommitMessage | None]) -> None:
        o = self._job.options
        async with await persist.connect(o.blob, o.consensus) as client:
            await _delete(client, _batches(messages))
            await _expire(client, self._job)


def _batch_id() -> int:
    ctx = TaskContext.get()
    raw = None if ctx is None else ctx.getLocalProperty("streaming.sql.batchId")
    if raw is None:
        raise InvalidUsage("a streaming write task does not know its micro-batch id")
    return int(raw)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("persist")``: micro-batch ``b`` at time ``time_offset + b``,
    committed exactly once (a replayed batch id finds the upper past it and is dropped)."""

    def __init__(self, job: Job) -> None:
        self._job = job

    def _time(self, batch_id: int) -> int:
        return self._job.options.time_offset + batch_id

    @rt.presented
    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        t = self._time(_batch_id())
        job = self._job
        o = job.options
        with rt.client(o) as client:
            upper = rt.run(client.frontiers(o.shard))[1]
        # A replay of a committed batch id (the upper is past t) writes nothing.
        if upper is None or upper > t:
            for _ in iterator:
                pass
            return Written(b"", t + 1)
        # All its rows at t: the commit appends it from whatever upper it finds (at most t).
        at_t = Job(o, job.schema, job.writer_id, t, t + 1, t)
        return _write_task(at_t, iterator, t, t + 1)

    @rt.presented
    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rt.run(self._commit(messages, batchId))

    async def _commit(self, messages: list[WriterCommitMessage | None], batch_id: int) -> None:
        job = self._job
        o = job.options
        t = self._time(batch_id)
        batches = _batches(messages)
        async with await persist.connect(o.blob, o.consensus) as client:
            try:
                write = await client.resume_writer(o.shard, job.writer_id)
                while True:
                    upper = await write.fetch_recent_upper()
                    if upper is None or upper > t:
                        # Committed before: this is a replay after a restart.
                        await _delete(client, batches)
                        return
                    try:
                        await write.compare_and_append_batch(batches, upper, t + 1)
                        return
                    except UpperMismatch:
                        continue
            except BaseException as exc:
                if await _landed(client, batches) and isinstance(exc, Exception):
                    return  # the micro-batch is in: committed, whatever the error said
                raise

    @rt.presented
    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        o = self._job.options

        async def run() -> None:
            async with await persist.connect(o.blob, o.consensus) as client:
                await _delete(client, _batches(messages))

        rt.run(run())
