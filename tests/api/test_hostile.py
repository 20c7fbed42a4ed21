"""Defects found by trying to break persist: lost replies met by expired leases, values that
don't fit the state, cancelled calls, clocks that run ahead. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import pyarrow as pa
import pytest

import persist
from persist.core.shard import codec, keys
from persist.location import Blob, Consensus, VersionedData, open_blob, open_consensus
from persist.testing import Faults, FaultyBlob, FaultyConsensus

from .conftest import SCHEMA, Connect, contents, fast_config, updates


class Forwarding(Consensus):
    """Passes every call to ``inner``; subclasses change ``compare_and_set``."""

    def __init__(self, inner: Consensus) -> None:
        self.inner = inner

    async def head(self, key: str) -> VersionedData | None:
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        return await self.inner.compare_and_set(key, expected_seqno, data)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return await self.inner.scan(key, from_seqno, limit)

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.inner.truncate(key, seqno)

    async def close(self) -> None:
        await self.inner.close()


class LoseNextReply(Forwarding):
    """Lets the next compare-and-set land, runs ``meanwhile`` (what happens before the retry),
    then reports the reply lost."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner)
        self.meanwhile: Callable[[], Awaitable[None]] | None = None

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        ok = await self.inner.compare_and_set(key, expected_seqno, data)
        hook = self.meanwhile
        # Only a commit that moves the upper: the client's own maintenance (a rollup, a
        # fold) may commit first, and losing its reply instead proves nothing.
        if hook is not None and ok and _moves_upper(data):
            self.meanwhile = None
            await hook()
            raise persist.ExternalError("reply lost after commit", determinate=False)
        return ok


def _moves_upper(data: bytes) -> bool:
    try:
        return bool(codec.decode_diff(data).upper)
    except Exception:
        return False  # not a diff (a catalog entry)


def _open(location: tuple[str, str]) -> tuple[Blob, Consensus]:
    return open_blob(location[0]), open_consensus(location[1])


async def test_a_retry_meeting_an_expired_lease_keeps_the_landed_batch(
    location: tuple[str, str],
) -> None:
    """Defect 1: the append lands, its reply is lost, the writer stalls past its lease and
    another client expires it; the retry is refused. Its parts must stay (the batch is in the
    shard), and the caller learns the outcome is unknown, not "nothing happened"."""
    now = [1_000_000]
    blob, inner = _open(location)
    lossy = LoseNextReply(inner)
    stalled = persist.PersistClient(
        blob,
        lossy,
        fast_config(lease_duration_s=1, heartbeat_interval_s=3600, now_ms=lambda: now[0]),
    )
    other = await persist.connect(
        *location, config=fast_config(heartbeat_interval_s=3600, now_ms=lambda: now[0])
    )
    async with stalled, other:
        shard = persist.ShardId.new()
        write = await stalled.open_writer(shard, SCHEMA)
        w2, read = await other.open(shard, SCHEMA)

        async def stall_then_expire() -> None:
            now[0] += 5_000  # past the stalled writer's 1 s lease
            upper = await w2.fetch_recent_upper()  # 1: the write landed
            await w2.compare_and_append(updates([], 0), upper, upper)  # any commit expires it

        lossy.meanwhile = stall_then_expire
        with pytest.raises(persist.ExternalError) as failure:
            await write.compare_and_append(updates([1, 2], 0), 0, 1)
        assert not failure.value.determinate
        assert isinstance(failure.value.__cause__, persist.LeaseExpired)
        with pytest.raises(persist.LeaseExpired):
            await write.compare_and_append(updates([3], 1), 1, 2)
        await asyncio.sleep(0.05)  # background clean-up, if any, has run
        assert contents(await read.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}
        async with await persist.connect(*location, config=fast_config()) as fresh:
            r = await fresh.open_leased_reader(shard, SCHEMA)
            assert contents(await r.snapshot_and_fetch(0)) == {(1, "v1"): 1, (2, "v2"): 1}


