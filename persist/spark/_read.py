"""Reading shards in Spark: batch scans of a snapshot's splits and micro-batches of a stream.

Planning (on the driver's Python worker) opens a leased reader and cuts the snapshot into key-range
splits (``PersistClient.plan_snapshot``; a stream's ``ReadHandle.snapshot`` / ``splits_between``);
only the encoded splits travel to the executors, which fetch them straight from blob as record
batches. Each split is exact on its own, so every partition's output is final without any shuffle.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.types import StructType

import persist
import persist.spark._runtime as rt
from persist.core.arrow.updates import as_rows
from persist.errors import InvalidUsage
from persist.spark._options import Options
from persist.spark._types import arrow_for_spark

__all__ = ["PushingReader", "Reader", "SplitPartition", "read_split", "schema_at"]

# A batch read of at least this many bytes of parts says, once per process, that
# ``persist.spark.read`` would be faster: here every column of every row passes through a Python
# worker, where Spark's own Parquet reader prunes columns and skips row groups (TPC-H at SF1 ran
# about four times faster that way).
HINT_BYTES = 128 << 20
# Spark's Python workers leave logging as it comes (the root logger at WARNING): this logger lets
# its INFO through unless the program set its level, so that Spark's Python worker logs
# (``spark.sql.pyspark.worker.logging.enabled``) show the hint.
_hints = logging.getLogger("persist.spark.hint")
if _hints.level == logging.NOTSET:
    _hints.setLevel(logging.INFO)
_hinted = False


class SplitPartition(InputPartition):
    """One split, encoded (``Split.to_bytes``) as its ``value``."""


# --- filters -------------------------------------------------------------------------------------

_COMPARE = {
    EqualTo: pc.equal,
    GreaterThan: pc.greater,
    GreaterThanOrEqual: pc.greater_equal,
    LessThan: pc.less,
    LessThanOrEqual: pc.less_equal,
}


@dataclass(frozen=True)
class _Pushed:
    """A filter taken from Spark: ``column op value`` (``op`` ``in`` for IN)."""

    column: str
    op: str
    value: Any


def _pushable(f: Filter, schema: pa.Schema) -> _Pushed | None:
    """The filter as one persist evaluates exactly as Spark would, else None (Spark keeps it)."""
    attribute: tuple[str, ...] = getattr(f, "attribute", ())
    if not isinstance(f, (*_COMPARE, In, IsNull, IsNotNull)) or len(attribute) != 1:
        return None
    name = attribute[0]
    if name not in schema.names:
        return None
    if isinstance(f, IsNull | IsNotNull):
        return _Pushed(name, type(f).__name__, None)
    typ = schema.field(name).type
    # Spark orders NaN above every number and equal to itself; Arrow compares by IEEE rules.
    if pa.types.is_floating(typ) or pa.types.is_timestamp(typ) or pa.types.is_time(typ):
        return None
    value: Any = getattr(f, "value", None)
    values = value if isinstance(f, In) else (value,)
    try:
        scalars = [pa.scalar(v, typ) for v in values]
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    if any(not s.is_valid for s in scalars):
        return None  # comparisons with null are Spark's own business
    if isinstance(f, In):
        return _Pushed(name, "in", pa.array([s.as_py() for s in scalars], typ))
    return _Pushed(name, type(f).__name__, scalars[0])


def _apply(table: pa.Table, filters: Sequence[_Pushed]) -> pa.Table:
    if not filters:
        return table
    mask = None
    for f in filters:
        col = table.column(f.column)
        if f.op == "in":
            m = pc.is_in(col, value_set=f.value, skip_nulls=True)
        elif f.op == "IsNull":
            m = pc.is_null(col)
        elif f.op == "IsNotNull":
            m = pc.is_valid(col)
        else:
            compare = {c.__name__: fn for c, fn in _COMPARE.items()}[f.op]
            m = compare(col, f.value)
        mask = m if mask is None else pc.and_kleene(mask, m)
    return table.filter(mask, null_selection_behavior="drop")


# --- reading a split -----------------------------------------------------------------------------


def _rows(updates: pa.Table, mode: str, out: pa.Schema) -> pa.Table:
    """A split's consolidated updates as Spark rows: each row ``_diff`` times (``contents``), or
    the updates with ``_time``/``_diff`` as bigint (``updates``)."""
    if mode == "updates":
        return updates.cast(out)
    data = as_rows(updates, ": mode=contents can't show it (read it with mode=updates)")
    return data.cast(out)


def read_split(
    options: Options, split_bytes: bytes, spark_schema: StructType, filters: Sequence[_Pushed]
) -> Iterator[pa.RecordBatch]:
    """The Spark rows of one split, fetched in bounded pieces. The reader that made the split is
    heartbeated while this task reads (a job of any length keeps its data)."""
    split = persist.Split.from_bytes(split_bytes)
    out = arrow_for_spark(spark_schema)
    mode = "updates" if split.updates_from is not None else options.mode
    with rt.client(options) as client:
        fallback = rt.run(_hold(client, split, options))
        try:
            # Contents are a multiset of rows: a piece without retractions needs no merge (its
            # rows are repeated by their diffs either way), only one with them does.
            pieces = _pieces(client, split, consolidate=mode != "contents")
            for piece in rt.iterate(pieces):
                rows = _rows(_apply(piece, filters), mode, out)
                yield from rows.to_batches()
        finally:
            if fallback is not None:
                rt.run(fallback.expire())


async def _hold(
    client: persist.PersistClient, split: persist.Split, options: Options
) -> persist.ReadHandle | None:
    """Heartbeats the reader that made ``split``; if its lease ran out (a DataFrame used again
    after ``lease_duration_s`` with no task reading it), registers a reader of the task's own
    that holds the split's times, if the shard's since still allows, and returns it (the task
    expires it). The parts may still be gone then: the read fails, never returns other rows."""
    try:
        await client.resume_reader(split.shard_id, split.reader_id)
        return None
    except persist.LeaseExpired:
        pass
    needed = split.as_of if split.updates_from is None else split.updates_from
    read = await client.open_leased_reader(
        split.shard_id, purpose="spark scan (held again)", lease_duration_s=options.lease_duration_s
    )
    if read.since is None or read.since > needed:
        await read.expire()
        raise InvalidUsage(
            f"the snapshot of shard {split.shard_id} as of {split.as_of} that this DataFrame "
            f"was planned at is no longer held: its reader's lease ran out with no task reading, "
            f"and the shard's since is now {read.since}. Load the DataFrame again (or keep "
            "using it within lease_duration_s)"
        )
    return read


async def _pieces(
    client: persist.PersistClient, split: persist.Split, *, consolidate: bool
) -> AsyncIterator[pa.Table]:
    async for rb in client.fetch_split_batches(split, consolidate=consolidate):
        yield pa.Table.from_batches([rb])


# --- batch reads ---------------------------------------------------------------------------------


class Reader(DataSourceReader):
    """A batch scan: the shard's contents (or consolidated updates) as of one time.

    ``options.as_of`` is the snapshot's time (pinned when the DataFrame was loaded); None
    (a user-given schema: nothing was resolved at load) plans at the upper - 1 as it is now.
    ``parallelism`` is how many cores the default split count aims to keep busy."""

    def __init__(self, options: Options, spark_schema: StructType, parallelism: int) -> None:
        self._options = options
        self._spark_schema = spark_schema
        self._parallelism = parallelism
        self._filters: list[_Pushed] = []

    @rt.presented
    def partitions(self) -> Sequence[InputPartition]:
        return rt.run(self._plan())

    async def _plan(self) -> list[SplitPartition]:
        o = self._options
        if o.empty:
            return []
        async with await persist.connect(o.blob, o.consensus) as client:
            # The read never waits (as_of >= upper is refused) and a shard with nothing written
            # reads empty. Every split is kept: the scan has exactly as many partitions. The
            # reader outlives this planning process (the tasks heartbeat it): detached, so
            # closing the client does not expire it.
            plan = await client.plan_snapshot(
                o.shard_id(),
                as_of=o.as_of,
                splits=o.splits,
                parallelism=self._parallelism,
                wait=False,
                empty_if_unwritten=True,
                purpose="spark scan",
                lease_duration_s=o.lease_duration_s,
            )
            splits: Sequence[persist.Split] = plan.splits
            reader = plan.reader
            if reader is not None and o.schema_version not in (None, reader.schema_version):
                # The shard evolved since the DataFrame was loaded: it still shows the schema
                # Spark took then, read by a reader of that version (as many splits).
                assert plan.as_of is not None
                try:
                    splits = await _at_version(client, o, plan.as_of, len(splits))
                finally:
                    await reader.expire()
            elif reader is not None:
                reader.detach()
            _hint(o, splits)
            return [SplitPartition(s.to_bytes()) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if partition.value is None:  # Spark reads one such partition when planning gave none
            return iter(())
        return rt.presented_rows(
            read_split(self._options, partition.value, self._spark_schema, self._filters)
        )


def _hint(o: Options, splits: Sequence[persist.Split]) -> None:
    """Says once per process, at INFO, that a read this large would be faster natively."""
    global _hinted
    size = sum({p.key: p.size for s in splits for p in s.parts}.values())
    if _hinted or size < HINT_BYTES:
        return
    _hinted = True
    shard = o.name or o.shard
    _hints.info(
        "persist.spark: this read of shard %s passes %d MiB of parts through Spark's Python "
        "workers, every column of every row; persist.spark.read(spark, shard=%r, ...) reads "
        "the same snapshot with Spark's own Parquet reader (column pruning, row groups "
        "skipped by value), several times faster for a scan this large. See docs/spark.md, "
        '"Native reads" (said once per process)',
        shard,
        size >> 20,
        shard,
    )


async def schema_at(client: persist.PersistClient, shard: str, version: int | None) -> pa.Schema:
    """The shard's schema in ``version`` (None: its current one)."""
    schemas = await client.schemas(shard)
    if version is None:
        return schemas[-1][1]
    return dict(schemas)[version]


