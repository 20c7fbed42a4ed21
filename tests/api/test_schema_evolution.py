"""Schema evolution, the api contract end to end (``docs/api.md``, "Schema evolution"): every
allowed change and every refused one, version races, fields with identities (a drop redacts,
a rename keeps values), handles at earlier versions, every read door showing rows of other
versions in its reader's schema, consolidation by row identity across versions, and erasure
and ``delete_where`` over rows stored under an older version. On mem and file+sqlite; the
Hypothesis machine (``tests/harness/test_schema_evolution.py``) covers the other locations.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

import persist
from persist.core.arrow.keyrange import encode_keys

from .conftest import Connect

# The embedded locations; the engines read part files, of a file blob.
BOTH = pytest.mark.parametrize("location", ["mem", "file+sqlite"], indirect=True)
FILE = pytest.mark.parametrize("location", ["file+sqlite"], indirect=True)

V0 = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        pa.field("v", pa.string()),
        pa.field("n", pa.int32()),
        pa.field("ts", pa.timestamp("ms")),
    ]
)


def at(seconds: int) -> datetime.datetime:
    return datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=seconds)


def table(
    schema: pa.Schema, rows: list[dict[str, Any]], time: int, diff: int | list[int] = 1
) -> pa.Table:
    """Updates of ``schema``'s columns (a name not in ``rows``: null) at ``time``."""
    diffs = diff if isinstance(diff, list) else [diff] * len(rows)
    columns = {f.name: pa.array([r.get(f.name) for r in rows], f.type) for f in schema}
    columns["_time"] = pa.array([time] * len(rows), pa.uint64())
    columns["_diff"] = pa.array(diffs, pa.int64())
    return pa.table(columns)


def shown(result: pa.Table) -> list[dict[str, Any]]:
    """A read's rows (``_time`` left out), sorted: what a comparison needs."""
    names = [n for n in result.column_names if n != "_time"]
    return sorted(result.select(names).to_pylist(), key=repr)


def data_schema(result: pa.Table) -> pa.Schema:
    return pa.schema([f for f in result.schema if f.name not in ("_time", "_diff")])


ROWS_V0 = [
    {"k": 1, "v": "a", "n": 10, "ts": at(1)},
    {"k": 2, "v": "b", "n": None, "ts": at(2)},
]


async def _shard_at_v0(client: persist.PersistClient) -> tuple[str, persist.WriteHandle]:
    """A new shard of ``V0`` with ``ROWS_V0`` at time 0 (upper 1), and its writer."""
    shard = persist.ShardId.new()
    write = await client.open_writer(shard, V0, purpose="v0 writer")
    await write.compare_and_append(table(V0, ROWS_V0, 0), 0, 1)
    return shard, write


# --- every allowed change ----------------------------------------------------------------------

# kind -> (the new schema, renames, ROWS_V0 as a reader at the new version shows them, a row
# written at the new version, and that row as a reader at V0 shows it).
ALLOWED: dict[
    str,
    tuple[pa.Schema, dict[str, str] | None, list[dict[str, Any]], dict[str, Any], dict[str, Any]],
] = {
    "add": (
        pa.schema([V0.field("k"), pa.field("x", pa.float64()), *list(V0)[1:]]),
        None,
        [{**r, "x": None} for r in ROWS_V0],
        {"k": 3, "x": 1.5, "v": "c", "n": 30, "ts": at(3)},
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
    ),
    "drop": (
        pa.schema([V0.field("k"), V0.field("v"), V0.field("ts")]),
        None,
        [{"k": 1, "v": "a", "ts": at(1)}, {"k": 2, "v": "b", "ts": at(2)}],
        {"k": 3, "v": "c", "ts": at(3)},
        {"k": 3, "v": "c", "n": None, "ts": at(3)},
    ),
    "rename": (
        pa.schema([V0.field("k"), pa.field("value", pa.string()), V0.field("n"), V0.field("ts")]),
        {"v": "value"},
        [
            {"k": 1, "value": "a", "n": 10, "ts": at(1)},
            {"k": 2, "value": "b", "n": None, "ts": at(2)},
        ],
        {"k": 3, "value": "c", "n": 30, "ts": at(3)},
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
    ),
    "widen": (
        pa.schema(
            [
                V0.field("k"),
                V0.field("v"),
                pa.field("n", pa.int64()),
                pa.field("ts", pa.timestamp("us")),
            ]
        ),
        None,
        ROWS_V0,
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},  # fits V0's int32 and milliseconds
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
    ),
    "nullable": (
        pa.schema([pa.field("k", pa.int64()), *list(V0)[1:]]),
        None,
        ROWS_V0,
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
    ),
    "reorder": (
        pa.schema(list(reversed(list(V0)))),
        None,
        ROWS_V0,
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
        {"k": 3, "v": "c", "n": 30, "ts": at(3)},
    ),
}


