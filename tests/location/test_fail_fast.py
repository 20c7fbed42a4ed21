"""A wrong location fails at once with its cause: Postgres refused or a wrong database, a
missing bucket, an unknown URI query parameter. (How long each takes is a figure in the
notes, not asserted: the machines are shared.)"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

import persist

SCHEMA = pa.schema([("k", pa.int64())])


async def _open(blob: str, consensus: str) -> None:
    async with await persist.connect(blob, consensus) as client:
        await client.open_writer(persist.ShardId.new(), SCHEMA)


@pytest.mark.parametrize(
    ("uri", "cause"),
    [
        ("postgresql://postgres@127.0.0.1:1/test", "Connection refused"),
        ("postgresql://postgres@127.0.0.1:5432/no_such_database", 'database "no_such_database"'),
    ],
)
async def test_a_wrong_postgres_fails_with_its_cause(
    uri: str, cause: str, postgres_uri: str
) -> None:
    with pytest.raises(persist.ExternalError, match=cause) as info:
        await _open(f"mem://{uuid.uuid4().hex}", uri)
    assert info.value.determinate  # nothing happened: safe to retry once it is fixed


async def test_a_missing_bucket_fails_naming_it(s3_endpoint: str) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    blob = f"s3://{bucket}/p?endpoint_url={s3_endpoint}&region=us-east-1"
    with pytest.raises(persist.ExternalError, match=f"NoSuchBucket|{bucket}"):
        await _open(blob, f"mem://{uuid.uuid4().hex}")


@pytest.mark.parametrize(
    ("blob", "consensus", "name"),
    [
        ("s3://b/p?endpoint=http://127.0.0.1:9", "mem://x", "endpoint"),
        ("s3://b/p?endpoint_url=http://127.0.0.1:9&regoin=eu", "mem://x", "regoin"),
        ("file:///tmp/x?mode=ro", "mem://x", "mode"),
        ("mem://x", "sqlite:///tmp/c.db?timeout=5", "timeout"),
        ("mem://x?shared=1", "mem://x", "shared"),
    ],
)
async def test_an_unknown_uri_parameter_is_refused(blob: str, consensus: str, name: str) -> None:
    with pytest.raises(persist.InvalidUsage, match=f"unknown URI query parameter.*'{name}'"):
        await _open(blob, consensus)
