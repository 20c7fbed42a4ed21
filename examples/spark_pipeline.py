"""End to end: persist -> Spark -> persist, followed live with ``listen``.

1. Write orders (updates, with a retraction) to a shard with persist's asyncio API.
2. Read a consistent snapshot in Spark (key-range splits, read in parallel from blob).
3. Transform: total amount per user.
4. Write the totals to another shard with the Spark writer (one atomic commit).
5. A ``listen`` on that shard, from a reader opened before the Spark write, hears the totals.

Run it: ``python examples/spark_pipeline.py`` (needs ``pip install -e '.[spark]'`` and Java 17;
it uses a temporary directory for the blob and SQLite for consensus unless ``PERSIST_BLOB_URI`` /
``PERSIST_CONSENSUS_URI`` are set).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from typing import Any

import pyarrow as pa

import persist

ORDERS = pa.schema([("order_id", pa.int64()), ("user", pa.string()), ("amount", pa.int64())])
TOTALS = pa.schema([("user", pa.string()), ("total", pa.int64())])


async def write_orders(client: persist.PersistClient, shard: str) -> None:
    write = await client.open_writer(shard, ORDERS, "example orders")
    placed = pa.table(
        {
            "order_id": [1, 2, 3, 4],
            "user": ["ada", "bob", "ada", "cy"],
            "amount": [30, 12, 5, 40],
            "_time": pa.array([0, 0, 0, 0], pa.uint64()),
        }
    )
    await write.compare_and_append(placed, expected_upper=0, new_upper=1)
    cancelled = pa.table(  # order 2 is cancelled at time 1: a retraction
        {
            "order_id": [2],
            "user": ["bob"],
            "amount": [12],
            "_time": pa.array([1], pa.uint64()),
            "_diff": pa.array([-1], pa.int64()),
        }
    )
    await write.compare_and_append(cancelled, expected_upper=1, new_upper=2)
    await write.expire()


def spark_job(spark: Any, orders: str, totals: str, where: dict[str, str]) -> None:
    from pyspark.sql import functions as F

    snapshot = spark.read.format("persist").options(shard=orders, **where).load()
    per_user = snapshot.groupBy("user").agg(F.sum("amount").alias("total"))
    per_user.write.format("persist").options(shard=totals, time="1", **where).mode("append").save()


async def run(
    spark: Any, blob: str, consensus: str, lease_duration_s: float = 60.0
) -> list[dict[str, Any]]:
    """Runs the pipeline; returns the totals a listen on the totals shard heard after time 0."""
    orders, totals = str(persist.ShardId.new()), str(persist.ShardId.new())
    async with await persist.connect(blob, consensus) as client:
        await write_orders(client, orders)
        # The listen starts at 0: the Spark job writes at time 1. Opened before the job, the
        # reader holds time 0 while the job runs, kept by this client's heartbeats.
        read = await client.open_leased_reader(
            totals, TOTALS, "example listen", lease_duration_s=lease_duration_s
        )
        # A Spark action blocks its thread until the job is done: on a thread of its own, this
        # loop goes on heartbeating the reader, however long the job takes (called here, it
        # would stop every heartbeat of the client until it returned).
        where = {"blob": blob, "consensus": consensus}
        await asyncio.to_thread(spark_job, spark, orders, totals, where)
        heard = await asyncio.wait_for(listened(read), 60)
        await read.expire()
        return heard


async def listened(read: persist.ReadHandle) -> list[dict[str, Any]]:
    """What a listen from time 0 hears first."""
    heard: list[dict[str, Any]] = []
    async for event in read.listen(0):
        heard.extend(event.updates.to_pylist())
        if heard:
            break
    return heard


def pipeline(
    spark: Any, blob: str, consensus: str, lease_duration_s: float = 60.0
) -> list[dict[str, Any]]:
    """Runs the pipeline; returns the totals the listen heard."""
    return asyncio.run(run(spark, blob, consensus, lease_duration_s))


def main() -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import persist.spark

    data = tempfile.mkdtemp(prefix="persist-example-")
    blob = os.environ.get("PERSIST_BLOB_URI", f"file://{data}/blob")
    consensus = os.environ.get("PERSIST_CONSENSUS_URI", f"sqlite:///{data}/consensus.db")
    spark = (
        SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    )
    persist.spark.register(spark)
    try:
        for row in sorted(pipeline(spark, blob, consensus), key=lambda r: r["user"]):
            print(f"{row['user']}: {row['total']} (time {row['_time']}, diff {row['_diff']})")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