@BOTH
@pytest.mark.parametrize("kind", sorted(ALLOWED))
async def test_an_allowed_change(client: persist.PersistClient, kind: str) -> None:
    new, renames, old_rows_now, new_row, new_row_at_v0 = ALLOWED[kind]
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    seqno = (await client.inspect(shard))["seqno"]

    assert await client.evolve_schema(shard, new, renames=renames) == 1
    versions = await client.schemas(shard)
    assert [n for n, _ in versions] == [0, 1]
    assert versions[0][1].equals(V0) and versions[1][1].equals(new)
    info = await client.inspect(shard)
    assert info["schema_version"] == 1 and info["seqno"] == seqno + 1
    assert (await client.shard_schema(shard)).equals(new)
    assert (await client.history(shard))[-1]["purpose"] == "evolve schema"
    assert await client.frontiers(shard) == (0, 1)  # an evolution writes no time

    # A new handle is at the new version; the rows of version 0 read in its schema.
    write1, read1 = await client.open(shard, None)
    assert (write1.schema_version, read1.schema_version) == (1, 1)
    assert write1.schema.equals(new) and read1.schema.equals(new)
    now = await read1.snapshot_and_fetch(0)
    assert data_schema(now).equals(new)
    assert shown(now) == sorted(({**r, "_diff": 1} for r in old_rows_now), key=repr)

    # Rows written at the new version, read at both versions, each in its own schema.
    await write1.compare_and_append(table(new, [new_row], 1), 1, 2)
    assert shown(await read1.snapshot_and_fetch(1)) == sorted(
        ({**r, "_diff": 1} for r in [*old_rows_now, new_row]), key=repr
    )
    old = await read0.snapshot_and_fetch(1)
    assert read0.schema_version == 0 and data_schema(old).equals(read0.schema)
    # Version 0's schema, but a field a later version let nulls into (made nullable, or
    # dropped) is shown nullable from then on.
    assert read0.schema.names == V0.names and read0.schema.types == V0.types
    relaxed = {f.name for f, g in zip(V0, read0.schema, strict=True) if f.nullable != g.nullable}
    assert relaxed == ({"k"} if kind == "nullable" else set())
    # A drop redacts: from its commit on, no reader sees the dropped field's values.
    old_rows_at_v0 = [{**r, "n": None} for r in ROWS_V0] if kind == "drop" else ROWS_V0
    assert shown(old) == sorted(
        ({**r, "_diff": 1} for r in [*old_rows_at_v0, new_row_at_v0]), key=repr
    )
    await write0.expire()


# --- every refused change ----------------------------------------------------------------------

# kind -> (the schema asked for, renames, a name the refusal must quote)
REFUSED: dict[str, tuple[pa.Schema, dict[str, str] | None, str]] = {
    "narrow": (pa.schema([V0.field("k"), V0.field("v"), pa.field("n", pa.int16()), V0.field("ts")]), None, "n"),
    "lossy": (pa.schema([pa.field("k", pa.float64(), nullable=False), *list(V0)[1:]]), None, "k"),
    "unrelated": (pa.schema([V0.field("k"), pa.field("v", pa.int64()), *list(V0)[2:]]), None, "v"),
    "coarser unit": (pa.schema([*list(V0)[:3], pa.field("ts", pa.timestamp("s"))]), None, "ts"),
    "another zone": (pa.schema([*list(V0)[:3], pa.field("ts", pa.timestamp("ms", tz="UTC"))]), None, "ts"),
    "new NOT NULL": (pa.schema([*V0, pa.field("y", pa.int64(), nullable=False)]), None, "y"),
    "NOT NULL on a nullable": (pa.schema([V0.field("k"), pa.field("v", pa.string(), nullable=False), *list(V0)[2:]]), None, "v"),
    # One refused change refuses the whole evolution, the allowed add beside it included.
    "add and narrow": (pa.schema([*V0.remove(2), pa.field("n", pa.int8()), pa.field("x", pa.string())]), None, "n"),
    "renamed and narrowed": (pa.schema([V0.field("k"), V0.field("v"), pa.field("count", pa.int16()), V0.field("ts")]), {"n": "count"}, "count"),
    "rename of a missing field": (V0, {"nope": "v"}, "nope"),
    "rename to a missing name": (V0, {"v": "value"}, "value"),
    "two renamed to one name": (pa.schema([V0.field("k"), pa.field("w", pa.string()), V0.field("ts")]), {"v": "w", "n": "w"}, "w"),
    "a reserved name": (pa.schema([*V0, pa.field("_x", pa.int64())]), None, "_x"),
}  # fmt: skip


@BOTH
@pytest.mark.parametrize("kind", sorted(REFUSED))
async def test_a_refused_change(client: persist.PersistClient, kind: str) -> None:
    schema, renames, named = REFUSED[kind]
    shard, write = await _shard_at_v0(client)
    before = await client.inspect(shard)
    with pytest.raises(persist.InvalidUsage) as info:
        await client.evolve_schema(shard, schema, renames=renames)
    assert f"'{named}'" in str(info.value), str(info.value)
    # Nothing changed: no version, no commit, the rows as they were.
    versions = await client.schemas(shard)
    assert [n for n, _ in versions] == [0] and versions[0][1].equals(V0)
    after = await client.inspect(shard)
    assert (after["seqno"], after["schema_version"]) == (before["seqno"], 0)
    read = await client.open_leased_reader(shard)
    assert read.schema_version == 0
    assert shown(await read.snapshot_and_fetch(0)) == sorted(
        ({**r, "_diff": 1} for r in ROWS_V0), key=repr
    )
    await write.expire()


