"""A real local Spark (``local[2]``) for the persist source: one session for the whole run.

Executors are separate Python workers running the test interpreter; they reach the same file blob
and the real Postgres consensus the location tests use.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import persist

os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    import persist.spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("persist-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    persist.spark.register(session)
    yield session
    session.stop()


class Location:
    """A file blob under a test's tmp dir and the Postgres consensus, as Spark options."""

    def __init__(self, root: Path, postgres_uri: str) -> None:
        self.blob = f"file://{root}/blob"
        self.consensus = postgres_uri
        self.blob_dir = root / "blob"

    def options(self, shard: str, **more: object) -> dict[str, str]:
        return {"shard": shard, "blob": self.blob, "consensus": self.consensus} | {
            k: str(v) for k, v in more.items()
        }

    def run(self, fn: Any) -> Any:
        """``await fn(client)`` on a fresh client of this location."""

        async def go() -> Any:
            async with await persist.connect(self.blob, self.consensus) as client:
                return await fn(client)

        return asyncio.run(go())

    def blob_keys(self) -> set[str]:
        return {str(p.relative_to(self.blob_dir)) for p in self.blob_dir.rglob("*") if p.is_file()}


@pytest.fixture
def loc(tmp_path: Path, postgres_uri: str) -> Location:
    return Location(tmp_path, postgres_uri)


def times(values: list[int]) -> pa.Array:
    return pa.array(values, pa.uint64())
