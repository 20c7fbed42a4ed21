"""Splits are cut by key range: each fetched split is exact on its own, wherever a row's inserts
and retractions were written, and a split reads only the parts its keys may be in."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

import persist

from .conftest import SCHEMA, Connect, contents, updates


@pytest.mark.parametrize("num_splits", [2, 3, 7])
async def test_each_split_is_exact_wherever_retractions_sit(
    connect: Connect, num_splits: int
) -> None:
    # Every part in blob (no inline parts) and no merges: the inserts and the retractions of a
    # row stay in different parts, which a split by part would tear apart.
    planner = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    executor = await connect()
    shard = persist.ShardId.new()
    write, read = await planner.open(shard, SCHEMA)
    rng = random.Random(7)
    keys = list(range(400))
    rng.shuffle(keys)
    expected: dict[tuple[int, str], int] = {}
    t = 0
    for chunk in range(4):
        ins = keys[chunk * 100 : (chunk + 1) * 100]
        await write.compare_and_append(updates(ins, t, 2), t, t + 1)
        for k in ins:
            expected[(k, f"v{k}")] = 2
        t += 1
    for chunk in range(4):
        # Retract rows written by every earlier append, in appends of their own.
        out = [k for i, k in enumerate(keys) if i % 4 == chunk][:60]
        await write.compare_and_append(updates(out, t, -1), t, t + 1)
        for k in out:
            expected[(k, f"v{k}")] -= 1
        t += 1
    out = keys[:50]
    await write.compare_and_append(updates(out, t, -1), t, t + 1)
    for k in out:
        expected[(k, f"v{k}")] -= 1
        if not expected[(k, f"v{k}")]:
            del expected[(k, f"v{k}")]
    as_of = t
    splits = await read.snapshot(as_of, num_splits)
    assert len(splits) == num_splits
    union: dict[tuple[int, str], int] = {}
    nonempty = 0
    for s in splits:
        got = contents(await executor.fetch_split(persist.Split.from_bytes(s.to_bytes())))
        # Exact on its own: consolidated (checked by contents), no negative multiplicity.
        assert all(d > 0 for d in got.values())
        assert not union.keys() & got.keys(), "a row is in two splits"
        union.update(got)
        nonempty += bool(got)
    assert union == expected
    assert nonempty >= 2  # the cuts come from the parts' first and last keys


async def test_splits_of_inline_parts_are_exact(connect: Connect) -> None:
    # Inline parts have no key index: every split reads them and keeps only its own keys.
    client = await connect()
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1, 2, 3], 0), 0, 1)
    await write.compare_and_append(updates([2, 3], 1, -1), 1, 2)
    splits = await read.snapshot(1, 3)
    assert len(splits) == 3
    got = [contents(await client.fetch_split(s)) for s in splits]
    assert got[0] == {(1, "v1"): 1} and got[1:] == [{}, {}]


async def test_a_split_names_only_the_parts_its_keys_may_be_in(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    for i in range(8):  # 8 parts of disjoint key ranges, of equal size
        keys = list(range(100 * i, 100 * i + 100))
        await write.compare_and_append(updates(keys, i), i, i + 1)
    splits = await read.snapshot(7, 4)
    assert [len(s.parts) for s in splits] == [2, 2, 2, 2]
    for i, s in enumerate(splits):
        got = contents(await client.fetch_split(s))
        assert sorted(k for k, _ in got) == list(range(200 * i, 200 * i + 200))


async def test_splits_between_two_frontiers_hold_each_update_once_at_its_time(
    connect: Connect,
) -> None:
    planner = await connect(inline_writes_max_bytes=0)
    executor = await connect()
    shard = persist.ShardId.new()
    write, read = await planner.open(shard, SCHEMA)
    expected: dict[tuple[int, str, int], int] = {}
    for t in range(6):
        keys = [(t * 37 + i * 11) % 150 for i in range(40)]
        diff = -1 if t % 3 == 2 else 1
        await write.compare_and_append(updates(keys, t, diff), t, t + 1)
        if 2 <= t < 5:
            for k in set(keys):
                expected[(k, f"v{k}", t)] = expected.get((k, f"v{k}", t), 0) + diff
    await planner.maintain(shard)  # merges keep every time at or above the since (0)
    splits = await read.splits_between(2, 5, 3)
    assert len(splits) == 3
    seen: set[tuple[int, str]] = set()
    got: dict[tuple[int, str, int], int] = {}
    for s in splits:
        table = await executor.fetch_split(persist.Split.from_bytes(s.to_bytes()))
        rows = {(r["k"], r["v"]) for r in table.to_pylist()}
        assert not seen & rows, "a row is in two splits"
        seen |= rows
        for r in table.to_pylist():
            key = (r["k"], r["v"], r["_time"])
            assert key not in got and r["_diff"] != 0
            got[key] = r["_diff"]
    assert got == {k: d for k, d in expected.items() if d}
    await read.downgrade_since(3)
    with pytest.raises(persist.InvalidUsage, match="below this reader's since"):
        await read.splits_between(2, 5)
    with pytest.raises(persist.InvalidUsage, match="must be above"):
        await read.splits_between(4, 4)


@pytest.mark.parametrize("keys", [([1, 2], [5, 6]), ([1, 5], [2, 6])], ids=["apart", "interleaved"])
async def test_a_snapshot_consolidates_only_parts_that_may_share_a_row(
    connect: Connect, monkeypatch: pytest.MonkeyPatch, keys: tuple[list[int], list[int]]
) -> None:
    """Parts that keep one time each and whose key ranges don't meet are read without the
    row-by-row consolidation; interleaved ones are consolidated. Either way, the contents."""
    import persist.core.arrow.updates as up

    calls: list[int] = []
    consolidate = up.consolidate_sorted

    def counted(table: pa.Table, keys: list[str]) -> pa.Table:
        calls.append(table.num_rows)
        return consolidate(table, keys)

    monkeypatch.setattr(up, "consolidate_sorted", counted)
    client = await connect(inline_writes_max_bytes=0)
    shard = persist.ShardId.new()
    write, read = await client.open(shard, SCHEMA)
    first, second = keys
    await write.compare_and_append(updates(first, 0), 0, 1)
    await write.compare_and_append(updates(second, 1, 2), 1, 2)
    got = contents(await read.snapshot_and_fetch(1))
    assert got == {(k, f"v{k}"): 1 for k in first} | {(k, f"v{k}"): 2 for k in second}
    assert bool(calls) == (keys[0] == [1, 5])
