"""Splits of an explicit key range (``ReadHandle.snapshot`` / ``splits_between`` with
``lower_key`` / ``upper_key``) and row bounds (``ReadHandle.row_bounds``): a range reads exactly
its keys, the same rows after compaction rewrote the parts, names only the parts that may hold
them, and steps cut by ``RowBounds.key_within`` tile the keys in pieces of at most N rows."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pytest

import persist
from persist.core.arrow.keyrange import encode_keys

from .conftest import SCHEMA, Connect, contents, updates


def key(k: int) -> bytes:
    return encode_keys(pa.table({"k": pa.array([k], pa.int64()), "v": [f"v{k}"]}))


async def fetched(client: persist.PersistClient, splits: list[persist.Split]) -> dict:
    union: dict[tuple[int, str], int] = {}
    for s in splits:
        got = contents(await client.fetch_split(persist.Split.from_bytes(s.to_bytes())))
        assert not union.keys() & got.keys(), "a row is in two splits"
        union.update(got)
    return union


async def test_a_key_range_reads_its_keys_and_the_same_rows_after_compaction(
    connect: Connect,
) -> None:
    planner = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    shard = persist.ShardId.new()
    write, read = await planner.open(shard, SCHEMA)
    expected: dict[tuple[int, str], int] = {}
    for i in range(8):  # parts of disjoint key ranges, then retractions across them
        keys = list(range(100 * i, 100 * i + 100))
        await write.compare_and_append(updates(keys, i), i, i + 1)
        expected.update({(k, f"v{k}"): 1 for k in keys})
    out = list(range(0, 800, 7))
    await write.compare_and_append(updates(out, 8, -1), 8, 9)
    for k in out:
        del expected[(k, f"v{k}")]

    def inside(lo: int | None, hi: int | None) -> dict[tuple[int, str], int]:
        return {
            r: d
            for r, d in expected.items()
            if (lo is None or r[0] >= lo) and (hi is None or r[0] < hi)
        }

    splits = await read.snapshot(8, 2, lower_key=key(150), upper_key=key(420))
    assert len(splits) == 2
    assert await fetched(planner, splits) == inside(150, 420)
    # The appends of keys 100..499 and the retractions: no other part is named.
    names = {p.key for s in splits for p in s.parts}
    assert len(names) == 5
    # Ranges from one cut to the next tile the keys.
    union: dict[tuple[int, str], int] = {}
    cuts = [b"", key(150), key(420), b""]
    for lo, hi in itertools.pairwise(cuts):
        union.update(await fetched(planner, await read.snapshot(8, 3, lower_key=lo, upper_key=hi)))
    assert union == expected
    # Compaction rewrites the parts; the range is a range of values and reads the same rows.
    merger = await connect(compaction_min_parts=1)
    assert (await merger.maintain(shard))["merges"] >= 1
    fresh = await merger.open_leased_reader(shard)
    after = await fresh.snapshot(8, 1, lower_key=key(150), upper_key=key(420))
    assert {p.key for s in after for p in s.parts} != names
    assert await fetched(planner, after) == inside(150, 420)


async def test_a_key_range_of_updates_between_frontiers(connect: Connect) -> None:
    client = await connect(inline_writes_max_bytes=0)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    for t in range(5):
        await write.compare_and_append(updates(list(range(t, 300, 3)), t), t, t + 1)
    splits = await read.splits_between(1, 4, 2, lower_key=key(50), upper_key=key(200))
    got: dict[tuple[int, int], int] = {}
    for s in splits:
        for r in (await client.fetch_split(s)).to_pylist():
            assert (r["k"], r["_time"]) not in got
            got[(r["k"], r["_time"])] = r["_diff"]
    assert got == {(k, t): 1 for t in range(1, 4) for k in range(t, 300, 3) if 50 <= k < 200}


async def test_steps_of_about_n_rows_tile_a_snapshot(connect: Connect) -> None:
    # One sorted run of parts (one per 16 KiB of the write: ~500 rows, indexed by 4 keys): a step
    # cut at the parts' own index keys holds exactly the rows it is charged, at most N.
    client = await connect(inline_writes_max_bytes=0, part_target_bytes=16 << 10)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates(list(range(3000)), 0), 0, 1)
    bounds = await read.row_bounds(0, 1)
    assert bounds.rows == 3000 and len(bounds.parts) > 4
    lower: pa.Table | None = None
    union: dict[tuple[int, str], int] = {}
    sizes = []
    for _ in range(100):
        cut, charge = bounds.key_within(lower, 400)
        lo = b"" if lower is None else encode_keys(lower)
        hi = b"" if cut is None else encode_keys(cut)
        got = await fetched(client, await read.snapshot(0, 1, lower_key=lo, upper_key=hi))
        assert len(got) == charge <= 400 and not union.keys() & got.keys()
        union.update(got)
        sizes.append(len(got))
        if cut is None:
            break
        lower = cut
    assert union == {(k, f"v{k}"): 1 for k in range(3000)}
    assert 3000 // 400 <= len(sizes) <= 2 * 3000 // 400, sizes


async def test_bad_key_ranges_and_row_bounds_are_refused(client: persist.PersistClient) -> None:
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(updates([1, 2], 0), 0, 1)
    with pytest.raises(persist.InvalidUsage, match="lower_key"):
        await read.snapshot(0, lower_key=b"junk")
    two = encode_keys(pa.table({"k": pa.array([1, 2], pa.int64()), "v": ["a", "b"]}))
    with pytest.raises(persist.InvalidUsage, match="upper_key"):
        await read.splits_between(0, 1, upper_key=two)
    with pytest.raises(persist.InvalidUsage, match="must be above"):
        await read.row_bounds(1, 1)
    await read.downgrade_since(1)
    with pytest.raises(persist.InvalidUsage, match="below this reader's since"):
        await read.row_bounds(0, 1)