@pytest.mark.parametrize(
    "purpose", [123, b"bytes", ["a", "list"], None, 1.5, "\ud800 lone surrogate", "x" * 5_000_000]
)
async def test_a_purpose_that_does_not_fit_is_refused_and_the_shard_still_opens(
    connect: Connect, purpose: object
) -> None:
    """Defect 2: such a purpose was committed, and every later open failed IntegrityError."""
    client = await connect()
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA, "fine")
    with pytest.raises(persist.InvalidUsage, match="purpose"):
        await client.open_writer(shard, SCHEMA, purpose)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage, match="purpose"):
        await client.open_leased_reader(shard, SCHEMA, purpose)  # type: ignore[arg-type]
    fresh = await connect()
    _write, _read = await fresh.open(shard, SCHEMA, "ok")
    assert (await fresh.inspect(shard))["writers"] == 2


async def test_the_largest_purpose_is_accepted(connect: Connect) -> None:
    client = await connect()
    write = await client.open_writer(persist.ShardId.new(), SCHEMA, "é" * (32 * 1024))
    await write.compare_and_append(updates([1], 0), 0, 1)


@pytest.mark.parametrize("clock", [lambda: 1.5e12, lambda: "now", lambda: -1, lambda: 2**70])
async def test_a_clock_that_is_not_int_ms_is_refused_before_committing(
    connect: Connect, clock: Callable[[], object]
) -> None:
    """Defect 2: a float clock was committed into heartbeats, bricking the shard."""
    good = await connect()
    shard = persist.ShardId.new()
    write, _read = await good.open(shard, SCHEMA)
    bad = await connect(now_ms=clock)
    with pytest.raises(persist.InvalidUsage, match="now_ms"):
        await bad.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    fresh = await connect()
    r = await fresh.open_leased_reader(shard, SCHEMA)
    assert contents(await r.snapshot_and_fetch(0)) == {(1, "v1"): 1}


@pytest.mark.parametrize(
    "bad",
    [
        {"lease_duration_s": -1},
        {"lease_duration_s": float("nan")},
        {"heartbeat_interval_s": 0},
        {"rollup_interval": 1.5},
        {"retry_attempts": True},
        {"io_concurrency": 0},
        {"compaction_enabled": "yes"},
        {"now_ms": 5},
        {"retry_attempts": 10**30},
        {"lease_duration_s": 1e300},
    ],
)
def test_a_config_that_does_not_fit_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(persist.InvalidUsage):
        persist.PersistConfig(**bad)  # type: ignore[arg-type]


async def _held_then_cancelled(faults: Faults, call: Awaitable[None]) -> None:
    """Starts ``call`` with the location paused, cancels it while a location call is held."""
    faults.pause()
    task = asyncio.ensure_future(call)
    try:
        for _ in range(2000):
            if faults.waiting or task.done():
                break
            await asyncio.sleep(0.001)
        assert faults.waiting, "the call never reached the location"
        task.cancel()
    finally:
        faults.resume()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancelled_downgrade_keeps_the_readers_split_holds(
    location: tuple[str, str],
) -> None:
    """Defect 3: the holds were pruned before the commit; when it never happened the next
    heartbeat released the split's state version and its parts were collected."""
    faults = Faults()
    blob, consensus = _open(location)
    client = persist.PersistClient(
        FaultyBlob(blob, faults),
        FaultyConsensus(consensus, faults),
        # Even two parts are merged, and they are in blob, where collection would show.
        fast_config(compaction_min_parts=1, inline_writes_max_bytes=0),
    )
    async with client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 1)
        await write.compare_and_append(updates([2], 1), 1, 2)
        (split,) = await read.snapshot(1)
        await client.maintain(shard)  # merged (here or in the background): its parts retired
        retired = client._shards.machines[shard].state.retired
        assert {p.key for p in split.parts} <= retired.keys()
        await _held_then_cancelled(faults, read.downgrade_since(2))
        assert read.since == 0
        await read.downgrade_since(0)  # a heartbeat: records the reader's holds again
        await client.maintain(shard)  # garbage collection runs
        got = await client.fetch_split(persist.Split.from_bytes(split.to_bytes()))
        assert contents(got) == {(1, "v1"): 1, (2, "v2"): 1}


class HeldCas(Forwarding):
    """Holds the next compare-and-set until released: before it runs, or after it landed."""

    def __init__(self, inner: Consensus, after: bool) -> None:
        super().__init__(inner)
        self.after = after
        self.armed = False
        self.holding = asyncio.Event()

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        if not self.armed:
            return await self.inner.compare_and_set(key, expected_seqno, data)
        self.armed = False
        ok = await self.inner.compare_and_set(key, expected_seqno, data) if self.after else False
        self.holding.set()
        await asyncio.Event().wait()  # until cancelled
        return ok


