"""spark: reading and writing a shard through Spark, against Spark's own Parquet.

One shard of ``spark_rows`` rows (``k`` unique int64, ``g`` int64 of 100 values, ``v`` float64),
written by persist in five appends then maintained, and the same rows as five plain Parquet
files. In one Spark session (``local[2]``, in a child process so that its JVM is the bench's
own):

- read: ``count()`` and ``sum(v)`` of ``spark.read.format("persist")`` with 1, 2 and 4 splits and
  the default, and of ``persist.spark.read`` (Spark's Parquet reader over the parts), vs
  ``spark.read.parquet`` of the files (best of ``spark_repeats``, after a warm-up read of each):
  rows/s and persist / parquet;
- retractions: a second shard, the same rows then an append retracting 1% of them, read with
  ``persist.spark.read`` vs ``spark.read.parquet`` of the rows that remain; and a third, of
  appends of new rows beside retractions of 1% of the rows still there, maintained (its
  retractions merged with the rows they retract), read the same way;
- write: ``df.write.format("persist")`` of the cached rows to a new shard vs
  ``df.write.parquet`` of them (best of ``spark_repeats``); and ``df.write.parquet`` of the rows
  sorted within partitions in persist's part order (every column, then ``_time``), the floor of
  a native Spark write of sorted parts;
- fresh: the shard the last persist write made, read right after it (no maintenance between)
  with ``persist.spark.read`` vs ``spark.read.parquet`` of what ``df.write.parquet`` made of the
  same rows (``count()`` and ``sum(v)``, the two alternating, best of ``spark_repeats`` + 1
  each after a warm-up), and the number of parts that write made vs the files of Spark's;
- bytes (in this process, no Spark): the blob bytes ``fetch_split`` reads for a 4-split snapshot
  over those a 1-split one reads (a counting Blob around the file blob);
- page checksums: the shard's parts encoded (``encode_part``) with and without them, and
  decoded by pyarrow (in this process) and read by Spark (``spark.read.parquet`` of the part
  files, every column summed) with and without verifying them, the two alternating, best of
  ``_CHECKSUM_REPEATS`` each: what writing and verifying them costs.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import persist
from benches import bare
from benches.fixtures import CountingBlob, IoCounts, NoAdapter, keyed_rows
from benches.harness import BASELINE, SUBJECT, Context, Run, System, ratio
from benches.harness import ratio_entry as entry
from benches.procs import local_spark, run_in_child
from persist.core.arrow.updates import encode_part, part_row_group_rows
from persist.location import open_blob

NAME = "spark"
TITLE = "Spark: a snapshot read as splits, and a coordinated-commit write"

PERSIST = "persist file+postgres"
NATIVE = "persist native read (persist.spark.read)"
PARQUET = "spark parquet"
BARE = "bare python source"
SORTED = "spark parquet, sorted within partitions"
SCHEMA = pa.schema([("k", pa.int64()), ("g", pa.int64()), ("v", pa.float64())])
_PARTS = 5
# The appends of the shard whose retractions are merged with the rows they retract.
_MERGED_APPENDS = 4
_SPLITS = (1, 2, 4, None)
# Each with and without page checksums, alternating: the difference is a few percent, below
# what a best of two or three on a shared machine resolves.
_CHECKSUM_REPEATS = 7
_VERIFY_PAGES = "parquet.page.verify-checksum.enabled"


def systems() -> list[System]:
    return [
        System(PERSIST, SUBJECT, lambda ctx: NoAdapter()),
        System(PARQUET, BASELINE, lambda ctx: NoAdapter()),
        System(BARE, BASELINE, lambda ctx: NoAdapter()),
    ]


def _rows(n: int, part: int, rng: np.random.Generator) -> pa.Table:
    return keyed_rows(n, part, _PARTS, rng)


async def _build(ctx: Context, blob: str, consensus: str, pq_dir: Path) -> str:
    """The shard and the Parquet files, holding the same rows."""
    shard = str(persist.ShardId.new())
    rng = np.random.default_rng(7)
    per = ctx.scale.spark_rows // _PARTS
    pq_dir.mkdir(parents=True)
    async with await persist.connect(blob, consensus) as client:
        write = await client.open_writer(shard, SCHEMA, "bench spark")
        for i in range(_PARTS):
            table = _rows(per, i, rng)
            pq.write_table(table, pq_dir / f"part-{i}.parquet")
            stamped = table.append_column("_time", pa.array(np.full(per, i, np.uint64)))
            await write.compare_and_append(stamped, i, i + 1)
        await client.maintain(shard)
        await write.expire()
    return shard


async def _retracted(ctx: Context, blob: str, consensus: str, pq_dir: Path) -> str:
    """A shard of the same rows plus an append retracting every 100th, and the rows that remain
    as Parquet."""
    shard = str(persist.ShardId.new())
    rng = np.random.default_rng(7)
    per = ctx.scale.spark_rows // _PARTS
    pq_dir.mkdir(parents=True)
    async with await persist.connect(blob, consensus) as client:
        write = await client.open_writer(shard, SCHEMA, "bench spark retractions")
        for i in range(_PARTS):
            table = _rows(per, i, rng)
            gone = table.take(pa.array(np.arange(0, per, 100)))
            keep = np.ones(per, bool)
            keep[::100] = False
            pq.write_table(table.filter(pa.array(keep)), pq_dir / f"part-{i}.parquet")
            stamped = table.append_column("_time", pa.array(np.full(per, 2 * i, np.uint64)))
            await write.compare_and_append(stamped, 2 * i, 2 * i + 1)
            retract = gone.append_column(
                "_time", pa.array(np.full(len(gone), 2 * i + 1, np.uint64))
            ).append_column("_diff", pa.array(np.full(len(gone), -1, np.int64)))
            await write.compare_and_append(retract, 2 * i + 1, 2 * i + 2)
        await client.maintain(shard)
        await write.expire()
    return shard


async def _merged(ctx: Context, blob: str, consensus: str, pq_dir: Path) -> str:
    """A shard of ``spark_rows`` updates in ``_MERGED_APPENDS`` appends, each of new rows and
    (after the first) retractions of every 100th row still there, maintained: its retractions
    merged with the rows they retract. And the rows that remain, as Parquet."""
    shard = str(persist.ShardId.new())
    rng = np.random.default_rng(11)
    per = ctx.scale.spark_rows // _MERGED_APPENDS
    left: pa.Table | None = None
    pq_dir.mkdir(parents=True)
    async with await persist.connect(blob, consensus) as client:
        write = await client.open_writer(shard, SCHEMA, "bench spark merged retractions")
        for i in range(_MERGED_APPENDS):
            gone = None if left is None else left.take(pa.array(np.arange(0, left.num_rows, 100)))
            new = _rows(per - (0 if gone is None else gone.num_rows), i, rng)
            ones = pa.array(np.ones(new.num_rows, np.int64))
            updates = new.append_column("_diff", ones)
            if gone is not None and left is not None:
                minus = pa.array(np.full(gone.num_rows, -1, np.int64))
                updates = pa.concat_tables([updates, gone.append_column("_diff", minus)])
                keep = np.ones(left.num_rows, bool)
                keep[::100] = False
                left = left.filter(pa.array(keep))
            left = new if left is None else pa.concat_tables([left, new])
            times = pa.array(np.full(updates.num_rows, i, np.uint64))
            await write.compare_and_append(updates.append_column("_time", times), i, i + 1)
        await client.maintain(shard)
        await write.expire()
    assert left is not None
    pq.write_table(left, pq_dir / "left.parquet")
    return shard


async def shard_parts(blob: str, consensus: str, shard: str) -> dict[str, int]:
    """The parts of ``shard`` and their bytes, from its state."""
    async with await persist.connect(blob, consensus) as client:
        info = await client.inspect(shard)
    return {"parts": info["parts"], "bytes": info["bytes"]}


async def _bytes_read(blob: str, consensus: str, shard: str) -> dict[str, int]:
    """Blob bytes read by fetching a snapshot cut in 1 and in 4 splits."""
    counts = IoCounts()
    config = persist.PersistConfig(recent_parts_bytes=0)
    out: dict[str, int] = {}
    async with await persist.connect(
        CountingBlob(open_blob(blob), counts), consensus, config=config
    ) as client:
        read = await client.open_leased_reader(shard)
        _, upper = await client.frontiers(shard)
        assert upper is not None
        for n in (1, 4):
            before = counts.blob_get_bytes
            rows = 0
            for split in await read.snapshot(upper - 1, n):
                rows += (await client.fetch_split(split)).num_rows
            out[f"bytes_{n}_splits"] = counts.blob_get_bytes - before
            out[f"rows_{n}_splits"] = rows
        await read.expire()
    return out


def _count(df: Any) -> int:
    return int(df.count())


def _sum_v(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.agg(F.sum("v")).collect()[0][0]


def _alternating(fn: Any, repeats: int) -> tuple[float, float]:
    """The best times of ``fn(True)`` and ``fn(False)``, run alternately ``repeats`` times each."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            t0 = time.perf_counter()
            fn(on)
            times[on].append(time.perf_counter() - t0)
    return min(times[True]), min(times[False])


