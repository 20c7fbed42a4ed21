"""``WriteHandle.batch_builder``: a batch written in parts as its updates arrive."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

import persist
from persist.core.shard import keys
from tests.api.conftest import SCHEMA, contents, fast_config, updates

TARGET = 64 << 10


@pytest.fixture
async def client() -> AsyncIterator[persist.PersistClient]:
    where = f"mem://{uuid.uuid4().hex}"
    # Every part in blob, where the test can see it.
    config = fast_config(part_target_bytes=TARGET, inline_writes_max_bytes=0)
    async with await persist.connect(where, where, config=config) as c:
        yield c


def chunk(i: int) -> list[int]:
    return list(range(i * 1000, (i + 1) * 1000))


async def written(client: persist.PersistClient, shard: str, writer_id: str) -> list[str]:
    return await client.blob.list_keys(keys.writer_prefix(shard, writer_id))


async def test_parts_are_written_as_updates_arrive(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    builder = write.batch_builder(0, 10)
    seen = []
    for i in range(40):  # ~30 KiB each
        await builder.add(updates(chunk(i), i % 10))
        seen.append(len(await written(client, shard, write.writer_id)))
    # Parts went to blob along the way, each once about a target's worth had come.
    assert seen[0] == 0 and 10 <= seen[-1] <= 40 and seen == sorted(seen)
    batch = await builder.finish(10)
    assert batch.lower == 0 and batch.upper == 10 and batch.rows == 40_000
    assert all(p.nbytes < 2 * TARGET for p in batch.hollow.parts)
    with pytest.raises(persist.InvalidUsage, match="finished or discarded"):
        await builder.add(updates([1], 1))
    await builder.discard()  # the batch is the caller's now: nothing happens
    await write.compare_and_append_batch([persist.Batch.from_bytes(batch.to_bytes())], 0, 10)
    reader = await client.open_leased_reader(shard)
    got = contents(await reader.snapshot_and_fetch(9))
    assert got == {(k, f"v{k}"): 1 for k in range(40_000)}


@pytest.mark.parametrize("bad", ["time past the upper", "time below the lower", "wrong column"])
async def test_a_bad_add_deletes_what_the_builder_wrote(
    client: persist.PersistClient, bad: str
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    builder = write.batch_builder(2, 5)
    for i in range(10):
        await builder.add(updates(chunk(i), 3))
    assert await written(client, shard, write.writer_id)
    wrong = {
        "time past the upper": updates([1], 5),
        "time below the lower": updates([1], 1),
        "wrong column": updates([1], 3).rename_columns(["k", "w", "_time", "_diff"]),
    }[bad]
    with pytest.raises(persist.InvalidUsage):
        await builder.add(wrong)
    assert await written(client, shard, write.writer_id) == []
    with pytest.raises(persist.InvalidUsage, match="finished or discarded"):
        await builder.finish(5)


async def test_finish_takes_an_upper_within_the_builders_above_its_times(
    client: persist.PersistClient,
) -> None:
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    # An unbounded builder: finish picks the upper (here just above the times added).
    builder = write.batch_builder(0, None)
    for i in range(10):
        await builder.add(updates(chunk(i), 7))
    batch = await builder.finish(8)
    assert (batch.lower, batch.upper, batch.rows) == (0, 8, 10_000)
    await write.compare_and_append_batch([batch], 0, 8)
    for upper, bound in ((10, None), (12, 11)):
        builder = write.batch_builder(8, bound)
        for i in range(10):
            await builder.add(updates(chunk(i), 10))
        with pytest.raises(persist.InvalidUsage, match="must be at most"):
            await builder.finish(upper)
        # Refused, it deleted its parts; the committed batch's are still there.
        left = set(await written(client, shard, write.writer_id))
        assert left == {p.key for p in batch.hollow.parts}
    # Discarded before finishing: its parts are gone too.
    builder = write.batch_builder(8, 9)
    for i in range(10):
        await builder.add(updates(chunk(i), 8))
    await builder.discard()
    assert set(await written(client, shard, write.writer_id)) == {p.key for p in batch.hollow.parts}
