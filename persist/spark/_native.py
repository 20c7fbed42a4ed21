"""``persist.spark.read``: a snapshot read by Spark's own Parquet reader over persist's parts.

The driver plans the scan (``PersistClient.plan_scan``: the part files, the inline parts, and
whether the snapshot needs a ``_time`` filter or a consolidation) and holds it with a leased
reader, heartbeated from this process's persist loop until ``release(df)``, the session's stop,
or the process's exit. Spark then reads the files itself (column pruning, predicate pushdown,
its own partitioning); persist adds only what the plan says: ``_time <= as_of`` where a part
holds later times, a ``groupBy`` summing ``_diff`` where retractions or multiplicities may exist.
Parts written in earlier schema versions are read per version, with that version's columns, and
shown in the plan's (the shard's current schema when ``read`` is called) by field id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

import persist
from persist.bridge import LoopThread
from persist.core.arrow.updates import DIFF, TIME
from persist.core.read.scan import Consolidation, ScanPart
from persist.errors import InvalidUsage
from persist.scan import ScanPlan
from persist.spark._options import Options, parse_options, with_shard
from persist.spark._types import arrow_for_spark, spark_schema

__all__ = ["read", "release"]

_log = logging.getLogger("persist.spark")

# The column holding a row's digest while retractions are matched.
_DIGEST = "_persist_digest"
# Above this many rows touched by retractions (or multiplicities), a read sums every part that
# is not untouched on every action instead of keeping the touched rows' sums as local data.
_TOUCHED_ROWS = 1_000_000
# Up to this many updates, and Parquet bytes, in the parts that are not untouched (before the
# time filter), read() sums them all in the driver: every action then reads only the untouched
# parts' files. (Bytes too: the rows of a wide shard are kept in the driver's memory.)
_LOCAL_ROWS = 1_000_000
_LOCAL_BYTES = 32 << 20
# How often the hold checks whether its session stopped.
_WATCH_S = 5.0
# Parquet's reader checks each page's CRC-32, where a part carries them (older parts of one row
# group carry none and read unchecked).
_VERIFY_PAGES = {"parquet.page.verify-checksum.enabled": "true"}
# Options of a batch read that this path takes (the rest are the Python source's).
_NATIVE = frozenset(
    {"shard", "name", "blob", "consensus", "as_of", "mode", "lease_duration_s", "verify"}
)


@dataclass
class _Hold:
    """A planned scan held for one DataFrame: its client (whose loop heartbeats the reader)."""

    client: persist.PersistClient
    plan: ScanPlan
    session: SparkSession


_holds: dict[int, _Hold] = {}
_lock = threading.Lock()


def read(spark: SparkSession, **options: Any) -> DataFrame:
    """The shard's contents (or consolidated updates) as of one time, read by Spark's Parquet
    reader. Options and answer as ``spark.read.format("persist")``'s (``shard``, ``blob``,
    ``consensus``, ``as_of``, ``mode``, ``lease_duration_s``). Spark verifies the parts' page
    checksums: a damaged page fails the action, never answers other rows (parts of one row
    group written before persist checksummed every page read unchecked). ``verify=True``
    reads through that source instead, which checks each part's CRC-32.

    ``as_of`` is resolved now, once: every action on the DataFrame reads that snapshot. Its
    parts stay in blob until ``release(df)``, the session's stop, or this process's exit.
    """
    raw = {str(k).lower(): str(v) for k, v in options.items()}
    unknown = sorted(set(raw) - _NATIVE)
    if unknown:
        raise InvalidUsage(
            f"unknown option(s) {unknown}; persist.spark.read takes {sorted(_NATIVE)}"
        )
    verify = raw.pop("verify", "false").lower()
    if verify not in ("true", "false"):
        raise InvalidUsage(f"option verify must be true or false, not {options.get('verify')!r}")
    if verify == "true":
        return spark.read.format("persist").options(**raw).load()
    loop = LoopThread.for_process()
    o = loop.run(with_shard(parse_options(raw)))
    client, plan = loop.run(_plan(o))
    try:
        df = _frame(spark, o, plan)
    except BaseException:
        loop.run(_drop(client, plan))
        raise
    with _lock:
        _holds[id(df)] = _Hold(client, plan, spark)
    _watch(spark)
    return df


def release(df: DataFrame) -> None:
    """Lets the snapshot of a DataFrame ``read`` made go (its parts may then be compacted away
    and deleted); later actions on it may fail. A second call, or another DataFrame, does
    nothing."""
    _release(id(df))


async def _plan(o: Options) -> tuple[persist.PersistClient, ScanPlan]:
    client = await persist.connect(o.blob, o.consensus)
    try:
        # As the Python source: a read never waits, and a shard with nothing written is empty.
        plan = await client.plan_scan(
            o.shard_id(),
            as_of=o.as_of,
            wait=False,
            empty_if_unwritten=True,
            purpose="spark native read",
            lease_duration_s=o.lease_duration_s,
        )
    except BaseException:
        await client.close()
        raise
    return client, plan


async def _drop(client: persist.PersistClient, plan: ScanPlan) -> None:
    try:
        await plan.release()
    finally:
        await client.close()


def _frame(spark: SparkSession, o: Options, plan: ScanPlan) -> DataFrame:
    shard = plan.schema
    if plan.scan is None or not (plan.scan.parts or plan.inline):
        return spark.createDataFrame([], spark_schema(shard, updates=o.mode == "updates"))
    read = _Reads(spark, plan)
    data = [_q(name) for name in shard.names]
    if o.mode == "contents" and plan.contents is Consolidation.SUM:
        return _contents_summed(read, data)
    rows = read(lambda part: True)
    assert rows is not None
    if o.mode == "updates":
        if plan.updates is not Consolidation.NONE:
            rows = _summed(rows, data)
        return rows.select(*data, F.lit(plan.as_of).cast("bigint").alias(TIME), DIFF)
    if plan.contents is Consolidation.NONE:
        return rows.select(*data)
    return _repeated(rows, data)


def _may_hold_one(part: ScanPart) -> bool:
    low, high = part.min_diff, part.max_diff
    return low is None or high is None or low <= 1 <= high


def _only_ones(part: ScanPart) -> bool:
    return part.min_diff == 1 and part.max_diff == 1


class _Reads:
    """The updates of some of a plan's parts, as Spark reads them: ``read(keep)``."""

    def __init__(self, spark: SparkSession, plan: ScanPlan) -> None:
        self.spark, self.plan = spark, plan
        # Each schema version's files as Spark reads them, inferred from the first read: later
        # reads of that version's files name it and open no footer to make their DataFrame.
        self._schemas: dict[int, StructType] = {}

    def __call__(
        self, keep: Callable[[ScanPart], bool], *, inline: bool = True
    ) -> DataFrame | None:
        """The updates of the parts that ``keep`` takes and (with ``inline``) of the inline
        parts, with ``_time <= as_of`` where the plan says so; None when there are none."""
        spark, plan = self.spark, self.plan
        updates = spark_schema(plan.schema, updates=True)
        frames: list[DataFrame] = []
        if plan.scan is not None and plan.scan.parts:
            # Each schema version's files hold its own columns: one Parquet read per version
            # (Spark takes a read's columns from one of its files), each shown in the plan's.
            by_version: dict[int, list[str]] = {}
            for uri, part in zip(plan.files, plan.scan.parts, strict=True):
                if keep(part):
                    # s3a: Hadoop's S3 file system (the session needs hadoop-aws and settings).
                    by_version.setdefault(part.schema_version, []).append(_hadoop(uri))
            for version, files in sorted(by_version.items()):
                # Spark skips the parts' checksums: a damaged page must fail the action rather
                # than answer other rows. (Spark passes a read's options on to Parquet's.)
                reader = spark.read.options(**_VERIFY_PAGES)
                if version in self._schemas:
                    reader = reader.schema(self._schemas[version])
                parquet = reader.parquet(*files)
                self._schemas.setdefault(version, parquet.schema)
                frames.append(parquet.select(*_shown(plan, version, updates)))
        if inline and plan.inline:
            table = pa.concat_tables(plan.inline).cast(arrow_for_spark(updates))
            frames.append(spark.createDataFrame(table, schema=updates))
        if not frames:
            return None
        rows = reduce(DataFrame.unionByName, frames)
        if plan.filter_time:
            rows = rows.where(F.col(TIME) <= F.lit(plan.as_of))
        return rows


