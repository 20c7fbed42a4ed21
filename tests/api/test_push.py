"""Listens hear other clients' commits pushed by consensus, not by polling it; a lost push is
found by the slow fallback poll; idle listeners do not query consensus."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import persist
from persist.location import Consensus, Pushed, VersionedData, open_blob, open_consensus
from persist.location.mem import MemBlob, MemConsensus
from tests.api.conftest import SCHEMA, fast_config, updates

# So slow that a test passes only if the change was pushed.
NEVER_S = 600.0


class Counting(Consensus):
    """``inner``, counting the reads a waiting listener would make; ``drop`` loses every push."""

    def __init__(self, inner: Consensus, *, drop: bool = False) -> None:
        self.inner = inner
        self.drop = drop
        self.reads = 0

    async def head(self, key: str) -> VersionedData | None:
        self.reads += 1
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        return await self.inner.compare_and_set(key, expected_seqno, data)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        self.reads += 1
        return await self.inner.scan(key, from_seqno, limit)

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.inner.truncate(key, seqno)

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        if self.drop:
            return self.inner.watch(key, lambda seqno, data: None)
        return self.inner.watch(key, on_change)

    async def close(self) -> None:
        await self.inner.close()


async def _listen_for_one_append(
    location: tuple[str, str], listener_consensus: Consensus, fallback_s: float
) -> Counting | None:
    blob, consensus = location
    shard = persist.ShardId.new()
    # No poll, and no heartbeat (whose commit would re-read the state) within the test.
    config = fast_config(
        poll_interval_s=NEVER_S,
        push_poll_interval_s=fallback_s,
        heartbeat_interval_s=NEVER_S,
        lease_duration_s=2 * NEVER_S,
    )
    async with (
        await persist.connect(blob, consensus, config=config) as writer_client,
        await persist.connect(open_blob(blob), listener_consensus, config=config) as reader_client,
    ):
        write, _ = await writer_client.open(shard, SCHEMA)
        await write.compare_and_append(updates([0], 0), 0, 1)
        reader = await reader_client.open_leased_reader(shard, SCHEMA)
        events: asyncio.Queue[persist.ListenEvent] = asyncio.Queue()

        async def listen() -> None:
            async for event in reader.listen(0):
                await events.put(event)

        task = asyncio.create_task(listen())
        try:
            await asyncio.sleep(0.3)  # the listen is waiting, its watch set up
            await write.compare_and_append(updates([1], 1), 1, 2)
            async with asyncio.timeout(20):
                while True:
                    event = await events.get()
                    if event.upper is not None and event.upper >= 2:
                        break
            assert event.updates.column("k").to_pylist() == [1]
        finally:
            task.cancel()
        return listener_consensus if isinstance(listener_consensus, Counting) else None


async def test_a_listen_hears_another_clients_append_without_polling(
    location: tuple[str, str],
) -> None:
    await _listen_for_one_append(location, open_consensus(location[1]), fallback_s=NEVER_S)


async def test_a_lost_push_is_found_by_the_fallback_poll(location: tuple[str, str]) -> None:
    counting = Counting(open_consensus(location[1]), drop=True)
    await _listen_for_one_append(location, counting, fallback_s=0.2)
    assert counting.reads > 0


async def test_idle_listeners_do_not_read_consensus(location: tuple[str, str]) -> None:
    blob, consensus = location
    shard = persist.ShardId.new()
    counting = Counting(open_consensus(consensus))
    config = fast_config(poll_interval_s=0.01, push_poll_interval_s=NEVER_S)
    async with await persist.connect(open_blob(blob), counting, config=config) as client:
        write, _ = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([0], 0), 0, 1)
        readers = [await client.open_leased_reader(shard, SCHEMA) for _ in range(10)]

        async def listen(reader: persist.ReadHandle) -> None:
            async for _ in reader.listen(0):
                pass

        tasks = [asyncio.create_task(listen(r)) for r in readers]
        try:
            # Settled: each waiting, the one watch set up. On a loaded machine that takes a
            # while: wait (boundedly) for a quiet spell before counting.
            for _ in range(50):
                before = counting.reads
                await asyncio.sleep(0.3)
                if counting.reads == before:
                    break
            before = counting.reads
            await asyncio.sleep(1.0)
            # Polling every 10 ms, these ten listeners would read about a hundred times.
            assert counting.reads == before
        finally:
            for t in tasks:
                t.cancel()


class _Gated(Counting):
    """Holds each scan's answer, once read, until ``gate`` opens; loses the next ``lose``
    pushes."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.gate.set()
        self.scanned = asyncio.Event()
        self.lose = 0

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        entries = await super().scan(key, from_seqno, limit)
        self.scanned.set()
        await self.gate.wait()
        return entries

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        def maybe(seqno: int | None, data: bytes | None) -> None:
            if self.lose:
                self.lose -= 1
            else:
                on_change(seqno, data)

        return self.inner.watch(key, maybe)


async def test_a_push_during_a_poll_is_not_lost() -> None:
    # A push that arrives while a poll's read is already answered must start another read: the
    # poll in flight can't see it, and no fallback poll comes soon.
    blob, inner = MemBlob(), MemConsensus()
    gated = _Gated(inner)
    config = fast_config(
        poll_interval_s=NEVER_S,
        push_poll_interval_s=NEVER_S,
        heartbeat_interval_s=NEVER_S,
        lease_duration_s=2 * NEVER_S,
        compaction_enabled=False,  # no commits but the test's
    )
    shard = persist.ShardId.new()
    async with (
        await persist.connect(blob, inner, config=config) as writer_client,
        await persist.connect(blob, gated, config=config) as reader_client,
    ):
        write, _ = await writer_client.open(shard, SCHEMA)
        await write.compare_and_append(updates([0], 0), 0, 1)
        reader = await reader_client.open_leased_reader(shard, SCHEMA)
        heard: asyncio.Queue[int | None] = asyncio.Queue()

        async def listen() -> None:
            async for event in reader.listen(0):
                await heard.put(event.upper)

        task = asyncio.create_task(listen())
        try:
            await asyncio.sleep(0.2)
            gated.lose = 1  # the push of this commit is lost...
            await write.compare_and_append(updates([1], 1), 1, 2)
            await asyncio.sleep(0.1)
            assert gated.lose == 0
            gated.gate.clear()
            gated.scanned.clear()
            # ...so the next one shows a gap and starts a poll, whose read is held
            await write.compare_and_append(updates([2], 2), 2, 3)
            await asyncio.wait_for(gated.scanned.wait(), 10)
            # a commit whose push arrives while that poll's answer is on its way
            await write.compare_and_append(updates([3], 3), 3, 4)
            await asyncio.sleep(0.1)
            gated.gate.set()
            async with asyncio.timeout(10):
                while (await heard.get() or 0) < 4:
                    pass
        finally:
            task.cancel()
