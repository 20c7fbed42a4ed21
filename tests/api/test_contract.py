"""The public contract of ../shared/spec/api.md, by public names only, on every location."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

import persist

from .conftest import SCHEMA, Connect, contents, updates


async def test_compare_and_append_then_snapshot(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    assert write.upper == 0 and read.since == 0
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    await write.compare_and_append(updates([2, 3], [1, 2], [-1, 1]), 1, 3)
    assert write.upper == 3 and await write.fetch_recent_upper() == 3
    at0 = await read.snapshot_and_fetch(0)
    assert contents(at0) == {(1, "v1"): 1, (2, "v2"): 1}
    assert set(at0.column("_time").to_pylist()) == {0}
    assert contents(await read.snapshot_and_fetch(1)) == {(1, "v1"): 1}
    at2 = await read.snapshot_and_fetch(2)
    assert contents(at2) == {(1, "v1"): 1, (3, "v3"): 1}
    assert at2.schema.names == ["k", "v", "_time", "_diff"]


async def test_upper_mismatch_writes_nothing(client: persist.PersistClient) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 2)
    with pytest.raises(persist.UpperMismatch) as info:
        await write.compare_and_append(updates([9], 1), 1, 3)
    assert (info.value.expected, info.value.current) == (1, 2)
    assert contents(await read.snapshot_and_fetch(1)) == {(1, "v1"): 1}
    assert (await client.inspect(write.shard_id))["upper"] == 2


async def test_empty_append_with_same_upper_is_a_heartbeat(client: persist.PersistClient) -> None:
    write, _ = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([], 0), 0, 0)
    assert (await client.inspect(write.shard_id))["batches"] == 0
    await write.compare_and_append(updates([], 0), 0, 4)
    assert write.upper == 4


async def test_stale_writer_learns_current_upper(connect: Connect) -> None:
    a, b = await connect(), await connect()
    shard = persist.ShardId.new()
    wa = await a.open_writer(shard, SCHEMA)
    wb = await b.open_writer(shard, SCHEMA)
    await wa.compare_and_append(updates([1], 0), 0, 1)
    assert wb.upper == 0  # b's cache is stale; the write must still be judged on the latest state
    with pytest.raises(persist.UpperMismatch) as info:
        await wb.compare_and_append(updates([2], 0), 0, 1)
    assert info.value.current == 1
    await wb.compare_and_append(updates([2], 1), 1, 2)
    assert wb.upper == 2


async def test_concurrent_writers_exactly_one_wins_each_upper(connect: Connect) -> None:
    clients = [await connect() for _ in range(4)]
    shard = persist.ShardId.new()
    writers = [await c.open_writer(shard, SCHEMA) for c in clients]
    wins: list[tuple[int, int]] = []

    async def race(i: int, w: persist.WriteHandle) -> None:
        for _ in range(6):
            upper = await w.fetch_recent_upper()
            assert upper is not None
            try:
                await w.compare_and_append(updates([i * 100 + upper], upper), upper, upper + 1)
                wins.append((upper, i))
            except persist.UpperMismatch:
                pass

    await asyncio.gather(*(race(i, w) for i, w in enumerate(writers)))
    uppers = sorted(u for u, _ in wins)
    assert uppers == list(range(len(uppers)))  # each upper interval won exactly once
    read = await clients[0].open_leased_reader(shard, SCHEMA)
    final = contents(await read.snapshot_and_fetch(len(uppers) - 1))
    assert final == {(i * 100 + u, f"v{i * 100 + u}"): 1 for u, i in wins}


async def test_replicated_append(connect: Connect) -> None:
    a, b = await connect(), await connect()
    shard = persist.ShardId.new()
    wa, ra = await a.open(shard, SCHEMA)
    wb = await b.open_writer(shard, SCHEMA)
    data = updates([1, 2, 3], [0, 1, 2])
    await wa.append(data, 0, 3)
    await wb.append(data, 0, 3)  # the same data again: returns at once
    await wa.append(updates([4], 3), 3, 4)
    # b is behind at 0..3 and overlaps [3, 5): only the part at or above 4 is new.
    await wb.append(pa.concat_tables([data, updates([4, 5], [3, 4])]), 0, 5)
    assert wb.upper == 5
    assert contents(await ra.snapshot_and_fetch(4)) == {(k, f"v{k}"): 1 for k in range(1, 6)}
    with pytest.raises(persist.UpperMismatch):
        await wa.append(updates([9], 7), 7, 8)  # a gap below 7


async def test_batches_commit_atomically_across_processes(connect: Connect) -> None:
    coordinator, worker = await connect(), await connect()
    shard = persist.ShardId.new()
    w_coord, read = await coordinator.open(shard, SCHEMA)
    w_work = await worker.open_writer(shard, SCHEMA)
    b1 = await w_coord.batch(updates([1], 1), 1, 3)
    b2 = persist.Batch.from_bytes((await w_work.batch(updates([2], 2), 1, 3)).to_bytes())
    assert b2.rows == 1
    with pytest.raises(persist.UpperMismatch):
        await w_coord.compare_and_append_batch([b1, b2], 1, 3)
    assert (await coordinator.inspect(shard))["batches"] == 0
    await w_work.compare_and_append(updates([0], 0), 0, 1)
    await w_coord.compare_and_append_batch([b1, b2], 1, 3)  # the refused batches are still good
    assert contents(await read.snapshot_and_fetch(1)) == {(0, "v0"): 1, (1, "v1"): 1}
    assert contents(await read.snapshot_and_fetch(2)) == {(0, "v0"): 1, (1, "v1"): 1, (2, "v2"): 1}
    with pytest.raises(persist.InvalidUsage):
        await coordinator.delete_batch(b1)  # appended: not the caller's to delete anymore
    with pytest.raises(persist.UpperMismatch):  # a commit is never replayed
        await w_coord.compare_and_append_batch([b1], 1, 3)
    b3 = await w_work.batch(updates([3], 3), 3, 4)
    with pytest.raises(persist.InvalidUsage, match="not within"):
        await w_coord.compare_and_append_batch([b3], 4, 5)
    await worker.delete_batch(b3)
    assert (await coordinator.inspect(shard))["upper"] == 3


async def test_splits_cover_the_snapshot_and_move_between_clients(connect: Connect) -> None:
    planner, executor = await connect(), await connect()
    shard = persist.ShardId.new()
    write, read = await planner.open(shard, SCHEMA)
    for t in range(5):
        await write.compare_and_append(updates(list(range(t * 10, t * 10 + 10)), t), t, t + 1)
    await write.compare_and_append(updates([0, 10], 5, -1), 5, 6)
    splits = await read.snapshot(5, num_splits=3)
    assert len(splits) == 3
    tables = [await executor.fetch_split(persist.Split.from_bytes(s.to_bytes())) for s in splits]
    union: dict[tuple[int, str], int] = {}
    for t in tables:
        assert set(t.column("_time").to_pylist()) <= {5}
        got = contents(t)
        assert not union.keys() & got.keys(), "a row is in two splits"
        union.update(got)
    expected = contents(await read.snapshot_and_fetch(5))
    assert union == expected
    assert len(expected) == 48


async def test_snapshot_waits_for_upper(client: persist.PersistClient) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    pending = asyncio.ensure_future(read.snapshot_and_fetch(2))
    await asyncio.sleep(0.05)
    assert not pending.done()
    await write.compare_and_append(updates([1], 0), 0, 2)
    await asyncio.sleep(0.05)
    assert not pending.done()  # upper 2 does not make time 2 readable yet
    await write.compare_and_append(updates([2], 2), 2, 3)
    assert contents(await asyncio.wait_for(pending, 5)) == {(1, "v1"): 1, (2, "v2"): 1}


async def test_a_read_waits_at_most_its_timeout(client: persist.PersistClient) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    for call in (
        lambda: read.snapshot_and_fetch(1, timeout=0.05),
        lambda: read.snapshot(1, 2, timeout=0),
        lambda: read.dataset(1, timeout=0.05),
    ):
        with pytest.raises(TimeoutError, match=r"as_of 1 of shard .* upper is still 1"):
            await call()
    with pytest.raises(persist.InvalidUsage, match="timeout"):
        await read.snapshot_and_fetch(1, timeout=-1)
    # A timeout that the upper beats changes nothing; the since stayed where it was.
    assert read.since == 0
    pending = asyncio.ensure_future(read.snapshot_and_fetch(1, timeout=30))
    await write.compare_and_append(updates([2], 1), 1, 2)
    assert contents(await pending) == {(1, "v1"): 1, (2, "v2"): 1}


async def test_listen_in_process_and_across_clients(connect: Connect) -> None:
    a, b = await connect(), await connect()
    shard = persist.ShardId.new()
    write, local = await a.open(shard, SCHEMA)
    remote = await b.open_leased_reader(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)

    async def collect(read: persist.ReadHandle) -> list[persist.ListenEvent]:
        events = []
        async for ev in read.listen(0):
            events.append(ev)
            if ev.upper is None:
                return events
        return events

    tasks = [asyncio.ensure_future(collect(r)) for r in (local, remote)]
    await write.compare_and_append(updates([2, 1], [1, 2], [1, -1]), 1, 3)
    await write.compare_and_append(updates([3], 3), 3, 5)
    await write.compare_and_append(updates([], 5), 5, None)
    for events in await asyncio.wait_for(asyncio.gather(*tasks), 10):
        uppers = [ev.upper for ev in events]
        finite = uppers[:-1]
        assert uppers[-1] is None and None not in finite
        assert finite == sorted(set(finite))  # strictly increasing
        seen = [(r["k"], r["_time"], r["_diff"]) for ev in events for r in ev.updates.to_pylist()]
        for ev in events:
            assert all(
                ev.upper is None or t < ev.upper for t in ev.updates.column("_time").to_pylist()
            )
        assert sorted(seen) == [(1, 2, -1), (2, 1, 1), (3, 3, 1)]  # only times > as_of 0


async def test_snapshot_plus_listen_reproduces_the_collection(
    client: persist.PersistClient,
) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    for t in range(6):
        await write.compare_and_append(updates([t, t + 1], t, [1, -1] if t % 2 else 1), t, t + 1)
    acc = contents(await read.snapshot_and_fetch(2))
    async for ev in read.listen(2):
        for r in ev.updates.to_pylist():
            key = (r["k"], r["v"])
            acc[key] = acc.get(key, 0) + r["_diff"]
        if ev.upper == 6:
            break
    assert {k: v for k, v in acc.items() if v} == contents(await read.snapshot_and_fetch(5))


async def test_downgrade_since_and_reader_holds(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, r1 = await client.open(shard, SCHEMA)
    r2 = await client.open_leased_reader(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 10)
    await r1.downgrade_since(5)
    assert r1.since == 5 and (await client.inspect(shard))["since"] == 0
    await r2.downgrade_since(3)
    assert (await client.inspect(shard))["since"] == 3
    with pytest.raises(persist.InvalidUsage, match="backwards"):
        await r2.downgrade_since(2)
    with pytest.raises(persist.InvalidUsage, match="below"):
        await r1.snapshot(4)
    with pytest.raises(persist.InvalidUsage):
        await r1.snapshot_and_fetch(4)
    await r2.expire()
    assert (await client.inspect(shard))["since"] == 5
    with pytest.raises(persist.InvalidUsage):
        await r2.snapshot_and_fetch(7)


async def test_handles_after_expire_refuse(client: persist.PersistClient) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.expire()
    await read.expire()
    with pytest.raises(persist.LeaseExpired):
        await write.compare_and_append(updates([1], 0), 0, 1)
    with pytest.raises(persist.LeaseExpired):
        await read.snapshot_and_fetch(0)
    with pytest.raises(persist.InvalidUsage):
        await read.downgrade_since(1)
    info = await client.inspect(write.shard_id)
    assert info["writers"] == 0 and info["readers"] == 0


async def test_lease_expiry_releases_holds(connect: Connect) -> None:
    now = [1_000_000]  # one clock for both clients, moved by hand: no race with real time

    def clock() -> int:
        return now[0]

    sleepy = await connect(lease_duration_s=1, heartbeat_interval_s=3600, now_ms=clock)
    awake = await connect(lease_duration_s=3600, heartbeat_interval_s=3600, now_ms=clock)
    shard = persist.ShardId.new()
    w_sleepy, r_sleepy = await sleepy.open(shard, SCHEMA)
    w, r = await awake.open(shard, SCHEMA)
    await w.compare_and_append(updates([1], 0), 0, 5)
    await r.downgrade_since(4)
    assert (await awake.inspect(shard))["since"] == 0  # held back by the sleepy reader
    now[0] += 1_001
    await r.downgrade_since(4)  # any commit expires stale leases
    info = await awake.inspect(shard)
    assert info["since"] == 4 and info["readers"] == 1 and info["writers"] == 1
    with pytest.raises(persist.LeaseExpired):
        await w_sleepy.compare_and_append(updates([2], 5), 5, 6)
    with pytest.raises(persist.LeaseExpired):
        await r_sleepy.downgrade_since(5)


async def test_background_heartbeat_keeps_leases(connect: Connect) -> None:
    client = await connect(lease_duration_s=1.5, heartbeat_interval_s=0.05)
    other = await connect()
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    w2 = await other.open_writer(shard, SCHEMA)
    for t in range(8):  # 2.4 s without using the handles: only heartbeats keep them
        await asyncio.sleep(0.3)
        await w2.compare_and_append(updates([t], t), t, t + 1)
    await write.compare_and_append(updates([100], 8), 8, 9)
    assert (100, "v100") in contents(await read.snapshot_and_fetch(8))
    assert (await other.inspect(shard))["readers"] == 1


async def test_schema_is_fixed_at_first_open(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA)
    with pytest.raises(persist.InvalidUsage, match="schema"):
        await client.open_writer(shard, pa.schema([("k", pa.int32())]))
    with pytest.raises(persist.InvalidUsage, match="reserved"):
        await client.open_writer(persist.ShardId.new(), pa.schema([("_k", pa.int64())]))


async def test_inspect_and_finalize(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    info = await client.inspect(shard)
    for key in (
        "seqno",
        "since",
        "upper",
        "batches",
        "parts",
        "bytes",
        "readers",
        "writers",
        "rollups",
    ):
        assert key in info
    assert (info["batches"], info["parts"], info["readers"], info["writers"]) == (1, 1, 1, 1)
    assert info["bytes"] > 0
    with pytest.raises(persist.InvalidUsage, match="since and upper"):
        await client.finalize(shard)
    await write.compare_and_append(updates([], 1), 1, None)
    await read.downgrade_since(None)
    await client.finalize(shard)
    info = await client.inspect(shard)
    assert info["finalized"] and info["batches"] == 0
    assert len(await client.blob.list_keys(f"{shard}/")) == 1  # the tombstone rollup
    with pytest.raises(persist.InvalidUsage, match="finalized"):
        await client.open_writer(shard, SCHEMA)
    with pytest.raises(persist.InvalidUsage, match="finalized"):
        await client.open_leased_reader(shard)  # without a schema, refused alike


async def test_rollups_bound_what_an_open_reads(connect: Connect) -> None:
    client = await connect(rollup_interval=8)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    for t in range(40):
        await write.compare_and_append(updates([t], t), t, t + 1)
    await client.maintain(shard)
    info = await client.inspect(shard)
    assert info["seqno"] - info["latest_rollup_seqno"] < 8 + 2
    # Rollups were written as the shard grew; older ones were retired, then deleted.
    assert info["rollups"] == 1 and info["latest_rollup_seqno"] > 30
    assert len(await client.blob.list_keys(f"{shard}/rollup/")) == 1
    fresh = await connect()
    r = await fresh.open_leased_reader(shard, SCHEMA)
    assert contents(await r.snapshot_and_fetch(39)) == {(t, f"v{t}"): 1 for t in range(40)}


async def test_large_append_is_cut_into_bounded_parts(connect: Connect) -> None:
    client = await connect(part_target_bytes=64 * 1024)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    n = 50_000
    data = pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "v": [f"value-{i % 977}" for i in range(n)],
            "_time": pa.array([i % 3 for i in range(n)], pa.uint64()),
        }
    )
    await write.compare_and_append(data, 0, 3)
    info = await client.inspect(write.shard_id)
    assert info["parts"] >= 10 and info["rows"] == n
    out = await read.snapshot_and_fetch(2)
    assert out.num_rows == n and out.column("k").to_pylist() == list(range(n))


async def test_client_use_after_close_is_refused(client: persist.PersistClient) -> None:
    await client.close()
    with pytest.raises(persist.InvalidUsage, match="closed"):
        await client.open_writer(persist.ShardId.new(), SCHEMA)


async def test_listen_wakes_on_a_local_commit_without_polling(connect: Connect) -> None:
    client = await connect(poll_interval_s=3600)  # only a local commit can wake it in time
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    stream = read.listen(0)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)
    await write.compare_and_append(updates([1], 1), 0, 2)
    event = await asyncio.wait_for(first, 5)
    assert event.upper == 2 and contents(event.updates) == {(1, "v1"): 1}
    await stream.aclose()


async def test_closing_the_client_ends_waiting_reads(connect: Connect) -> None:
    client = await connect()
    _, read = await client.open(persist.ShardId.new(), SCHEMA)
    waiting = asyncio.ensure_future(read.snapshot_and_fetch(5))
    await asyncio.sleep(0.05)
    await client.close()
    with pytest.raises(persist.InvalidUsage, match="closed"):
        await asyncio.wait_for(waiting, 5)


async def test_listen_refuses_once_since_passes_what_it_delivered(
    client: persist.PersistClient,
) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 3)
    stream = read.listen(0)
    first = await stream.__anext__()
    assert first.upper == 3
    await read.downgrade_since(2)  # fine: 2 was delivered
    await write.compare_and_append(updates([2], 3), 3, 4)
    assert (await stream.__anext__()).upper == 4
    await read.downgrade_since(4)  # beyond the 3 delivered
    await write.compare_and_append(updates([3], 4), 4, 5)
    with pytest.raises(persist.InvalidUsage, match="passed the listen"):
        await stream.__anext__()


async def test_a_shard_opens_without_its_schema_and_tells_its_frontiers(
    connect: Connect,
) -> None:
    creator, other = await connect(), await connect()
    shard = persist.ShardId.new()
    with pytest.raises(persist.InvalidUsage, match="does not exist"):
        await other.open_leased_reader(shard)
    with pytest.raises(persist.InvalidUsage, match="does not exist"):
        await other.frontiers(shard)
    write, _ = await creator.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 3)
    assert await other.shard_schema(shard) == SCHEMA
    assert await other.frontiers(shard) == (0, 3)
    w2, r2 = await other.open(shard)
    assert w2.schema == SCHEMA and r2.schema == SCHEMA
    await w2.compare_and_append(updates([3], 3), 3, 4)
    await r2.downgrade_since(2)
    # The creator's client sees the other's changes too (it reads only the new diffs).
    assert await creator.frontiers(shard) == (0, 4)  # the creator's reader still holds 0
    assert contents(await r2.snapshot_and_fetch(3)) == {(1, "v1"): 1, (2, "v2"): 1, (3, "v3"): 1}