def _shown(plan: ScanPlan, version: int, updates: StructType) -> list[Column]:
    """The columns of ``updates`` (the plan's, with ``_time`` and ``_diff``) from a file of
    schema ``version``: each field from the file's column of the same field id, cast to the
    plan's type (a lossless widening, or Spark's type for an unsigned one), null where the
    file has none (a field added or dropped since)."""
    source = dict(plan.columns_of(version))
    out = []
    for f in updates:
        stored = source.get(f.name, f.name)  # _time and _diff are every version's
        column = F.lit(None) if stored is None else _q(stored)
        out.append(column.cast(f.dataType).alias(f.name))
    return out


def _contents_summed(read: _Reads, data: list[Column]) -> DataFrame:
    """The contents where retractions (or multiplicities) may meet their rows.

    The parts the plan marks untouched (inserts alone, in key ranges no other diff reaches)
    are read as they are. The rest, when they hold at most ``_LOCAL_ROWS`` updates and
    ``_LOCAL_BYTES``, are read once at ``read()`` and summed by row, kept as local data.
    Otherwise two Spark jobs at ``read()`` find the touched rows: the 64-bit digests of the
    updates other than +1 (a scan), then the rows whose digest is one of them (a broadcast semi
    join), each summed by its data columns (over those rows alone), kept as local data. Every action then reads the files once: an update whose digest no
    touched row has is a +1 of an untouched row, one copy of it as it is (a broadcast anti join
    on the digest), and the touched rows come from the local data. Digests that collide only
    put more rows into the group-by, which matches on every column: exact either way. Past
    ``_TOUCHED_ROWS`` updates other than +1, or rows touched, each action sums the rest
    instead."""
    spark = read.spark
    apart = read(lambda p: p.untouched, inline=False)
    rest = read(lambda p: not p.untouched)
    if rest is None:  # no part could be summed with another: every update a +1
        assert apart is not None
        return apart.select(*data)
    plain = [] if apart is None else [apart.select(*data)]
    scan = read.plan.scan
    assert scan is not None  # a plan with parts
    outside = [p for p in (*scan.parts, *scan.inline_parts) if not p.untouched]
    if sum(p.rows for p in outside) <= _LOCAL_ROWS and sum(p.size for p in outside) <= _LOCAL_BYTES:
        # A merged shard's retractions and the rows they meet, or a few recent appends: all
        # summed once, here, from one scan of their parts (no digest, no join on any action).
        rows = rest.select(*data, DIFF)
        found = _sums(rows, None)
        assert found is not None  # unbounded
        left = found.filter(pc.not_equal(found[DIFF], 0))
        local = spark.createDataFrame(left, schema=rows.schema)
        return reduce(DataFrame.unionByName, [*plain, _repeated(local, data)])
    odd = read(lambda p: not p.untouched and not _only_ones(p))
    if odd is None:  # SUM for parts of several schema versions: every update a +1
        return reduce(DataFrame.unionByName, [*plain, rest.select(*data)])
    digest = _digest(data).alias(_DIGEST)
    # A scan of the parts with other diffs, no shuffle; bounded, as the local data below.
    hits = odd.where(F.col(DIFF) != 1).select(digest)
    found = _collected(hits, _TOUCHED_ROWS + 1)
    if found.num_rows > _TOUCHED_ROWS:
        return reduce(DataFrame.unionByName, [*plain, _repeated(_summed(rest, data), data)])
    hit = F.broadcast(spark.createDataFrame(found, schema=hits.schema))
    touched = rest.select(*data, DIFF, digest).join(hit, _DIGEST, "left_semi")
    groups = _sums(touched, _TOUCHED_ROWS)
    if groups is None:
        return reduce(DataFrame.unionByName, [*plain, _repeated(_summed(rest, data), data)])
    # Only the rows left (nonzero sums) are shown; every touched row's digest (a zero sum's
    # too) leaves its updates out of the files' rows.
    summed = StructType([f for f in touched.schema if f.name != _DIGEST])
    left = groups.filter(pc.not_equal(groups[DIFF], 0)).drop_columns([_DIGEST])
    kept = [_repeated(spark.createDataFrame(left, schema=summed), data)]
    # Each action reads only the parts that may hold a +1: an update of the others is touched.
    ones = read(lambda p: not p.untouched and _may_hold_one(p))
    if ones is not None:
        digests = F.broadcast(spark.createDataFrame(groups.select([_DIGEST]), schema=hits.schema))
        untouched = ones.select(*data, digest).join(digests, _DIGEST, "left_anti")
        kept.insert(0, untouched.select(*data))
    return reduce(DataFrame.unionByName, [*plain, *kept])


