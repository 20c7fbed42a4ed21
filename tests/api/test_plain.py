"""Plain reads and writes: persist.read_table (sync) and write.append_next, on every location."""

from __future__ import annotations

import asyncio
import datetime

import pyarrow as pa
import pytest

import persist

from .conftest import SCHEMA, Connect, updates


def _rows(table: pa.Table) -> list[tuple[int, str]]:
    return sorted(zip(table.column("k").to_pylist(), table.column("v").to_pylist(), strict=True))


async def test_read_table_reads_the_contents_without_asyncio(
    connect: Connect, location: tuple[str, str]
) -> None:
    # A retention keeps history whatever the reads do (readers alone, each read's reader
    # would move the since up to what it read).
    client = await connect(retention_s=3600.0)
    shard = await client.create_shard(
        f"plain.t{persist.ShardId.new().replace('-', '')[:12]}", SCHEMA
    )
    blob, consensus = location
    # Nothing written: empty, with the shard's columns.
    empty = await asyncio.to_thread(persist.read_table, shard, blob=blob, consensus=consensus)
    assert empty.schema == SCHEMA and empty.num_rows == 0
    write = await client.open_writer(shard)
    await write.compare_and_append(updates([1, 2, 3], 0, [1, 2, 1]), 0, 1)
    await write.compare_and_append(updates([3], 1, -1), 1, 2)

    def read(**kw: object) -> pa.Table:
        return persist.read_table(shard, blob=blob, consensus=consensus, **kw)  # type: ignore[arg-type]

    now = await asyncio.to_thread(read)
    assert now.schema == SCHEMA  # the data columns only
    assert _rows(now) == [(1, "v1"), (2, "v2"), (2, "v2")]
    assert _rows(await asyncio.to_thread(read, as_of=0)) == [
        (1, "v1"),
        (2, "v2"),
        (2, "v2"),
        (3, "v3"),
    ]
    instant = datetime.datetime.now(datetime.UTC)
    assert _rows(await asyncio.to_thread(read, as_of=instant)) == _rows(now)
    with pytest.raises(persist.InvalidUsage, match="upper"):
        await asyncio.to_thread(read, as_of=5)  # not readable yet: at once, no wait
    with pytest.raises(persist.InvalidUsage, match="as_of"):
        await asyncio.to_thread(read, as_of="0")
    await write.compare_and_append(updates([9], 2, -1), 2, 3)
    with pytest.raises(persist.InvalidUsage, match="negative multiplicity"):
        await asyncio.to_thread(read)
    assert (await client.inspect(shard))["readers"] == 0  # each read let its reader go


async def test_append_next_lands_every_write_once_at_the_time_it_returns(
    connect: Connect,
) -> None:
    clients = [await connect() for _ in range(3)]
    shard = persist.ShardId.new()
    writers = [await c.open_writer(shard, SCHEMA) for c in clients]

    async def write(i: int, w: persist.WriteHandle) -> list[int]:
        times = []
        for j in range(8):
            data = updates([100 * i + j], 0).drop_columns(["_time"])
            times.append(await w.append_next(data))
        return times

    got = await asyncio.gather(*(write(i, w) for i, w in enumerate(writers)))
    times = sorted(t for ts in got for t in ts)
    assert times == list(range(24))  # every write once, each at its own time
    read = await clients[0].open_leased_reader(shard)
    for i, ts in enumerate(got):
        for j, t in enumerate(ts):
            at = await read.snapshot_and_fetch(t)
            before = await read.snapshot_and_fetch(t - 1) if t else at.slice(0, 0)
            assert at.num_rows - before.num_rows == 1
            assert 100 * i + j in at.column("k").to_pylist()
    rb = updates([7], 0).drop_columns(["_time"]).to_batches()[0]
    assert await writers[0].append_next(rb) == 24
    with pytest.raises(persist.InvalidUsage, match="_time"):
        await writers[0].append_next(updates([1], 0))
    await writers[0].compare_and_append(updates([], 25), 25, None)
    with pytest.raises(persist.InvalidUsage, match="sealed"):
        await writers[1].append_next(updates([1], 0).drop_columns(["_time"]))


async def test_read_table_of_a_dropped_shard_says_it_was_dropped(
    connect: Connect, location: tuple[str, str]
) -> None:
    client = await connect()
    name = f"plain.d{persist.ShardId.new().replace('-', '')[:12]}"
    shard = await client.create_shard(name, SCHEMA)
    write = await client.open_writer(shard)
    await write.compare_and_append(updates([1], 0), 0, 1)
    await write.expire()
    await client.drop_shard(shard)
    blob, consensus = location
    for as_of in (None, 0):
        with pytest.raises(persist.InvalidUsage, match="dropped") as info:
            await asyncio.to_thread(
                persist.read_table, shard, blob=blob, consensus=consensus, as_of=as_of
            )
        assert "give as_of" not in str(info.value) and "since" not in str(info.value)
