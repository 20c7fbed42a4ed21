"""Hypothesis strategies for shard schemas, rows and updates.

    from persist.testing import strategies as pst

    @given(data=st.data())
    def test_roundtrip(data):
        schema = data.draw(pst.schemas())
        table = data.draw(pst.updates(schema, lower=0, upper=10))

Every schema drawn is one persist accepts (every column sortable and comparable; no reserved
names). Float values are finite unless ``special_floats=True``, which adds NaN, the infinities
and -0.0 (the model compares NaN equal to NaN as a value of a row, as persist must when it
consolidates). ``updates`` draws rows from a small pool so that equal rows (and so consolidation)
are common.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import string
from collections.abc import Sequence

import pyarrow as pa
from hypothesis import strategies as st

from persist.testing.model import NAN, Row, Update

__all__ = [
    "COLUMN_TYPES",
    "as_table",
    "column_names",
    "place",
    "relative_update_lists",
    "rows",
    "schemas",
    "update_lists",
    "updates",
    "values",
]

COLUMN_TYPES: tuple[pa.DataType, ...] = (
    pa.int64(),
    pa.int32(),
    pa.int8(),
    pa.uint16(),
    pa.uint64(),
    pa.float64(),
    pa.float32(),
    pa.bool_(),
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.date32(),
    pa.timestamp("us"),
    pa.decimal128(10, 2),
)
"""The column types ``schemas`` draws from (all supported by persist's sort and equality)."""

_TEXT = st.text(st.characters(codec="utf-8"), max_size=6)  # no lone surrogates


_SPECIAL_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0)


def values(dtype: pa.DataType, *, special_floats: bool = False) -> st.SearchStrategy[object]:
    """Python values of the Arrow type ``dtype`` (as ``Table.to_pylist`` gives them back);
    with ``special_floats``, floats are often NaN, +-inf or -0.0."""
    if special_floats and pa.types.is_floating(dtype):
        return st.one_of(st.sampled_from(_SPECIAL_FLOATS), values(dtype))
    if pa.types.is_boolean(dtype):
        return st.booleans()
    if pa.types.is_integer(dtype):
        info = (dtype.bit_width, pa.types.is_signed_integer(dtype))
        bits, signed = info
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        # Mostly small values (so rows repeat), sometimes the edges.
        return st.one_of(st.integers(-3 if signed else 0, 3), st.sampled_from([lo, hi]))
    if pa.types.is_float32(dtype):
        return st.floats(allow_nan=False, width=32)
    if pa.types.is_floating(dtype):
        return st.floats(allow_nan=False)
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return _TEXT
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
        return st.binary(max_size=6)
    if pa.types.is_date32(dtype):
        return st.dates(dt.date(1900, 1, 1), dt.date(2200, 12, 31))
    if pa.types.is_timestamp(dtype) and dtype.tz is None:
        return st.datetimes(dt.datetime(1970, 1, 1), dt.datetime(2200, 1, 1))
    if pa.types.is_decimal(dtype):
        bound = decimal.Decimal(10) ** (dtype.precision - dtype.scale) - 1
        return st.decimals(-bound, bound, places=dtype.scale, allow_nan=False)
    raise ValueError(f"no value strategy for {dtype}")


def column_names() -> st.SearchStrategy[str]:
    """Column names persist accepts: not empty, not starting with ``_``; some non-ASCII."""
    first = st.sampled_from(string.ascii_letters + "éßЖ中")
    rest = st.text(st.sampled_from(string.ascii_letters + string.digits + "_é中 -"), max_size=7)
    return st.builds(lambda a, b: a + b, first, rest)


@st.composite
def schemas(
    draw: st.DrawFn,
    *,
    min_columns: int = 1,
    max_columns: int = 4,
    types: Sequence[pa.DataType] = COLUMN_TYPES,
) -> pa.Schema:
    """Schemas of ``min_columns``..``max_columns`` columns of ``types``, some nullable."""
    names = draw(st.lists(column_names(), min_size=min_columns, max_size=max_columns, unique=True))
    fields = [pa.field(n, draw(st.sampled_from(list(types))), draw(st.booleans())) for n in names]
    return pa.schema(fields)


