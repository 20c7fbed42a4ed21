"""``append_next`` of several handles of one client on one shard: committed in groups.

Every actor and fault that touches what a group owns (its queue, its leader's part and commit)
is driven here:

- the other handles of the same client (the group's members), each with its own lease;
- a writer of another client (another process) moving the upper between a group's tries;
- a leader handle expired while its group commits (its own failure: the rest go on);
- a caller cancelled while its call waits in the queue, and one cancelled during its commit;
- the client closing with calls queued;
- a sealed shard (every call's failure);
- data its own handle refuses (refused at the call, never part of a group).

Restarts and damaged bytes are not this module's: a group is one ``compare_and_append`` of its
leader, whose retries, recovery and damaged parts the harness and the model tests cover.
"""

from __future__ import annotations

import asyncio
import contextlib

import pyarrow as pa
import pytest

import persist
from persist.location.mem import MemBlob, MemConsensus

from .conftest import SCHEMA, Connect, fast_config, updates


def _data(keys: list[int]) -> pa.Table:
    return updates(keys, 0).drop_columns(["_time"])


async def _rows_at(read: persist.ReadHandle, t: int) -> list[int]:
    """The keys that time ``t`` added (every write here adds rows, none retracts)."""
    at = await read.snapshot_and_fetch(t)
    before = await read.snapshot_and_fetch(t - 1) if t else at.slice(0, 0)
    keys = at.column("k").to_pylist()
    for k in before.column("k").to_pylist():
        keys.remove(k)
    return sorted(keys)


async def test_calls_at_once_land_once_each_at_their_own_time(connect: Connect) -> None:
    client = await connect()
    outside = await connect()  # another process's writer, racing the group for the upper
    shard = persist.ShardId.new()
    handles = [await client.open_writer(shard, SCHEMA) for _ in range(6)]
    other = await outside.open_writer(shard, SCHEMA)
    told: dict[int, list[int]] = {}

    async def call(i: int, j: int) -> None:
        keys = [1000 * i + j, 1000 * i + j + 500]
        told[await handles[i].append_next(_data(keys))] = keys

    async def outsider(r: int) -> None:
        for j in range(10):
            keys = [-(100 * r + j + 1)]
            told[await other.append_next(_data(keys))] = keys
            await asyncio.sleep(0)

    for j in range(5):
        await asyncio.gather(outsider(j), *(call(i, j) for i in range(len(handles))))
    # Every call at a time of its own, with nothing between: 6 x 5 + 50 calls.
    assert sorted(told) == list(range(80))
    read = await client.open_leased_reader(shard)
    assert await handles[0].fetch_recent_upper() == 80
    for t, keys in told.items():
        assert await _rows_at(read, t) == sorted(keys), t


class _CountingConsensus(MemConsensus):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        self.sets += 1
        return await super().compare_and_set(key, expected_seqno, data)


