"""``PersistClient.plan_scan``: a snapshot an engine reads from the part files themselves, held
until released; and the diff bounds every written part records."""

from __future__ import annotations

import os
from collections import Counter
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import persist
from persist.core.arrow.updates import DIFF, TIME
from persist.core.read.scan import Consolidation
from persist.core.shard.types import PartRef
from persist.location.mem import MemBlob, MemConsensus
from persist.scan import ScanPlan

from .conftest import SCHEMA, fast_config, updates

Row = tuple[int | None, str | None]


def shard_parts(client: persist.PersistClient, shard: str) -> list[PartRef]:
    state = client._shards.machines[shard].state
    return [p for b in state.batches.values() for p in b.parts]


def table_of(part: PartRef, blob_root: Path | None = None) -> pa.Table:
    if part.inline:
        return pq.read_table(pa.BufferReader(part.inline))
    assert blob_root is not None
    return pq.read_table(blob_root / part.key)


def engine_read(plan: ScanPlan) -> Counter[Row]:
    """What an engine following the plan reads: pyarrow over the files, as another program."""
    tables = [pq.read_table(url2pathname(urlsplit(uri).path)) for uri in plan.files]
    rows: Counter[Row] = Counter()
    for t in [*tables, *plan.inline]:
        if plan.filter_time:
            t = t.filter(pc.less_equal(t.column(TIME), pa.scalar(plan.as_of, pa.uint64())))
        for r in t.to_pylist():
            if plan.contents is Consolidation.NONE:
                rows[(r["k"], r["v"])] += 1
            else:
                rows[(r["k"], r["v"])] += r[DIFF]
    return Counter({row: m for row, m in rows.items() if m})


def snapshot_counter(table: pa.Table) -> Counter[Row]:
    return Counter({(r["k"], r["v"]): r[DIFF] for r in table.to_pylist()})


async def file_client(tmp_path: Path, **config: object) -> persist.PersistClient:
    return await persist.connect(
        (tmp_path / "blob").as_uri(),
        f"sqlite://{tmp_path / 'consensus.db'}",
        config=fast_config(**config),
    )


# --- diff bounds --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("diffs", "bounds"),
    [([1, 1, 1], (1, 1)), ([1, 3, 2], (1, 3)), ([2, -1, 5], (-1, 5)), ([-4, -2, -9], (-9, -2))],
)
@pytest.mark.parametrize("inline_max", [0, 4096], ids=["blob", "inline"])
async def test_writes_record_their_parts_diff_bounds(
    tmp_path: Path, diffs: list[int], bounds: tuple[int, int], inline_max: int
) -> None:
    async with await file_client(tmp_path, inline_writes_max_bytes=inline_max) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(updates([1, 2, 3], 0, diffs), 0, 1)
        (part,) = shard_parts(client, shard)
        assert bool(part.inline) == (inline_max > 0)
        assert (part.min_diff, part.max_diff) == bounds
        stored = table_of(part, tmp_path / "blob").column(DIFF)
        assert (pc.min(stored).as_py(), pc.max(stored).as_py()) == bounds


async def test_merges_record_their_parts_diff_bounds(tmp_path: Path) -> None:
    # Rewritten at once (no folds), in parts of a few KB.
    async with await file_client(
        tmp_path, compaction_min_parts=1, part_target_bytes=4096, inline_writes_max_bytes=0
    ) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        for t in range(6):
            keys = list(range(t * 200, t * 200 + 300))
            diff = [2 if k % 7 == 0 else 1 for k in keys]
            await write.compare_and_append(updates(keys, t, diff), t, t + 1)
        # Retract some inserts (their rows' sums drop to 0 or stay positive).
        await write.compare_and_append(updates(list(range(0, 600, 5)), 6, -1), 6, 7)
        await client.maintain(shard)
        parts = shard_parts(client, shard)
        merged = [p for p in parts if "/c/" in p.key]
        assert len(merged) >= 2
        for part in parts:
            diffs = table_of(part, tmp_path / "blob").column(DIFF)
            assert (part.min_diff, part.max_diff) == (pc.min(diffs).as_py(), pc.max(diffs).as_py())
        assert {p.max_diff for p in merged} >= {2}


