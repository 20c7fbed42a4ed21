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


Update = tuple[int, int, int]  # (k, time, diff); the row is (k, f"v{k}")


@st_.composite
def merged_streams(draw: st_.DrawFn) -> list[list[Update]]:
    """The rows a merge emits, in order (sorted by row then time, one update per row and
    time, no zero diff), cut into pieces anywhere, even inside one row's updates; a row and
    time may also end one piece and start the next (then the two sum)."""
    rows = draw(st_.lists(st_.integers(0, 12), unique=True, max_size=10))
    stream: list[Update] = []
    for k in sorted(rows):
        times = draw(st_.lists(st_.integers(0, 3), unique=True, min_size=1, max_size=3))
        for t in sorted(times):
            stream.append((k, t, draw(st_.sampled_from([1, 1, 1, 2, -1]))))
    cuts = sorted(draw(st_.lists(st_.integers(0, len(stream)), max_size=4)))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    # A seam's row and time split in two updates, one ending a piece and one starting the next.
    for i in range(len(pieces) - 1):
        if pieces[i] and pieces[i + 1] and draw(st_.booleans()):
            k, t, d = pieces[i][-1]
            pieces[i][-1] = (k, t, d + 1)
            pieces[i + 1].insert(0, (k, t, -1))
    return pieces


@settings(max_examples=300, deadline=None)
@given(merged_streams())
def test_a_merge_writes_the_rows_of_one_plus_one_apart(pieces: list[list[Update]]) -> None:
    """Fed a merge's rows piece by piece, the split gives every row whose only update is a +1
    to the alone run and every other update to the other, each once and in order, whatever
    the cuts (a row's updates held back across them). Actors: one merge's stream alone (the
    split sees nothing else); its cuts anywhere, a seam's row and time in two pieces."""
    from persist.internal import compact

    keys = [*SCHEMA.names, "_time"]
    alone: list[Update] = []
    others: list[Update] = []
    held = None

    def listed(table: pa.Table | None) -> list[Update]:
        if table is None:
            return []
        return list(
            zip(
                table["k"].to_pylist(),
                table["_time"].to_pylist(),
                table["_diff"].to_pylist(),
                strict=True,
            )
        )

    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        if piece:
            table = updates(
                [k for k, _, _ in piece], [t for _, t, _ in piece], [d for *_, d in piece]
            )
        else:
            table = updates([], [], [])
        a, o, held = compact._split_alone(held, table, keys, last)
        alone += listed(a)
        others += listed(o)
    if held is not None:  # the last piece was empty: the end lets the held row go
        a, o, _ = compact._split_alone(None, held, keys, True)
        alone += listed(a)
        others += listed(o)
    summed: Counter[tuple[int, int]] = Counter()
    for piece in pieces:
        for k, t, d in piece:
            summed[(k, t)] += d
    merged = sorted((k, t, d) for (k, t), d in summed.items() if d)
    per_row = Counter(k for k, _, _ in merged)
    assert alone == [u for u in merged if per_row[u[0]] == 1 and u[2] == 1]
    assert others == [u for u in merged if not (per_row[u[0]] == 1 and u[2] == 1)]


async def test_a_merged_shard_reads_its_untouched_rows_as_they_are() -> None:
    """Inserts spread over every key, then appends retracting some of them beside new inserts
    (as updates of rows come): once merged, the rows never retracted are in parts of their
    own, which a scan takes as they are (no other part of their merge holds their rows, though
    every part's key range meets theirs). Merged again with later updates (the two runs as
    inputs), the same holds; the contents match the model throughout. Actors: one writer, and
    maintenance run to the end (merges of two-run batches, garbage collection)."""
    cfg = fast_config(compaction_min_parts=1)
    async with persist.PersistClient(MemBlob(), MemConsensus(), cfg) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        model = Model()
        for t in range(4):
            new = list(range(t, 4000, 20))  # 200 rows spread over the whole key space
            gone = [k for k, _ in model.as_of(t)][: 20 * (t > 0)]
            rows = updates(
                [*gone, *new[: len(new) - len(gone)]],
                t,
                [-1] * len(gone) + [1] * (len(new) - len(gone)),
            )
            await write.compare_and_append(rows, t, t + 1)
            model.updates += [
                ((k, f"v{k}"), t, d)
                for k, d in zip(rows["k"].to_pylist(), rows["_diff"].to_pylist(), strict=True)
            ]
        await client.maintain(shard)
        state = client._shards.machines[shard].state
        (batch,) = state.batches.values()
        assert batch.sorted_run and {p.origin for p in batch.parts} == {batch.id}
        alone = [p for p in batch.parts if p.alone]
        assert alone and all(p.min_diff == p.max_diff == 1 for p in alone)
        live = model.as_of(3)
        retracted = len([u for u in model.updates if u[2] < 0])
        # Every live row has a single +1 (a row is inserted once and maybe retracted once).
        assert sum(p.rows for p in alone) == len(live)
        assert sum(p.rows for p in batch.parts if not p.alone) == 2 * retracted
        plan = await client.plan_scan(str(shard), as_of=3)
        try:
            assert plan.scan is not None
            assert {p.key for p in plan.scan.parts if p.untouched} == {p.key for p in alone}
        finally:
            await plan.release()
        for t in range(4):
            assert as_counter(await read.snapshot_and_fetch(t)) == model.as_of(t)
