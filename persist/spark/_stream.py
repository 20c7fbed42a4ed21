"""Streaming reads in Spark: micro-batches of a shard's updates between frontiers.

The stream's reader lives in the driver's Python worker for the whole query; each micro-batch's
splits are planned there (``ReadHandle.snapshot`` / ``splits_between``) and read on the
executors by ``persist.spark._read.read_split``, as a batch scan's are. Offsets, and the reads
between two of them, are ``persist.spark._offsets``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

import persist
import persist.spark._runtime as rt
from persist.errors import InvalidUsage
from persist.spark._offsets import Position, next_position, reads, settled
from persist.spark._options import Options
from persist.spark._read import SplitPartition, read_split, schema_at

__all__ = ["StreamReader"]


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of a shard's updates. An offset ``{"frontier": f}`` says everything below
    ``f`` has been emitted; one that also has ``until`` and ``key`` is inside a bucket of updates
    cut by key (``persist.spark._offsets``). The first micro-batch (from frontier 0) starts with
    the snapshot at ``as_of`` (default: the upper - 1 when the query started) and continues
    with the updates after it; each later one the updates with ``start <= _time < end``. Each
    depends only on its offsets, so a replay after a restart reads the same rows.

    Read limits: with option ``maxRowsPerTrigger`` the default limit is ``ReadMaxRows`` of it,
    else ``ReadAllAvailable``; Spark passes one of the two (``ReadAllAvailable`` for
    ``Trigger.Once``). Under ``ReadMaxRows(n)`` each micro-batch is cut from the parts' row
    counts, times and key indexes alone (``_offsets.next_position``; docs/spark.md says what
    that guarantees). ``Trigger.AvailableNow`` runs micro-batches under the limit up to the
    upper seen when the query started.

    This object lives in the driver's Python worker for the whole query, with a reader whose
    since follows the committed frontier (minus one).
    """

    def __init__(self, options: Options, spark_schema: StructType) -> None:
        self._options = options
        self._spark_schema = spark_schema
        self._client: persist.PersistClient | None = None
        self._read: persist.ReadHandle | None = None
        # The upper the last latestOffset saw (reported as the latest offset).
        self._upper: int | None = None
        # Trigger.AvailableNow: the upper when the query started, past which no batch reaches.
        self._target: int | None = None

    def _handle(self) -> persist.ReadHandle:
        return rt.run(self._open())

    async def _open(self) -> persist.ReadHandle:
        if self._read is None:
            o = self._options
            self._client = await persist.connect(o.blob, o.consensus)
            # At the schema version the DataFrame was loaded at (Spark's schema for the
            # query): an evolution while the query runs changes nothing it reads.
            schema = await schema_at(self._client, o.shard_id(), o.schema_version)
            self._read = await self._client.open_leased_reader(
                o.shard_id(), schema, purpose="spark stream", lease_duration_s=o.lease_duration_s
            )
        return self._read

    def _position(self, offset: dict[str, Any], read: persist.ReadHandle) -> Position:
        return Position.parse(offset).in_version(read.schema_version)

    def initialOffset(self) -> dict[str, Any]:
        return Position(0).to_offset()

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self._options.max_rows_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if isinstance(limit, ReadAllAvailable):
            max_rows = None
        elif isinstance(limit, ReadMaxRows) and limit.max_rows >= 1:
            max_rows = limit.max_rows
        else:  # Spark passes only our default limit or ReadAllAvailable
            raise InvalidUsage(f"the persist source does not support the read limit {limit!r}")
        return rt.run(self._latest(start, max_rows)).to_offset()

    async def _latest(self, offset: dict[str, Any], max_rows: int | None) -> Position:
        read = await self._open()
        given = Position.parse(offset)
        start = given.in_version(read.schema_version)
        assert self._client is not None
        _, upper = await self._client.frontiers(self._options.shard_id())
        if upper is None:  # finished: nothing is ever admitted past what was
            return given
        if self._target is not None:
            upper = min(upper, self._target)
        self._upper = upper
        as_of = self._options.as_of
        end = settled(start, upper, max_rows, as_of)
        if end is None:
            assert max_rows is not None
            bounds = await read.row_bounds(start.frontier, upper)
            end = next_position(start, upper, max_rows, as_of, bounds)
        # Nothing new: the offset as Spark recorded it (Spark tells offsets apart by JSON).
        return given if end == start else end.in_version(read.schema_version)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return None if self._upper is None else Position(self._upper).to_offset()

    def prepareForTriggerAvailableNow(self) -> None:
        self._handle()
        assert self._client is not None
        _, self._target = rt.run(self._client.frontiers(self._options.shard_id()))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return rt.run(self._plan(start, end))

    async def _plan(self, first: dict[str, Any], last: dict[str, Any]) -> list[SplitPartition]:
        read = await self._open()
        start, end = self._position(first, read), self._position(last, read)
        n = self._options.splits or 1
        splits: list[persist.Split] = []
        for r in reads(start, end, self._options.as_of):
            lo, hi = r.lower_key, r.upper_key
            if r.snapshot:
                splits += await read.snapshot(r.upper - 1, n, lower_key=lo, upper_key=hi)
            else:
                splits += await read.splits_between(r.lower, r.upper, n, lower_key=lo, upper_key=hi)
        return [SplitPartition(s.to_bytes()) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_split(self._options, partition.value, self._spark_schema, ())

    def commit(self, end: dict[str, Any]) -> None:
        frontier = Position.parse(end).frontier
        if frontier > 0:
            read = self._handle()
            if read.since is None or read.since < frontier - 1:
                rt.run(read.downgrade_since(frontier - 1))

    def stop(self) -> None:
        if self._client is not None:
            rt.run(self._client.close())
            self._client = None