@BOTH
async def test_bad_arguments_are_refused(client: persist.PersistClient) -> None:
    shard, _ = await _shard_at_v0(client)
    for kwargs in (
        {"renames": [("v", "w")]},
        {"expected_version": "0"},
        {"expected_version": True},
    ):
        with pytest.raises(persist.InvalidUsage):
            await client.evolve_schema(shard, V0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage):
        await client.evolve_schema(shard, "k int64")  # type: ignore[arg-type]
    with pytest.raises(persist.InvalidUsage, match="no shard is named"):
        await client.evolve_schema("evo.nobody", V0)
    assert [n for n, _ in await client.schemas(shard)] == [0]
    with pytest.raises(persist.InvalidUsage, match="does not exist"):
        await client.evolve_schema(persist.ShardId.new(), V0)
    await client.drop_shard(shard, force=True)
    with pytest.raises(persist.InvalidUsage, match="finalized"):
        await client.evolve_schema(shard, V0.remove(1))


# --- versions, races, no-ops, history -----------------------------------------------------------


@BOTH
async def test_expected_version_and_no_ops(client: persist.PersistClient) -> None:
    shard, write = await _shard_at_v0(client)
    v1 = pa.schema([*V0, pa.field("x", pa.string())])
    v2 = pa.schema([*v1, pa.field("y", pa.string())])
    assert await client.evolve_schema(shard, v1, expected_version=0) == 1

    with pytest.raises(persist.SchemaChanged) as info:
        await client.evolve_schema(shard, v2, expected_version=0)
    assert (info.value.expected, info.value.current) == (0, 1)
    assert isinstance(info.value, persist.PersistError)
    assert not isinstance(info.value, persist.InvalidUsage)
    assert [n for n, _ in await client.schemas(shard)] == [0, 1]

    # Evolving to the current schema changes nothing and answers its version.
    seqno = (await client.inspect(shard))["seqno"]
    history = await client.history(shard)
    assert await client.evolve_schema(shard, v1) == 1
    assert await client.evolve_schema(shard, v1, expected_version=1) == 1
    assert (await client.inspect(shard))["seqno"] == seqno
    assert await client.history(shard) == history
    # ... but the expected version still has to hold.
    with pytest.raises(persist.SchemaChanged):
        await client.evolve_schema(shard, v1, expected_version=0)

    assert await client.evolve_schema(shard, v2, expected_version=1) == 2
    evolutions = [h for h in await client.history(shard) if h["purpose"] == "evolve schema"]
    assert len(evolutions) == 2
    assert all(h["rows_added"] == h["rows_retracted"] == 0 for h in evolutions)
    assert [h["upper"] for h in evolutions] == [1, 1]
    assert [n for n, _ in await client.schemas(shard)] == [0, 1, 2]
    assert (await client.inspect(shard))["schema_version"] == 2
    await write.expire()


@BOTH
async def test_two_clients_race_for_the_next_version(connect: Connect) -> None:
    first, second = await connect(), await connect()
    shard, write = await _shard_at_v0(first)
    with_x = pa.schema([*V0, pa.field("x", pa.string())])
    with_y = pa.schema([*V0, pa.field("y", pa.int64())])
    results = await asyncio.gather(
        first.evolve_schema(shard, with_x, expected_version=0),
        second.evolve_schema(shard, with_y, expected_version=0),
        return_exceptions=True,
    )
    won = [r for r in results if r == 1]
    lost = [r for r in results if isinstance(r, persist.SchemaChanged)]
    assert len(won) == 1 and len(lost) == 1, results
    assert (lost[0].expected, lost[0].current) == (0, 1)
    versions = await second.schemas(shard)
    assert [n for n, _ in versions] == [0, 1]
    winner = with_x if results[0] == 1 else with_y
    assert versions[1][1].equals(winner)
    await write.expire()


# --- fields have identities --------------------------------------------------------------------


