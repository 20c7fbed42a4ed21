"""A part damaged in blob (one flipped bit in a data page) fails Spark's reads of it, the native
read (Spark's own Parquet reader, verifying page checksums) and the verified one alike: never
other rows."""

from __future__ import annotations

import asyncio
from typing import Any

import pyarrow as pa
import pytest

import persist
import persist.spark
from tests.damaged import RANDOM, damage_file, random_values
from tests.spark.conftest import Location, times

SCHEMA = pa.schema([("k", pa.int64()), (RANDOM, pa.int64())])
N = 4000


def _one_part(loc: Location) -> tuple[str, str]:
    """A shard of one part of N rows (one row group) in blob, and its file's URI."""
    shard = str(persist.ShardId.new())
    rows = pa.table(
        {"k": pa.array(range(N), pa.int64()), RANDOM: random_values(N), "_time": times([0] * N)}
    )

    async def go() -> str:
        config = persist.PersistConfig(inline_writes_max_bytes=0)
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            write = await client.open_writer(shard, SCHEMA)
            await write.compare_and_append(rows, 0, 1)
            await write.expire()
            plan = await client.plan_scan(shard, as_of=0)
            await plan.release()
            [uri] = plan.files
            return uri

    return shard, asyncio.run(go())


def test_a_damaged_part_fails_spark_reads_and_never_answers_other_rows(
    spark: Any, loc: Location
) -> None:
    shard, uri = _one_part(loc)
    native = persist.spark.read(spark, **loc.options(shard))
    assert sorted(r.k for r in native.collect()) == list(range(N))  # undamaged, it reads
    persist.spark.release(native)
    damage_file(uri)

    native = persist.spark.read(spark, **loc.options(shard))
    for df in (native, native.select(RANDOM), native.where(native.k >= 0)):
        with pytest.raises(Exception, match="CRC checksum verification failed"):
            df.collect()
    persist.spark.release(native)
    verified = persist.spark.read(spark, **loc.options(shard, verify=True))
    with pytest.raises(Exception, match=r"persist\.IntegrityError: .*checksum"):
        verified.collect()