def _page_checksum_costs(parts: list[bytes]) -> dict[str, float]:
    """Encoding the parts' rows with and without page checksums, and decoding the parts (as
    written: with them) verifying them or not, in this process."""
    tables = [pq.read_table(pa.BufferReader(data)) for data in parts]
    out: dict[str, float] = {}

    def encode(on: bool) -> None:
        out["bytes_on" if on else "bytes_off"] = sum(
            len(
                encode_part(
                    t,
                    row_group_rows=part_row_group_rows(t.num_rows, t.nbytes),
                    key_names=SCHEMA.names,
                    page_checksums=on,
                )
            )
            for t in tables
        )

    def decode(on: bool) -> None:
        for data in parts:
            pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=on).read(
                use_threads=False
            )

    out["encode_on_s"], out["encode_off_s"] = _alternating(encode, _CHECKSUM_REPEATS)
    out["decode_on_s"], out["decode_off_s"] = _alternating(decode, _CHECKSUM_REPEATS)
    return out


def _spark_work(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: one Spark session, the timed reads and writes."""
    from pyspark.sql import functions as F

    import persist.spark

    spark = local_spark()
    persist.spark.register(spark)
    spark.dataSource.register(bare.source())
    where = {"blob": spec["blob"], "consensus": spec["consensus"]}
    repeats = spec["repeats"]

    def best(fn: Any) -> tuple[float, Any]:
        times, got = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = fn()
            times.append(time.perf_counter() - t0)
        return min(times), got

    def persist_df(n: int | None) -> Any:
        extra = {} if n is None else {"splits": str(n)}
        return spark.read.format("persist").options(shard=spec["shard"], **where, **extra).load()

    def parquet_df() -> Any:
        return spark.read.parquet(spec["parquet"])

    def bare_df() -> Any:
        return spark.read.format("bare").option("path", spec["parquet"]).load()

    natives: dict[str, Any] = {}

    def native_df(shard: str) -> Any:
        # Read once, then timed by its actions (as a DataFrame is used): read() plans the
        # files, and for retractions sums the rows they touch, once per snapshot.
        if shard not in natives:
            natives[shard] = persist.spark.read(spark, shard=shard, **where)
        return natives[shard]

    results: dict[str, Any] = {}
    try:
        parquet_df().count(), persist_df(2).count()  # warm-up: JVM, Python workers, page cache
        reads = [("parquet", parquet_df), ("bare", bare_df)]
        reads += [(f"splits_{n}", lambda n=n: persist_df(n)) for n in _SPLITS]
        reads += [("native", lambda: native_df(spec["shard"]))]
        reads += [("retracted_parquet", lambda: spark.read.parquet(spec["retracted_parquet"]))]
        reads += [("retracted_native", lambda: native_df(spec["retracted"]))]
        reads += [("merged_parquet", lambda: spark.read.parquet(spec["merged_parquet"]))]
        reads += [("merged_native", lambda: native_df(spec["merged"]))]
        for label, df in reads:
            if label.endswith("native"):  # making the DataFrame: persist.spark.read itself
                t0 = time.perf_counter()
                df()
                results[f"{label}_make_s"] = time.perf_counter() - t0
            results[f"{label}_count_s"], results[f"{label}_count"] = best(
                lambda df=df: df().count()
            )
            results[f"{label}_sum_s"], results[f"{label}_sum_value"] = best(
                lambda df=df: df().agg(F.sum("v")).collect()[0][0]
            )
            results[f"{label}_partitions"] = df().rdd.getNumPartitions()
        cached = parquet_df().cache()
        cached.count()
        target = spec["out"]
        results["write_parquet_s"], _ = best(lambda: cached.write.mode("overwrite").parquet(target))

        written: list[str] = []

        def write_persist() -> None:
            shard = str(persist.ShardId.new())
            cached.write.format("persist").options(shard=shard, **where).mode("append").save()
            written.append(shard)

        results["write_persist_s"], _ = best(write_persist)
        # The last write's shard as it is right after the write, against Spark's own files.
        results["fresh_parts"] = asyncio.run(
            shard_parts(spec["blob"], spec["consensus"], written[-1])
        )
        results["fresh_parquet_files"] = len(list(Path(target).glob("*.parquet")))
        fresh = {
            True: spark.read.parquet(target),
            False: native_df(written[-1]),
        }
        for df in fresh.values():
            df.count()  # warm-up: these files, as Spark reads them
        # Alternating, as the page checksums below: the two reads of one figure share the
        # machine's moment (one after the other, a load swing lands on one of them only).
        for what, action in (("count", _count), ("sum", _sum_v)):
            got: dict[bool, Any] = {}

            def timed(parquet: bool, action: Any = action, got: dict[bool, Any] = got) -> None:
                got[parquet] = action(fresh[parquet])

            on_s, off_s = _alternating(timed, repeats + 1)
            results[f"fresh_parquet_{what}_s"], results[f"fresh_native_{what}_s"] = on_s, off_s
            value = "" if what == "count" else "_value"
            results[f"fresh_parquet_{what}{value}"] = got[True]
            results[f"fresh_native_{what}{value}"] = got[False]
        stamped = cached.withColumn("_time", F.lit(0).cast("long"))
        stamped = stamped.withColumn("_diff", F.lit(1).cast("long"))
        in_order = stamped.sortWithinPartitions(*SCHEMA.names, "_time")
        results["write_sorted_s"], _ = best(
            lambda: in_order.write.mode("overwrite").parquet(target + "-sorted")
        )
        for df in natives.values():
            persist.spark.release(df)

        def every_column(on: bool) -> None:
            files = spark.read.option(_VERIFY_PAGES, str(on).lower()).parquet(*spec["parts"])
            files.agg(*(F.sum(c) for c in SCHEMA.names)).collect()

        every_column(True)  # warm-up: these files, as Spark reads them
        on_s, off_s = _alternating(every_column, _CHECKSUM_REPEATS)
        results["parts_verified_s"], results["parts_unverified_s"] = on_s, off_s
        bare_out = target + "-bare"
        results["write_bare_s"], _ = best(
            lambda: cached.write.format("bare").option("path", bare_out).mode("append").save()
        )
    finally:
        spark.stop()
    return results


def _retraction_rows(
    run: Run, s: dict[str, Any], kind: str, rate: Any
) -> dict[str, dict[str, Any]]:
    """The table rows of a retracted shard (``kind``: its results' prefix): Parquet over the
    rows left, and the native read with the time it took to make its DataFrame."""
    return {
        PARQUET: run.row(
            PARQUET,
            count_rows_per_s=rate(s[f"{kind}_parquet_count_s"]),
            sum_rows_per_s=rate(s[f"{kind}_parquet_sum_s"]),
        ),
        NATIVE: run.row(
            NATIVE,
            count_rows_per_s=rate(s[f"{kind}_native_count_s"]),
            sum_rows_per_s=rate(s[f"{kind}_native_sum_s"]),
            make_s=round(s[f"{kind}_native_make_s"], 3),
        ),
    }


def _retraction_entries(s: dict[str, Any], kind: str, what: str, jobs: str) -> list[Any]:
    """The ratios of a retracted shard's native read (``kind``: its results' prefix), and the
    time to make its DataFrame."""
    per_s = "rows/s(persist.spark.read) / rows/s(parquet)"
    return [
        entry(
            f"native read sum, {what}, vs parquet of the rows left",
            ratio(s[f"{kind}_parquet_sum_s"], s[f"{kind}_native_sum_s"]),
            per_s,
            at_least=0.7,
        ),
        entry(
            f"native read count, {what}, vs parquet of the rows left",
            ratio(s[f"{kind}_parquet_count_s"], s[f"{kind}_native_count_s"]),
            per_s,
        ),
        entry(
            f"making the DataFrame of the {what.replace('1% ', '1%-')} shard "
            "(persist.spark.read), s",
            round(s[f"{kind}_native_make_s"], 3),
            f"seconds persist.spark.read takes (the plan, and {jobs})",
            at_most=2,
        ),
    ]


async def run(ctx: Context) -> dict[str, Any]:
    scale = ctx.scale
    n = scale.spark_rows
    blob = f"file://{ctx.workdir / 'blob'}"
    consensus = ctx.postgres_uri
    async with Run(ctx, NAME, systems()) as run:
        run.log(f"building {n} rows")
        shard = await _build(ctx, blob, consensus, ctx.workdir / "parquet")
        retracted = await _retracted(ctx, blob, consensus, ctx.workdir / "retracted")
        merged = await _merged(ctx, blob, consensus, ctx.workdir / "merged")
        counted = await _bytes_read(blob, consensus, shard)
        async with await persist.connect(blob, consensus) as held:
            # The shard's part files, held while they are read outside persist.
            plan = await held.plan_scan(shard, purpose="bench spark: page checksums")
            try:
                paths = [urllib.parse.unquote(urllib.parse.urlparse(f).path) for f in plan.files]
                parts = [Path(path).read_bytes() for path in paths]
                run.log(f"page checksums: encoding and decoding {len(parts)} parts")
                checksums = await asyncio.to_thread(_page_checksum_costs, parts)
                del parts
                run.log("spark session (child process)")
                spec = {
                    "blob": blob,
                    "consensus": consensus,
                    "shard": shard,
                    "parquet": str(ctx.workdir / "parquet"),
                    "retracted": retracted,
                    "retracted_parquet": str(ctx.workdir / "retracted"),
                    "merged": merged,
                    "merged_parquet": str(ctx.workdir / "merged"),
                    "out": str(ctx.workdir / "parquet-out"),
                    "repeats": scale.spark_repeats,
                    "parts": paths,
                }
                s = await asyncio.to_thread(run_in_child, _spark_work, spec, 1800)
            finally:
                await plan.release()
    for label in ("parquet", "bare", "native", *(f"splits_{k}" for k in _SPLITS)):
        if s[f"{label}_count"] != n:
            raise RuntimeError(f"{label} counted {s[f'{label}_count']} of {n} rows")
    for kind in ("retracted", "merged"):
        if s[f"{kind}_native_count"] != s[f"{kind}_parquet_count"]:
            raise RuntimeError(
                f"the {kind} shard counted {s[f'{kind}_native_count']} rows, "
                f"not {s[f'{kind}_parquet_count']}"
            )
    for label in ("fresh_parquet", "fresh_native"):
        if s[f"{label}_count"] != n:
            raise RuntimeError(f"{label} counted {s[f'{label}_count']} of {n} rows")
    for what in ("sum", "retracted_sum", "merged_sum", "fresh_sum"):
        parquet, native = what.replace("sum", "parquet_sum"), what.replace("sum", "native_sum")
        if abs(s[f"{parquet}_value"] - s[f"{native}_value"]) > 1e-6 * abs(s[f"{parquet}_value"]):
            raise RuntimeError(f"{native} is {s[f'{native}_value']}, not {s[f'{parquet}_value']}")
    if counted["rows_1_splits"] != n or counted["rows_4_splits"] != n:
        raise RuntimeError(f"fetched {counted} rows, not {n}")

    def rate(seconds: float) -> float:
        return n / seconds

    read_rows: dict[str, dict[str, Any]] = {}
    labels = [(PARQUET, "parquet"), (BARE, "bare"), (NATIVE, "native")]
    labels += [
        (f"{PERSIST}, {k or 'default'} split{'s' if k != 1 else ''}", f"splits_{k}")
        for k in _SPLITS
    ]
    for name, label in labels:
        run.roles.setdefault(name, SUBJECT)
        read_rows[name] = run.row(
            name,
            count_rows_per_s=rate(s[f"{label}_count_s"]),
            sum_rows_per_s=rate(s[f"{label}_sum_s"]),
            partitions=s[f"{label}_partitions"],
        )
    run.roles.setdefault(SORTED, BASELINE)
    write_rows = {
        PARQUET: run.row(PARQUET, rows_per_s=rate(s["write_parquet_s"])),
        BARE: run.row(BARE, rows_per_s=rate(s["write_bare_s"])),
        SORTED: run.row(SORTED, rows_per_s=rate(s["write_sorted_s"])),
        PERSIST: run.row(PERSIST, rows_per_s=rate(s["write_persist_s"])),
    }
    best_count = min(s[f"splits_{k}_count_s"] for k in _SPLITS)
    best_sum = min(s[f"splits_{k}_sum_s"] for k in _SPLITS)
    retracted_rows = _retraction_rows(run, s, "retracted", rate)
    merged_rows = _retraction_rows(run, s, "merged", rate)
    fresh_rows = {
        PARQUET: run.row(
            PARQUET,
            files=s["fresh_parquet_files"],
            count_rows_per_s=rate(s["fresh_parquet_count_s"]),
            sum_rows_per_s=rate(s["fresh_parquet_sum_s"]),
        ),
        NATIVE: run.row(
            NATIVE,
            files=s["fresh_parts"]["parts"],
            count_rows_per_s=rate(s["fresh_native_count_s"]),
            sum_rows_per_s=rate(s["fresh_native_sum_s"]),
        ),
    }
    checksum_rows: dict[str, dict[str, Any]] = {}
    for name, (with_s, without_s) in {
        "persist part encode (in process)": (checksums["encode_on_s"], checksums["encode_off_s"]),
        "pyarrow part decode (in process)": (checksums["decode_on_s"], checksums["decode_off_s"]),
        "spark read of the part files": (s["parts_verified_s"], s["parts_unverified_s"]),
    }.items():
        run.roles.setdefault(name, SUBJECT)
        checksum_rows[name] = run.row(
            name, with_rows_per_s=rate(with_s), without_rows_per_s=rate(without_s)
        )
    ratios = [
        entry(
            "native read count vs parquet count",
            ratio(s["parquet_count_s"], s["native_count_s"]),
            "rows/s(persist.spark.read) / rows/s(parquet)",
            at_least=0.8,
        ),
        entry(
            "native read sum vs parquet sum",
            ratio(s["parquet_sum_s"], s["native_sum_s"]),
            "rows/s(persist.spark.read) / rows/s(parquet)",
            at_least=0.8,
        ),
        *_retraction_entries(s, "retracted", "1% retracted", "the jobs finding the touched rows"),
        *_retraction_entries(
            s, "merged", "1% retracted and merged", "the job summing the touched rows"
        ),
        entry(
            "persist count vs parquet count (best split count)",
            ratio(s["parquet_count_s"], best_count),
            "rows/s(persist) / rows/s(parquet)",
        ),
        entry(
            "persist sum vs parquet sum (best split count)",
            ratio(s["parquet_sum_s"], best_sum),
            "rows/s(persist) / rows/s(parquet)",
        ),
        entry(
            "persist sum vs the bare Python source's sum",
            ratio(s["bare_sum_s"], best_sum),
            "rows/s(persist) / rows/s(bare python source)",
        ),
        entry(
            "bare Python source sum vs parquet sum (the ceiling of any Python source)",
            ratio(s["parquet_sum_s"], s["bare_sum_s"]),
            "rows/s(bare) / rows/s(parquet)",
        ),
        entry(
            "persist sum, 2 splits vs 1",
            ratio(s["splits_1_sum_s"], s["splits_2_sum_s"]),
            "rate(2) / rate(1)",
        ),
        entry(
            "persist sum, 4 splits vs 1",
            ratio(s["splits_1_sum_s"], s["splits_4_sum_s"]),
            "rate(4) / rate(1)",
        ),
        entry(
            "blob bytes read, 4 splits vs 1",
            ratio(counted["bytes_4_splits"], counted["bytes_1_splits"]),
            "bytes(4 splits) / bytes(1 split)",
            at_most=1.2,
        ),
        entry(
            "bare Python sink write vs parquet write (the ceiling of any Python sink)",
            ratio(s["write_parquet_s"], s["write_bare_s"]),
            "rows/s(bare) / rows/s(parquet)",
        ),
        entry(
            "sorted parquet write vs parquet write (the floor of a native write of parts)",
            ratio(s["write_parquet_s"], s["write_sorted_s"]),
            "rows/s(sorted within partitions) / rows/s(parquet)",
        ),
        entry(
            "persist write vs parquet write",
            ratio(s["write_parquet_s"], s["write_persist_s"]),
            "rows/s(persist) / rows/s(parquet)",
            at_least=0.7,
        ),
        entry(
            "native read sum right after a Spark write vs parquet of Spark's write",
            ratio(s["fresh_parquet_sum_s"], s["fresh_native_sum_s"]),
            "rows/s(persist.spark.read of the fresh shard) / rows/s(parquet)",
            at_least=0.9,
        ),
        entry(
            "native read count right after a Spark write vs parquet of Spark's write",
            ratio(s["fresh_parquet_count_s"], s["fresh_native_count_s"]),
            "rows/s(persist.spark.read of the fresh shard) / rows/s(parquet)",
        ),
        entry(
            "parts of a fresh Spark write vs the files of df.write.parquet",
            ratio(s["fresh_parts"]["parts"], s["fresh_parquet_files"]),
            "parts(persist write) / files(parquet write)",
        ),
        entry(
            "part encode with page checksums vs without",
            ratio(checksums["encode_off_s"], checksums["encode_on_s"]),
            "rows/s(with) / rows/s(without)",
        ),
        entry(
            "part bytes with page checksums vs without",
            ratio(checksums["bytes_on"], checksums["bytes_off"]),
            "bytes(with) / bytes(without)",
        ),
        entry(
            "pyarrow part decode, pages verified vs not",
            ratio(checksums["decode_off_s"], checksums["decode_on_s"]),
            "rows/s(verified) / rows/s(not)",
        ),
        entry(
            "spark read of the parts (every column), pages verified vs not",
            ratio(s["parts_unverified_s"], s["parts_verified_s"]),
            "rows/s(verified) / rows/s(not)",
        ),
    ]
    return await run.result(
        params={"rows": n, "repeats": scale.spark_repeats, "appends": _PARTS, "master": "local[2]"},
        tables={
            "read": read_rows,
            "retractions": retracted_rows,
            "retractions, merged": merged_rows,
            "write": write_rows,
            "fresh write, read right after": fresh_rows,
            "bytes": {PERSIST: run.row(PERSIST, **counted)},
            "page checksums": checksum_rows,
        },
        ratios=ratios,
        notes=[
            "one Spark session (local[2]) in a child process; times are the best of the repeats, "
            "after one warm-up read of each source",
            "count of plain Parquet reads no column (Spark answers it from the files' row "
            "groups); a Python data source hands Spark every column of every row",
            f"{BARE}: a minimal Python data source over the same Parquet files (2 partitions, "
            "ready-made Arrow batches; as a sink, each task writes its batches to one Parquet "
            "file): the floor any Python source pays, persist or not",
            "bytes: fetch_split of every split, in this process, through a counting Blob",
            "retractions, make_s: persist.spark.read of that shard, once (its DataFrame is then "
            "timed by its actions): the plan, and the Spark jobs that find the touched rows",
            f"retractions, merged: {_MERGED_APPENDS} appends of new rows and retractions of 1% of "
            "the rows still there, maintained (the retractions merged with the rows they "
            "retract), vs spark.read.parquet of the rows left",
            "fresh write: the shard of the last timed persist write, read by persist.spark.read "
            "before any maintenance, vs spark.read.parquet of the last df.write.parquet; files: "
            "the parts of that write (from the shard's state) and the Parquet files",
            "page checksums: with and without, alternating, best of "
            f"{_CHECKSUM_REPEATS} each; encode and decode in this process (one thread), the "
            "Spark read sums every column of the shard's part files",
        ],
    )
