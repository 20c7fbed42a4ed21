"""Folds: a merge of few parts lists them as they are, in the commit of the append that makes
it due; only ``compaction_min_parts`` parts or more are rewritten."""

from __future__ import annotations

import asyncio

import persist
from persist.core.shard import keys
from tests.api.conftest import SCHEMA, Connect, contents, updates


async def test_small_appends_fold_without_writing_then_merge_at_min_parts(
    connect: Connect,
) -> None:
    client = await connect(compaction_min_parts=8)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)

    async def listen() -> dict[tuple[int, str], int]:
        seen: dict[tuple[int, str], int] = {}
        async for event in read.listen(0):
            for key, n in contents(event.updates).items():
                seen[key] = seen.get(key, 0) + n
            if event.upper == 8:
                return seen
        raise AssertionError("the listen ended")

    # Started before the appends, it reads them as they fold.
    listening = asyncio.create_task(listen())
    await asyncio.sleep(0)
    for t in range(7):
        await write.compare_and_append(updates([t], t), t, t + 1)
    await client.maintain(shard)
    # Seven one-part appends: folds of 4, 2 and 1 parts, by a binary counter; no merge is
    # due below eight parts, so nothing was rewritten.
    info = await client.inspect(shard)
    assert (info["batches"], info["parts"], info["rows"]) == (3, 7, 7)
    assert await client.blob.list_keys(keys.compaction_prefix(shard)) == []
    assert contents(await read.snapshot_and_fetch(6)) == {(t, f"v{t}"): 1 for t in range(7)}
    assert contents(await read.snapshot_and_fetch(2)) == {(t, f"v{t}"): 1 for t in range(3)}

    await write.compare_and_append(updates([7], 7), 7, 8)
    await client.maintain(shard)
    info = await client.inspect(shard)
    assert (info["batches"], info["parts"], info["rows"]) == (1, 1, 8)
    assert contents(await read.snapshot_and_fetch(7)) == {(t, f"v{t}"): 1 for t in range(8)}

    # Snapshot at 0 plus the listen from 0 saw every update once, whatever folded or merged
    # meanwhile.
    seen = await asyncio.wait_for(listening, 30)
    for key, n in contents(await read.snapshot_and_fetch(0)).items():
        seen[key] = seen.get(key, 0) + n
    assert seen == {(t, f"v{t}"): 1 for t in range(8)}
