"""Indeterminate failures never make a write apply twice; corrupt data is never returned."""

from __future__ import annotations

import uuid

import pytest

import persist
from persist.location import Consensus, VersionedData
from persist.location.mem import MemBlob, MemConsensus

from .conftest import SCHEMA, contents, fast_config, updates


class AfterCommitFailures(Consensus):
    """Fails the next ``fail_next`` compare-and-sets *after* they took effect (a timeout on
    the reply), and the next ``fail_reads`` reads before they happen."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner
        self.fail_next = 0
        self.fail_reads = 0
        self.landed_then_failed = 0

    async def head(self, key: str) -> VersionedData | None:
        self._maybe_fail_read()
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        ok = await self.inner.compare_and_set(key, expected_seqno, data)
        if self.fail_next and ok:
            self.fail_next -= 1
            self.landed_then_failed += 1
            raise persist.ExternalError("reply lost after commit", determinate=False)
        return ok

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        self._maybe_fail_read()
        return await self.inner.scan(key, from_seqno, limit)

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.inner.truncate(key, seqno)

    def _maybe_fail_read(self) -> None:
        if self.fail_reads:
            self.fail_reads -= 1
            raise persist.ExternalError("read failed", determinate=True)


async def test_indeterminate_commit_is_resolved_without_applying_twice() -> None:
    consensus = AfterCommitFailures(MemConsensus())
    async with persist.PersistClient(MemBlob(), consensus, fast_config()) as client:
        write, read = await client.open(persist.ShardId.new(), SCHEMA)
        consensus.fail_next = 1
        await write.compare_and_append(updates([1, 2], 0), 0, 1)
        assert consensus.landed_then_failed == 1
        assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
        info = await client.inspect(write.shard_id)
        assert (info["upper"], info["batches"]) == (1, 1)


async def test_indeterminate_error_reaches_the_caller_and_a_retry_is_safe() -> None:
    consensus = AfterCommitFailures(MemConsensus())
    cfg = fast_config(retry_attempts=2)
    async with persist.PersistClient(MemBlob(), consensus, cfg) as client:
        write, read = await client.open(persist.ShardId.new(), SCHEMA)
        consensus.fail_next = 1
        consensus.fail_reads = 100  # persist can't learn the outcome: the caller is told so
        with pytest.raises(persist.ExternalError) as info:
            await write.compare_and_append(updates([7], 0), 0, 1)
        assert info.value.determinate is False
        consensus.fail_reads = 0
        # The caller retries the same write: it must not apply twice.
        with pytest.raises(persist.UpperMismatch) as mismatch:
            await write.compare_and_append(updates([7], 0), 0, 1)
        assert mismatch.value.current == 1  # the first try had landed
        assert contents(await read.snapshot_and_fetch(0)) == {(7, "v7"): 1}


async def test_a_landed_indeterminate_downgrade_is_learned_before_reading() -> None:
    consensus = AfterCommitFailures(MemConsensus())
    cfg = fast_config(retry_attempts=2)
    async with persist.PersistClient(MemBlob(), consensus, cfg) as client:
        write, read = await client.open(persist.ShardId.new(), SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 1)
        await write.compare_and_append(updates([1], 1, -1), 1, 2)
        await write.compare_and_append(updates([2], 2), 2, 3)
        consensus.fail_next = 1
        consensus.fail_reads = 100
        with pytest.raises(persist.ExternalError) as info:
            await read.downgrade_since(2)
        assert info.value.determinate is False
        consensus.fail_reads = 0
        assert read.since == 0  # the handle can't know yet
        # It landed: compaction may now fold times 0 and 1 into 2, so as of 0 is unreadable.
        await client.maintain(write.shard_id)
        with pytest.raises(persist.InvalidUsage, match="below this reader's since 2"):
            await read.snapshot_and_fetch(0)
        assert read.since == 2
        assert contents(await read.snapshot_and_fetch(2)) == {(2, "v2"): 1}
        # Heartbeats keep the landed since instead of failing on a move backwards.
        await read._apply_since(0, heartbeat=True)
        assert read.since == 2


async def test_determinate_read_failures_are_retried() -> None:
    consensus = AfterCommitFailures(MemConsensus())
    async with persist.PersistClient(MemBlob(), consensus, fast_config()) as client:
        write = await client.open_writer(persist.ShardId.new(), SCHEMA)
        consensus.fail_reads = 2
        assert await write.fetch_recent_upper() == 0


async def test_corrupt_part_is_an_integrity_error_never_data() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    shard = persist.ShardId.new()
    cfg = fast_config(inline_writes_max_bytes=0)  # the part in blob, to be damaged there
    async with persist.PersistClient(blob, consensus, cfg) as writer_client:
        write = await writer_client.open_writer(shard, SCHEMA)
        await write.compare_and_append(updates([1, 2, 3], 0), 0, 1)
    keys = [k for k in await blob.list_keys(f"{shard}/w/")]
    assert len(keys) == 1
    data = bytearray(await blob.get(keys[0]) or b"")
    data[len(data) // 3] ^= 0x10
    await blob.set(keys[0], bytes(data))
    # Another client: the writer's own remembers the part as it wrote it.
    async with persist.PersistClient(blob, consensus, fast_config()) as client:
        read = await client.open_leased_reader(shard, SCHEMA)
        with pytest.raises(persist.IntegrityError):
            await read.snapshot_and_fetch(0)
        splits = await read.snapshot(0)
        with pytest.raises(persist.IntegrityError):
            await client.fetch_split(splits[0])


async def test_corrupt_rollup_is_an_integrity_error_on_open() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    shard = persist.ShardId.new()
    async with persist.PersistClient(blob, consensus, fast_config()) as client:
        await client.open_writer(shard, SCHEMA)
    (rollup,) = await blob.list_keys(f"{shard}/rollup/")
    data = bytearray(await blob.get(rollup) or b"")
    data[-1] ^= 0x01
    await blob.set(rollup, bytes(data))
    async with persist.PersistClient(blob, consensus, fast_config()) as client:
        with pytest.raises(persist.IntegrityError):
            await client.open_writer(shard, SCHEMA)


async def test_corrupt_consensus_entry_is_an_integrity_error() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    shard = persist.ShardId.new()
    async with persist.PersistClient(blob, consensus, fast_config()) as client:
        write = await client.open_writer(shard, SCHEMA)
        head = await consensus.head(shard)
        assert head is not None
        bad = bytearray(head.data)
        bad[-2] ^= 0x40
        assert await consensus.compare_and_set(shard, head.seqno, bytes(bad))
        with pytest.raises(persist.IntegrityError):
            await write.fetch_recent_upper()


def test_errors_pickle() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(persist.ExternalError("x", determinate=False)))
    assert isinstance(e, persist.ExternalError) and e.determinate is False
    m = pickle.loads(pickle.dumps(persist.UpperMismatch(1, 2)))
    assert (m.expected, m.current) == (1, 2)
    i = pickle.loads(pickle.dumps(persist.IntegrityError("bad")))
    assert isinstance(i, persist.IntegrityError) and i.determinate
    assert uuid.UUID(persist.ShardId.new()[1:])
