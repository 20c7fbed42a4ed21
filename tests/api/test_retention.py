"""Retention by policy, wall-clock time travel and history, by public names, on every location.
The clock is the config's ``now_ms``, moved by the test: days pass in a millisecond."""

from __future__ import annotations

import datetime
import logging

import pytest

import persist
from persist.core.shard.history import SKEW_MS

from .conftest import SCHEMA, Connect, contents, updates

T0 = 1_800_000_000_000  # ms since the epoch: 2027-01-15


class FakeClock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> int:
        return self.ms

    def at(self, ms: int) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_the_default_retention_and_setting_it(connect: Connect, clock: FakeClock) -> None:
    client = await connect(retention_s=24 * 3600.0, now_ms=clock)
    shard = persist.ShardId.new()
    await client.open_writer(shard, SCHEMA)
    assert (await client.inspect(shard))["retention_s"] == 24 * 3600.0
    await client.set_retention(shard, 90)
    assert (await client.inspect(shard))["retention_s"] == 90
    await client.set_retention(shard, None)
    assert (await client.inspect(shard))["retention_s"] is None
    for bad in (0, -1, float("nan"), "1d", True, 10**12):
        with pytest.raises(persist.InvalidUsage, match="retention"):
            await client.set_retention(shard, bad)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage):
        persist.PersistConfig(retention_s=0)


async def test_readers_can_not_take_history_within_retention(
    connect: Connect, clock: FakeClock
) -> None:
    client = await connect(retention_s=60.0, now_ms=clock, lease_duration_s=3600.0)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    for t in range(10):
        clock.ms += 1000
        await write.compare_and_append(updates([t], t), t, t + 1)
    await read.downgrade_since(9)  # an eager reader: today this took history away
    assert (await client.frontiers(shard))[0] == 0
    other = await client.open_leased_reader(shard)
    assert contents(await other.snapshot_and_fetch(0)) == {(0, "v0"): 1}
    await other.expire()
    # Once the instant time 4 became readable (upper 5) is more than the window ago, the since
    # may pass 4, and goes as far as the reader lets it.
    clock.ms = T0 + 5000 + 60_000 + SKEW_MS + 1
    await client.maintain(shard)
    assert (await client.frontiers(shard))[0] == 4
    clock.ms += 3600 * 1000
    await client.maintain(shard)
    assert (await client.frontiers(shard))[0] == 9  # the reader's since: it holds the rest


async def test_without_readers_the_since_follows_the_window_and_cost_stays_bounded(
    connect: Connect, clock: FakeClock
) -> None:
    client = await connect(retention_s=30.0, now_ms=clock, compaction_min_parts=1)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    # One row rewritten over and over: with no reader, only the window's versions stay.
    for t in range(120):
        clock.ms += 5_000
        table = updates([t], t) if t == 0 else updates([t - 1, t], t, [-1, 1])
        await write.compare_and_append(table, t, t + 1)
        if t % 20 == 19:
            await client.maintain(shard)
    await client.maintain(shard)
    since, upper = await client.frontiers(shard)
    # The window (30 s + skew) spans 18 commits at 5 s apiece: the since is just behind it.
    assert upper == 120 and since is not None and 100 <= since < 120
    info = await client.inspect(shard)
    window_updates = 2 * (upper - since) + 1  # the row and each rewrite in the window
    # Compaction merges by size levels, so a tail below the since may wait for its merge:
    # bounded by the window either way, far from the 239 updates written.
    assert info["rows"] <= 3 * window_updates, info
    await client.purge(shard)  # consolidates everything below the since now
    assert (await client.inspect(shard))["rows"] <= window_updates + 1
    reader = await client.open_leased_reader(shard)
    assert contents(await reader.snapshot_and_fetch(119)) == {(119, "v119"): 1}
    assert contents(await reader.snapshot_and_fetch(since)) == {(since, f"v{since}"): 1}
    with pytest.raises(persist.InvalidUsage, match="since"):
        await reader.snapshot_and_fetch(since - 1)