def _sums(rows: DataFrame, limit: int | None) -> pa.Table | None:
    """Each distinct row of ``rows`` (the data columns, ``_diff``, maybe the digest) with its
    ``_diff`` summed (and any one of its digests: equal rows have equal digests), computed now
    and summed in the driver (Spark's group-by shuffles, which was most of such a job's time);
    None past ``limit`` updates (None: no limit, the caller knows them few)."""
    if limit is None:
        found = rows.toArrow()
    else:
        found = _collected(rows, limit + 1)
        if found.num_rows > limit:
            return None
    return _grouped(found, [f.name for f in rows.schema if f.name not in (DIFF, _DIGEST)])


def _grouped(updates: pa.Table, names: list[str]) -> pa.Table:
    """One row per distinct row of ``updates`` (columns ``names``, ``_diff``, maybe the
    digest), its ``_diff`` summed and any one of its digests (equal rows have equal digests).

    pyarrow groups by value, nulls together, as Spark does, but floats by their bits, where Spark
    and persist take -0.0 for 0.0 and every NaN for one: each float column is first made
    canonical (one NaN; adding 0.0 turns -0.0 into 0.0), as Spark's own group-by shows them.
    (A shard has no nested column, whose floats would need the same care: persist can't sort
    and compare them.)"""
    for i, field in enumerate(updates.schema):
        if pa.types.is_floating(field.type) and field.name in names:
            col = updates.column(i)
            nan = pa.scalar(float("nan"), field.type)
            canonical = pc.if_else(pc.is_nan(col), nan, pc.add(col, pa.scalar(0.0, field.type)))
            updates = updates.set_column(i, field, canonical)
    digest = _DIGEST in updates.column_names
    aggregates = [(DIFF, "sum"), *([(_DIGEST, "max")] if digest else [])]
    sums = updates.group_by(names, use_threads=False).aggregate(aggregates)
    columns = [*names, DIFF, *([_DIGEST] if digest else [])]
    return sums.select([*names, *(f"{c}_{f}" for c, f in aggregates)]).rename_columns(columns)


