"""Schema evolution where handles of two versions meet: a writer at an earlier version deleting
rows that carry values of fields added since, a listen whose field is dropped under it, an
older reader shown a value its narrower type can't hold."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist

V0 = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("v", pa.int32())])
V1 = pa.schema([*V0, pa.field("note", pa.string())])


def rows(schema: pa.Schema, time: int, diff: int = 1, **columns: list[object]) -> pa.Table:
    n = len(next(iter(columns.values())))
    data = {name: pa.array(columns[name], schema.field(name).type) for name in schema.names}
    data["_time"] = pa.array([time] * n, pa.uint64())
    data["_diff"] = pa.array([diff] * n, pa.int64())
    return pa.table(data)


def contents(table: pa.Table) -> list[dict[str, object]]:
    data = table.select([n for n in table.column_names if n != "_time"])
    return sorted(data.to_pylist(), key=lambda r: sorted((k, str(v)) for k, v in r.items()))


async def test_an_earlier_writers_delete_where_retracts_rows_as_they_now_are() -> None:
    async with await persist.connect("mem://", "mem://") as client:
        w0, r0 = await client.open("t.del", V0)
        await w0.compare_and_append(rows(V0, 0, k=[1, 2], v=[10, 20]), 0, 1)
        await client.evolve_schema("t.del", V1)
        w1, r1 = await client.open("t.del")
        await w1.compare_and_append(rows(V1, 1, k=[3], v=[30], note=["kept"]), 1, 2)
        # The version-0 writer can't name "note", but its delete must take the row whole.
        assert await w0.delete_where(pc.field("k") >= 2) == 2
        assert contents(await r1.snapshot_and_fetch(2)) == [
            {"k": 1, "v": 10, "note": None, "_diff": 1}
        ]
        assert contents(await r0.snapshot_and_fetch(2)) == [{"k": 1, "v": 10, "_diff": 1}]


async def test_a_listen_stops_loudly_when_its_field_is_dropped_under_it() -> None:
    async with await persist.connect("mem://", "mem://") as client:
        w0, r0 = await client.open("t.listen", V1)
        await w0.compare_and_append(rows(V1, 0, k=[1], v=[1], note=["secret"]), 0, 1)
        events = r0.listen(0)
        await w0.compare_and_append(rows(V1, 1, k=[2], v=[2], note=["x"]), 1, 2)
        first = await anext(events)
        assert first.updates.column("note").to_pylist() == ["x"]
        await client.evolve_schema("t.listen", V0)  # drops "note"
        await w0.compare_and_append(rows(V1, 2, k=[3], v=[3], note=["y"]), 2, 3)
        with pytest.raises(persist.InvalidUsage, match=r"'note'.*dropped"):
            await asyncio.wait_for(anext(events), 10)
        # A listen begun after the drop sees the field null throughout, and keeps going.
        again = r0.listen(2)
        await w0.compare_and_append(rows(V1, 3, k=[4], v=[4], note=["z"]), 3, 4)
        event = await asyncio.wait_for(anext(again), 10)
        assert event.updates.column("note").to_pylist() == [None]
        snapshot = await r0.snapshot_and_fetch(3)
        assert snapshot.column("note").to_pylist() == [None, None, None, None]


async def test_an_older_reader_refuses_a_widened_value_it_cannot_hold() -> None:
    async with await persist.connect("mem://", "mem://") as client:
        _, r0 = await client.open("t.wide", V0)
        wide = pa.schema([V0.field("k"), pa.field("v", pa.int64())])
        await client.evolve_schema("t.wide", wide)
        w1 = await client.open_writer("t.wide")
        await w1.compare_and_append(rows(wide, 0, k=[1, 2], v=[5, 2**40]), 0, 1)
        with pytest.raises(persist.InvalidUsage, match=r"'v'.*version 1"):
            await r0.snapshot_and_fetch(0)
        r1 = await client.open_leased_reader("t.wide")
        assert contents(await r1.snapshot_and_fetch(0)) == [
            {"k": 1, "v": 5, "_diff": 1},
            {"k": 2, "v": 2**40, "_diff": 1},
        ]
