"""The driver's side of ``persist.spark.read``: the snapshot is held while the driver blocks in
a Spark job longer than the lease, and let go, with no traceback, when the driver exits.

The exit's script runs in a subprocess of its own (the exit is what is tested): it reads a shard with
``persist.spark.read``, whose reader's registration starts a compaction in the background (the
shard has many small batches), and ends without ``release`` or ``spark.stop()``. Consensus is SQLite, as in the README's set-up
(its calls run on a thread pool of their own, as the file blob's do).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import persist
import persist.spark
from tests.spark.conftest import Location

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    import pyarrow as pa
    import persist

    blob, consensus, shard = sys.argv[1:4]

    async def fill() -> None:
        # Compaction off while writing: the read's client finds the merges due.
        config = persist.PersistConfig(compaction_enabled=False)
        async with await persist.connect(blob, consensus, config=config) as client:
            write = await client.open_writer(shard, pa.schema([("k", pa.int64())]), "fill")
            for t in range(12):
                rows = pa.table({"k": range(t * 20_000, (t + 1) * 20_000),
                                 "_time": pa.array([t] * 20_000, pa.uint64())})
                await write.compare_and_append(rows, t, t + 1)
            await write.expire()

    asyncio.run(fill())
    from pyspark.sql import SparkSession
    import persist.spark

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = persist.spark.read(spark, shard=shard, blob=blob, consensus=consensus)
    print("rows", df.count(), flush=True)
    """
)


def test_a_driver_that_read_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(SCRIPT)
    blob, consensus = f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db"
    shard = str(persist.ShardId.new())
    env = os.environ | {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    done = subprocess.run(
        [sys.executable, str(script), blob, consensus, shard],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "rows 240000" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "Error" not in done.stderr, done.stderr
    assert "could not" not in done.stderr, done.stderr
    # The driver's exit let the snapshot go: no reader is left to hold it until its lease ends.
    assert asyncio.run(_readers(blob, consensus, shard)) == 0


async def _readers(blob: str, consensus: str, shard: str) -> int:
    async with await persist.connect(blob, consensus) as client:
        return int((await client.inspect(shard))["readers"])


def test_a_hold_outlives_a_job_longer_than_its_lease(spark: Any, loc: Location) -> None:
    shard = str(persist.ShardId.new())

    async def fill(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, pa.schema([("k", pa.int64())]), "fill")
        for t in range(10):
            rows = pa.table(
                {"k": range(t * 5000, (t + 1) * 5000), "_time": pa.array([t] * 5000, pa.uint64())}
            )
            await write.compare_and_append(rows, t, t + 1)
        await write.expire()

    async def fill_unmerged() -> None:
        # Compaction off: the read holds the appends' own parts, which the maintenance below
        # replaces for sure (a filling client could have merged them before the read).
        still = persist.PersistConfig(compaction_enabled=False)
        async with await persist.connect(loc.blob, loc.consensus, config=still) as client:
            await fill(client)

    asyncio.run(fill_unmerged())
    where = {"blob": loc.blob, "consensus": loc.consensus}
    held = persist.spark.read(spark, shard=shard, lease_duration_s=1, **where)
    # The driver waits in a Spark job for three leases (a sleep on the executor's JVM).
    spark.range(1).selectExpr(
        "reflect('java.lang.Thread', 'sleep', cast(3000 as bigint))"
    ).collect()
    # Compaction replaces the snapshot's parts (the read's client may have started it);
    # garbage collection deletes those no reader holds.
    loc.run(lambda c: c.maintain(shard))
    assert sorted(r.k for r in held.collect()) == list(range(50_000))
    persist.spark.release(held)
    loc.run(lambda c: c.maintain(shard))
    with pytest.raises(Exception, match=r"(?i)not exist|not found"):
        held.collect()  # its parts are gone now: the hold was what kept them
