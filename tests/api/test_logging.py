"""The persist logger says what the library does: opens, commits, merges, collections, expiries."""

from __future__ import annotations

import logging

import pytest

import persist

from .conftest import SCHEMA, Connect, updates


async def test_a_debug_session_tells_what_happened(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1_800_000_000_000]
    client = await connect(compaction_min_parts=1, now_ms=lambda: now[0], lease_duration_s=10)
    shard = persist.ShardId.new()
    with caplog.at_level(logging.DEBUG, logger="persist"):
        write = await client.open_writer(shard, SCHEMA, "loader")
        for t in range(6):
            await write.compare_and_append(updates([t], t), t, t + 1)
        await client.maintain(shard)
        now[0] += 60_000  # the first writer's lease runs out; the next commit expires it
        other = await client.open_writer(shard, SCHEMA, "other")
        await other.compare_and_append(updates([9], 6), 6, 7)
    text = caplog.text
    assert f"opened writer {write.writer_id} of shard {shard} ('loader')" in text
    assert f"shard {shard}: committed seqno" in text and "upper 6" in text
    assert f"shard {shard}: merged " in text
    assert f"shard {shard}: writer(s) {write.writer_id} expired" in text
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert any("expired" in r.getMessage() for r in infos)


async def test_a_read_that_waits_says_so(
    client: persist.PersistClient, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    with caplog.at_level(logging.INFO, logger="persist"), pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await read.snapshot_and_fetch(1)  # the upper: readable only once it moves on
    assert "waits for shard" in caplog.text and "to pass as_of 1" in caplog.text
