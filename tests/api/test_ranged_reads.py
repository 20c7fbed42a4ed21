"""A split reads only its key range of a big part: the row groups that can hold its keys,
fetched by range, each page verified by its checksum."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

import persist
import persist.core.arrow.keyrange
import persist.core.arrow.updates
import persist.internal.fetch
from persist.errors import IntegrityError
from persist.location import Blob
from persist.location.mem import MemBlob

# Small row groups, so that a few MB of test data hold many: a split then reads at most one row
# group per part beyond its range at each end, which must be a small share of the part.
GROUP = 128 << 10


@pytest.fixture(autouse=True)
def small_row_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(persist.core.arrow.keyrange, "ROW_GROUP_BYTES", GROUP)
    monkeypatch.setattr(persist.internal.fetch, "ROW_GROUP_BYTES", GROUP)
    monkeypatch.setattr(persist.core.arrow.updates, "PART_ROW_GROUP_BYTES", GROUP)


SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.string()), ("x", pa.float64())])
# Writes here store sorted runs at any size (as compaction writes them): reading by row group
# is what these tests are about, and an unsorted run has no key index to read by.
SORTED = 2**40


class CountingBlob(MemBlob):
    """A mem blob that counts the bytes its reads return."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.ranged = 0

    async def get(self, key: str) -> bytes | None:
        data = await super().get(key)
        self.read += len(data or b"")
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        data = await super().get_range(key, start, end)
        self.read += len(data or b"")
        self.ranged += 1
        return data


def rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    k = rng.permutation(n).astype(np.int64)
    return pa.table(
        {
            "k": k,
            "s": pa.array([f"row-{i:08d}" for i in k]),
            "x": rng.random(n),
            "_time": pa.array(np.zeros(n, np.uint64)),
        }
    )


async def big_shard(blob: Blob) -> tuple[persist.PersistClient, persist.ReadHandle, pa.Table]:
    # Nothing kept in memory: every read goes to blob. The parts are sorted runs with key
    # indexes, as compaction leaves them (a big write's unsorted runs have none: every split
    # reads them whole until compaction rewrites them, see test_unsorted_runs.py).
    config = persist.PersistConfig(recent_parts_bytes=0, sorted_part_max_bytes=SORTED)
    client = await persist.connect(blob, "mem://ranged-" + str(random.random()), config=config)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    table = rows(300_000, 1)
    await write.compare_and_append(table, 0, 1)
    (split,) = await read.snapshot(0, 1)
    assert all(p.nbytes > 20 * GROUP for p in split.parts)  # each several row groups
    return client, read, table


async def test_four_splits_read_the_data_about_once() -> None:
    blob = CountingBlob()
    client, read, table = await big_shard(blob)
    whole = await client.fetch_split((await read.snapshot(0, 1))[0])
    one = blob.read
    blob.read = 0
    pieces = [await client.fetch_split(s) for s in await read.snapshot(0, 4)]
    four = blob.read
    assert pa.concat_tables(pieces).equals(whole)
    assert whole.num_rows == table.num_rows
    assert all(p.num_rows for p in pieces)
    print(f"bytes read: 4 splits {four}, 1 split {one}, ratio {four / one:.3f}")
    assert four <= 1.2 * one, (four, one)
    assert blob.ranged >= 8  # a footer and a span of row groups per split
    await client.close()


@pytest.mark.parametrize("seed", range(6))
async def test_ranged_and_whole_reads_agree(seed: int) -> None:
    blob = CountingBlob()
    client, read, _ = await big_shard(blob)
    whole = await client.fetch_split((await read.snapshot(0, 1))[0])
    n = random.Random(seed).randint(2, 9)
    pieces = [await client.fetch_split(s) for s in await read.snapshot(0, n)]
    assert pa.concat_tables(pieces).equals(whole)
    await client.close()