class _GatedBlob(MemBlob):
    """Holds every part write (``set_new``) while ``gate`` is clear, telling ``held`` when one
    waits: a group's commit stays in flight as long as a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()

    async def set_new(self, key: str, value: bytes) -> None:
        if not self.gate.is_set():
            self.held.set()
            await self.gate.wait()
        await super().set_new(key, value)


def _config() -> persist.PersistConfig:
    # No inline parts: every write goes through the (gated) blob.
    return fast_config(inline_writes_max_bytes=0)


async def test_calls_at_once_share_one_part_and_commit() -> None:
    blob, consensus = MemBlob(), _CountingConsensus()
    client = await persist.connect(blob, consensus, config=_config())
    try:
        shard = persist.ShardId.new()
        handles = [await client.open_writer(shard, SCHEMA) for _ in range(8)]
        before = consensus.sets
        times = await asyncio.gather(*(h.append_next(_data([i])) for i, h in enumerate(handles)))
        assert times == list(range(8))  # in the order they came
        # One part for all eight (each alone would have written its own) and fewer commits
        # than calls (maintenance may commit beside them).
        assert len(await blob.list_keys(f"{shard}/w/")) == 1
        assert consensus.sets - before < 8
    finally:
        await client.close()


async def test_a_call_cancelled_in_the_queue_never_lands() -> None:
    blob = _GatedBlob()
    client = await persist.connect(blob, MemConsensus(), config=_config())
    try:
        shard = persist.ShardId.new()
        a, b = [await client.open_writer(shard, SCHEMA) for _ in range(2)]
        blob.gate.clear()
        first = asyncio.create_task(a.append_next(_data([1])))
        await asyncio.wait_for(blob.held.wait(), 10)  # first's group is writing its part
        queued = asyncio.create_task(b.append_next(_data([2])))
        third = asyncio.create_task(b.append_next(_data([3])))
        await asyncio.sleep(0.01)
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
        blob.gate.set()
        assert await first == 0
        assert await third == 1  # the cancelled call took no time
        read = await client.open_leased_reader(shard)
        assert sorted((await read.snapshot_and_fetch(1)).column("k").to_pylist()) == [1, 3]
    finally:
        blob.gate.set()
        await client.close()


async def test_a_leader_closed_during_its_commit_fails_alone() -> None:
    blob = _GatedBlob()
    client = await persist.connect(blob, MemConsensus(), config=_config())
    try:
        shard = persist.ShardId.new()
        a, b, c = [await client.open_writer(shard, SCHEMA) for _ in range(3)]
        blob.gate.clear()
        calls = [asyncio.create_task(h.append_next(_data([i]))) for i, h in enumerate((a, b, c))]
        await asyncio.wait_for(blob.held.wait(), 10)  # one group of three, led by a
        closing = asyncio.create_task(a.expire())
        await asyncio.sleep(0.05)
        blob.gate.set()
        await closing
        got = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(got[0], persist.PersistError), got
        # b and c went on under b, in their order, from where the shard was.
        assert got[1:] == [0, 1], got
        read = await client.open_leased_reader(shard)
        assert sorted((await read.snapshot_and_fetch(1)).column("k").to_pylist()) == [1, 2]
    finally:
        blob.gate.set()
        await client.close()


async def test_closing_the_client_answers_every_queued_call() -> None:
    blob = _GatedBlob()
    client = await persist.connect(blob, MemConsensus(), config=_config())
    shard = persist.ShardId.new()
    a, b = [await client.open_writer(shard, SCHEMA) for _ in range(2)]
    blob.gate.clear()
    first = asyncio.create_task(a.append_next(_data([1])))
    await asyncio.wait_for(blob.held.wait(), 10)
    queued = [asyncio.create_task(b.append_next(_data([i]))) for i in range(2, 5)]
    await asyncio.sleep(0.01)
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0.05)
    blob.gate.set()
    await asyncio.wait_for(closing, 30)
    got = await asyncio.wait_for(asyncio.gather(first, *queued, return_exceptions=True), 10)
    for g in got[1:]:
        assert isinstance(g, persist.InvalidUsage), got
    with pytest.raises(persist.InvalidUsage, match="closed"):
        await b.append_next(_data([9]))


async def test_refused_data_fails_its_own_call_only(connect: Connect) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    a, b = [await client.open_writer(shard, SCHEMA) for _ in range(2)]
    bad = pa.table({"k": pa.array([1]), "w": pa.array(["x"])})
    got = await asyncio.gather(
        a.append_next(_data([1])),
        b.append_next(bad),
        a.append_next(_data([2])),
        return_exceptions=True,
    )
    assert isinstance(got[1], persist.InvalidUsage) and got[0::2] == [0, 1], got
    # A sealed shard is every call's failure.
    await a.compare_and_append(updates([], 2), 2, None)
    got = await asyncio.gather(
        a.append_next(_data([3])), b.append_next(_data([4])), return_exceptions=True
    )
    assert all(isinstance(g, persist.InvalidUsage) and "sealed" in str(g) for g in got), got
