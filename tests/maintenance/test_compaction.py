"""Compaction and garbage collection keep a shard's cost proportional to what it holds."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

import persist
from persist.core.arrow.updates import encode_part
from persist.core.shard import garbage
from persist.location.mem import MemBlob, MemConsensus

from ..api.conftest import SCHEMA, fast_config, updates

Row = tuple[int, str]


def as_counter(table: pa.Table) -> Counter[Row]:
    out: Counter[Row] = Counter()
    for r in table.to_pylist():
        key = (r["k"], r["v"])
        assert key not in out and r["_diff"] != 0
        out[key] = r["_diff"]
    return out


class Model:
    """The shard's updates, as plain data: contents as of t sum every update at or before t."""

    def __init__(self) -> None:
        self.updates: list[tuple[Row, int, int]] = []

    def as_of(self, t: int) -> Counter[Row]:
        out: Counter[Row] = Counter()
        for row, time, diff in self.updates:
            if time <= t:
                out[row] += diff
        return Counter({k: v for k, v in out.items() if v})


step_st = st_.one_of(
    st_.tuples(st_.just("append"), st_.integers(1, 3), st_.lists(st_.integers(0, 8), max_size=6)),
    st_.tuples(st_.just("since"), st_.integers(0, 3), st_.just([])),
    st_.tuples(st_.just("maintain"), st_.just(0), st_.just([])),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st_.lists(step_st, min_size=1, max_size=25))
def test_contents_match_the_model_through_compaction_and_gc(
    steps: list[tuple[str, int, list[int]]],
) -> None:
    async def run() -> None:
        cfg = fast_config(rollup_interval=4)
        async with persist.PersistClient(MemBlob(), MemConsensus(), cfg) as client:
            shard = persist.ShardId.new()
            write, read = await client.open(shard, SCHEMA)
            model = Model()
            live: Counter[Row] = Counter()
            for op, n, keys in steps:
                upper = write.upper
                assert upper is not None
                if op == "append":
                    # Inserts of `keys`, and retractions of rows present now (so diffs cancel).
                    rows, times, diffs = [], [], []
                    for i, k in enumerate(keys):
                        t = upper + i % n
                        if live[(k, f"v{k}")] > 0 and i % 2:
                            rows.append(k), times.append(t), diffs.append(-1)
                        else:
                            rows.append(k), times.append(t), diffs.append(1)
                    await write.compare_and_append(updates(rows, times, diffs), upper, upper + n)
                    for k, t, d in zip(rows, times, diffs, strict=True):
                        model.updates.append(((k, f"v{k}"), t, d))
                        live[(k, f"v{k}")] += d
                elif op == "since":
                    since = read.since
                    assert since is not None
                    await read.downgrade_since(min(since + n, max(upper - 1, since)))
                else:
                    await client.maintain(shard)
                since = read.since
                assert since is not None
                for t in range(since, write.upper or 0):
                    assert as_counter(await read.snapshot_and_fetch(t)) == model.as_of(t), t
            await client.maintain(shard)
            state = client._shards.machines[shard].state
            keys_now = set(await client.blob.list_keys(f"{shard}/"))
            assert keys_now == garbage.referenced_keys(state)
            # Merging only ever consolidates: never more updates than were appended.
            assert sum(b.rows for b in state.batches.values()) <= len(model.updates)

    asyncio.run(run())


async def test_a_long_lived_shard_costs_what_it_holds(tmp_path: Path) -> None:
    n_appends, rollup_interval = 2_000, 32
    cfg = fast_config(rollup_interval=rollup_interval)
    blob, consensus = (tmp_path / "blob").as_uri(), f"sqlite://{tmp_path / 'c.db'}"
    async with await persist.connect(blob, consensus, config=cfg) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        appended = 0
        for i in range(n_appends):
            # Ten new rows, and five of the previous append's rows retracted: a keyed table.
            new = list(range(10 * i, 10 * i + 10))
            gone = list(range(10 * (i - 1), 10 * (i - 1) + 5)) if i else []
            await write.compare_and_append(
                updates(new + gone, i, [1] * len(new) + [-1] * len(gone)), i, i + 1
            )
            appended += len(new) + len(gone)
            await read.downgrade_since(i)  # since follows upper
        await client.maintain(shard)
        # Merges step aside for the appends, so the last ones may have run just now: what they
        # retired is still held by the reader's last recorded state version until it renews.
        await read.downgrade_since(n_appends - 1)
        info = await client.maintain(shard)
        state = client._shards.machines[shard].state
        contents = await read.snapshot_and_fetch(n_appends - 1)
        assert contents.num_rows == 10 * n_appends - 5 * (n_appends - 1)

        batches = len(state.batches)
        assert batches <= 2 * math.log2(appended), (batches, info)
        entries = await client.consensus.scan(shard, 0, 100_000)
        assert len(entries) <= rollup_interval + 8, len(entries)
        keys_now = set(await client.blob.list_keys(f"{shard}/"))
        assert keys_now == garbage.referenced_keys(state)  # no leaks
        # Everything on blob (live parts, rollup, blobs retired but still held by the reader's
        # latest seqno) against the contents written once, consolidated.
        stored = 0
        for key in keys_now:
            stored += len(await client.blob.get(key) or b"")
        consolidated = len(encode_part(contents))
        assert stored <= 2 * consolidated, (stored, consolidated, len(state.retired))