@BOTH
async def test_a_dropped_field_never_comes_back(client: persist.PersistClient) -> None:
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    assert {r["v"] for r in (await read0.snapshot_and_fetch(0)).to_pylist()} == {"a", "b"}

    without_v = V0.remove(1)
    assert await client.evolve_schema(shard, without_v) == 1
    # The writer at version 0 still writes v; from the drop on, nobody is shown it.
    await write0.compare_and_append(table(V0, [{"k": 4, "v": "late", "n": 40}], 1), 1, 2)
    # Added back under its name: another field, null for every row written before.
    with_v_again = pa.schema([*without_v, pa.field("v", pa.string())])
    assert await client.evolve_schema(shard, with_v_again) == 2
    write2, read2 = await client.open(shard, None)
    await write2.compare_and_append(table(with_v_again, [{"k": 5, "v": "new", "n": 50}], 2), 2, 3)

    assert shown(await read2.snapshot_and_fetch(2)) == [
        {"k": 1, "n": 10, "ts": at(1), "v": None, "_diff": 1},
        {"k": 2, "n": None, "ts": at(2), "v": None, "_diff": 1},
        {"k": 4, "n": 40, "ts": None, "v": None, "_diff": 1},
        {"k": 5, "n": 50, "ts": None, "v": "new", "_diff": 1},
    ]
    # The reader at version 0 sees null in its v, for the old rows and the new field's alike,
    # and so does a time travel to before the drop.
    expected_v0 = [
        {"k": 1, "v": None, "n": 10, "ts": at(1), "_diff": 1},
        {"k": 2, "v": None, "n": None, "ts": at(2), "_diff": 1},
        {"k": 4, "v": None, "n": 40, "ts": None, "_diff": 1},
        {"k": 5, "v": None, "n": 50, "ts": None, "_diff": 1},
    ]
    assert shown(await read0.snapshot_and_fetch(2)) == expected_v0
    assert shown(await read0.snapshot_and_fetch(0)) == expected_v0[:2]
    assert shown(await read2.snapshot_and_fetch(0)) == [
        {"k": 1, "n": 10, "ts": at(1), "v": None, "_diff": 1},
        {"k": 2, "n": None, "ts": at(2), "v": None, "_diff": 1},
    ]
    # A v0 row and the same row's retraction at version 2: the dropped v is no part of the
    # row's identity any more (null on both sides), so they cancel.
    await write2.compare_and_append(
        table(with_v_again, [{"k": 1, "n": 10, "ts": at(1)}], 3, -1), 3, 4
    )
    assert [r["k"] for r in shown(await read2.snapshot_and_fetch(3))] == [2, 4, 5]
    await write0.expire()


@BOTH
async def test_erase_matches_by_field_identity(client: persist.PersistClient) -> None:
    shard, write0 = await _shard_at_v0(client)
    await client.evolve_schema(shard, V0.remove(1))
    await client.evolve_schema(shard, pa.schema([*V0.remove(1), pa.field("v", pa.string())]))
    write2, read2 = await client.open(shard, None)
    await write2.compare_and_append(table(write2.schema, [{"k": 3, "v": "a"}], 1), 1, 2)
    # Row 1's dropped v held "a" too: it is not the field the predicate names.
    report = await client.erase(shard, pc.field("v") == "a")
    assert report["rows_erased"] == 1, report
    assert [(r["k"], r["v"]) for r in shown(await read2.snapshot_and_fetch(1))] == [
        (1, None),
        (2, None),
    ]
    # Every row stored before the drop has no value in the new v.
    assert await write2.delete_where(pc.field("v").is_null()) == 2
    assert shown(await read2.snapshot_and_fetch(2)) == []
    await write0.expire()


@BOTH
async def test_the_same_shape_again_opens_the_newest_version(
    client: persist.PersistClient,
) -> None:
    shard, write0 = await _shard_at_v0(client)
    await client.evolve_schema(shard, V0.remove(1))
    # v added back where it was: version 2 looks exactly like version 0.
    assert await client.evolve_schema(shard, V0) == 2
    versions = await client.schemas(shard)
    assert versions[0][1].equals(versions[2][1])
    read = await client.open_leased_reader(shard, V0)
    assert read.schema_version == 2  # the newest it is: the one holding the live v
    assert {r["v"] for r in (await read.snapshot_and_fetch(0)).to_pylist()} == {None}
    await write0.expire()


@BOTH
async def test_a_renamed_field_keeps_its_values(client: persist.PersistClient) -> None:
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    renamed = pa.schema([V0.field("k"), pa.field("label", pa.string()), *list(V0)[2:]])
    assert await client.evolve_schema(shard, renamed, renames={"v": "label"}) == 1
    # Renamed again, and a new field takes the old name: it holds none of the old values.
    again = pa.schema(
        [V0.field("k"), pa.field("tag", pa.string()), *list(V0)[2:], pa.field("v", pa.string())]
    )
    assert await client.evolve_schema(shard, again, renames={"label": "tag"}) == 2
    write2, read2 = await client.open(shard, None)
    await write2.compare_and_append(table(again, [{"k": 3, "tag": "c", "v": "other"}], 1), 1, 2)
    assert shown(await read2.snapshot_and_fetch(1)) == [
        {"k": 1, "tag": "a", "n": 10, "ts": at(1), "v": None, "_diff": 1},
        {"k": 2, "tag": "b", "n": None, "ts": at(2), "v": None, "_diff": 1},
        {"k": 3, "tag": "c", "n": None, "ts": None, "v": "other", "_diff": 1},
    ]
    # At version 0, v is the field now named tag.
    assert shown(await read0.snapshot_and_fetch(1)) == [
        {"k": 1, "v": "a", "n": 10, "ts": at(1), "_diff": 1},
        {"k": 2, "v": "b", "n": None, "ts": at(2), "_diff": 1},
        {"k": 3, "v": "c", "n": None, "ts": None, "_diff": 1},
    ]
    await write0.expire()


# --- handles at earlier versions ---------------------------------------------------------------

V1 = pa.schema(
    [
        pa.field("k", pa.int64(), nullable=False),
        pa.field("value", pa.string()),
        pa.field("n", pa.int64()),
        pa.field("ts", pa.timestamp("ms")),
        pa.field("x", pa.float64()),
    ]
)