async def test_a_corrupt_row_group_fails_its_checksum() -> None:
    blob = CountingBlob()
    client, read, _ = await big_shard(blob)
    splits = await read.snapshot(0, 4)
    part = splits[1].parts[0]
    data = bytearray(blob._data[part.key])  # type: ignore[attr-defined]
    data[len(data) // 3] ^= 0xFF  # inside a row group's pages, not the footer
    blob._data[part.key] = bytes(data)
    with pytest.raises(IntegrityError):
        for s in splits:
            await client.fetch_split(s)
    await client.close()


async def test_a_split_streams_in_bounded_pieces() -> None:
    blob = CountingBlob()
    client, read, table = await big_shard(blob)
    write = await client.open_writer(read.shard_id)
    # Retractions of a tenth of the rows, in a part of their own.
    out = table.slice(0, 30_000).set_column(3, "_time", pa.array(np.ones(30_000, np.uint64)))
    out = out.append_column("_diff", pa.array(np.full(30_000, -1, np.int64)))
    await write.compare_and_append(out, 1, 2)
    for as_of, n in [(1, 1), (1, 3), (0, 2)]:
        for split in await read.snapshot(as_of, n):
            whole = await client.fetch_split(split)
            streamed = [rb async for rb in client.fetch_split_batches(split, max_bytes=1 << 20)]
            assert pa.Table.from_batches(streamed, schema=whole.schema).equals(whole)
    # Updates between two frontiers stream the same way.
    for split in await read.splits_between(1, 2, 2):
        whole = await client.fetch_split(split)
        streamed = [rb async for rb in client.fetch_split_batches(split, max_bytes=1 << 20)]
        assert pa.Table.from_batches(streamed, schema=whole.schema).equals(whole)
        assert 0 < whole.num_rows <= 30_000
    # Pieces hold about max_bytes each: never the whole split at once.
    (split,) = await read.snapshot(1, 1)
    total = sum(p.nbytes for p in split.parts)
    sizes = [
        t.nbytes
        async for t in persist.internal.fetch.stream_split(
            client.blob, client.config, split, 1 << 20
        )
    ]
    print(f"pieces {len(sizes)}, largest {max(sizes)}, split {total}")
    assert len(sizes) >= total // (2 << 20)
    assert max(sizes) <= 3 << 20 < total
    with pytest.raises(persist.InvalidUsage):
        [rb async for rb in client.fetch_split_batches(split, max_bytes=0)]
    await client.close()


def multiset(table: pa.Table) -> dict[tuple[object, ...], int]:
    out: dict[tuple[object, ...], int] = {}
    for row in table.drop_columns(["_time"]).to_pylist():
        diff = row.pop("_diff")
        key = tuple(row.values())
        out[key] = out.get(key, 0) + diff
    return {k: v for k, v in out.items() if v}


async def test_unconsolidated_pieces_are_the_same_multiset() -> None:
    client = await persist.connect(MemBlob(), "mem://multiset-" + str(random.random()))
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    first = rows(20_000, 3)
    await write.compare_and_append(first, 0, 1)
    again = first.slice(0, 5000).set_column(3, "_time", pa.array(np.ones(5000, np.uint64)))
    await write.compare_and_append(again, 1, 2)  # the same rows once more: multiplicity 2
    for split in await read.snapshot(1, 2):
        whole = await client.fetch_split(split)
        loose = pa.Table.from_batches(
            [rb async for rb in client.fetch_split_batches(split, consolidate=False)],
            schema=whole.schema,
        )
        assert multiset(loose) == multiset(whole)
        assert loose.num_rows > whole.num_rows  # not merged: repeated rows stay apart
    # A retraction in the split: consolidated as usual (no negative diff reaches the reader).
    out = first.slice(0, 10).set_column(3, "_time", pa.array(np.full(10, 2, np.uint64)))
    out = out.append_column("_diff", pa.array(np.full(10, -1, np.int64)))
    await write.compare_and_append(out, 2, 3)
    (split,) = await read.snapshot(2, 1)
    whole = await client.fetch_split(split)
    loose = pa.Table.from_batches(
        [rb async for rb in client.fetch_split_batches(split, consolidate=False)],
        schema=whole.schema,
    )
    assert loose.equals(whole)
    await client.close()


@pytest.mark.parametrize("n_splits", [1, 3])
async def test_raw_updates_are_the_split_read_by_row_group_once(n_splits: int) -> None:
    blob = CountingBlob()
    config = persist.PersistConfig(
        recent_parts_bytes=0, compaction_enabled=False, sorted_part_max_bytes=SORTED
    )
    client = await persist.connect(blob, "mem://raw-" + str(random.random()), config=config)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    first = rows(200_000, 5)
    await write.compare_and_append(first, 0, 1)
    more = rows(100_000, 6).set_column(3, "_time", pa.array(np.ones(100_000, np.uint64)))
    await write.compare_and_append(more, 1, 2)
    # Retract rows of the first part in a third: the raw stream carries negative diffs.
    out = first.slice(0, 3000).set_column(3, "_time", pa.array(np.full(3000, 2, np.uint64)))
    out = out.append_column("_diff", pa.array(np.full(3000, -1, np.int64)))
    await write.compare_and_append(out, 2, 3)
    splits = await read.snapshot(2, n_splits)
    data_bytes = sum({p.key: p.size for s in splits for p in s.parts}.values())
    union: dict[tuple[object, ...], int] = {}
    raw_bytes = 0
    for split in splits:
        exact = await client.fetch_split(split)
        before, chunks, negative = blob.read, 0, False
        raw: list[pa.RecordBatch] = []
        async for rb in client.fetch_split_batches(split, 4 * GROUP, consolidate="never"):
            assert rb.num_rows <= 300_000
            chunks += 1
            negative |= bool(min(rb.column("_diff").to_pylist(), default=1) < 0)
            raw.append(rb)
        raw_bytes += blob.read - before
        table = pa.Table.from_batches(raw, schema=exact.schema)
        assert set(table.column("_time").to_pylist()) <= {2}
        assert multiset(table) == multiset(exact)  # consolidated, the split's contents
        assert not union.keys() & multiset(exact).keys()
        union.update(multiset(exact))
        assert chunks > 1  # row group by row group, not the split at once
        assert negative or n_splits > 1
    assert sum(union.values()) == 300_000 - 3000
    # Every part read about once over all the splits: no row group twice, beyond a footer per
    # part and the row groups a split's key range cuts at its ends.
    assert raw_bytes <= 1.1 * data_bytes + n_splits * 3 * persist.internal.fetch.FOOTER_READ
    await client.close()


async def test_raw_updates_are_for_snapshot_splits_and_consolidate_takes_three_values() -> None:
    client = await persist.connect(MemBlob(), "mem://raw-refused-" + str(random.random()))
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    await write.compare_and_append(rows(1000, 7), 0, 2)
    (between,) = await read.splits_between(0, 2, 1)
    with pytest.raises(persist.InvalidUsage, match="splits_between"):
        [rb async for rb in client.fetch_split_batches(between, consolidate="never")]
    (split,) = await read.snapshot(1, 1)
    for wrong in ("no", None, 1):
        with pytest.raises(persist.InvalidUsage, match="consolidate must be"):
            [rb async for rb in client.fetch_split_batches(split, consolidate=wrong)]  # type: ignore[arg-type]
    await client.close()


def run(n: int, seed: int, time: int, runs: int) -> pa.Table:
    """``n`` rows at ``time`` of the keys ``k * runs + seed % runs``: appends of runs with
    other seeds interleave with it over the whole key space."""
    table = rows(n, seed)
    k = table.column("k").to_numpy() * runs + seed % runs
    table = table.set_column(0, "k", pa.array(k)).set_column(1, "s", pa.array(k.astype(str)))
    return table.set_column(3, "_time", pa.array(np.full(n, time, np.uint64)))


@pytest.mark.parametrize("consolidate", [True, False])
async def test_pieces_of_a_split_read_each_row_group_once(consolidate: bool) -> None:
    """A split streamed in many pieces over overlapping parts fetches every row group (and
    footer) of each part about once: a piece starts in the row group of each part where the
    previous piece ended, and that one is kept, not fetched and decoded again."""
    blob = CountingBlob()
    config = persist.PersistConfig(
        recent_parts_bytes=0, compaction_enabled=False, sorted_part_max_bytes=SORTED
    )
    client = await persist.connect(blob, "mem://pieces-" + str(random.random()), config=config)
    write, read = await client.open(persist.ShardId.new(), SCHEMA)
    for i in range(4):  # four sorted runs, each spanning the key space
        await write.compare_and_append(run(60_000, 20 + i, i, 4), i, i + 1)
    (split,) = await read.snapshot(3, 1)
    assert len(split.parts) == 4 and all(p.nbytes > 10 * GROUP for p in split.parts)
    whole = await client.fetch_split(split)
    data = sum(p.size for p in split.parts)
    max_bytes = 256 << 10
    assert sum(p.nbytes for p in split.parts) > 30 * max_bytes  # many pieces
    blob.read = 0
    streamed = [
        rb async for rb in client.fetch_split_batches(split, max_bytes, consolidate=consolidate)
    ]
    got = pa.Table.from_batches(streamed, schema=whole.schema)
    if consolidate:
        assert got.equals(whole)
    else:
        assert multiset(got) == multiset(whole)
    print(f"bytes read: pieces {blob.read}, parts {data}, ratio {blob.read / data:.3f}")
    assert blob.read <= 1.1 * data, (blob.read, data)
    # Updates between two frontiers, streamed the same way.
    (between,) = await read.splits_between(1, 3, 1)
    exact = await client.fetch_split(between)
    needed = sum(p.size for p in between.parts)
    blob.read = 0
    streamed = [rb async for rb in client.fetch_split_batches(between, max_bytes)]
    assert pa.Table.from_batches(streamed, schema=exact.schema).equals(exact)
    assert exact.num_rows == 120_000
    assert blob.read <= 1.1 * needed, (blob.read, needed)
    await client.close()
