"""Bad input gets a clear error and changes nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pyarrow as pa
import pytest

import persist
from persist.location.mem import MemBlob, MemConsensus

from .conftest import SCHEMA, contents, fast_config, updates

Misuse = Callable[
    [persist.WriteHandle, persist.ReadHandle, persist.PersistClient], Awaitable[object]
]

CASES: dict[str, tuple[Misuse, type[Exception], str]] = {
    "time below lower": (
        lambda w, r, c: w.compare_and_append(updates([1], 1), 2, 5),
        persist.InvalidUsage,
        "outside",
    ),
    "time at upper": (
        lambda w, r, c: w.compare_and_append(updates([1], 5), 2, 5),
        persist.InvalidUsage,
        "outside",
    ),
    "upper below lower": (
        lambda w, r, c: w.compare_and_append(updates([], 2), 2, 1),
        persist.InvalidUsage,
        "below",
    ),
    "append upper below lower": (
        lambda w, r, c: w.append(updates([], 2), 2, 1),
        persist.InvalidUsage,
        "below",
    ),
    "batch upper below lower": (
        lambda w, r, c: w.batch(updates([], 2), 3, 1),
        persist.InvalidUsage,
        "below",
    ),
    "negative time": (
        lambda w, r, c: w.compare_and_append(
            pa.table({"k": [1], "v": ["a"], "_time": pa.array([-1], pa.int64())}), 2, 5
        ),
        persist.InvalidUsage,
        "negative",
    ),
    "float time": (
        lambda w, r, c: w.compare_and_append(
            pa.table({"k": [1], "v": ["a"], "_time": pa.array([2.0])}), 2, 5
        ),
        persist.InvalidUsage,
        "unsigned integer",
    ),
    "negative expected upper": (
        lambda w, r, c: w.compare_and_append(updates([], 0), -1, 5),
        persist.InvalidUsage,
        "time",
    ),
    "non-int upper": (
        lambda w, r, c: w.compare_and_append(updates([], 2), 2, "5"),
        persist.InvalidUsage,
        "time",
    ),  # type: ignore[arg-type]
    "reserved column": (
        lambda w, r, c: w.compare_and_append(
            updates([1], 2).append_column("_x", pa.array([1])), 2, 5
        ),
        persist.InvalidUsage,
        "reserved",
    ),
    "schema mismatch": (
        lambda w, r, c: w.compare_and_append(
            pa.table(
                {
                    "k": pa.array([1.0], pa.float64()),
                    "v": ["a"],
                    "_time": pa.array([2], pa.uint64()),
                }
            ),
            2,
            5,
        ),
        persist.InvalidUsage,
        "type double",
    ),
    "not a table": (
        lambda w, r, c: w.compare_and_append([(1, "a", 2, 1)], 2, 5),
        persist.InvalidUsage,
        "pyarrow",
    ),  # type: ignore[arg-type]
    "reopen with another schema": (
        lambda w, r, c: c.open_writer(w.shard_id, pa.schema([("k", pa.int64())])),
        persist.InvalidUsage,
        "schema",
    ),
    "as_of below since": (lambda w, r, c: r.snapshot(0), persist.InvalidUsage, "below"),
    "listen below since": (lambda w, r, c: r.listen(0).__anext__(), persist.InvalidUsage, "below"),
    "since backwards": (lambda w, r, c: r.downgrade_since(0), persist.InvalidUsage, "backwards"),
    "zero splits": (
        lambda w, r, c: r.snapshot(1, num_splits=0),
        persist.InvalidUsage,
        "num_splits",
    ),
    "bad split bytes": (
        lambda w, r, c: c.fetch_split(persist.Split.from_bytes(b"garbage")),
        persist.InvalidUsage,
        "split",
    ),
    "bad batch bytes": (
        lambda w, r, c: w.compare_and_append_batch(
            [persist.Batch.from_bytes(b"PRSB\x01" + b"\x00" * 40)], 2, 3
        ),
        persist.InvalidUsage,
        "batch",
    ),
    "split as batch": (
        lambda w, r, c: w.compare_and_append_batch(["nope"], 2, 3),
        persist.InvalidUsage,
        "Batch",
    ),  # type: ignore[list-item]
    "unknown shard inspect": (
        lambda w, r, c: c.inspect(persist.ShardId.new()),
        persist.InvalidUsage,
        "does not exist",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_misuse_is_refused_and_changes_nothing(case: str) -> None:
    misuse, error, message = CASES[case]
    async with persist.PersistClient(MemBlob(), MemConsensus(), fast_config()) as client:
        shard = persist.ShardId.new()
        write, read = await client.open(shard, SCHEMA)
        await write.compare_and_append(updates([1, 2], [0, 1]), 0, 2)
        await read.downgrade_since(1)
        before = await client.inspect(shard)
        snapshot = contents(await read.snapshot_and_fetch(1))
        with pytest.raises(error, match=message):
            await misuse(write, read, client)
        after = await client.inspect(shard)
        assert {
            k: after[k]
            for k in ("upper", "since", "batches", "parts", "rows", "readers", "writers")
        } == {
            k: before[k]
            for k in ("upper", "since", "batches", "parts", "rows", "readers", "writers")
        }
        assert contents(await read.snapshot_and_fetch(1)) == snapshot


@pytest.mark.parametrize(
    "shard_id",
    [
        "",
        "../etc/passwd",
        "s" + "0" * 10_000,
        "sé",
        "s00000000-0000-0000-0000-00000000000/",
        42,
        None,
        "S00000000-0000-0000-0000-000000000001",
    ],
)
async def test_hostile_shard_ids_are_refused(shard_id: object) -> None:
    with pytest.raises(persist.InvalidUsage, match="shard id"):
        persist.ShardId(shard_id)
    async with persist.PersistClient(MemBlob(), MemConsensus(), fast_config()) as client:
        with pytest.raises(persist.InvalidUsage, match="shard id"):
            await client.open_writer(shard_id, SCHEMA)  # type: ignore[arg-type]
        with pytest.raises(persist.InvalidUsage, match="shard id"):
            await client.inspect(shard_id)  # type: ignore[arg-type]


def test_shard_id_roundtrip() -> None:
    sid = persist.ShardId.new()
    assert persist.ShardId(str(sid)) == sid and isinstance(sid, str)
    assert repr(sid).startswith("ShardId(")


async def test_an_upper_that_does_not_advance_is_named_with_both_uppers() -> None:
    # Updates need room: new_upper above expected_upper. The refusal names the two uppers and
    # the rule, not the updates' _time (which is right; the uppers leave it no room).
    async with persist.PersistClient(MemBlob(), MemConsensus(), fast_config()) as client:
        write = await client.open_writer(persist.ShardId.new(), SCHEMA)
        await write.compare_and_append(updates([1], 0), 0, 5)
        for new_upper, rule in [(5, "above"), (3, ">=")]:
            with pytest.raises(persist.InvalidUsage) as info:
                await write.compare_and_append(updates([1], 5), 5, new_upper)
            text = str(info.value)
            assert f"new_upper {new_upper}" in text and "expected_upper 5" in text, text
            assert rule in text and not text.startswith("_time"), text
        with pytest.raises(persist.InvalidUsage, match="upper 5 equals lower 5"):
            await write.append(updates([1], 5), 5, 5)
        with pytest.raises(persist.InvalidUsage, match="upper 5 equals lower 5"):
            await write.batch(updates([1], 5), 5, 5)
        await write.compare_and_append(updates([], 5), 5, 5)  # the heartbeat stays a no-op
        assert await write.fetch_recent_upper() == 5