def rows(schema: pa.Schema, *, special_floats: bool = False) -> st.SearchStrategy[Row]:
    """Rows of ``schema``: tuples of values in column order (None only in nullable columns)."""
    parts = []
    for f in schema:
        v = values(f.type, special_floats=special_floats)
        parts.append(st.one_of(st.none(), v) if f.nullable else v)
    return st.tuples(*parts)


@st.composite
def update_lists(
    draw: st.DrawFn,
    schema: pa.Schema,
    lower: int,
    upper: int | None,
    *,
    max_rows: int = 8,
    max_distinct_rows: int = 4,
    diffs: st.SearchStrategy[int] | None = None,
    special_floats: bool = False,
) -> list[Update]:
    """``(row, time, diff)`` with ``lower <= time < upper`` (``upper`` None: up to lower + 10).

    Rows come from a pool of at most ``max_distinct_rows``, so repeats are common; diffs are
    small and may be negative or zero. An empty interval gives no updates.
    """
    hi = lower + 10 if upper is None else upper
    if hi <= lower:
        return []
    pool = draw(
        st.lists(
            rows(schema, special_floats=special_floats), min_size=1, max_size=max_distinct_rows
        )
    )
    diff = diffs if diffs is not None else st.integers(-2, 3)
    return draw(
        st.lists(
            st.tuples(st.sampled_from(pool), st.integers(lower, hi - 1), diff),
            max_size=max_rows,
        )
    )


def _raw(value: object) -> object:
    return math.nan if value is NAN else value


def as_table(schema: pa.Schema, updates: Sequence[Update], *, with_diff: bool = True) -> pa.Table:
    """The Arrow table of ``updates`` (``_time`` uint64, ``_diff`` int64 unless ``with_diff``
    is False, in which case every diff must be 1)."""
    cols: dict[str, pa.Array] = {}
    for i, f in enumerate(schema):
        cols[f.name] = pa.array([_raw(u[0][i]) for u in updates], type=f.type)
    cols["_time"] = pa.array([u[1] for u in updates], type=pa.uint64())
    if with_diff:
        cols["_diff"] = pa.array([u[2] for u in updates], type=pa.int64())
    elif any(u[2] != 1 for u in updates):
        raise ValueError("updates without a _diff column must all have diff 1")
    fields = [*schema, pa.field("_time", pa.uint64(), nullable=False)]
    if with_diff:
        fields.append(pa.field("_diff", pa.int64(), nullable=False))
    return pa.Table.from_pydict(cols, schema=pa.schema(fields))


@st.composite
def updates(
    draw: st.DrawFn,
    schema: pa.Schema,
    lower: int,
    upper: int | None,
    *,
    max_rows: int = 8,
    max_distinct_rows: int = 4,
    special_floats: bool = False,
) -> pa.Table:
    """An Arrow table of updates for ``schema`` with times in ``[lower, upper)``, as
    ``update_lists`` draws them; sometimes without the ``_diff`` column (meaning +1 each)."""
    plain = draw(st.booleans())
    lists = draw(
        update_lists(
            schema,
            lower,
            upper,
            max_rows=max_rows,
            max_distinct_rows=max_distinct_rows,
            diffs=st.just(1) if plain else None,
            special_floats=special_floats,
        )
    )
    return as_table(schema, lists, with_diff=not plain or not lists or draw(st.booleans()))


def relative_update_lists(
    schema: pa.Schema,
    *,
    max_rows: int = 8,
    max_distinct_rows: int = 4,
    max_offset: int = 10,
    special_floats: bool = False,
) -> st.SearchStrategy[list[Update]]:
    """Updates whose times are offsets in ``[0, max_offset)``, to be placed in an interval
    known only later (``place``). Their shape does not depend on that interval, which keeps
    Hypothesis's draws the same however a nondeterministic system under test behaved."""
    return update_lists(
        schema,
        0,
        max_offset,
        max_rows=max_rows,
        max_distinct_rows=max_distinct_rows,
        special_floats=special_floats,
    )


def place(updates: Sequence[Update], lower: int, upper: int | None) -> list[Update]:
    """``relative_update_lists`` updates moved into ``[lower, upper)`` (offsets wrap around the
    interval's width; an empty interval gets none; ``upper`` None: ``lower + offset``)."""
    if upper is None:
        return [(row, lower + off, diff) for row, off, diff in updates]
    width = upper - lower
    if width <= 0:
        return []
    return [(row, lower + off % width, diff) for row, off, diff in updates]
