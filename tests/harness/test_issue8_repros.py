"""Minimal reproductions of library failures the issue-8 harness checks found (cancellation,
stalls, hostile values). Each names the defect it belongs to; each fails until its fix lands."""

from __future__ import annotations

import pyarrow as pa
import pytest

import persist


@pytest.mark.parametrize("bad", [["mem://x"], 1.5, 123, b"mem://x"])
async def test_connect_refuses_a_uri_that_is_not_a_str(bad: object) -> None:
    """Hostile values (new: connect's arguments): a list raises TypeError (unhashable), a
    float AttributeError ('float' object has no attribute 'decode'), not InvalidUsage."""
    with pytest.raises(persist.InvalidUsage):
        client = await persist.connect(blob="mem://x", consensus=bad)  # type: ignore[arg-type]
        await client.close()


@pytest.mark.parametrize(
    "dtype", [pa.timestamp("s", tz="UTC"), pa.date64(), pa.time32("s")], ids=str
)
async def test_a_column_reads_back_in_its_own_type(dtype: pa.DataType) -> None:
    """Type round-trips (defect 6): timestamp[s, tz=UTC] read back as timestamp[ms, tz=UTC]."""
    schema = pa.schema([("v", dtype)])
    raw = [0, 86_400_000] if dtype == pa.date64() else [0, 3_600]
    column = pa.array(raw, pa.int32() if dtype.bit_width == 32 else pa.int64()).cast(dtype)
    async with await persist.connect(blob="mem://repro-types", consensus="mem://repro-types") as c:
        w, r = await c.open(persist.ShardId.new(), schema)
        await w.compare_and_append(
            pa.table({"v": column, "_time": pa.array([0, 0], pa.uint64())}), 0, 1
        )
        got = await r.snapshot_and_fetch(0)
    assert got.schema.field("v").type == dtype


async def test_nan_rows_consolidate_across_batches() -> None:
    """NaN consolidation (defect 4): the same NaN row written by two writes came back twice
    from snapshot_and_fetch ("appears twice in a consolidated result")."""
    schema = pa.schema([("f", pa.float64())])

    def nan_at(t: int) -> pa.Table:
        return pa.table({"f": [float("nan")], "_time": pa.array([t], pa.uint64())})

    async with await persist.connect(blob="mem://repro-nan", consensus="mem://repro-nan") as c:
        w, r = await c.open(persist.ShardId.new(), schema)
        await w.compare_and_append(nan_at(0), 0, 1)
        await w.compare_and_append(nan_at(1), 1, 2)
        got = await r.snapshot_and_fetch(1)
    assert got.num_rows == 1 and got.column("_diff").to_pylist() == [2]