# --- the plan -----------------------------------------------------------------------------------


async def test_an_engine_following_the_plan_reads_the_snapshot(tmp_path: Path) -> None:
    async with await file_client(tmp_path) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        big = list(range(3000))  # a part in blob
        await write.compare_and_append(updates(big, 0), 0, 1)
        await write.compare_and_append(updates([5000], 1), 1, 2)  # an inline one
        plan = await client.plan_scan(shard)
        assert plan.as_of == 1 and plan.engine_readable and plan.reader is not None
        assert len(plan.files) == 1 and len(plan.inline) == 1
        assert plan.files[0].startswith("file:///") and plan.scan is not None
        # The reader holds the version whose parts the plan names (and its since at as_of).
        held = client._shards.machines[shard].state.readers[plan.reader.reader_id]
        assert (held.since, held.seqno_since) == (1, plan.scan.seqno)
        # Inserts only, every time at or before as_of: the files' data columns as they are.
        assert not plan.filter_time and not plan.consolidate
        assert engine_read(plan) == snapshot_counter(await read.snapshot_and_fetch(1))
        # A retraction: the engine must sum; as of 1 it must drop the update at 2.
        await write.compare_and_append(updates([7], 2, -1), 2, 3)
        later = await client.plan_scan(shard)
        assert later.consolidate and later.contents is Consolidation.SUM
        assert engine_read(later) == snapshot_counter(await read.snapshot_and_fetch(2))
        past = await client.plan_scan(shard, as_of=1)
        assert past.filter_time or len(past.inline) == 1  # the retraction is inline: dropped
        assert engine_read(past) == snapshot_counter(await read.snapshot_and_fetch(1))
        for p in (plan, later, past):
            await p.release()
            await p.release()  # idempotent
        assert set(client._shards.machines[shard].state.readers) == {read.reader_id}


async def test_the_plan_holds_its_files_through_compaction_and_gc(tmp_path: Path) -> None:
    async with await file_client(
        tmp_path, compaction_min_parts=1, inline_writes_max_bytes=0
    ) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        for t in range(4):
            await write.compare_and_append(
                updates(list(range(t * 100, t * 100 + 150)), t), t, t + 1
            )
        await client.maintain(shard)
        plan = await client.plan_scan(shard, purpose="engine")
        assert plan.reader is not None and plan.reader.since == 3
        planned = [Path(url2pathname(urlsplit(u).path)) for u in plan.files]
        assert planned and all(p.exists() for p in planned)
        expected = engine_read(plan)
        # Retract everything, compact and collect: every planned part is replaced and retired.
        for t in range(4, 12):
            await write.compare_and_append(updates(list(range(t * 50)), t, -1), t, t + 1)
            await plan.reader.heartbeat()
        done = await client.maintain(shard)
        assert done, done
        state = client._shards.machines[shard].state
        live = {p.key for b in state.batches.values() for p in b.parts}
        keys = [p.key for p in plan.scan.parts] if plan.scan else []
        assert keys and not live.intersection(keys), "compaction replaced every planned part"
        assert set(keys) <= set(state.retired)
        assert all(p.exists() for p in planned), "garbage collection kept the plan's files"
        assert engine_read(plan) == expected
        # Released, the files go at the next collection.
        await plan.release()
        await client.maintain(shard)
        assert not any(p.exists() for p in planned)
        assert not set(keys) & set(client._shards.machines[shard].state.retired)


async def test_a_mem_blob_cant_be_read_by_an_engine() -> None:
    async with persist.PersistClient(MemBlob(), MemConsensus(), fast_config()) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(updates(list(range(3000)), 0), 0, 1)
        plan = await client.plan_scan(shard)
        assert plan.scan is not None and len(plan.scan.parts) == 1
        assert not plan.engine_readable and plan.uris == (None,)
        with pytest.raises(persist.InvalidUsage, match="no other program"):
            plan.files  # noqa: B018
        await plan.release()


