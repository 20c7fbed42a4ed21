"""read.dataset: a snapshot that DuckDB, Polars and pyarrow scan lazily, on every location."""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

import persist

from .conftest import SCHEMA, Connect, updates


def _pairs(table: pa.Table) -> list[tuple[int, str]]:
    return sorted(zip(table.column("k").to_pylist(), table.column("v").to_pylist(), strict=True))


async def test_engines_scan_a_snapshot(connect: Connect, location: tuple[str, str]) -> None:
    client = await connect(inline_writes_max_bytes=2048)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates(list(range(2000)), 0), 0, 1)  # a part in blob
    await write.compare_and_append(updates([5000, 5001], 1), 1, 2)  # inline, in the state
    expected = [(k, f"v{k}") for k in [*range(2000), 5000, 5001]]

    data = await read.dataset(1)
    assert isinstance(data, ds.Dataset) and data.schema == SCHEMA
    in_place = location[0].startswith(("file:", "s3:"))
    files = [f for c in getattr(data, "children", [data]) for f in getattr(c, "files", [])]
    assert bool(files) == in_place  # part files scanned where they lie; mem: in memory
    assert _pairs(data.to_table()) == expected
    # DuckDB and Polars, with their own filter and projection.
    got = duckdb.sql("select k, v from data where k >= 1990 order by k").fetchall()
    assert got == [(k, f"v{k}") for k in [*range(1990, 2000), 5000, 5001]]
    assert duckdb.sql("select count(*), sum(k) from data").fetchall() == [
        (2002, sum(range(2000)) + 5000 + 5001)
    ]
    frame = pl.scan_pyarrow_dataset(data).filter(pl.col("k") < 3).select("v").collect()
    assert sorted(frame["v"].to_list()) == ["v0", "v1", "v2"]

    # Retractions and multiplicities: consolidated (in memory), exact.
    await write.compare_and_append(updates([1, 2, 2], 2, [-1, 1, 1]), 2, 3)
    after = await read.dataset(2)
    rows = _pairs(after.to_table())
    assert (1, "v1") not in rows and rows.count((2, "v2")) == 3 and len(rows) == 2003
    assert duckdb.sql("select count(*) from after where k = 2").fetchall() == [(3,)]
    # As of an earlier time, parts holding later updates are read to that time.
    assert _pairs((await read.dataset(0)).to_table()) == [(k, f"v{k}") for k in range(2000)]