async def _evolve_to_v1(client: persist.PersistClient, shard: str) -> None:
    assert await client.evolve_schema(shard, V1, renames={"v": "value"}) == 1


@BOTH
async def test_handles_opened_at_an_earlier_version(
    client: persist.PersistClient, connect: Connect
) -> None:
    shard, first = await _shard_at_v0(client)
    await _evolve_to_v1(client, shard)
    write0, read0 = await client.open(shard, V0, purpose="still at v0")
    assert (write0.schema_version, read0.schema_version) == (0, 0)
    assert write0.schema.equals(V0) and read0.schema.equals(V0)
    # Types that convert losslessly to a version's open that version, as at any open.
    loose = V0.set(1, pa.field("v", pa.large_string()))
    assert (await client.open_leased_reader(shard, loose)).schema_version == 0
    # A schema that is no version is refused, naming the versions it was compared with.
    with pytest.raises(persist.InvalidUsage, match="earlier version"):
        await client.open_writer(shard, pa.schema([("k", pa.int64())]))

    await write0.compare_and_append(table(V0, [{"k": 3, "v": "c", "n": 30}], 1), 1, 2)
    write1, read1 = await client.open(shard, V1)
    assert (write1.schema_version, read1.schema_version) == (1, 1)
    await write1.compare_and_append(table(V1, [{"k": 4, "value": "d", "x": 0.5}], 2), 2, 3)
    await write0.compare_and_append(table(V0, [{"k": 5, "v": "e"}], 3), 3, 4)

    assert shown(await read0.snapshot_and_fetch(3)) == [
        {"k": 1, "v": "a", "n": 10, "ts": at(1), "_diff": 1},
        {"k": 2, "v": "b", "n": None, "ts": at(2), "_diff": 1},
        {"k": 3, "v": "c", "n": 30, "ts": None, "_diff": 1},
        {"k": 4, "v": "d", "n": None, "ts": None, "_diff": 1},
        {"k": 5, "v": "e", "n": None, "ts": None, "_diff": 1},
    ]
    assert shown(await read1.snapshot_and_fetch(3)) == [
        {"k": 1, "value": "a", "n": 10, "ts": at(1), "x": None, "_diff": 1},
        {"k": 2, "value": "b", "n": None, "ts": at(2), "x": None, "_diff": 1},
        {"k": 3, "value": "c", "n": 30, "ts": None, "x": None, "_diff": 1},
        {"k": 4, "value": "d", "n": None, "ts": None, "x": 0.5, "_diff": 1},
        {"k": 5, "value": "e", "n": None, "ts": None, "x": None, "_diff": 1},
    ]
    # A planned read shows the current schema, at a time before the evolution too.
    plan = await client.plan_snapshot(shard, as_of=0, move_since=False)
    assert plan.schema.equals(V1) and plan.reader is not None
    assert shown(pa.concat_tables([await client.fetch_split(s) for s in plan.splits])) == [
        {"k": 1, "value": "a", "n": 10, "ts": at(1), "x": None, "_diff": 1},
        {"k": 2, "value": "b", "n": None, "ts": at(2), "x": None, "_diff": 1},
    ]
    await plan.reader.expire()
    # A writer at version 0 can't write version 1's columns.
    with pytest.raises(persist.InvalidUsage):
        await write0.compare_and_append(table(V1, [{"k": 6, "value": "f"}], 4), 4, 5)

    # Resumed in another process, each handle keeps its version.
    write0.detach()
    read0.detach()
    other = await connect()
    again_w = await other.resume_writer(shard, write0.writer_id)
    again_r = await other.resume_reader(shard, read0.reader_id)
    assert (again_w.schema_version, again_r.schema_version) == (0, 0)
    assert again_w.schema.equals(V0) and again_r.schema.equals(V0)
    await again_w.compare_and_append(table(V0, [{"k": 6, "v": "f", "n": 60}], 4), 4, 5)
    got = shown(await again_r.snapshot_and_fetch(4))
    assert data_schema(await again_r.snapshot_and_fetch(4)).equals(V0)
    assert got[-1] == {"k": 6, "v": "f", "n": 60, "ts": None, "_diff": 1}
    # Splits a v0 reader hands out are fetched in its schema anywhere.
    (split,) = await again_r.snapshot(4)
    fetched = await client.fetch_split(persist.Split.from_bytes(split.to_bytes()))
    assert data_schema(fetched).equals(V0) and shown(fetched) == got
    await first.expire()