def _collected(df: DataFrame, limit: int) -> pa.Table:
    """At most ``limit`` of ``df``'s rows, computed now, in one job over all its partitions.
    (A limit collected as it is runs as Spark's ``take``: a job over one partition, then over
    a few more, and so on, one after another.)"""
    return df.limit(limit).repartition(1).toArrow()


def _digest(data: list[Column]) -> Column:
    """A 64-bit digest of a row, never null: equal rows have equal digests (the converse may
    fail)."""
    return F.xxhash64(*data)


def _repeated(rows: DataFrame, data: list[Column]) -> DataFrame:
    """Each row ``_diff`` times; a negative ``_diff`` fails the action naming the row."""
    negative = F.concat(
        F.lit("persist.InvalidUsage: row "),
        F.to_json(F.struct(*data, F.col(DIFF))),
        F.lit(
            " has a negative multiplicity: mode=contents can't show it (read it with mode=updates)"
        ),
    )
    checked = F.when(F.col(DIFF) < 0, F.raise_error(negative)).otherwise(F.col(DIFF))
    copies = F.explode(F.array_repeat(F.lit(0), checked.cast("int")))
    return rows.select(*data, copies.alias("_copy")).select(*data)


def _summed(rows: DataFrame, data: list[Column]) -> DataFrame:
    """One row per distinct row with its summed ``_diff``, zero sums dropped."""
    return rows.groupBy(*data).agg(F.sum(DIFF).alias(DIFF)).where(F.col(DIFF) != 0)


def _hadoop(uri: str) -> str:
    """``uri`` as Hadoop's file systems name it: S3 through S3A, and unquoted (Hadoop's ``Path``
    quotes it again)."""
    if uri.startswith("s3://"):
        uri = "s3a://" + uri.removeprefix("s3://")
    return urllib.parse.unquote(uri)


def _q(name: str, column: str | None = None) -> Column:
    """Column ``name``, quoted; with ``column``: ``name`` is ``<alias>.<column>``."""
    if column is None:
        return F.col("`" + name.replace("`", "``") + "`")
    alias = name[: len(name) - len(column) - 1]
    return F.col(alias + ".`" + column.replace("`", "``") + "`")


_watcher: threading.Thread | None = None


def _watch(spark: SparkSession) -> None:
    """Makes sure a thread releases the holds of every session that stops."""
    global _watcher
    with _lock:
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(
                target=_watch_sessions, name="persist-spark-holds", daemon=True
            )
            _watcher.start()


def _watch_sessions() -> None:
    while True:
        time.sleep(_WATCH_S)
        with _lock:
            stopped = [key for key, hold in _holds.items() if _stopped(hold.session)]
            if not _holds:
                return  # the next read starts another watcher
        for key in stopped:
            try:
                _release(key)
            except Exception as exc:  # not a thread's traceback: the lease ends the hold anyway
                _log.warning("persist.spark: releasing a stopped session's snapshot: %r", exc)


def _stopped(spark: SparkSession) -> bool:
    # pyspark drops the gateway's handle on a stopped context.
    return getattr(spark.sparkContext, "_jsc", None) is None


def _release(key: int) -> None:
    with _lock:
        hold = _holds.pop(key, None)
    if hold is not None:
        LoopThread.for_process().run(_drop(hold.client, hold.plan))


def _release_all() -> None:
    if os.getpid() != _OWNER:
        return  # a forked child's copy of the driver's holds is not its to let go
    for key in list(_holds):
        with contextlib.suppress(Exception):  # the process is going: leases run out anyway
            _release(key)


# As the driver exits, while persist's calls still work (before Python shuts down the thread
# pools its blob and SQLite calls use); then the loop's background work (a compaction the
# read started) is cancelled, not left to fail into those pools.
_OWNER = os.getpid()
LoopThread.before_exit(_release_all)
