"""write.delete_where: retracting rows by predicate, linearized against concurrent writers."""

from __future__ import annotations

import asyncio
import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist

from .conftest import SCHEMA, Connect, contents, updates


async def test_delete_where_retracts_the_matching_rows(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2, 3, 4], 0, [1, 2, 1, 1]), 0, 1)
    assert await write.delete_where(pc.field("k") >= 3) == 2
    assert await write.delete_where(pc.field("v") == "v2") == 2  # its multiplicity
    assert write.upper == 3
    assert contents(await read.snapshot_and_fetch(2)) == {(1, "v1"): 1}
    assert contents(await read.snapshot_and_fetch(0)) == {
        (1, "v1"): 1,
        (2, "v2"): 2,
        (3, "v3"): 1,
        (4, "v4"): 1,
    }
    assert await write.delete_where(pc.field("k") == 99) == 0  # nothing matches: no append
    assert write.upper == 3
    with pytest.raises(persist.InvalidUsage, match="Expression"):
        await write.delete_where("k = 1")  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage, match="predicate"):
        await write.delete_where(pc.field("nope") == 1)
    info = await client.inspect(shard)
    assert info["readers"] == 1  # its own scratch readers are gone


async def test_delete_where_refuses_predicates_on_time_or_diff(
    client: persist.PersistClient,
) -> None:
    # The predicate runs on the contents as of the upper - 1, where every _time is that as_of
    # and _diff a summed multiplicity: `_time >= 5` would match every row, not the late ones.
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates(list(range(10)), list(range(10))), 0, 10)
    for predicate, column in [
        (pc.field("_time") >= 5, "_time"),
        (pc.field("_diff") == 1, "_diff"),
        ((pc.field("k") < 3) | (pc.field("_time") > 7), "_time"),
    ]:
        with pytest.raises(persist.InvalidUsage, match=column):
            await write.delete_where(predicate)
    assert await write.fetch_recent_upper() == 10  # nothing was appended
    assert len(contents(await read.snapshot_and_fetch(9))) == 10
    assert (await client.inspect(shard))["readers"] == 1  # no scratch reader left behind


async def test_delete_where_on_an_empty_shard(client: persist.PersistClient) -> None:
    write = await client.open_writer(persist.ShardId.new(), SCHEMA)
    assert await write.delete_where(pc.field("k") == 1) == 0


async def test_delete_where_is_linearized_with_concurrent_writers(connect: Connect) -> None:
    # Writers append rows (some matching) while a deleter deletes by predicate, all racing on
    # the upper. Each delete's commit at time T must leave no matching row as of T, and must
    # have retracted exactly the matching rows as of T - 1: no write lost, none missed.
    clients = [await connect() for _ in range(3)]
    shard = persist.ShardId.new()
    matching = pc.field("k") < 50
    rng = random.Random(5)

    async def writer(client: persist.PersistClient, seed: int) -> None:
        w = await client.open_writer(shard, SCHEMA, "writer")
        r = random.Random(seed)
        for _ in range(15):
            keys = r.sample(range(100), 3)
            while True:
                upper = await w.fetch_recent_upper()
                assert upper is not None
                try:
                    await w.compare_and_append(updates(keys, upper), upper, upper + 1)
                    break
                except persist.UpperMismatch:
                    continue

    deleted: list[int] = []

    async def deleter() -> None:
        w = await clients[2].open_writer(shard, SCHEMA, "deleter")
        for _ in range(8):
            await asyncio.sleep(rng.random() * 0.02)
            deleted.append(await w.delete_where(matching))

    await clients[0].open_writer(shard, SCHEMA)
    await asyncio.gather(writer(clients[0], 1), writer(clients[1], 2), deleter())
    read = await clients[0].open_leased_reader(shard)
    commits = [h for h in await clients[0].history(shard) if h["purpose"] == "deleter"]
    assert len(commits) == sum(1 for d in deleted if d)
    for h, count in zip(commits, [d for d in deleted if d], strict=True):
        t = h["upper"] - 1
        after = await read.snapshot_and_fetch(t)
        assert after.filter(matching).num_rows == 0
        before = await read.snapshot_and_fetch(t - 1)
        assert pc.sum(before.filter(matching).column("_diff")).as_py() == count
        assert h["rows_retracted"] == before.filter(matching).num_rows
    assert any(deleted)  # the race did retract something
    final = await read.snapshot_and_fetch((await clients[0].frontiers(shard))[1] - 1)
    assert pa.compute.min(final.column("_diff")).as_py() > 0
