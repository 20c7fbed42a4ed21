"""Fixtures for the contract tests: every test runs on each kind of location."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pyarrow as pa
import pytest

import persist

LOCATIONS = ["mem", "file+sqlite", "file+postgres", "s3+postgres"]
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def fast_config(**overrides: object) -> persist.PersistConfig:
    # Readers alone hold history here (retention None): these tests prove the reader holds of
    # the contract, which a retention window would mask; tests of retention set one.
    base: dict[str, object] = {
        "poll_interval_s": 0.01,
        "retry_initial_delay_s": 0.001,
        "retention_s": None,
    }
    base.update(overrides)
    return persist.PersistConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint: str) -> str:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="persist-api")
    return "persist-api"


@pytest.fixture(params=LOCATIONS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(blob URI, consensus URI) of a fresh location of each kind."""
    kind = request.param
    unique = uuid.uuid4().hex
    if kind == "mem":
        return f"mem://{unique}", f"mem://{unique}"
    file_blob = (tmp_path / "blob").as_uri()
    if kind == "file+sqlite":
        return file_blob, f"sqlite://{tmp_path / 'consensus.db'}"
    postgres = request.getfixturevalue("postgres_uri")
    if kind == "file+postgres":
        return file_blob, postgres
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{unique}?endpoint_url={endpoint}&region=us-east-1", postgres


Connect = Callable[..., Awaitable[persist.PersistClient]]


@pytest.fixture
async def connect(location: tuple[str, str]) -> AsyncIterator[Connect]:
    """Opens clients on the test's location (each its own connections, like another process)."""
    clients: list[persist.PersistClient] = []

    async def open_client(**overrides: object) -> persist.PersistClient:
        client = await persist.connect(location[0], location[1], config=fast_config(**overrides))
        clients.append(client)
        return client

    yield open_client
    for c in clients:
        await c.close()


@pytest.fixture
async def client(connect: Connect) -> persist.PersistClient:
    return await connect()


def updates(keys: list[int], time: int | list[int], diff: int | list[int] = 1) -> pa.Table:
    n = len(keys)
    times = time if isinstance(time, list) else [time] * n
    diffs = diff if isinstance(diff, list) else [diff] * n
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "v": pa.array([f"v{k}" for k in keys], pa.string()),
            "_time": pa.array(times, pa.uint64()),
            "_diff": pa.array(diffs, pa.int64()),
        }
    )


def contents(table: pa.Table) -> dict[tuple[int, str], int]:
    """Row -> multiplicity, checking the table is consolidated."""
    out: dict[tuple[int, str], int] = {}
    for r in table.to_pylist():
        key = (r["k"], r["v"])
        assert key not in out and r["_diff"] != 0
        out[key] = r["_diff"]
    return out
