"""Inline writes: a small part lives in the state itself, so its commit is the write's only I/O."""

from __future__ import annotations

import pytest

import persist
from persist.core.read.queries import inline_bytes
from persist.core.shard import garbage, keys
from tests.api.conftest import SCHEMA, Connect, contents, updates


def rows(ks: range) -> dict[tuple[int, str], int]:
    return {(k, f"v{k}"): 1 for k in ks}


async def test_a_small_append_is_inline_and_reads_back_anywhere(connect: Connect) -> None:
    client = await connect(compaction_enabled=False)
    shard = persist.ShardId.new()
    write, _holds_since = await client.open(shard, SCHEMA)
    for t in range(3):
        await write.compare_and_append(updates([t], t), t, t + 1)
    assert await client.blob.list_keys(keys.writer_prefix(shard, write.writer_id)) == []
    state = client._shards.machines[shard].state
    assert inline_bytes(state) > 0
    assert all(p.inline for b in state.batches.values() for p in b.parts)
    # Another client (no memory of the writes): snapshots, time travel, a listen, a split.
    other = await connect(recent_parts_bytes=0)
    reader = await other.open_leased_reader(shard, SCHEMA)
    assert contents(await reader.snapshot_and_fetch(2)) == rows(range(3))
    assert contents(await reader.snapshot_and_fetch(1)) == rows(range(2))
    [split] = await reader.snapshot(2)
    assert contents(await other.fetch_split(persist.Split.from_bytes(split.to_bytes()))) == rows(
        range(3)
    )
    async for event in reader.listen(0):
        assert contents(event.updates) == rows(range(1, 3))
        break


async def test_big_parts_and_parts_past_the_total_go_to_blob(connect: Connect) -> None:
    client = await connect(compaction_enabled=False, inline_writes_total_max_bytes=1)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates(list(range(1000)), 0), 0, 1)  # over 4 KiB encoded
    await write.compare_and_append(updates([1000], 1), 1, 2)  # inline: none held yet
    await write.compare_and_append(updates([1001], 2), 2, 3)  # the total is reached: blob
    state = client._shards.machines[shard].state
    by_lower = {b.lower: b.parts for b in state.batches.values()}
    assert [bool(by_lower[t][0].inline) for t in range(3)] == [False, True, False]
    assert len(await client.blob.list_keys(keys.writer_prefix(shard, write.writer_id))) == 2
    assert contents(await read.snapshot_and_fetch(2)) == rows(range(1002))


async def test_a_merge_moves_inline_parts_to_blob(connect: Connect) -> None:
    client = await connect(compaction_enabled=False, compaction_min_parts=1)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    for t in range(4):
        await write.compare_and_append(updates([t], t), t, t + 1)
    assert (await client.maintain(shard))["merges"] >= 1
    state = client._shards.machines[shard].state
    assert len(state.batches) == 1 and inline_bytes(state) == 0
    # Nothing to delete for the inline inputs; the merged part is the only blob part.
    assert not state.retired
    assert set(await client.blob.list_keys(f"{shard}/")) == garbage.referenced_keys(state)
    assert contents(await read.snapshot_and_fetch(3)) == rows(range(4))


async def test_a_handed_batch_with_an_inline_part_over_the_limit_is_refused(
    connect: Connect,
) -> None:
    maker, committer = (
        await connect(inline_writes_max_bytes=4096),
        await connect(inline_writes_max_bytes=100),
    )
    shard = persist.ShardId.new()
    w_commit, read = await committer.open(shard, SCHEMA)
    w_make = await maker.open_writer(shard, SCHEMA)
    batch = await w_make.batch(updates([1, 2], 0), 0, 1)
    assert batch.hollow.parts[0].inline
    handed = persist.Batch.from_bytes(batch.to_bytes())
    with pytest.raises(persist.InvalidUsage, match="inline_writes_max_bytes"):
        await w_commit.compare_and_append_batch([handed], 0, 1)
    await w_make.compare_and_append_batch([batch], 0, 1)  # within its own writer's limit
    assert contents(await read.snapshot_and_fetch(0)) == rows(range(1, 3))
    with pytest.raises(persist.InvalidUsage, match="was appended"):
        await maker.delete_batch(batch)
