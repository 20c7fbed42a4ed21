"""tpch, the write half: Spark writing TPC-H ``lineitem`` (16 columns), and reading it right after.

Runs in the tpch bench's Spark child, after its query rounds. ``lineitem`` as Spark reads
tpchgen's file, cached, is written (best of ``repeats``):

- ``df.write.parquet`` (the baseline);
- ``df.write.format("persist")`` to a new shard each time;
- ``df.write.format("bare")`` (``benches/bare.py``): a Python sink that only writes the Arrow
  batches Spark hands it to Parquet files, the ceiling of any Python sink on this Spark.

Then the shard of the last persist write, as it is right after the write (no maintenance
between), is read with ``persist.spark.read`` and queried (Q1, Q6: the queries of ``lineitem``
alone, where they run) against the files of the last ``df.write.parquet``; each answer must equal
the one over tpchgen's file.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benches.spark import shard_parts

__all__ = ["FRESH_QUERIES", "lineitem_writes"]

# The queries that read lineitem alone.
FRESH_QUERIES = ("Q1", "Q6")


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def lineitem_writes(
    spark: Any,
    spec: dict[str, Any],
    run_query: Callable[[str, dict[str, Any]], tuple[float, bool]],
    queries: set[str],
    out: Path,
) -> dict[str, Any]:
    """Seconds of each write, the parts the last persist write made vs the files of Spark's, and
    the fresh queries' seconds (best of ``repeats``) and whether their answers are right.

    ``run_query(name, views)`` runs one TPC-H query over the temp views ``views`` (table name to
    DataFrame) and returns its seconds and whether its answer is the one over tpchgen's files;
    ``queries`` are the queries this run has."""
    import persist.spark

    repeats = max(1, spec["repeats"])
    where = {"blob": spec["blob"], "consensus": spec["consensus"]}
    cached = spark.read.parquet(spec["tables"]["lineitem"]["parquet"]).cache()
    rows = cached.count()
    target = str(out / "lineitem-parquet")
    results: dict[str, Any] = {"rows": rows}
    results["parquet_s"] = _best(lambda: cached.write.mode("overwrite").parquet(target), repeats)

    written: list[str] = []

    def to_persist() -> None:
        shard = str(persist.ShardId.new())
        cached.write.format("persist").options(shard=shard, **where).mode("append").save()
        written.append(shard)

    results["persist_s"] = _best(to_persist, repeats)
    results["bare_s"] = _best(
        lambda: (
            cached.write.format("bare")
            .option("path", str(out / f"lineitem-bare-{uuid.uuid4().hex}"))
            .mode("append")
            .save()
        ),
        repeats,
    )
    cached.unpersist()
    results["parquet_files"] = len(list(Path(target).glob("*.parquet")))
    parts = shard_parts(spec["blob"], spec["consensus"], written[-1])
    results["persist_parts"] = asyncio.run(parts)["parts"]

    fresh = persist.spark.read(spark, shard=written[-1], **where)
    files = spark.read.parquet(target)
    try:
        for q in FRESH_QUERIES:
            if q not in queries:
                continue
            for label, df in (("parquet", files), ("native", fresh)):
                run_query(q, {"lineitem": df})  # warm-up: these files, as Spark reads them
                times, right = [], True
                for _ in range(repeats):
                    dt, equal = run_query(q, {"lineitem": df})
                    times.append(dt)
                    right = right and equal
                results[f"fresh_{label}_{q}_s"] = min(times)
                results[f"fresh_{label}_{q}_right"] = right
    finally:
        persist.spark.release(fresh)
    return results