async def _at_version(
    client: persist.PersistClient, o: Options, as_of: int, n: int
) -> list[persist.Split]:
    """The snapshot at ``as_of`` in ``n`` splits, held by a new reader (detached: the tasks
    heartbeat it) at the schema version the DataFrame was loaded at. The caller's own plan
    holds the since at ``as_of`` meanwhile."""
    schema = await schema_at(client, o.shard_id(), o.schema_version)
    read = await client.open_leased_reader(
        o.shard_id(), schema, purpose="spark scan", lease_duration_s=o.lease_duration_s
    )
    try:
        splits = await read.snapshot(as_of, n)
        if read.since is not None and read.since < as_of:
            await read.downgrade_since(as_of)
    except BaseException:
        await read.expire()
        raise
    read.detach()
    return splits


class PushingReader(Reader):
    """A ``Reader`` that takes comparisons on data columns from Spark and evaluates them itself
    (only when the session allows Python filter pushdown: Spark refuses the class otherwise)."""

    def __init__(
        self, options: Options, spark_schema: StructType, parallelism: int, shard: pa.Schema
    ) -> None:
        super().__init__(options, spark_schema, parallelism)
        self._shard = shard

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for f in filters:
            pushed = _pushable(f, self._shard)
            if pushed is None:
                yield f
            else:
                self._filters.append(pushed)
