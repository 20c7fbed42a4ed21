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


def test_s3_timeouts_are_uri_settings() -> None:
    from persist.location import open_blob
    from persist.location.s3 import S3Blob

    blob = open_blob(
        "s3://b/p?endpoint_url=http://127.0.0.1:9&connect_timeout=1.5&read_timeout=7"
        "&max_attempts=2"
    )
    assert isinstance(blob, S3Blob)
    config = blob._get_client().meta.config
    assert (config.connect_timeout, config.read_timeout) == (1.5, 7.0)
    assert config.retries["total_max_attempts"] == 2
    default = open_blob("s3://b/p")
    assert isinstance(default, S3Blob)
    config = default._get_client().meta.config
    assert (config.connect_timeout, config.read_timeout) == (5.0, 20.0)
    assert config.retries["total_max_attempts"] == 3
    for bad in ("connect_timeout=0", "read_timeout=-1", "max_attempts=1.5", "max_attempts=x"):
        with pytest.raises(persist.InvalidUsage, match=bad.split("=")[0]):
            open_blob(f"s3://b/p?{bad}")


async def test_an_s3_endpoint_that_refuses_fails_with_its_cause() -> None:
    blob = "s3://b/p?endpoint_url=http://127.0.0.1:1&connect_timeout=1&max_attempts=1"
    with pytest.raises(persist.ExternalError, match=r"127\.0\.0\.1:1\b"):
        await _open(blob, f"mem://{uuid.uuid4().hex}")


def test_dataset_reads_reach_the_store_boto3_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's S3 filesystem ignores AWS_ENDPOINT_URL; boto3 takes it. Both must go to one
    store, with the URI's timeouts."""
    from persist.location import open_blob

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9123")
    where = open_blob("s3://b/p?read_timeout=9").arrow_location()
    assert where is not None
    options = where[0].__reduce__()[1][0]
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:9123", "http")
    assert (options["connect_timeout"], options["request_timeout"]) == (5.0, 9.0)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    where = open_blob("s3://b/p").arrow_location()  # AWS itself: pyarrow's own default
    assert where is not None and not where[0].__reduce__()[1][0]["endpoint_override"]