class HeldSet(Blob):
    """Lets ``passes`` sets through, then holds the next one until cancelled."""

    def __init__(self, inner: Blob) -> None:
        self.inner = inner
        self.passes: int | None = None
        self.holding = asyncio.Event()

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def set(self, key: str, value: bytes) -> None:
        if self.passes is not None:
            if self.passes == 0:
                self.holding.set()
                await asyncio.Event().wait()  # until cancelled
            self.passes -= 1
        await self.inner.set(key, value)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list_keys(self, prefix: str) -> list[str]:
        return await self.inner.list_keys(prefix)

    async def close(self) -> None:
        await self.inner.close()


async def test_an_append_cancelled_while_writing_leaves_no_parts(location: tuple[str, str]) -> None:
    """Defect 8: parts written before a cancellation stayed until the writer expired."""
    blob, consensus = _open(location)
    held = HeldSet(blob)
    # Small parts, one at a time: the write is cut into many, and the second one is held.
    cfg = fast_config(part_target_bytes=1024, io_concurrency=1, inline_writes_max_bytes=0)
    async with persist.PersistClient(held, consensus, cfg) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 1)
        held.passes = 1
        task = asyncio.ensure_future(write.compare_and_append(updates(list(range(2000)), 1), 1, 2))
        await asyncio.wait_for(held.holding.wait(), 10)
        prefix = keys.writer_prefix(shard, write.writer_id)
        assert len(await blob.list_keys(prefix)) == 2  # one committed part, one of this write
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held.passes = None
        assert await write.fetch_recent_upper() == 1
        await _only_committed_parts_left(client, shard, write.writer_id)
        await write.compare_and_append(updates([5], 1), 1, 2)  # the writer is still live
        assert contents(await read.snapshot_and_fetch(1)) == {(1, "v1"): 1, (5, "v5"): 1}