async def test_plans_that_hold_nothing_register_nothing(tmp_path: Path) -> None:
    async with await file_client(tmp_path) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        empty = await client.plan_scan(shard, empty_if_unwritten=True)
        assert empty.as_of is None and empty.scan is None and empty.files == ()
        assert not empty.consolidate and not empty.filter_time
        with pytest.raises(persist.InvalidUsage, match="nothing to read yet"):
            await client.plan_scan(shard)
        await write.compare_and_append(updates([1, 2], 0), 0, 1)  # inline
        only_inline = await client.plan_scan(shard)
        assert only_inline.reader is None and only_inline.files == ()
        assert only_inline.inline[0].column("k").to_pylist() == [1, 2]
        assert only_inline.inline[0].schema.field(TIME).type == pa.uint64()
        await client.maintain(shard)
        assert client._shards.machines[shard].state.readers == {}


async def test_refusals_leave_no_reader(tmp_path: Path) -> None:
    async with await file_client(tmp_path) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates(list(range(3000)), 0), 0, 5)
        await read.downgrade_since(3)
        with pytest.raises(persist.InvalidUsage, match="below the shard's since 3"):
            await client.plan_scan(shard, as_of=2)
        with pytest.raises(persist.InvalidUsage, match="not below the shard's upper 5"):
            await client.plan_scan(shard, as_of=5, wait=False)
        with pytest.raises(persist.InvalidUsage, match="bool"):
            await client.plan_scan(shard, wait="no")  # type: ignore[arg-type]
        plan = await client.plan_scan(shard, as_of=4)
        assert plan.reader is not None and plan.reader.since == 4
        assert set(client._shards.machines[shard].state.readers) == {
            read.reader_id,
            plan.reader.reader_id,
        }
        await plan.release()
        assert set(client._shards.machines[shard].state.readers) == {read.reader_id}


async def test_a_plan_can_wait_for_its_as_of(tmp_path: Path) -> None:
    import asyncio

    async with await file_client(tmp_path) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, SCHEMA)
        await write.compare_and_append(updates(list(range(3000)), 0), 0, 1)
        waiting = asyncio.create_task(client.plan_scan(shard, as_of=1))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await write.compare_and_append(updates([9000], 1), 1, 2)
        plan = await asyncio.wait_for(waiting, 10)
        assert plan.as_of == 1 and len(plan.inline) == 1 and len(plan.files) == 1
        await plan.release()


async def test_part_files_are_plain_parquet_for_engines(tmp_path: Path) -> None:
    schema = pa.schema([("k", pa.int64()), ("price", pa.decimal128(15, 2)), ("s", pa.string())])
    async with await file_client(tmp_path) as client:
        shard = persist.ShardId.new()
        write = await client.open_writer(shard, schema)
        n = 50_000
        big = pa.table(
            {
                "k": pa.array(range(n), pa.int64()),
                "price": pa.array([Decimal(i) / 100 for i in range(n)], pa.decimal128(15, 2)),
                "s": pa.array([f"s{i % 97}" for i in range(n)]),
                TIME: pa.array([0] * n, pa.uint64()),
            }
        )
        await write.compare_and_append(big, 0, 1)
        plan = await client.plan_scan(shard)
        (uri,) = plan.files
        meta = pq.read_metadata(url2pathname(urlsplit(uri).path))
        columns = {meta.schema.column(i).name: i for i in range(len(meta.schema))}
        assert meta.schema.column(columns["price"]).physical_type == "INT64"
        group = meta.row_group(0)
        assert all(group.column(i).is_stats_set for i in range(group.num_columns))
        assert group.column(columns["k"]).statistics.min == 0
        back = pq.read_table(url2pathname(urlsplit(uri).path))
        assert back.schema.field("price").type == pa.decimal128(15, 2)
        assert back.column("price").equals(big.column("price"))
        await plan.release()
    assert os.path.exists(url2pathname(urlsplit(uri).path))
