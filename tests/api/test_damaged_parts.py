"""A part damaged in blob (one flipped bit in a data page) fails every read path: persist's own
reads and the engines that read the part files themselves. None answers other rows."""

from __future__ import annotations

import asyncio
import urllib.parse

import duckdb
import pyarrow as pa
import pytest

import persist
from persist.errors import IntegrityError
from tests.damaged import RANDOM, damage_file, flip_in_data_page, random_values

from .conftest import Connect

SCHEMA = pa.schema([("k", pa.int64()), (RANDOM, pa.int64())])
N = 4000


def _damage(uri: str, request: pytest.FixtureRequest) -> None:
    if uri.startswith("file:"):
        damage_file(uri)
        return
    import boto3

    where = urllib.parse.urlparse(uri)
    bucket, key = where.netloc, urllib.parse.unquote(where.path.lstrip("/"))
    s3 = boto3.client(
        "s3", endpoint_url=request.getfixturevalue("s3_endpoint"), region_name="us-east-1"
    )
    data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=flip_in_data_page(data))


@pytest.mark.parametrize("location", ["file+postgres", "s3+postgres"], indirect=True)
async def test_a_damaged_part_fails_every_read_and_never_answers_other_rows(
    connect: Connect, location: tuple[str, str], request: pytest.FixtureRequest
) -> None:
    client = await connect(inline_writes_max_bytes=0)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    rows = pa.table(
        {
            "k": pa.array(range(N), pa.int64()),
            RANDOM: random_values(N),
            "_time": pa.array([0] * N, pa.uint64()),
        }
    )
    await write.compare_and_append(rows, 0, 1)
    plan = await client.plan_scan(shard, as_of=0)
    [uri] = plan.files  # one part of one row group, in blob
    await plan.release()
    _damage(uri, request)
    # Another client: the writer's holds the part it wrote in memory.
    _, read = await (await connect()).open(shard, SCHEMA)

    # persist's own reads verify the part's checksum.
    with pytest.raises(IntegrityError, match="checksum"):
        await read.snapshot_and_fetch(0)
    with pytest.raises(IntegrityError, match="checksum"):
        await asyncio.to_thread(
            persist.read_table, shard, blob=location[0], consensus=location[1], as_of=0
        )
    # The dataset scans the part file in place, verifying its pages: pyarrow and DuckDB.
    data = await read.dataset(0)
    assert data.files  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        data.to_table()
    with pytest.raises(duckdb.Error, match="CRC checksum verification failed"):
        duckdb.sql("select * from data").fetchall()