@BOTH
async def test_a_listen_keeps_its_version(client: persist.PersistClient) -> None:
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    snapshot = await read0.snapshot_and_fetch(0)
    events: list[persist.ListenEvent] = []

    async def follow() -> None:
        async for event in read0.listen(0):
            events.append(event)
            if event.upper is None or event.upper >= 4:
                return

    follower = asyncio.create_task(follow())
    await write0.compare_and_append(table(V0, [{"k": 3, "v": "c", "n": 30}], 1), 1, 2)
    await _evolve_to_v1(client, shard)
    write1 = await client.open_writer(shard)
    # Version 1 retracts a v0 row (x null) and adds one; then version 0 writes again.
    await write1.compare_and_append(
        table(V1, [{"k": 1, "value": "a", "n": 10, "ts": at(1)}, {"k": 4, "value": "d", "x": 2.5}], 2, [-1, 1]),
        2,
        3,
    )  # fmt: skip
    await write0.compare_and_append(table(V0, [{"k": 5, "v": "e"}], 3), 3, 4)
    await asyncio.wait_for(follower, timeout=60)

    for event in events:
        assert data_schema(event.updates).equals(V0)
    updates = pa.concat_tables([e.updates for e in events])
    assert sorted((r["_time"], r["k"], r["v"], r["_diff"]) for r in updates.to_pylist()) == [
        (1, 3, "c", 1),
        (2, 1, "a", -1),
        (2, 4, "d", 1),
        (3, 5, "e", 1),
    ]
    # The snapshot at 0 plus the listen's updates are the contents as of 3.
    accumulated = _consolidate(pa.concat_tables([snapshot, updates]))
    assert accumulated == _consolidate(await read0.snapshot_and_fetch(3))
    assert sorted(k for (k, *_), _ in accumulated) == [2, 3, 4, 5]
    await write0.expire()


def _consolidate(updates: pa.Table) -> list[tuple[tuple[Any, ...], int]]:
    """Row (data columns) -> summed diff, zeros left out, sorted."""
    sums: dict[tuple[Any, ...], int] = {}
    names = [n for n in updates.column_names if n not in ("_time", "_diff")]
    for r in updates.to_pylist():
        row = tuple(r[n] for n in names)
        sums[row] = sums.get(row, 0) + r["_diff"]
    return sorted(((r, d) for r, d in sums.items() if d), key=repr)


# --- consolidation across versions ---------------------------------------------------------------


@BOTH
async def test_an_insert_and_its_retraction_at_another_version_cancel(
    connect: Connect, location: tuple[str, str]
) -> None:
    # Every write its own part; a maintain merges them all at once.
    client = await connect(
        compaction_enabled=False, compaction_min_parts=1, inline_writes_max_bytes=0
    )
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    snapshot = await read0.snapshot_and_fetch(0)
    listened: list[persist.ListenEvent] = []

    async def follow() -> None:
        async for event in read0.listen(0):
            listened.append(event)
            if event.upper is None or event.upper >= 3:
                return

    follower = asyncio.create_task(follow())
    added = pa.schema([*V0, pa.field("extra", pa.string())])
    assert await client.evolve_schema(shard, added) == 1
    write1, read1 = await client.open(shard, None)
    # Row 1 retracted at version 1, its new field null: the row it retracts.
    await write1.compare_and_append(table(added, [ROWS_V0[0]], 1, -1), 1, 2)
    # Row 2 retracted with a value in the new field: another row, so both stay.
    await write1.compare_and_append(table(added, [{**ROWS_V0[1], "extra": "e"}], 2, -1), 2, 3)
    await asyncio.wait_for(follower, timeout=60)

    expected = sorted(
        [
            {"k": 2, "v": "b", "n": None, "ts": at(2), "extra": None, "_diff": 1},
            {"k": 2, "v": "b", "n": None, "ts": at(2), "extra": "e", "_diff": -1},
        ],
        key=repr,
    )
    kept = [r for r in expected if r["_diff"] == 1]
    # A handle's snapshot at the current version, and at version 0 (where the two rows of k 2
    # are one row, and cancel too).
    assert shown(await read1.snapshot_and_fetch(1)) == kept
    assert shown(await read1.snapshot_and_fetch(2)) == expected
    assert shown(await read0.snapshot_and_fetch(2)) == []
    # A planned snapshot, split and fetched.
    plan = await client.plan_snapshot(shard, as_of=1, splits=2)
    assert plan.schema.equals(added)
    assert plan.reader is not None and plan.reader.schema_version == 1
    fetched = pa.concat_tables([await client.fetch_split(s) for s in plan.splits])
    assert shown(fetched) == kept
    await plan.reader.expire()
    # persist.read_table (the contents, each row by its multiplicity) as of 1.
    blob, consensus = location
    plain = await asyncio.to_thread(
        persist.read_table, shard, blob=blob, consensus=consensus, as_of=1
    )
    assert plain.schema.equals(added)
    assert plain.to_pylist() == [{k: v for k, v in kept[0].items() if k != "_diff"}]
    # The listen's updates, accumulated on the snapshot.
    updates = pa.concat_tables([snapshot, *(e.updates for e in listened)])
    assert [(row[0], d) for row, d in _consolidate(updates)] == []

    # Compaction merges parts of both versions into the current one: the pair of row 1 is
    # gone from storage once the since passes the retraction.
    for handle in (read0, read1):
        await handle.downgrade_since(2)
    merged = await client.maintain(shard)
    assert merged["merges"] >= 1, merged
    info = await client.inspect(shard)
    assert info["rows"] == 2, info  # k 2's insert (extra null) and its retraction (extra e)
    fresh = await client.open_leased_reader(shard)
    assert shown(await fresh.snapshot_and_fetch(2)) == expected
    assert shown(await read0.snapshot_and_fetch(2)) == []
    await write0.expire()


