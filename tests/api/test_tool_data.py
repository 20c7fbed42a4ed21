"""Appends take what tools produce (Polars, DuckDB, string views, dictionaries, time-zone
aliases, narrower numbers, nullable data for NOT NULL fields): converted where nothing
changes, refused naming the column and both types otherwise. On every location."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import persist

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        ("price", pa.decimal128(12, 2)),
        ("at", pa.timestamp("us", "UTC")),
        ("score", pa.float64()),
    ]
)
ROWS = [
    (1, "ada", Decimal("3.50"), datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), 0.5),
    (2, "bob", None, None, None),
]


def _contents(table: pa.Table) -> list[tuple[object, ...]]:
    return sorted(tuple(r[n] for n in SCHEMA.names) for r in table.to_pylist())


async def test_polars_duckdb_views_and_dictionaries_append_as_they_come(
    client: persist.PersistClient,
) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    polars = pl.DataFrame(
        {
            "id": [1, 2],
            "name": ["ada", "bob"],
            "price": pl.Series([Decimal("3.50"), None], dtype=pl.Decimal(10, 2)),
            "at": pl.Series([datetime.datetime(2026, 1, 1), None]).dt.replace_time_zone("Etc/UTC"),
            "score": pl.Series([0.5, None], dtype=pl.Float32),
        }
    ).to_arrow()  # large/view strings, a narrower decimal and float, an alias of UTC
    assert polars.schema.field("name").type != pa.string()
    t = await write.append_next(polars)
    assert _contents(await read.snapshot_and_fetch(t)) == ROWS

    con = duckdb.connect()
    result = con.sql(
        "select 3::integer as id, 'cyd' as name, 1.25::decimal(4,2) as price, "
        "timestamptz '2026-01-02 00:00:00+00' as at, 2.0::double as score"
    ).to_arrow_table()  # nullable everything, an int32, a decimal(4, 2)
    await write.append_next(result)
    tpch_like = pa.table(
        {
            "id": pa.array([4], pa.int64()),
            "name": pa.array(["dee"], pa.string_view()),
            "price": pa.array([Decimal("1.00")], pa.decimal128(12, 2)),
            "at": pa.array([None], pa.timestamp("us", "UTC")),
            "score": pa.array([None], pa.float64()),
        }
    )
    await write.append_next(tpch_like)
    encoded = pa.table(
        {
            "id": pa.array([5], pa.int8()),
            "name": pa.array(["eve"]).dictionary_encode(),
            "price": pa.array([None], pa.decimal128(12, 2)),
            "at": pa.array([None], pa.timestamp("us", "UTC")),
            "score": pa.array([1.0], pa.float64()),
        }
    )
    t = await write.append_next(encoded)
    got = await read.snapshot_and_fetch(t)
    assert got.schema.remove_metadata() == persist_full(SCHEMA)
    assert sorted(got.column("name").to_pylist()) == ["ada", "bob", "cyd", "dee", "eve"]
    assert pc.sum(got.column("_diff")).as_py() == 5


def persist_full(schema: pa.Schema) -> pa.Schema:
    return pa.schema(
        [*schema, pa.field("_time", pa.uint64(), False), pa.field("_diff", pa.int64(), False)]
    )


async def test_timestamps_in_a_coarser_unit_append_converted(
    client: persist.PersistClient,
) -> None:
    # Seconds and milliseconds are whole microseconds: every write path takes them.
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    at = datetime.datetime(2026, 1, 1, 12, 30, 15, 250_000, tzinfo=datetime.UTC)
    whole = at.replace(microsecond=0)
    for i, (unit, tz, value) in enumerate(
        [("s", "UTC", whole), ("ms", "Etc/UTC", at), ("ms", "UTC", None)]
    ):
        await write.append_next(
            pa.table(
                {
                    "id": pa.array([i], pa.int64()),
                    "name": pa.array(["x"]),
                    "price": pa.array([None], pa.decimal128(12, 2)),
                    "at": pa.array([value], pa.timestamp(unit, tz)),
                    "score": pa.array([None], pa.float64()),
                }
            )
        )
    got = await read.snapshot_and_fetch(2)
    assert got.schema.field("at").type == pa.timestamp("us", "UTC")
    assert sorted(got.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 0, "name": "x", "price": None, "at": whole, "score": None, "_time": 2, "_diff": 1},
        {"id": 1, "name": "x", "price": None, "at": at, "score": None, "_time": 2, "_diff": 1},
        {"id": 2, "name": "x", "price": None, "at": None, "score": None, "_time": 2, "_diff": 1},
    ]


async def test_lossy_or_null_data_is_refused_naming_the_column(
    client: persist.PersistClient,
) -> None:
    write = await client.open_writer(persist.ShardId.new(), SCHEMA)
    good = {
        "id": pa.array([1], pa.int64()),
        "name": pa.array(["a"]),
        "price": pa.array([None], pa.decimal128(12, 2)),
        "at": pa.array([None], pa.timestamp("us", "UTC")),
        "score": pa.array([None], pa.float64()),
    }
    bad = [
        ("price", pa.array([Decimal("1.234")], pa.decimal128(12, 3)), "decimal128\\(12, 3\\)"),
        ("at", pa.array([0], pa.timestamp("us", "Europe/Paris")), "Europe/Paris"),
        ("at", pa.array([0], pa.timestamp("ns", "UTC")), "timestamp\\[ns"),
        ("id", pa.array([1], pa.uint64()), "uint64"),
        ("score", pa.array([1], pa.int64()), "'score' has type int64"),
        ("name", pa.array([None], pa.string()), "not nullable"),
    ]
    for column, array, message in bad:
        data = pa.table({**good, column: array})
        with pytest.raises(persist.InvalidUsage, match=f"'{column}'.*{message}|{message}"):
            await write.append_next(data)
    assert write.upper == 0  # nothing was written


async def test_open_takes_view_schemas_and_names_what_differs(
    client: persist.PersistClient,
) -> None:
    shard = persist.ShardId.new()
    views = pa.schema([pa.field("k", pa.int64(), nullable=False), ("v", pa.string_view())])
    write = await client.open_writer(shard, views)  # what pyarrow reads tpchgen-cli files as
    assert write.schema == pa.schema(
        [pa.field("k", pa.int64(), nullable=False), ("v", pa.string())]
    )
    await client.open_writer(shard, pa.schema([("k", pa.int64()), ("v", pa.large_string())]))
    with pytest.raises(persist.InvalidUsage) as info:
        await client.open_writer(shard, pa.schema([("k", pa.int64()), ("v", pa.int32())]))
    assert "column 'v' is int32, the shard's is string" in str(info.value)
    assert "column 'k'" not in str(info.value)  # only what differs


def _tpchgen(out: Path) -> Path:
    # In the test extra, installed beside this interpreter (a venv need not be activated).
    exe = Path(sys.executable).parent / "tpchgen-cli"
    cmd = str(exe) if exe.exists() else shutil.which("tpchgen-cli")
    assert cmd, "tpchgen-cli is in the test extra"
    subprocess.run(
        [cmd, "parquet", "-s", "0.01", "--tables=nation,orders", f"--output-dir={out}"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


async def test_tpchgen_parquet_appends_as_it_comes(tmp_path: Path) -> None:
    # Casts are the same on every location: the embedded default alone keeps this quick.
    files = _tpchgen(tmp_path / "tpch")
    client = await persist.connect(
        blob=f"file://{tmp_path}/blob", consensus=f"sqlite:///{tmp_path}/consensus.db"
    )
    async with client:
        await _append_tpch(client, files)


async def _append_tpch(client: persist.PersistClient, files: Path) -> None:
    for table in ("nation", "orders"):
        data = pq.read_table(files / f"{table}.parquet")  # string views, NOT NULL, field ids
        assert pa.string_view() in data.schema.types
        shard = persist.ShardId.new()
        write, read = await client.open(shard, data.schema)
        t = await write.append_next(data)
        got = await read.snapshot_and_fetch(t)
        assert got.num_rows == data.num_rows
        assert write.schema.field(1).nullable is False  # what the file said stays said
        want = data.cast(write.schema)
        key = [(data.schema.names[0], "ascending")]
        assert got.select(want.schema.names).sort_by(key).equals(want.sort_by(key))
        # The same file through DuckDB (every column nullable) and Polars (large strings).
        path = str(files / f"{table}.parquet")
        await write.append_next(duckdb.sql(f"select * from '{path}'").to_arrow_table())
        t = await write.append_next(pl.read_parquet(path).to_arrow())
        assert pc.sum((await read.snapshot_and_fetch(t))["_diff"]).as_py() == 3 * data.num_rows
