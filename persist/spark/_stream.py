"""Streaming reads in Spark: micro-batches of a shard's updates between frontiers.

The stream's reader lives in the driver's Python worker for the whole query; each micro-batch's
splits are planned there (``ReadHandle.snapshot`` / ``splits_between``) and read on the
executors by ``persist.spark._read.read_split``, as a batch scan's are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import StructType

import persist
import persist.spark._runtime as rt
from persist.errors import InvalidUsage
from persist.spark._options import Options
from persist.spark._read import SplitPartition, read_split

__all__ = ["StreamReader"]


class StreamReader(DataSourceStreamReader):
    """Micro-batches of a shard's updates. Offsets are ``{"frontier": f}``: everything below
    ``f`` has been emitted. The first micro-batch (from frontier 0) is the snapshot at ``as_of``
    (default: its end frontier - 1, which is the upper - 1 when the query started) plus the
    updates after it; each later one the updates with ``start <= _time < end``. Each depends
    only on its offsets, so a replay after a restart reads the same rows.

    This object lives in the driver's Python worker for the whole query, with a reader whose
    since follows the committed frontier (minus one).
    """

    def __init__(self, options: Options, spark_schema: StructType) -> None:
        self._options = options
        self._spark_schema = spark_schema
        self._client: persist.PersistClient | None = None
        self._read: persist.ReadHandle | None = None
        self._latest = 0

    def _handle(self) -> persist.ReadHandle:
        return rt.run(self._open())

    async def _open(self) -> persist.ReadHandle:
        if self._read is None:
            o = self._options
            self._client = await persist.connect(o.blob, o.consensus)
            self._read = await self._client.open_leased_reader(
                o.shard, purpose="spark stream", lease_duration_s=o.lease_duration_s
            )
        return self._read

    def initialOffset(self) -> dict[str, int]:
        return {"frontier": 0}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        # Every micro-batch takes all that is final: the limit (Spark's default, all
        # available) is not consulted.
        self._handle()
        assert self._client is not None
        _, upper = rt.run(self._client.frontiers(self._options.shard))
        if upper is None:  # finished: nothing follows the last frontier seen
            return {"frontier": self._latest}
        as_of = self._options.as_of
        if as_of is not None and upper <= as_of:
            return {"frontier": 0}  # the snapshot at as_of is not readable yet
        self._latest = upper
        return {"frontier": upper}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return rt.run(self._plan(int(start["frontier"]), int(end["frontier"])))

    async def _plan(self, start: int, end: int) -> list[SplitPartition]:
        read = await self._open()
        n = self._options.splits or 1
        splits: list[persist.Split] = []
        if start == 0:
            as_of = end - 1 if self._options.as_of is None else self._options.as_of
            if as_of >= end:
                raise InvalidUsage(f"as_of {as_of} is not below the shard's upper {end}")
            splits += await read.snapshot(as_of, n)
            start = as_of + 1
        if start < end:
            splits += await read.splits_between(start, end, n)
        return [SplitPartition(s.to_bytes()) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_split(self._options, partition.value, self._spark_schema, ())

    def commit(self, end: dict[str, int]) -> None:
        frontier = int(end["frontier"])
        if frontier > 0:
            read = self._handle()
            if read.since is None or read.since < frontier - 1:
                rt.run(read.downgrade_since(frontier - 1))

    def stop(self) -> None:
        if self._client is not None:
            rt.run(self._client.close())
            self._client = None
