"""core.arrow.predicates: a row predicate may name the shard's data columns and nothing else."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist.core.arrow.predicates import check_predicate
from persist.errors import InvalidUsage

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string()), ("s", pa.struct([("x", pa.int32())]))])


@pytest.mark.parametrize(
    "predicate",
    [
        pc.field("k") >= 3,
        (pc.field("v") == "a") | pc.field("k").isin([1, 2]),
        pc.field("s", "x").is_null(),
        pc.field(1) == "a",  # by position: a data column
        pc.scalar(True),
        pc.field("v") == "_time",  # a literal, not a column
    ],
    ids=str,
)
def test_data_columns_are_taken(predicate: pc.Expression) -> None:
    assert check_predicate(predicate, SCHEMA).equals(predicate)


@pytest.mark.parametrize(
    ("predicate", "named"),
    [
        (pc.field("_time") >= 5, "_time"),
        ((pc.field("k") == 1) & (pc.field("_diff") > 0), "_diff"),
        (pc.field("_time") == "x", "_time"),  # refused for the column, whatever its type
        (pc.field("nope") == 1, "nope"),
        (pc.field("s", "y").is_null(), "y"),
        (pc.field(3) == 1, "3"),  # by position: past the data columns (where _time would be)
    ],
    ids=str,
)
def test_anything_but_a_data_column_is_refused_by_name(
    predicate: pc.Expression, named: str
) -> None:
    with pytest.raises(InvalidUsage, match=named) as info:
        check_predicate(predicate, SCHEMA)
    assert "k: int64" not in str(info.value)  # Arrow's dump of the schema is left out


@pytest.mark.parametrize("column", ["_time", "_diff"])
def test_the_reserved_columns_are_explained(column: str) -> None:
    with pytest.raises(InvalidUsage) as info:
        check_predicate(pc.field(column) > 0, SCHEMA)
    text = str(info.value)
    assert f"{column!r}" in text and "data column" in text


@pytest.mark.parametrize(
    ("predicate", "why"),
    [
        ("k = 1", "Expression"),
        (pc.field("k") + 1, "bool"),
        (pc.field("v") == 1, "predicate"),
    ],
    ids=str,
)
def test_what_is_no_row_predicate_is_refused(predicate: object, why: str) -> None:
    with pytest.raises(InvalidUsage, match=why):
        check_predicate(predicate, SCHEMA)


@pytest.mark.parametrize(
    "predicate",
    [
        (pc.field("v") == "alice@example.com") & (pc.field("_time") >= 5),
        (pc.field("v") == "alice@example.com") & (pc.field("nope") == 1),
        pc.field("k") == "alice@example.com",  # a value the column's type does not take
    ],
    ids=str,
)
def test_a_refusal_never_quotes_the_predicates_values(predicate: pc.Expression) -> None:
    """An erase's predicate holds the very data being erased: it must not reach a message
    (and from there a log)."""
    with pytest.raises(InvalidUsage) as refused:
        check_predicate(predicate, SCHEMA)
    assert "alice@example.com" not in str(refused.value)
