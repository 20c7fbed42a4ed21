"""Unsorted runs (``PartRef.unsorted``): a big write stores its parts as its rows come, without
sorting or consolidating them, and every reader still sees exactly the shard's contents.

The model is a brute-force multiset of (row, time) -> diff. What can touch the parts this
test's writes leave, and where each is covered:

- the writer that stores unsorted runs, beside another client's writer that stores sorted
  runs, both on one shard, in any interleaving (here: each batch is written by either);
- duplicate rows and times within one part, retractions, multiplicities, diffs that cancel
  within a part (here);
- readers of every kind: snapshots, key-ranged splits (``snapshot(as_of, n)``, each split
  reading the whole unsorted part and keeping its own keys), listens, ``dataset`` (part files
  scanned in place when the scan is plain), ``read_table``-style contents (here);
- compaction merging unsorted and sorted runs into one sorted run (``maintain``, here);
- ``erase`` rewriting an unsorted part (here);
- another process decoding the parts (a fresh client with no memory of the writes: here);
- engines reading the files as stored (the brute-force scan model in
  ``tests/core/test_scan.py`` draws unsorted runs; Spark's exactness tests read what writes
  of more than ``sorted_part_max_bytes`` leave);
- faults, cancellations, lease expiries, restarts and clocks: the harness's state machine
  (``tests/harness/test_state_machine.py``), where every other client stores unsorted runs;
- a release that predates unsorted runs: it refuses every frame that references one
  (``tests/core/test_codec.py``);
- damaged bytes: an unsorted part is checksummed and verified as any other
  (``tests/api/test_damaged_parts.py`` holds for every part).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import persist
from persist.testing import scaled

from .conftest import SCHEMA, Connect

Update = tuple[int, str, int, int]  # k, v, time, diff


def table_of(ups: list[Update]) -> pa.Table:
    return pa.table(
        {
            "k": pa.array([u[0] for u in ups], pa.int64()),
            "v": pa.array([u[1] for u in ups], pa.string()),
            "_time": pa.array([u[2] for u in ups], pa.uint64()),
            "_diff": pa.array([u[3] for u in ups], pa.int64()),
        }
    )


def model_at(written: list[Update], as_of: int) -> dict[tuple[int, str], int]:
    sums: Counter[tuple[int, str]] = Counter()
    for k, v, t, d in written:
        if t <= as_of:
            sums[(k, v)] += d
    return {row: m for row, m in sums.items() if m}


def consolidated(table: pa.Table) -> dict[tuple[int, str], int]:
    """Row -> multiplicity of updates read back; they must come consolidated (each row once,
    no zero diff)."""
    out: dict[tuple[int, str], int] = {}
    for r in table.to_pylist():
        row = (r["k"], r["v"])
        assert row not in out and r["_diff"] != 0, f"{row} not consolidated"
        out[row] = r["_diff"]
    return out


def as_rows(table: pa.Table) -> dict[tuple[int, str], int]:
    return dict(Counter((r["k"], r["v"]) for r in table.to_pylist()))


batch_updates = st.lists(
    st.tuples(
        # Few keys and values: the same row (and time) appears more than once in a part.
        st.integers(0, 12),
        st.sampled_from(["a", "b"]),
        st.integers(0, 2),  # offset of the time in the batch's [lower, lower + 3)
        st.sampled_from([1, 1, 1, 2, -1]),
    ),
    min_size=2,
    max_size=40,
)


async def _nothing() -> AsyncIterator[persist.ListenEvent]:
    return
    yield


def unsorted_parts(client: persist.PersistClient, shard: str) -> int:
    state = client._shards.machines[shard].state
    return sum(p.unsorted for b in state.batches.values() for p in b.parts)


async def check_reads(
    reader: persist.ReadHandle,
    client: persist.PersistClient,
    written: list[Update],
    as_of: int,
) -> None:
    expected = model_at(written, as_of)
    assert consolidated(await reader.snapshot_and_fetch(as_of)) == expected
    for n in (1, 3):
        union: dict[tuple[int, str], int] = {}
        for split in await reader.snapshot(as_of, n):
            got = consolidated(await client.fetch_split(split))
            assert not union.keys() & got.keys(), "a row is in two splits"
            union.update(got)
        assert union == expected
    if all(m > 0 for m in expected.values()):
        table = (await reader.dataset(as_of)).to_table()
        assert as_rows(table) == expected


@pytest.mark.parametrize("location", ["mem", "file+postgres"], indirect=True)
@settings(
    max_examples=scaled(12),
    deadline=None,
    # Every step does real I/O: shrinking could take minutes; the failing example is reported.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    batches=st.lists(st.tuples(batch_updates, st.booleans()), min_size=1, max_size=5),
    data=st.data(),
)
async def test_unsorted_runs_read_as_the_model_says(
    connect: Connect, batches: list[tuple[list[Update], bool]], data: st.DataObject
) -> None:
    # The fixture's clients live for the whole test: each example closes its own, so that
    # the examples don't pile up Postgres connections.
    unsorted_writer = await connect(
        sorted_part_max_bytes=0, inline_writes_max_bytes=0, compaction_enabled=False
    )
    sorted_writer = await connect(inline_writes_max_bytes=0, compaction_enabled=False)
    fresh = await connect(compaction_enabled=False, recent_parts_bytes=0)
    try:
        await one_example(unsorted_writer, sorted_writer, fresh, batches, data)
    finally:
        for client in (unsorted_writer, sorted_writer, fresh):
            await client.close()


async def one_example(
    unsorted_writer: persist.PersistClient,
    sorted_writer: persist.PersistClient,
    fresh: persist.PersistClient,
    batches: list[tuple[list[Update], bool]],
    data: st.DataObject,
) -> None:
    shard = persist.ShardId.new()
    writes = {
        True: await unsorted_writer.open_writer(shard, SCHEMA),
        False: await sorted_writer.open_writer(shard, SCHEMA),
    }
    written: list[Update] = []
    upper = 0
    for ups, unsorted in batches:
        stamped = [(k, v, upper + dt, d) for k, v, dt, d in ups]
        await writes[unsorted].compare_and_append(table_of(stamped), upper, upper + 3)
        written += stamped
        upper += 3
    # The writer that stores unsorted runs stores a batch as one unless its rows come in key
    # order (a sorted run already, at no cost).
    expected = any(
        unsorted and not all(a[0] < b[0] for a, b in itertools.pairwise(ups))
        for ups, unsorted in batches
    )
    await writes[True].fetch_recent_upper()
    assert (unsorted_parts(unsorted_writer, shard) > 0) == expected

    # A client that wrote nothing decodes every part from blob.
    reader = await fresh.open_leased_reader(shard, SCHEMA)
    as_of = data.draw(st.integers(0, upper - 1), label="as_of")
    await check_reads(reader, fresh, written, as_of)
    await check_reads(reader, fresh, written, upper - 1)

    # A listen from as_of delivers the rest, consolidated per time.
    heard: Counter[tuple[int, str, int]] = Counter()
    # (From upper - 1 nothing follows until the upper moves: no event to wait for.)
    async with asyncio.timeout(60):
        async for event in reader.listen(as_of) if as_of < upper - 1 else _nothing():
            for r in event.updates.to_pylist():
                heard[(r["k"], r["v"], r["_time"])] += r["_diff"]
            if event.upper is not None and event.upper >= upper:
                break
    later: Counter[tuple[int, str, int]] = Counter()
    for k, v, t, d in written:
        if t > as_of:
            later[(k, v, t)] += d
    assert {r: d for r, d in heard.items() if d} == {r: d for r, d in later.items() if d}

    # Erase rewrites an unsorted part as a sorted one; then compaction merges the rest.
    gone = data.draw(st.integers(0, 12), label="erased key")
    await fresh.erase(shard, pc.field("k") == gone)
    written = [u for u in written if u[0] != gone]
    await reader.downgrade_since(upper - 1)
    await check_reads(reader, fresh, written, upper - 1)
    await fresh.maintain(shard)
    state = fresh._shards.machines[shard].state
    merged = [p for b in state.batches.values() for p in b.parts]
    assert not any(p.unsorted for p in merged) or len(state.batches) > 1
    await check_reads(reader, fresh, written, upper - 1)
    await reader.expire()


async def test_a_big_write_stores_unsorted_runs_and_small_or_ordered_ones_stay_sorted(
    connect: Connect,
) -> None:
    """The default: a part over ``sorted_part_max_bytes`` is stored as it comes (no key index,
    never inline, its batch not one sorted run); one at most that big, or whose rows come in
    key order, is a sorted run with a key index."""
    client = await connect(compaction_enabled=False)
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, SCHEMA)
    n = 60_000  # about 1.4 MB decoded: over the default 256 KiB
    shuffled = pc.random(n).to_numpy().argsort()
    big = table_of([(int(k), "x" * 8, 0, 1) for k in shuffled])
    await write.compare_and_append(big, 0, 1)
    ordered = table_of([(k, "y", 1, 1) for k in range(n)])
    await write.compare_and_append(ordered, 1, 2)
    small = table_of([(k, "z", 2, 1) for k in (5, 3, 3, 1)])
    await write.compare_and_append(small, 2, 3)
    state = client._shards.machines[shard].state
    by_lower = {b.lower: b for b in state.batches.values()}
    assert all(p.unsorted and not p.key_index and not p.inline for p in by_lower[0].parts)
    assert not by_lower[0].sorted_run
    assert sum(p.rows for p in by_lower[0].parts) == n
    assert not any(p.unsorted for p in by_lower[1].parts)
    assert all(p.key_index for p in by_lower[1].parts)
    assert [p.unsorted for p in by_lower[2].parts] == [False]
    reader = await client.open_leased_reader(shard, SCHEMA)
    got = consolidated(await reader.snapshot_and_fetch(2))
    assert got[(3, "z")] == 2 and len(got) == 2 * n + 3
