"""``PersistClient.plan_snapshot``: the one snapshot plan both front ends hand out (Flight's
GetFlightInfo, Spark's batch scans): its default as_of, its checks, its wait, its hold on the
since, its splits and its cleanup when anything fails."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

import persist
import persist.plan
from persist.plan import SnapshotPlan
from persist.read import ReadHandle

from .conftest import SCHEMA, Connect, contents, updates


async def _fill(write: persist.WriteHandle) -> dict[tuple[int, str], int]:
    """Three appends (three parts when nothing is inline): inserts of 0..299 at 0, retractions of
    every third key at 1, inserts of every fifth key again at 2. The contents as of 2."""
    keys = list(range(300))
    await write.compare_and_append(updates(keys, 0), 0, 1)
    await write.compare_and_append(updates(keys[::3], 1, -1), 1, 2)
    await write.compare_and_append(updates(keys[::5], 2), 2, 3)
    expected = {}
    for k in keys:
        m = 1 - (k % 3 == 0) + (k % 5 == 0)
        if m:
            expected[(k, f"v{k}")] = m
    return expected


async def _plan(client: persist.PersistClient, shard: str, **kwargs: Any) -> SnapshotPlan:
    """``client.plan_snapshot``, bounded: a plan expected not to wait fails instead of hanging."""
    return await asyncio.wait_for(client.plan_snapshot(shard, **kwargs), 30)


async def _union(client: persist.PersistClient, plan: SnapshotPlan) -> dict[tuple[int, str], int]:
    """The plan's splits fetched (handed over as bytes), checked disjoint and exact each."""
    union: dict[tuple[int, str], int] = {}
    for s in plan.splits:
        got = contents(await client.fetch_split(persist.Split.from_bytes(s.to_bytes())))
        assert all(d > 0 for d in got.values()), "a split alone must be exact"
        assert not union.keys() & got.keys(), "a row is in two splits"
        union.update(got)
    return union


async def _readers(client: persist.PersistClient, shard: str, n: int) -> None:
    """Waits (a bounded time) until the shard has ``n`` readers: failed plans expire theirs in
    the background."""
    deadline = time.monotonic() + 10
    while (got := (await client.inspect(shard))["readers"]) != n:
        assert time.monotonic() < deadline, f"{got} readers, not {n}"
        await asyncio.sleep(0.02)