@pytest.mark.parametrize("landed", [False, True])
async def test_an_append_cancelled_while_committing_keeps_exactly_what_the_shard_refers_to(
    location: tuple[str, str], landed: bool
) -> None:
    """Defect 8, at the commit: cancelled before its compare-and-set ran, the writer removes
    the parts; cancelled after it landed, they are the shard's and stay."""
    blob, inner = _open(location)
    held = HeldCas(inner, after=landed)
    cfg = fast_config(inline_writes_max_bytes=0)  # parts in blob, where leftovers would show
    async with persist.PersistClient(blob, held, cfg) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 1)
        held.armed = True
        task = asyncio.ensure_future(write.compare_and_append(updates([7, 8], 1), 1, 2))
        await asyncio.wait_for(held.holding.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await write.fetch_recent_upper() == (2 if landed else 1)
        await _only_committed_parts_left(client, shard, write.writer_id)
        expected = {(1, "v1"): 1, (7, "v7"): 1, (8, "v8"): 1} if landed else {(1, "v1"): 1}
        assert contents(await read.snapshot_and_fetch(1 if landed else 0)) == expected


async def _only_committed_parts_left(
    client: persist.PersistClient, shard: persist.ShardId, writer_id: str
) -> None:
    """Waits (boundedly) for the writer's background clean-up; then its prefix must hold
    exactly the parts the shard refers to."""
    state = await client._shards.machines[shard].refresh()
    committed = {p.key for b in state.batches.values() for p in b.parts} | state.retired.keys()
    prefix = keys.writer_prefix(shard, writer_id)
    left = set(await client.blob.list_keys(prefix))
    for _ in range(300):
        if left <= committed:
            break
        await asyncio.sleep(0.01)
        left = set(await client.blob.list_keys(prefix))
    assert left <= committed, left - committed
    assert {k for k in committed if k.startswith(prefix)} <= left


async def test_a_clock_minutes_ahead_does_not_expire_live_handles(
    location: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A commit from a client whose clock runs ten minutes ahead expired every other process's
    handles. It now says so (at INFO: handles of processes that are gone look the same) and
    leaves them, until it has watched them idle for a lease."""
    now = [10_000_000]
    normal = await persist.connect(
        *location, config=fast_config(heartbeat_interval_s=3600, now_ms=lambda: now[0])
    )
    ahead = await persist.connect(
        *location,
        config=fast_config(
            lease_duration_s=3600, heartbeat_interval_s=3600, now_ms=lambda: now[0] + 600_000
        ),
    )
    async with normal, ahead:
        shard = persist.ShardId.new()
        write, read = await normal.open(shard, SCHEMA)
        with caplog.at_level(logging.INFO, logger="persist"):
            w2 = await ahead.open_writer(shard, SCHEMA)
            await w2.compare_and_append(updates([1], 0), 0, 1)
            await w2.compare_and_append(updates([2], 1), 1, 2)
        assert "this clock runs ahead" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        info = await ahead.inspect(shard)
        assert (info["writers"], info["readers"]) == (2, 1)
        await write.compare_and_append(updates([3], 2), 2, 3)
        assert contents(await read.snapshot_and_fetch(2)) == {
            (1, "v1"): 1,
            (2, "v2"): 1,
            (3, "v3"): 1,
        }
        # Handles that really stopped heart-beating are still expired: the fast client, having
        # watched them idle for a lease by its own clock, lets them go.
        now[0] += 61_000
        await w2.compare_and_append(updates([], 3), 3, 3)
        info = await ahead.inspect(shard)
        assert (info["writers"], info["readers"]) == (1, 0)
        with pytest.raises(persist.LeaseExpired):
            await write.compare_and_append(updates([4], 3), 3, 4)


async def test_with_clocks_that_agree_the_dead_are_expired_at_once(
    location: tuple[str, str],
) -> None:
    """The skew guard must not keep dead handles: while a live handle of another client shows
    the clocks agree, a stale one is expired by the next commit of anyone."""
    now = [10_000_000]
    cfg = fast_config(heartbeat_interval_s=3600, now_ms=lambda: now[0])
    dead = await persist.connect(
        *location, config=fast_config(lease_duration_s=1, now_ms=lambda: now[0])
    )
    live = await persist.connect(*location, config=cfg)
    third = await persist.connect(*location, config=cfg)
    async with dead, live, third:
        shard = persist.ShardId.new()
        await dead.open(shard, SCHEMA)
        write = await live.open_writer(shard, SCHEMA)
        await third.open_leased_reader(shard, SCHEMA)
        now[0] += 2_000
        await write.compare_and_append(updates([1], 0), 0, 1)
        info = await live.inspect(shard)
        assert (info["writers"], info["readers"]) == (1, 1)


async def test_a_well_compressed_part_is_decoded_off_the_event_loop(
    client: persist.PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 7: parts were decoded on the loop by their size in blob, and one that compresses
    fifty-fold stalled it for hundreds of ms. The decoded size decides now."""
    from persist.internal import fetch
    from persist.internal.batch import INLINE_BYTES

    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    n = 10_000
    table = pa.table(
        {
            "k": pa.array([1] * n, pa.int64()),
            "v": pa.array(["x" * 500] * n),
            "_time": pa.array(range(n), pa.uint64()),
        }
    )
    await write.compare_and_append(table, 0, n)
    (part,) = [p for b in client._shards.machines[shard].state.batches.values() for p in b.parts]
    assert part.size <= INLINE_BYTES < part.nbytes
    threads: list[str] = []
    decode = fetch._decode_then

    def spy(*args: object) -> pa.Table:
        threads.append(threading.current_thread().name)
        return decode(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(fetch, "_decode_then", spy)
    got = await read.snapshot_and_fetch(n - 1)
    assert got.column("_diff").to_pylist() == [n]
    assert threads and threading.main_thread().name not in threads


async def test_a_batch_not_in_a_sequence_is_refused(client: persist.PersistClient) -> None:
    """Found by the value fuzzing: a bare Batch raised a raw TypeError."""
    write = await client.open_writer(persist.ShardId.new(), SCHEMA)
    batch = await write.batch(updates([1], 0), 0, 1)
    for bad in (batch, 5, "batches"):
        with pytest.raises(persist.InvalidUsage, match="sequence"):
            await write.compare_and_append_batch(bad, 0, 1)  # type: ignore[arg-type]
    await write.compare_and_append_batch((batch,), 0, 1)
    assert write.upper == 1
