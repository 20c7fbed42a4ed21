"""A Spark driver against a standalone cluster, run by tests/spark/test_cluster.py in a process
of its own (a process has one SparkContext, and the other tests' is a local one).

    python cluster_driver.py exact MASTER BLOB CONSENSUS SHARD NEW_SHARD OUT_DIR
    python cluster_driver.py unready MASTER BLOB CONSENSUS SHARD - OUT_DIR

``exact``: registers the source, reads SHARD by both paths (the Python source, the native
Parquet one), in both modes, into Parquet files under OUT_DIR, and writes rows to NEW_SHARD.
``unready``: the executors' Python lacks persist: writes ``register``'s error to OUT_DIR/error
and the native read's rows (which need persist on the driver only) to OUT_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from pyspark.sql import SparkSession

import persist
import persist.spark


def _session(master: str) -> Any:
    return (
        SparkSession.builder.master(master)
        .appName("persist-cluster-test")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )


def _save(df: Any, path: Path) -> None:
    pq.write_table(df.toArrow(), path)


def main(argv: list[str]) -> None:
    what, master, blob, consensus, shard, new_shard, out_dir = argv
    out = Path(out_dir)
    where = {"blob": blob, "consensus": consensus}
    spark = _session(master)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if what == "unready":
            try:
                persist.spark.register(spark)
            except persist.InvalidUsage as exc:
                (out / "error").write_text(str(exc))
            native = persist.spark.read(spark, shard=shard, **where)
            _save(native, out / "native_contents.parquet")
            return
        persist.spark.register(spark)
        for mode in ("contents", "updates"):
            source = spark.read.format("persist").options(shard=shard, mode=mode, splits=4, **where)
            _save(source.load(), out / f"source_{mode}.parquet")
            native = persist.spark.read(spark, shard=shard, mode=mode, **where)
            _save(native, out / f"native_{mode}.parquet")
        rows = spark.range(0, 30_000, numPartitions=4).selectExpr(
            "id as k", "cast(id % 7 as string) as v"
        )
        rows.write.format("persist").options(shard=new_shard, **where).mode("append").save()
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
