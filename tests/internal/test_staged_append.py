"""A small append plans its commit while its part is written (``Machine.apply``'s ``ready``).

Actors and faults around the append: its part's blob write (held open, failing, or cancelled
by the caller while it runs) and the consensus it commits to. Whatever happens to the write,
no commit names the part before its write returned, and a write that failed or was cancelled
leaves neither a commit nor the part.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pyarrow as pa
import pytest

import persist
from persist.location.mem import MemBlob, MemConsensus

SCHEMA = pa.schema([pa.field("k", pa.int64(), nullable=False)])
# Every part goes to blob.
CFG = persist.PersistConfig(inline_writes_max_bytes=0, compaction_enabled=False)


class HeldBlob(MemBlob):
    """A MemBlob whose part writes wait for ``release`` (or fail with ``fail``)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.fail: Exception | None = None
        self.hold = False
        self.done: list[str] = []

    async def set_new(self, key: str, value: bytes) -> None:
        if self.hold and "/w/" in key:
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                # A write in flight runs to its end, as one on a thread does.
                await self.release.wait()
                await super().set_new(key, value)
                self.done.append(key)
                raise
            if self.fail is not None:
                raise self.fail
        await super().set_new(key, value)
        self.done.append(key)


class SeenConsensus(MemConsensus):
    """Records, for each CAS, the part writes that had returned by then."""

    def __init__(self, blob: HeldBlob) -> None:
        super().__init__()
        self.blob = blob
        self.cas: list[list[str]] = []

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        self.cas.append(list(self.blob.done))
        return await super().compare_and_set(key, expected_seqno, data)


async def _world() -> tuple[HeldBlob, SeenConsensus, Any, Any]:
    """A held blob, the consensus that watches it, a client of both and a writer of a new
    shard."""
    blob = HeldBlob()
    consensus = SeenConsensus(blob)
    client = await persist.connect(blob, consensus, config=CFG)
    write = await client.open_writer(persist.ShardId.new(), SCHEMA)
    return blob, consensus, client, write


def _rows(t: int) -> pa.Table:
    return pa.table({"k": [t, t + 1], "_time": pa.array([t, t], pa.uint64())})


async def _parts(blob: MemBlob, write: persist.WriteHandle) -> list[str]:
    return await blob.list_keys(f"{write.shard_id}/w/")


async def test_the_commit_waits_for_the_part_it_names() -> None:
    blob, consensus, client, write = await _world()
    async with client:
        blob.hold = True
        append = asyncio.ensure_future(write.compare_and_append(_rows(0), 0, 1))
        await blob.entered.wait()
        before = len(consensus.cas)
        await asyncio.sleep(0.05)  # the commit is planned by now; it must not be sent
        assert len(consensus.cas) == before
        assert not append.done()
        blob.release.set()
        await append
        assert len(consensus.cas) == before + 1
        [part] = await _parts(blob, write)
        assert part in consensus.cas[-1]  # its write had returned when the CAS was sent
        assert await write.fetch_recent_upper() == 1
        reader = await client.open_leased_reader(write.shard_id, SCHEMA)
        assert (await reader.snapshot_and_fetch(0)).column("k").to_pylist() == [0, 1]


async def test_a_failed_part_write_commits_nothing_and_leaves_no_part() -> None:
    blob, consensus, client, write = await _world()
    async with client:
        blob.hold = True
        blob.fail = persist.ExternalError("disk on fire", determinate=True)
        blob.release.set()
        before = len(consensus.cas)
        with pytest.raises(persist.ExternalError, match="disk on fire"):
            await write.compare_and_append(_rows(0), 0, 1)
        assert len(consensus.cas) == before
        assert await write.fetch_recent_upper() == 0
        assert await _parts(blob, write) == []
        # The writer goes on.
        blob.hold = False
        await write.compare_and_append(_rows(0), 0, 1)
        assert await write.fetch_recent_upper() == 1


async def test_an_append_cancelled_during_its_part_write_settles_it_and_commits_nothing() -> None:
    blob, consensus, client, write = await _world()
    async with client:
        blob.hold = True
        before = len(consensus.cas)
        append = asyncio.ensure_future(write.compare_and_append(_rows(0), 0, 1))
        await blob.entered.wait()
        append.cancel()
        await asyncio.sleep(0.05)
        # The cancellation waits for the write it started to settle.
        assert not append.done()
        blob.release.set()
        with pytest.raises(asyncio.CancelledError):
            await append
        assert len(consensus.cas) == before
        assert await write.fetch_recent_upper() == 0
        for _ in range(100):  # the part is deleted in the background
            if not await _parts(blob, write):
                break
            await asyncio.sleep(0.01)
        assert await _parts(blob, write) == []
