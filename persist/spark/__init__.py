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

import dataclasses
import logging
import os
from typing import Any

import pyarrow as pa

from persist.errors import install_hint

try:
    import pyspark
except ImportError:  # pragma: no cover - depends on the install
    raise ImportError(
        "persist.spark needs persist's 'spark' extra (pyspark is not installed): "
        + install_hint("spark")
    ) from None
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
from persist.core.frontier import newest_readable
from persist.errors import InvalidUsage
from persist.spark._driver import check_workers, explain_save_modes
from persist.spark._native import read, release
from persist.spark._options import Options, parse_options, with_shard
from persist.spark._read import PushingReader, Reader, schema_at
from persist.spark._stream import StreamReader
from persist.spark._types import spark_schema
from persist.spark._write import BatchWriter, StreamWriter, plan_write

__all__ = ["PersistDataSource", "read", "register", "release"]

_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
_log = logging.getLogger("persist.spark")


class PersistDataSource(DataSource):
    """The ``persist`` data source (options: see ``docs/spark.md``).

    A batch read's ``as_of`` is resolved when the DataFrame is loaded (``schema``, called once
    by ``load()``): Spark keeps this object, and the read plan made from it, for every later
    action on the DataFrame, which so reads the same snapshot. So is the shard's schema
    version: every read of the DataFrame (a stream's too) shows its rows in the schema of the
    version current at the load, whatever evolutions come later."""

    # ``register`` registers a subclass that sets these from the session it is given.
    # Whether this Spark plans a Python source's read anew for every scan (then pushed filters
    # can't leak into a later query); None: not known, judged by the pyspark version.
    _scoped_read_plans: bool | None = None
    # The cores a default split count aims to keep busy (None: this machine's CPU count).
    _parallelism: int | None = None

    @rt.presented
    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self._options: Options = rt.run(with_shard(parse_options(options)))

    @classmethod
    def name(cls) -> str:
        return "persist"

    @rt.presented
    def schema(self) -> StructType:
        o = self._options
        arrow, version, as_of, empty = rt.run(_load(o))
        self._options = dataclasses.replace(o, as_of=as_of, empty=empty, schema_version=version)
        return spark_schema(arrow, updates=o.mode == "updates")

    @rt.presented
    def reader(self, schema: StructType) -> DataSourceReader:
        o = self._options
        cores = self._parallelism or os.cpu_count() or 1
        if o.pushdown or self._scoped_read_plans:
            if _pushdown_is_safe(self._scoped_read_plans):
                return PushingReader(o, schema, cores, rt.run(_shard_schema(o)))
            if o.pushdown:
                _log.warning(
                    "option pushdown ignored: Spark %s keeps a Python source's first read plan "
                    "for later queries on the DataFrame, so pushed filters would leak into them",
                    pyspark.__version__,
                )
        return Reader(o, schema, cores)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        o = self._options
        if o.mode != "updates" or not o.mode_given:
            # Raised from the reader's first call: pyspark 4.3 masks an error raised here
            # (its clean-up then stops a reader that was never made).
            return _Refused(
                InvalidUsage(
                    'a streaming read needs .option("mode", "updates"): its rows are updates '
                    "(with _time and _diff)"
                )
            )
        # A stream's snapshot time is chosen when the query starts, not when it was loaded.
        return StreamReader(dataclasses.replace(o, as_of=self._given_as_of(), empty=False), schema)

    @rt.presented
    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        _check_append(overwrite)
        return BatchWriter(rt.run(plan_write(self._options, schema, streaming=False)))

    @rt.presented
    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        _check_append(overwrite)
        return StreamWriter(rt.run(plan_write(self._options, schema, streaming=True)))

    def _given_as_of(self) -> int | None:
        given = parse_options(self.options)
        # An instant was resolved once, when this source was made.
        return self._options.as_of if given.as_of_at is not None else given.as_of


class _Refused(DataSourceStreamReader):
    """A stream that fails with ``error`` as soon as Spark asks it anything."""

    def __init__(self, error: InvalidUsage) -> None:
        self._error = error

    @rt.presented
    def initialOffset(self) -> dict[str, int]:
        raise self._error

    @rt.presented
    def latestOffset(self, *args: Any) -> dict[str, int]:
        raise self._error

    def read(self, partition: Any) -> Any:
        raise self._error

    def stop(self) -> None:
        pass


def _pushdown_is_safe(scoped: bool | None) -> bool:
    if scoped is not None:
        return scoped
    # pyspark 4.3 and older keep the plan on the relation (PythonDataSourceV2.readInfo);
    # Spark's main line keeps it on the scan.
    version = tuple(int(p) for p in pyspark.__version__.split(".")[:2] if p.isdigit())
    return version > (4, 3)


def _check_append(overwrite: bool) -> None:
    if overwrite:
        raise InvalidUsage('persist only appends: write with .mode("append")')


async def _load(o: Options) -> tuple[pa.Schema, int, int | None, bool]:
    """The shard's current schema and its version (every read of the DataFrame shows its rows
    in it), and the snapshot a batch read of it takes: ``as_of`` (given, else the upper - 1)
    and whether it is empty (nothing written, no ``as_of``)."""
    import persist

    async with await persist.connect(o.blob, o.consensus) as client:
        version, schema = (await client.schemas(o.shard_id()))[-1]
        if o.as_of is not None:
            return schema, version, o.as_of, False
        _, upper = await client.frontiers(o.shard_id())
        # A finished shard (upper None) has no default either, but isn't empty: planning says so.
        return schema, version, newest_readable(upper), upper == 0


async def _shard_schema(o: Options) -> Any:
    import persist

    async with await persist.connect(o.blob, o.consensus) as client:
        return await schema_at(client, o.shard_id(), o.schema_version)


def _scoped_read_plans(spark: SparkSession) -> bool:
    """Whether ``spark`` keeps a Python source's read plan on each scan (Spark's main line: a
    ``readInfo`` field of ``PythonScanBuilder``) rather than on the relation, where a plan made
    with one query's pushed filters serves the next query too (Spark 4.3)."""
    try:
        jvm: Any = spark._jvm
        builder = jvm.java.lang.Class.forName(
            "org.apache.spark.sql.execution.datasources.v2.python.PythonScanBuilder"
        )
        return any(f.getName() == "readInfo" for f in builder.getDeclaredFields())
    except Exception:  # Spark Connect (no JVM here) or another layout: don't push
        return False


def _default_parallelism(spark: SparkSession) -> int | None:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect has no SparkContext
        return None


def register(spark: SparkSession) -> None:
    """Registers the ``persist`` source on ``spark``: reads then split a snapshot for
    ``spark.defaultParallelism`` cores by default, and, where this Spark plans each scan anew,
    filters are pushed to persist (``spark.sql.python.filterPushdown.enabled`` is set).

    First it runs a small job on the executors (once per SparkContext): ``InvalidUsage``, naming
    ``PYSPARK_PYTHON`` / ``spark.pyspark.python``, when Spark's Python workers can't import
    persist."""
    check_workers(spark)
    spark.conf.set(_PUSHDOWN_CONF, "true")
    # Made here so that it carries this session's facts: cloudpickle sends it by value.
    source = type(
        "PersistDataSource",
        (PersistDataSource,),
        {
            "__module__": __name__,
            "__doc__": PersistDataSource.__doc__,
            "_scoped_read_plans": _scoped_read_plans(spark),
            "_parallelism": _default_parallelism(spark),
        },
    )
    spark.dataSource.register(source)


# Spark's refusal of its default save mode recommends Overwrite: say what persist takes.
explain_save_modes()
