"""``persist.spark``: shards as a PySpark (>= 4.3) data source named ``"persist"``.

    import persist.spark
    persist.spark.register(spark)
    df = spark.read.format("persist").option("shard", shard_id).load()
    df.write.format("persist").option("shard", other).mode("append").save()

Batch reads are a snapshot's key-range splits, read on the executors straight from blob; batch
writes commit every task's batch in one ``compare_and_append_batch``; streams read micro-batches
of updates between frontiers and write each micro-batch exactly once by its id. The contract is
``docs/spark.md``; how it is built is in ``docs/design.md`` ("Spark").
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

import persist.spark._runtime as rt
from persist.errors import InvalidUsage
from persist.spark._options import Options, parse_options
from persist.spark._read import PushingReader, Reader
from persist.spark._stream import StreamReader
from persist.spark._types import spark_schema
from persist.spark._write import BatchWriter, StreamWriter, plan_write

__all__ = ["PersistDataSource", "register"]

_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


class PersistDataSource(DataSource):
    """The ``persist`` data source (options: see ``docs/spark.md``)."""

    # Set on the class ``register`` registers: the session then allows pushed filters.
    _pushdown = False

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self._options: Options = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return "persist"

    def schema(self) -> StructType:
        o = self._options
        arrow = rt.run(_shard_schema(o))
        return spark_schema(arrow, updates=o.mode == "updates")

    def reader(self, schema: StructType) -> DataSourceReader:
        o = self._options
        if self._pushdown or o.pushdown:
            return PushingReader(o, schema, rt.run(_shard_schema(o)))
        return Reader(o, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        o = self._options
        if o.mode != "updates" or not o.mode_given:
            raise InvalidUsage(
                'a streaming read needs .option("mode", "updates"): its rows are updates '
                "(with _time and _diff)"
            )
        return StreamReader(o, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        _check_append(overwrite)
        return BatchWriter(rt.run(plan_write(self._options, schema, streaming=False)))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        _check_append(overwrite)
        return StreamWriter(rt.run(plan_write(self._options, schema, streaming=True)))


def _check_append(overwrite: bool) -> None:
    if overwrite:
        raise InvalidUsage('persist only appends: write with .mode("append")')


async def _shard_schema(o: Options) -> Any:
    import persist

    async with await persist.connect(o.blob, o.consensus) as client:
        return await client.shard_schema(o.shard)


class _RegisteredSource(PersistDataSource):
    _pushdown = True


def register(spark: SparkSession) -> None:
    """Registers the ``persist`` source on ``spark`` and allows Python filter pushdown there
    (comparisons on data columns are then evaluated by persist, not Spark)."""
    spark.conf.set(_PUSHDOWN_CONF, "true")
    spark.dataSource.register(_RegisteredSource)