async def test_time_travel_by_wall_clock(connect: Connect, clock: FakeClock) -> None:
    client = await connect(retention_s=3600.0, now_ms=clock)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    start = clock.ms
    with pytest.raises(persist.InvalidUsage, match="nothing had been written"):
        await client.as_of_at(shard, clock.at(start))
    stamps = []
    for t in range(5):
        clock.ms += 10_000
        await write.compare_and_append(updates([t], 2 * t), 2 * t, 2 * t + 2)
        stamps.append(clock.ms)
    clock.ms += 10_000
    for t, ms in enumerate(stamps):
        assert await client.as_of_at(shard, clock.at(ms)) == 2 * t + 1
        assert await client.as_of_at(shard, clock.at(ms + 9_999)) == 2 * t + 1
    as_of = await client.as_of_at(shard, clock.at(stamps[2]))
    assert contents(await read.snapshot_and_fetch(as_of)) == {
        (0, "v0"): 1,
        (1, "v1"): 1,
        (2, "v2"): 1,
    }
    naive = clock.at(stamps[1]).replace(tzinfo=None)  # naive means UTC
    assert await client.as_of_at(shard, naive) == 3
    with pytest.raises(persist.InvalidUsage, match="future"):
        await client.as_of_at(shard, clock.at(clock.ms + 60_000))
    with pytest.raises(persist.InvalidUsage, match="reach back"):
        await client.as_of_at(shard, clock.at(start - 1000))
    clock.ms += 2 * 3600 * 1000
    with pytest.raises(persist.InvalidUsage, match="retention"):
        await client.as_of_at(shard, clock.at(stamps[0]))
    with pytest.raises(persist.InvalidUsage, match="datetime"):
        await client.as_of_at(shard, stamps[0])  # type: ignore[arg-type]


async def test_time_travel_after_the_clock_stepped_back_says_it_may_be_stale(
    connect: Connect, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Stamps never go backwards: commits made after the clock stepped back are stamped with the
    # newest stamp before the step, so an instant read from the stepped clock finds them later
    # than it. The answer is older than what was just written: said, not silent.
    client = await connect(retention_s=3600.0, now_ms=clock)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    for t in range(2):
        clock.ms += 10_000
        await write.compare_and_append(updates([t], t), t, t + 1)
    with caplog.at_level(logging.WARNING, logger="persist"):
        assert await client.as_of_at(shard, clock.at(clock.ms)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    clock.ms -= 5_000  # stepped back
    await write.compare_and_append(updates([2], 2), 2, 3)
    with caplog.at_level(logging.WARNING, logger="persist"):
        assert await client.as_of_at(shard, clock.at(clock.ms)) == 0  # stale: 2 was written
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "clock" in warned[0] and shard in warned[0], warned


async def test_history_lists_the_commits_within_retention(
    connect: Connect, clock: FakeClock
) -> None:
    client = await connect(retention_s=600.0, now_ms=clock)
    shard = persist.ShardId.new()
    loader = await client.open_writer(shard, SCHEMA, "loader")
    cleaner = await client.open_writer(shard, SCHEMA, "cleaner")
    clock.ms += 1000
    await loader.compare_and_append(updates([1, 2, 3], 0), 0, 1)
    clock.ms += 1000
    await cleaner.compare_and_append(updates([2], 1, -1), 1, 2)
    clock.ms += 1000
    await loader.compare_and_append(updates([], 2), 2, 5)  # moves the upper alone
    got = await client.history(shard)
    assert [(h["upper"], h["rows_added"], h["rows_retracted"], h["purpose"]) for h in got] == [
        (0, 0, 0, ""),  # created
        (1, 3, 0, "loader"),
        (2, 0, 1, "cleaner"),
        (5, 0, 0, "loader"),
    ]
    assert [h["at"] for h in got] == [clock.at(T0 + i * 1000) for i in range(4)]
    assert all(h["commits"] == 1 for h in got)
    seqnos = [h["seqno"] for h in got]
    assert seqnos == sorted(seqnos) and len(set(seqnos)) == 4
    clock.ms += 3600 * 1000
    loader = await client.open_writer(shard, SCHEMA, "loader")  # the old one's lease ran out
    await loader.compare_and_append(updates([9], 5), 5, 6)
    assert [h["upper"] for h in await client.history(shard)] == [6]  # the rest left the window