# --- erasing and deleting rows stored under an older version ------------------------------------


@BOTH
async def test_erase_by_a_renamed_column(client: persist.PersistClient) -> None:
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    await _evolve_to_v1(client, shard)
    write1, read1 = await client.open(shard, None)
    await write1.compare_and_append(
        table(V1, [{"k": 3, "value": "a"}, {"k": 4, "value": "d"}], 1), 1, 2
    )
    # The current schema's name: the rows stored under v (at version 0) match it as well.
    report = await client.erase(shard, pc.field("value") == "a")
    assert report["rows_erased"] == 2, report
    assert [r["k"] for r in shown(await read1.snapshot_and_fetch(1))] == [2, 4]
    assert [r["k"] for r in shown(await read1.snapshot_and_fetch(0))] == [2]
    assert [r["k"] for r in shown(await read0.snapshot_and_fetch(1))] == [2, 4]
    # The old name is no column of the current schema.
    with pytest.raises(persist.InvalidUsage, match=r"Name\(v\)"):
        await client.erase(shard, pc.field("v") == "b")
    await write0.expire()


@BOTH
async def test_delete_where_at_the_current_version_then_purge(
    connect: Connect,
) -> None:
    client = await connect(inline_writes_max_bytes=0)
    shard, write0 = await _shard_at_v0(client)
    await _evolve_to_v1(client, shard)
    write1, read1 = await client.open(shard, None)
    # Rows stored at version 0, retracted by a predicate on their renamed column.
    assert await write1.delete_where(pc.field("value") == "a") == 1
    assert await client.frontiers(shard) == (0, 2)
    assert shown(await read1.snapshot_and_fetch(1)) == [
        {"k": 2, "value": "b", "n": None, "ts": at(2), "x": None, "_diff": 1}
    ]
    # A writer at version 0 deletes by its own names.
    assert await write0.delete_where(pc.field("v") == "b") == 1
    assert shown(await read1.snapshot_and_fetch(2)) == []
    # Purged, the rows and their retractions (stored at two versions) leave storage.
    await read1.downgrade_since(2)
    report = await client.purge(shard)
    assert report["rows_before"] == 4 and report["rows_after"] == 0, report
    assert shown(await read1.snapshot_and_fetch(2)) == []
    await write0.expire()


# --- DuckDB and Polars over a dataset of parts of three versions --------------------------------


@FILE
async def test_engines_scan_a_dataset_of_three_versions(connect: Connect) -> None:
    # Parts in blob files of versions 0, 1 and 2: the engines get the reader's schema, never
    # a pyarrow error over files of different columns.
    client = await connect(
        inline_writes_max_bytes=0, compaction_enabled=False, compaction_min_parts=1
    )
    shard, write0 = await _shard_at_v0(client)
    read0 = await client.open_leased_reader(shard, V0)
    await _evolve_to_v1(client, shard)  # v renamed value, n widened, x added
    write1 = await client.open_writer(shard)
    await write1.compare_and_append(table(V1, [{"k": 3, "value": "c", "n": 30, "x": 1.0}], 1), 1, 2)
    v2 = pa.schema(  # ts and x dropped, tag added, reordered
        [
            pa.field("tag", pa.string()),
            pa.field("k", pa.int64(), nullable=False),
            pa.field("n", pa.int64()),
            pa.field("value", pa.string()),
        ]
    )
    assert await client.evolve_schema(shard, v2) == 2
    write2, read2 = await client.open(shard, None)
    await write2.compare_and_append(
        table(v2, [{"k": 4, "value": "d", "n": 1 << 40, "tag": "t"}, {"k": 1, "value": "a", "n": 10}], 2, [1, -1]),
        2,
        3,
    )  # fmt: skip
    expected = [
        {"tag": None, "k": 2, "n": None, "value": "b"},
        {"tag": None, "k": 3, "n": 30, "value": "c"},
        {"tag": "t", "k": 4, "n": 1 << 40, "value": "d"},
    ]
    data = await read2.dataset(2)
    assert isinstance(data, ds.Dataset) and data.schema.equals(v2)
    assert sorted(data.to_table().to_pylist(), key=repr) == sorted(expected, key=repr)
    got = duckdb.sql("select tag, k, n, value from data order by k").fetchall()
    assert got == [tuple(r.values()) for r in expected]
    got = duckdb.from_arrow(data).filter("n > 20").project("k").fetchall()
    assert sorted(got) == [(3,), (4,)]
    frame = pl.scan_pyarrow_dataset(data).filter(pl.col("n").is_not_null()).select("k", "n")
    assert sorted(frame.collect().rows()) == [(3, 30), (4, 1 << 40)]

    # A reader at version 0 over the same parts, in its schema: ts was dropped (null for
    # every row), value is its v; as of 1, before k 4, whose n does not fit its int32.
    old = await read0.dataset(1)
    assert old.schema.equals(V0)
    rows = duckdb.sql("select k, v, n, ts from old order by k").fetchall()
    assert rows == [(1, "a", 10, None), (2, "b", None, None), (3, "c", 30, None)]
    assert pl.scan_pyarrow_dataset(old).select(pl.col("k").sum()).collect().item() == 6
    with pytest.raises(persist.InvalidUsage, match="'n'"):
        await read0.dataset(2)

    # Compacted into the current version, the part files are scanned where they lie.
    for handle in (read0, read2):
        await handle.downgrade_since(2)
    assert (await client.maintain(shard))["merges"] >= 1
    assert (await client.inspect(shard))["parts"] == 1
    merged = await read2.dataset(2)
    files = [f for c in getattr(merged, "children", [merged]) for f in getattr(c, "files", [])]
    assert files, merged
    got = duckdb.sql("select tag, k, n, value from merged order by k").fetchall()
    assert got == [tuple(r.values()) for r in expected]
    frame = pl.scan_pyarrow_dataset(merged).sort("k").collect()
    assert frame.rows() == [tuple(r.values()) for r in expected]
    await write0.expire()