async def test_a_reader_holding_an_old_snapshot_keeps_its_blobs() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    async with persist.PersistClient(blob, consensus, fast_config()) as client:
        shard = persist.ShardId.new()
        write, old_reader = await client.open(shard, SCHEMA)
        follower = await client.open_leased_reader(shard, SCHEMA)
        for t in range(8):
            await write.compare_and_append(updates([t], t), t, t + 1)
        splits = await old_reader.snapshot(3, num_splits=2)
        expected = as_counter(await old_reader.snapshot_and_fetch(3))
        # Everything after: retract every row, compact, collect, while old_reader holds 3.
        for t in range(8, 40):
            await write.compare_and_append(updates([t - 8], t, -1), t, t + 1)
            await follower.downgrade_since(t)
        await client.maintain(shard)
        assert client._shards.machines[shard].state.retired  # replaced parts wait for old_reader
        fetched: Counter[Row] = Counter()
        for split in splits:
            fetched.update(as_counter(await client.fetch_split(split)))
        assert fetched == expected
        # Once it lets go (and the other reader has heartbeaten past the merges, so it no
        # longer holds the versions before them either), the old blobs go too.
        await old_reader.downgrade_since(39)
        await follower.downgrade_since(39)
        await client.maintain(shard)
        state = client._shards.machines[shard].state
        remaining = set(await blob.list_keys(f"{shard}/"))
        assert remaining == garbage.referenced_keys(state)
        assert not remaining.intersection(p.key for s in splits for p in s.parts)


async def test_maintenance_settles_with_the_smallest_rollup_interval() -> None:
    """Forgetting a collected rollup is a commit; with ``rollup_interval=2`` it must not make
    another rollup due (whose collection would commit again, for ever): maintain returns."""
    cfg = fast_config(rollup_interval=2)
    async with persist.PersistClient(MemBlob(), MemConsensus(), cfg) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        for t in range(10):
            await write.compare_and_append(updates([t], t), t, t + 1)
            done = await asyncio.wait_for(client.maintain(shard), 30)
            assert done["rollups"] <= 1, done
        read = await client.open_leased_reader(shard, SCHEMA)
        assert as_counter(await read.snapshot_and_fetch(9)) == Counter(
            {(t, f"v{t}"): 1 for t in range(10)}
        )


def test_small_merge_outputs_leave_out_dictionaries_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A merge output a later merge soon rewrites skips the dictionaries (most of its encode
    cost) and keeps statistics on every column and the page index; a large one keeps them all,
    and has dictionaries on the columns whose values repeat (here ``_time`` and ``_diff``, not
    the distinct ``k`` and ``v``)."""
    from persist.internal import compact

    rows = updates(list(range(100)), 1)
    keys = [*SCHEMA.names, "_time"]

    def groups(data: bytes) -> list[tuple[bool, bool, bool]]:
        meta = pq.read_metadata(pa.BufferReader(data))
        chunks = [meta.row_group(0).column(i) for i in range(meta.num_columns)]
        return [(c.has_dictionary_page, c.is_stats_set, c.has_offset_index) for c in chunks]

    small = compact._encode_output([rows], keys)
    assert small is not None and groups(small[0]) == [(False, True, True)] * 4
    monkeypatch.setattr(compact, "PLAIN_OUTPUT_BYTES", 0)
    large = compact._encode_output([rows], keys)
    assert large is not None
    assert groups(large[0]) == [(False, True, True)] * 2 + [(True, True, True)] * 2


def test_a_merge_output_sums_the_rows_equal_across_its_cuts() -> None:
    """The pieces of one output part are consolidated each; a row equal to a cut's frontier
    can still end one piece and start the next, and must come out once."""
    from persist.internal import compact

    keys = [*SCHEMA.names, "_time"]
    a, b, c = updates([1, 2], 5), updates([2, 3], 5, [2, -1]), updates([3, 4], 5)
    out = compact._encode_output([a, b, c], keys)
    assert out is not None
    got = pq.read_table(pa.BufferReader(out[0]))
    assert list(zip(got["k"].to_pylist(), got["_diff"].to_pylist(), strict=True)) == [
        (1, 1),
        (2, 3),
        (4, 1),
    ]
    apart = compact._encode_output([a, updates([3], 5), updates([5, 6], 5)], keys)
    assert apart is not None and pq.read_table(pa.BufferReader(apart[0])).num_rows == 5