def _count_opens(client: persist.PersistClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shards ``client`` registers readers of from now on."""
    opened: list[str] = []
    opening = client.open_leased_reader

    async def counted(shard_id: str, *args: Any, **kwargs: Any) -> ReadHandle:
        opened.append(shard_id)
        return await opening(shard_id, *args, **kwargs)

    monkeypatch.setattr(client, "open_leased_reader", counted)
    return opened


async def test_the_default_as_of_is_held_and_the_splits_are_the_snapshot(
    connect: Connect,
) -> None:
    planner = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    executor = await connect()
    shard = persist.ShardId.new()
    expected = await _fill(await planner.open_writer(shard, SCHEMA))

    plan = await _plan(planner, shard, splits=3, purpose="test plan")
    assert plan.shard_id == shard and plan.schema == SCHEMA
    assert plan.as_of == 2  # upper - 1
    assert plan.reader is not None
    assert len(plan.splits) == 3
    assert {s.as_of for s in plan.splits} == {2}
    assert plan.size == sum(s.size for s in plan.splits) > 0
    # The hold: the reader, and with it the shard, holds the since at as_of.
    assert plan.reader.since == 2
    assert (await executor.inspect(shard))["since"] == 2
    assert await _union(executor, plan) == expected
    # The same, from another client: exactly what a snapshot at as_of fetches.
    assert contents(await plan.reader.snapshot_and_fetch(2)) == expected


async def test_the_hold_outlasts_the_shard_moving_on(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=0)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    expected = await _fill(write)
    plan = await _plan(client, shard, as_of=1, splits=2)
    assert plan.reader is not None and plan.reader.since == 1
    # Later retractions of everything, merged and collected: the splits still read as of 1.
    await write.compare_and_append(updates(list(range(300)), 3, -1), 3, 4)
    await client.maintain(shard)
    assert (await client.inspect(shard))["since"] == 1
    at1 = {kv: 1 for kv in expected if kv[0] % 3}
    assert await _union(await connect(), plan) == at1


async def test_a_plan_that_does_not_move_the_since_reads_the_same(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    shard = persist.ShardId.new()
    expected = await _fill(await client.open_writer(shard, SCHEMA))
    plan = await _plan(client, shard, splits=2, move_since=False)
    assert plan.as_of == 2 and plan.reader is not None
    # The reader stays at its registration, and so does the shard: history stays readable.
    assert plan.reader.since == 0 and (await client.inspect(shard))["since"] == 0
    assert await _union(await connect(), plan) == expected
    await plan.reader.expire()
    assert (await client.inspect(shard))["since"] == 0
    earlier = await _plan(client, shard, as_of=0, move_since=False)
    assert earlier.reader is not None
    await earlier.reader.expire()


async def test_the_default_split_count_is_one_per_split_bytes(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    shard = persist.ShardId.new()
    expected = await _fill(await client.open_writer(shard, SCHEMA))
    whole = await _plan(client, shard, splits=1)
    assert len(whole.splits) == 1
    # The default, 128 MiB a split: one.
    assert len((await _plan(client, shard)).splits) == 1
    step = max(1, whole.size // 3)
    plan = await _plan(client, shard, split_bytes=step)
    assert len(plan.splits) == math.ceil(whole.size / step) >= 3
    assert await _union(client, plan) == expected
    assert len((await _plan(client, shard, splits=5)).splits) == 5


async def test_empty_splits_are_kept_or_dropped(connect: Connect) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    # Retractions that cancel everything: no part at all.
    await write.compare_and_append(updates([1, 1], 0, [1, -1]), 0, 1)
    kept = await _plan(client, shard, splits=3)
    assert len(kept.splits) == 3 and kept.reader is not None
    assert not any(s.parts for s in kept.splits)
    assert await _union(client, kept) == {}
    await kept.reader.expire()
    dropped = await _plan(client, shard, splits=3, drop_empty_splits=True)
    # Nothing to fetch: nothing held, and the reader it registered is let go.
    assert dropped.splits == () and dropped.reader is None and dropped.as_of == 0
    assert dropped.size == 0
    await _readers(client, shard, 0)


async def test_a_shard_with_nothing_written_plans_empty_or_refuses(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA)  # upper 0
    opened = _count_opens(client, monkeypatch)
    plan = await _plan(client, shard, empty_if_unwritten=True)
    assert plan.as_of is None and plan.reader is None and plan.splits == ()
    assert plan.schema == SCHEMA
    with pytest.raises(persist.InvalidUsage, match="upper is 0"):
        await _plan(client, shard)
    with pytest.raises(persist.InvalidUsage, match="as_of 0 is not below the shard's upper 0"):
        await _plan(client, shard, as_of=0, wait=False)
    # None of them registered a reader.
    assert opened == []
    assert (await client.inspect(shard))["readers"] == 0
    with pytest.raises(persist.InvalidUsage, match="does not exist"):
        await client.plan_snapshot(persist.ShardId.new(), empty_if_unwritten=True)


async def test_a_finished_shard_needs_as_of(connect: Connect) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    await write.compare_and_append(updates([], 1), 1, None)
    with pytest.raises(persist.InvalidUsage, match="finished"):
        await _plan(client, shard, empty_if_unwritten=True)
    assert (await client.inspect(shard))["readers"] == 0
    # Every time is readable: an explicit as_of, however late, needs no wait.
    plan = await _plan(client, shard, as_of=7, wait=False)
    assert plan.as_of == 7 and plan.reader is not None and plan.reader.since == 7
    assert await _union(client, plan) == {(1, "v1"): 1, (2, "v2"): 1}


async def test_as_of_below_the_since_is_refused_naming_both(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    write, hold = await client.open(shard, SCHEMA)
    await _fill(write)
    await hold.downgrade_since(2)
    opened = _count_opens(client, monkeypatch)
    for wait in (True, False):
        with pytest.raises(persist.InvalidUsage, match="as_of 1 is below the shard's since 2"):
            await _plan(client, shard, as_of=1, wait=wait)
    # Refused from the shard's state, before any reader was registered.
    assert opened == []
    assert (await client.inspect(shard))["readers"] == 1  # only hold


async def test_a_since_that_moves_during_planning_is_caught_and_the_reader_expired(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    write, hold = await client.open(shard, SCHEMA)
    await _fill(write)
    registering = persist.plan.register_reader_handle

    async def racing_registration(*args: Any, **kwargs: Any) -> ReadHandle:
        # Between the plan's check of the state and its reader's registration, the only other
        # reader moves the since past as_of.
        await hold.downgrade_since(2)
        return await registering(*args, **kwargs)

    monkeypatch.setattr(persist.plan, "register_reader_handle", racing_registration)
    with pytest.raises(persist.InvalidUsage, match="as_of 1 is below the shard's since 2"):
        await _plan(client, shard, as_of=1)
    await _readers(client, shard, 1)


async def test_a_failed_plan_expires_its_reader(
    connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, other = await connect(), await connect()
    shard = persist.ShardId.new()
    await _fill(await client.open_writer(shard, SCHEMA))

    async def broken(self: ReadHandle, as_of: int, num_splits: int = 1) -> list[persist.Split]:
        raise RuntimeError("the blob store fell over")

    monkeypatch.setattr(ReadHandle, "snapshot", broken)
    with pytest.raises(RuntimeError, match="fell over"):
        await client.plan_snapshot(shard, lease_duration_s=600)
    # close waits for the expiry it started in the background.
    await client.close()
    state = await other.inspect(shard)
    assert state["readers"] == 0 and state["since"] == 0


async def test_a_plan_waits_for_a_future_as_of(connect: Connect) -> None:
    client, writer_client = await connect(), await connect()
    shard = persist.ShardId.new()
    write = await writer_client.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 1)
    with pytest.raises(persist.InvalidUsage, match="as_of 2 is not below the shard's upper 1"):
        await _plan(client, shard, as_of=2, wait=False)

    task = asyncio.create_task(client.plan_snapshot(shard, as_of=2, splits=2))
    await _readers(writer_client, shard, 1)
    assert not task.done()
    # Waiting, the reader holds the since it registered at, not as_of.
    state = await writer_client.inspect(shard)
    assert state["readers"] == 1 and state["since"] == 0
    await write.compare_and_append(updates([2], 1), 1, 2)
    await asyncio.sleep(0.1)
    assert not task.done()  # upper 2 is not past as_of 2
    await write.compare_and_append(updates([1], 2, -1), 2, 3)
    plan = await asyncio.wait_for(task, 30)
    assert plan.as_of == 2 and plan.reader is not None and plan.reader.since == 2
    assert len(plan.splits) == 2
    assert await _union(writer_client, plan) == {(2, "v2"): 1}


async def test_a_cancelled_wait_leaves_the_since_where_it_was(connect: Connect) -> None:
    client, other = await connect(), await connect()
    shard = persist.ShardId.new()
    write = await other.open_writer(shard, SCHEMA)
    await write.compare_and_append(updates([1], 0), 0, 2)
    task = asyncio.create_task(client.plan_snapshot(shard, as_of=10, lease_duration_s=600))
    await _readers(other, shard, 1)  # registered, and waiting for the upper to pass 10
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _readers(other, shard, 0)
    # The since never passed the upper: it is where it was.
    state = await other.inspect(shard)
    assert state["since"] == 0 and state["upper"] == 2
    # ... and as_of 1 still reads (no hold was lost to a since moved ahead).
    plan = await _plan(client, shard, as_of=1)
    assert await _union(other, plan) == {(1, "v1"): 1}


async def test_bad_arguments_are_invalid_usage_before_anything_is_done(connect: Connect) -> None:
    client = await connect()
    shard = persist.ShardId.new()
    await _fill(await client.open_writer(shard, SCHEMA))
    bad: list[dict[str, Any]] = [
        {"as_of": -1},
        {"as_of": True},
        {"splits": 0},
        {"splits": 1.5},
        {"split_bytes": 0},
        {"wait": "yes"},
        {"drop_empty_splits": 1},
        {"empty_if_unwritten": None},
        {"move_since": 0},
        {"purpose": b"bytes"},
        {"lease_duration_s": 0},
    ]
    for kwargs in bad:
        with pytest.raises(persist.InvalidUsage):
            await _plan(client, shard, **kwargs)
    with pytest.raises(persist.InvalidUsage):
        await client.plan_snapshot("not-a-shard")
    assert (await client.inspect(shard))["readers"] == 0