@BOTH
async def test_key_range_splits_across_a_reorder_are_exact(connect: Connect) -> None:
    # Reordered fields sort rows another way: parts of version 0 are shown in version 1's
    # order, and every split (cut by key range) still holds each row's every update.
    client = await connect(
        inline_writes_max_bytes=0,
        part_target_bytes=16 << 10,
        compaction_enabled=False,
        compaction_min_parts=1,
    )
    a_b = pa.schema([pa.field("a", pa.int64(), nullable=False), pa.field("b", pa.string())])
    b_a = pa.schema([pa.field("b", pa.string()), pa.field("a", pa.int64(), nullable=False)])
    shard = persist.ShardId.new()
    write0 = await client.open_writer(shard, a_b)
    rows = [{"a": i, "b": f"{(i * 7919) % 1000:04d}"} for i in range(3000)]
    await write0.compare_and_append(table(a_b, rows, 0), 0, 1)
    assert await client.evolve_schema(shard, b_a) == 1
    write1, read1 = await client.open(shard, None)
    # Every third row retracted at version 1, and new ones: as many updates as version 0
    # wrote, so that the spine merges the two batches.
    gone = rows[::3]
    new = [{"a": 10_000 + i, "b": f"{i % 1000:04d}"} for i in range(2000)]
    await write1.compare_and_append(
        pa.concat_tables([table(b_a, gone, 1, -1), table(b_a, new, 1)]), 1, 2
    )
    expected = sorted(
        [(r["b"], r["a"]) for r in rows if r not in gone] + [(r["b"], r["a"]) for r in new]
    )
    whole = await read1.snapshot_and_fetch(1)
    assert sorted(zip(whole["b"].to_pylist(), whole["a"].to_pylist(), strict=True)) == expected
    assert set(whole["_diff"].to_pylist()) == {1}
    for n in (2, 5):
        splits = await read1.snapshot(1, num_splits=n)
        got: list[tuple[str, int]] = []
        for split in splits:
            part = await client.fetch_split(persist.Split.from_bytes(split.to_bytes()))
            assert data_schema(part).equals(b_a) and set(part["_diff"].to_pylist()) <= {1}
            got += zip(part["b"].to_pylist(), part["a"].to_pylist(), strict=True)
        assert sorted(got) == expected, n

    # An explicit key range, of keys in version 1's order, over parts sorted in either.
    def key(b: str, a: int) -> bytes:
        return encode_keys(pa.table({"b": [b], "a": pa.array([a], pa.int64())}))

    ranged: list[tuple[str, int]] = []
    for split in await read1.snapshot(1, 3, lower_key=key("0100", 0), upper_key=key("0500", 0)):
        part = await client.fetch_split(split)
        ranged += zip(part["b"].to_pylist(), part["a"].to_pylist(), strict=True)
    assert sorted(ranged) == [r for r in expected if ("0100", 0) <= r < ("0500", 0)]
    # Streamed unconsolidated, the same multiset of rows once summed.
    (split,) = await read1.snapshot(1)
    sums: dict[tuple[str, int], int] = {}
    async for batch in client.fetch_split_batches(split, consolidate="never"):
        assert pa.schema(list(batch.schema)[:2]).equals(b_a)
        for r in batch.to_pylist():
            sums[(r["b"], r["a"])] = sums.get((r["b"], r["a"]), 0) + r["_diff"]
    assert sorted(k for k, d in sums.items() if d) == expected
    assert all(d in (0, 1) for d in sums.values())
    # The updates between times, at their own times, in version 1's schema.
    between = await read1.splits_between(0, 2, 3)
    updates = pa.concat_tables([await client.fetch_split(s) for s in between])
    assert data_schema(updates).equals(b_a)
    assert updates.num_rows == len(rows) + len(gone) + len(new)
    # Merged into version 1 once the since passes the retractions: each insert of version 0
    # and its retraction of version 1 cancel in storage.
    await read1.downgrade_since(1)
    assert (await client.maintain(shard))["merges"] >= 1
    assert (await client.inspect(shard))["rows"] == len(expected)
    whole = await read1.snapshot_and_fetch(1)
    assert sorted(zip(whole["b"].to_pylist(), whole["a"].to_pylist(), strict=True)) == expected
    await write0.expire()
