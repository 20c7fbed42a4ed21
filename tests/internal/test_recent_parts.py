"""The parts a client wrote lately are read back from memory by its own readers."""

from __future__ import annotations

import asyncio

import pyarrow as pa

import persist
from persist.core.arrow.updates import full_schema
from persist.internal.batch import RecentParts
from persist.location.mem import MemBlob, MemConsensus

SCHEMA = pa.schema([("k", pa.int64())])


def _table(n: int) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "_time": pa.array([0] * n, pa.uint64()),
            "_diff": pa.array([1] * n, pa.int64()),
        },
        schema=full_schema(SCHEMA),
    )


def test_the_oldest_parts_go_first_and_only_an_exact_schema_matches() -> None:
    one = _table(100)
    recent = RecentParts(budget_bytes=2 * one.nbytes)
    for key in ("a", "b", "c"):
        recent.put(key, one)
    assert recent.get("a", one.schema) is None  # evicted: over budget
    assert recent.get("c", one.schema) is one
    assert recent.get("c", pa.schema([("k", pa.int32())])) is None
    recent.put("big", _table(100_000))  # bigger than a part read inline: never kept
    assert recent.get("big", one.schema) is None


class _CountingBlob(MemBlob):
    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    async def get(self, key: str) -> bytes | None:
        self.gets += 1
        return await super().get(key)


async def test_a_local_listener_hears_a_write_without_reading_blob() -> None:
    blob, consensus = _CountingBlob(), MemConsensus()
    async with await persist.connect(blob, consensus) as client:
        write, read = await client.open(persist.ShardId.new(), SCHEMA)
        events: asyncio.Queue[persist.ListenEvent] = asyncio.Queue()

        async def listen() -> None:
            async for event in read.listen(0):
                await events.put(event)

        task = asyncio.create_task(listen())
        await asyncio.sleep(0.05)
        before = blob.gets
        updates = pa.table({"k": [7, 3], "_time": pa.array([1, 1], pa.uint64())})
        await write.compare_and_append(updates, 0, 2)
        event = await asyncio.wait_for(events.get(), 10)
        task.cancel()
        assert event.updates.column("k").to_pylist() == [3, 7]
        assert blob.gets == before
        # Another client has no such memory: it reads the same rows from blob.
        async with await persist.connect(blob, consensus) as other:
            other_read = await other.open_leased_reader(write.shard_id, SCHEMA)
            got = await other_read.snapshot_and_fetch(1)
        assert got.column("k").to_pylist() == [3, 7]
        assert blob.gets > before


def test_a_table_of_many_chunks_is_kept_as_one() -> None:
    """Found under a stream of 1-row writes: a group's table of a chunk per write held about
    1.5 KB of native memory per chunk that ``nbytes`` never counted, so the cache held tens of
    times its budget (a server's RSS climbed to ~900 MiB)."""
    recent = RecentParts(1 << 20)
    table = pa.Table.from_batches(
        [pa.record_batch([pa.array([i], pa.int64())], names=["k"]) for i in range(1000)]
    )
    assert table.column(0).num_chunks == 1000
    recent.put("p", table)
    kept = recent.get("p", table.schema)
    assert kept is not None and kept.column(0).num_chunks == 1 and kept.equals(table)


async def _append_four(write: persist.WriteHandle) -> None:
    for t in range(4):
        rows = pa.table({"k": [10 - t, t], "_time": pa.array([t, t], pa.uint64())})
        await write.compare_and_append(rows, t, t + 1)


async def test_a_merge_of_parts_the_client_wrote_reads_none_of_them_from_blob() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    read_keys: list[str] = []
    get = blob.get

    async def spy(key: str) -> bytes | None:
        read_keys.append(key)
        return await get(key)

    blob.get = spy  # type: ignore[method-assign]
    # Every merge rewrites, every part goes to blob; merges wait for ``maintain``.
    cfg = persist.PersistConfig(
        compaction_enabled=False, compaction_min_parts=1, inline_writes_max_bytes=0
    )
    async with await persist.connect(blob, consensus, config=cfg) as client:
        mine = await client.open_writer(persist.ShardId.new(), SCHEMA)
        theirs = await client.open_writer(persist.ShardId.new(), SCHEMA)
        await _append_four(mine)
        await _append_four(theirs)
        read_keys.clear()
        assert (await client.maintain(mine.shard_id))["merges"] >= 1
        assert not [k for k in read_keys if "/w/" in k]  # written parts: all from memory
        got = await client.open_leased_reader(mine.shard_id, SCHEMA)
        rows = await got.snapshot_and_fetch(3)
        assert rows.column("k").to_pylist() == [0, 1, 2, 3, 7, 8, 9, 10]
        assert set(rows.column("_time").to_pylist()) <= {0, 1, 2, 3}
    # Another client has no such memory: it merges what it reads from blob, to the same rows.
    async with await persist.connect(blob, consensus, config=cfg) as other:
        read_keys.clear()
        assert (await other.maintain(theirs.shard_id))["merges"] >= 1
        assert [k for k in read_keys if "/w/" in k]
        got = await other.open_leased_reader(theirs.shard_id, SCHEMA)
        assert (await got.snapshot_and_fetch(3)).equals(rows)
