"""core.arrow.evolution and the evolve_schema transition, on their own: which changes are
allowed, what field ids they give, and how a part of one version is shown in another."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest

from persist.core.arrow import evolution as evo
from persist.core.arrow.updates import full_schema
from persist.core.shard.diff import apply_diff
from persist.core.shard.transitions import Break, Continue, evolve_schema
from persist.core.shard.types import State
from persist.errors import InvalidUsage, SchemaChanged

from .test_state import created

V0 = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("amount", pa.int32()),
    ]
)


def shard(schema: pa.Schema = V0) -> State:
    return msgspec.structs.replace(created(), schema=schema.serialize().to_pybytes())


def evolved(state: State, schema: pa.Schema, renames: dict[str, str] | None = None) -> State:
    new = evo.plan_evolution(state, schema, renames)
    out = evolve_schema(state, evo.versions(state)[0], new, None, 5)
    assert isinstance(out, Continue), out
    return apply_diff(state, out.diff)


def test_a_never_evolved_shard_is_version_zero_with_ids_in_column_order() -> None:
    s = shard()
    assert evo.current_version(s) == 0
    assert evo.versions(s)[0].ids == (0, 1, 2)
    assert evo.matching_version(s, V0) == 0


@pytest.mark.parametrize(
    ("schema", "renames", "ids"),
    [
        # add a nullable field anywhere: a new id
        (
            pa.schema([V0.field(0), pa.field("note", pa.string()), V0.field(1), V0.field(2)]),
            None,
            (0, 3, 1, 2),
        ),
        # drop
        (pa.schema([V0.field(0), V0.field(2)]), None, (0, 2)),
        # rename keeps the id
        (
            pa.schema([V0.field(0), pa.field("label", pa.string()), V0.field(2)]),
            {"name": "label"},
            (0, 1, 2),
        ),
        # lossless widening
        (pa.schema([V0.field(0), V0.field(1), pa.field("amount", pa.int64())]), None, (0, 1, 2)),
        # NOT NULL -> nullable
        (pa.schema([pa.field("id", pa.int64()), V0.field(1), V0.field(2)]), None, (0, 1, 2)),
        # reorder
        (pa.schema([V0.field(2), V0.field(0), V0.field(1)]), None, (2, 0, 1)),
        # swap two names through renames: identities follow the renames, not the names
        (
            pa.schema([V0.field(0), pa.field("amount", pa.string()), pa.field("name", pa.int32())]),
            {"name": "amount", "amount": "name"},
            (0, 1, 2),
        ),
    ],
)
def test_allowed_changes_make_a_version_with_these_ids(
    schema: pa.Schema, renames: dict[str, str] | None, ids: tuple[int, ...]
) -> None:
    s = evolved(shard(), schema, renames)
    assert evo.current_version(s) == 1
    assert evo.versions(s)[1].ids == ids
    assert evo.versions(s)[0].ids == (
        0,
        1,
        2,
    )  # the first version, recorded with the first evolution
    assert evo.schema_of(evo.versions(s)[1]).equals(schema)
    assert s.schema == schema.serialize().to_pybytes()
    assert s.history[s.seqno].purpose == "evolve schema"


@pytest.mark.parametrize(
    ("schema", "renames", "names"),
    [
        (
            pa.schema([V0.field(0), V0.field(1), pa.field("amount", pa.int16())]),
            None,
            ["amount", "narrows"],
        ),
        (
            pa.schema([V0.field(0), V0.field(1), pa.field("amount", pa.string())]),
            None,
            ["amount", "lossless"],
        ),
        (
            pa.schema([*V0, pa.field("must", pa.int64(), nullable=False)]),
            None,
            ["must", "NOT NULL"],
        ),
        (
            pa.schema([V0.field(0), pa.field("name", pa.string(), nullable=False), V0.field(2)]),
            None,
            ["name", "NOT NULL"],
        ),
        (V0, {"nope": "id"}, ["nope"]),
        (V0, {"name": "gone"}, ["gone"]),
    ],
)
def test_refused_changes_name_the_field(
    schema: pa.Schema, renames: dict[str, str] | None, names: list[str]
) -> None:
    with pytest.raises(InvalidUsage) as err:
        evo.plan_evolution(shard(), schema, renames)
    for word in names:
        assert word in str(err.value)


def test_the_current_schema_again_is_a_no_op_and_a_stale_expectation_is_refused() -> None:
    s = shard()
    assert evo.plan_evolution(s, V0, None) is None
    out = evolve_schema(s, evo.versions(s)[0], None, None, 5)
    assert isinstance(out, Break) and out.result == 0 and out.error is None
    s1 = evolved(s, pa.schema([*V0, pa.field("note", pa.string())]))
    stale = evolve_schema(s1, evo.versions(s1)[0], None, 0, 5)
    assert isinstance(stale, Break) and isinstance(stale.error, SchemaChanged)
    assert (stale.error.expected, stale.error.current) == (0, 1)


def test_a_dropped_name_added_again_is_another_field() -> None:
    s = evolved(shard(), pa.schema([V0.field(0), V0.field(2)]))
    s = evolved(s, pa.schema([V0.field(0), V0.field(2), pa.field("name", pa.string())]))
    assert evo.versions(s)[2].ids == (0, 2, 3)
    # Its schema looks like version 0's reordered, but only an exact match picks a version.
    assert evo.matching_version(s, pa.schema([V0.field(0), V0.field(2), V0.field(1)])) == 2
    assert evo.matching_version(s, V0) == 0


def _part(schema: pa.Schema, rows: dict[str, list[object]], time: int = 0) -> pa.Table:
    n = len(next(iter(rows.values())))
    columns = {
        **rows,
        "_time": pa.array([time] * n, pa.uint64()),
        "_diff": pa.array([1] * n, pa.int64()),
    }
    return pa.table(columns, schema=full_schema(schema))


def test_a_view_shows_parts_by_field_id() -> None:
    s = evolved(
        shard(),
        pa.schema(
            [
                V0.field(0),
                pa.field("label", pa.string()),
                pa.field("amount", pa.int64()),
                pa.field("note", pa.string()),
            ]
        ),
        {"name": "label"},
    )
    v1 = evo.schema_of(evo.versions(s)[1])
    shapes = evo.shapes_for(s, 1, [0, 1])
    assert shapes is not None
    view = evo.View(shapes)
    old = _part(V0, {"id": [2, 1], "name": ["b", "a"], "amount": [20, 10]})
    shown = view.show(old, 0)
    assert shown.schema == full_schema(v1)
    assert shown.select(v1.names).to_pylist() == [
        {"id": 2, "label": "b", "amount": 20, "note": None},
        {"id": 1, "label": "a", "amount": 10, "note": None},
    ]  # aligned (an added field and a widening keep the order): not re-sorted
    assert view.aligned(0) and view.direct(1) and not view.direct(0)
    # Nothing is needed when every part is in the reader's version.
    assert evo.shapes_for(s, 1, [1, 1]) is None
    # An older reader sees newer rows in its own shape.
    back = evo.View(evo.shapes_for(s, 0, [1]) or pytest.fail("shapes"))
    new = _part(v1, {"id": [1], "label": ["x"], "amount": [5], "note": ["n"]})
    assert back.show(new, 1).select(V0.names).to_pylist() == [{"id": 1, "name": "x", "amount": 5}]
    too_big = _part(v1, {"id": [1], "label": ["x"], "amount": [2**40], "note": [None]})
    with pytest.raises(InvalidUsage, match="amount"):
        back.show(too_big, 1)


def test_a_drop_redacts_for_every_reader_and_a_reorder_is_sorted_again() -> None:
    s = evolved(shard(), pa.schema([V0.field(2), V0.field(0)]))  # drop name, reorder
    old = _part(V0, {"id": [1, 1, 2], "name": ["a", "b", "a"], "amount": [9, 9, 1]})
    # The version-0 reader still has "name", but its values are gone for good.
    v0_reader = evo.View(evo.shapes_for(s, 0, [0]) or pytest.fail("shapes"))
    assert not v0_reader.direct(0) and not v0_reader.aligned(0)
    assert v0_reader.show(old, 0).select(V0.names).to_pylist() == [
        {"id": 1, "name": None, "amount": 9},
        {"id": 2, "name": None, "amount": 1},
    ]
    assert v0_reader.show(old, 0).column("_diff").to_pylist() == [2, 1]
    current = evo.current_view(s)
    shown = current.show(old, 0)
    assert shown.column_names == ["amount", "id", "_time", "_diff"]
    assert shown.select(["amount", "id", "_diff"]).to_pylist() == [
        {"amount": 1, "id": 2, "_diff": 1},
        {"amount": 9, "id": 1, "_diff": 2},
    ]
