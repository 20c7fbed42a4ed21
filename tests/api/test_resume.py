"""Handles resumed by id in another process, and leases chosen per handle: what lets a Spark
job's tasks heartbeat the driver's reader and write under the driver's writer."""

from __future__ import annotations

import asyncio

import pytest

import persist

from .conftest import SCHEMA, Connect, contents, updates


async def test_a_reader_resumed_elsewhere_reads_heartbeats_and_expires_it(
    connect: Connect,
) -> None:
    driver, task = await connect(), await connect()
    shard = persist.ShardId.new()
    write, read = await driver.open(shard, SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 2)
    await read.downgrade_since(1)
    again = await task.resume_reader(shard, read.reader_id)
    assert again.since == 1 and again.schema == SCHEMA
    splits = await read.snapshot(1, 2)
    got: dict[tuple[int, str], int] = {}
    for s in splits:
        got.update(contents(await task.fetch_split(s)))
    assert got == {(1, "v1"): 1, (2, "v2"): 1}
    assert contents(await again.snapshot_and_fetch(1)) == got
    await again.heartbeat()
    await again.expire()
    assert (await driver.inspect(shard))["readers"] == 0
    with pytest.raises(persist.LeaseExpired):
        await read.downgrade_since(1)
    with pytest.raises(persist.LeaseExpired):
        await task.resume_reader(shard, read.reader_id)


async def test_batches_written_under_a_resumed_writer_commit_in_one_step(
    connect: Connect,
) -> None:
    driver, task_a, task_b = await connect(), await connect(), await connect()
    shard = persist.ShardId.new()
    write = await driver.open_writer(shard, SCHEMA, lease_duration_s=600)
    batches = []
    for i, task in enumerate([task_a, task_b]):
        w = await task.resume_writer(shard, write.writer_id)
        batches.append((await w.batch(updates([i], 0), 0, 1)).to_bytes())
    handed = [persist.Batch.from_bytes(b) for b in batches]
    await write.compare_and_append_batch(handed, 0, 1)
    reader = await driver.open_leased_reader(shard)
    assert contents(await reader.snapshot_and_fetch(0)) == {(0, "v0"): 1, (1, "v1"): 1}
    assert (await driver.inspect(shard))["writers"] == 1  # the tasks registered none


async def test_a_lease_chosen_per_handle_runs_out_on_its_own_length(connect: Connect) -> None:
    short_lived, other = await connect(), await connect()
    shard = persist.ShardId.new()
    gone = await short_lived.open_writer(shard, SCHEMA, lease_duration_s=0.2)
    gone.detach()  # left registered by the close:
    await short_lived.close()  # it stops heartbeating, as a crashed process would
    w = await other.open_writer(shard, SCHEMA)  # the client's lease: 60 s
    for _ in range(100):
        await w.compare_and_append(updates([], 0), w.upper, w.upper)  # commits judge leases
        if (await other.inspect(shard))["writers"] == 1:
            break
        await asyncio.sleep(0.05)
    assert (await other.inspect(shard))["writers"] == 1


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "60", 10**9])
async def test_a_bad_lease_length_is_refused(client: persist.PersistClient, bad: object) -> None:
    shard = persist.ShardId.new()
    with pytest.raises(persist.InvalidUsage, match="lease_duration_s"):
        await client.open_writer(shard, SCHEMA, lease_duration_s=bad)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage, match="lease_duration_s"):
        await client.open_leased_reader(shard, SCHEMA, lease_duration_s=bad)  # type: ignore[arg-type]


async def test_resuming_an_unknown_handle_is_lease_expired(client: persist.PersistClient) -> None:
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA)
    with pytest.raises(persist.LeaseExpired):
        await client.resume_writer(shard, "w-nope")
    with pytest.raises(persist.LeaseExpired):
        await client.resume_reader(shard, "r-nope")


async def test_a_resumed_reader_keeps_every_split_it_made_fetchable(connect: Connect) -> None:
    """A Spark task resumes the driver's reader by id and heartbeats it: the resumed handle knows
    nothing of the splits handed out, yet must keep the state version they name, or compaction
    and garbage collection delete parts those splits read while the since still holds as_of."""
    # Parts in blob (not inline in the state, which a split carries along).
    driver, task, other = [await connect(inline_writes_max_bytes=0) for _ in range(3)]
    shard = persist.ShardId.new()
    write = await other.open_writer(shard, SCHEMA)
    for t in range(4):
        await write.compare_and_append(updates([t], t), t, t + 1)
    plan = await driver.plan_snapshot(shard, as_of=3, splits=2)
    assert plan.reader is not None
    plan.reader.detach()  # handed to the tasks
    await driver.close()  # the planning process is gone: only the tasks heartbeat now
    again = await task.resume_reader(shard, plan.reader.reader_id)
    for t in range(4, 40):  # enough appends that compaction rewrites the planned parts
        await write.compare_and_append(updates([t], t), t, t + 1)
        await again.heartbeat()
        await other.maintain(shard)
    got: dict[tuple[int, str], int] = {}
    for s in plan.splits:
        got.update(contents(await task.fetch_split(s)))
    assert got == {(t, f"v{t}"): 1 for t in range(4)}
    await again.expire()
