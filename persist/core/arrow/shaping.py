"""How Arrow data becomes a shard's updates: the one place every writer's input is checked and
shaped (``compare_and_append``, ``append`` and ``batch`` through ``prepare_updates``; the Spark
writer; streaming writes, checked at the edge by ``EdgeCheck`` and shaped in bulk by
``shape_rows``). What one writer accepts, all accept; what a later step (a consolidation, the
Parquet encoder) would refuse is refused here, naming the column and why.

Pure and vectorized, like ``core.arrow.updates``: no I/O, no per-row Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.casts import lossless, refusal
from persist.core.arrow.updates import DIFF, TIME, full_schema, sort_consolidate
from persist.core.stream.durability import Write
from persist.errors import InvalidUsage

__all__ = [
    "EdgeCheck",
    "at_times",
    "prepare_updates",
    "refused_writes",
    "rows_schema",
    "shape_rows",
    "shape_updates",
]

_I64_MAX = 2**63 - 1


_DAY_MS = 86_400_000


def _parquet_changes(t: pa.DataType) -> bool:
    """Whether Parquet stores ``t`` as another type: it has no seconds unit (time32[s] and
    timestamp[s] are stored in milliseconds) and stores dates as days (date64 as date32)."""
    return bool(
        t == pa.date64() or ((pa.types.is_timestamp(t) or pa.types.is_time32(t)) and t.unit == "s")
    )


def _check_parquet_range(name: str, col: pa.ChunkedArray) -> None:
    """``InvalidUsage`` unless every value of ``col`` (a type ``_parquet_changes``) survives
    Parquet's conversion exactly, so that it reads back as written.

    The conversion multiplies seconds by 1000 (wrapping around, or failing, beyond the target
    integer) and divides date64 milliseconds by a day into an int32 (truncating). Arrow's own
    format says date64 values are whole days, so refusing the others refuses only what other
    Arrow implementations would not expect either.
    """
    t = col.type
    if col.null_count == len(col):
        return
    if t == pa.date64():
        ints = col.cast(pa.int64())
        lo, hi = -(2**31) * _DAY_MS, (2**31 - 1) * _DAY_MS
        # Integer division truncates: multiplied back, only whole days come out unchanged.
        whole = pc.multiply(pc.divide(ints, _DAY_MS), _DAY_MS)
        partial = pc.filter(ints, pc.not_equal(whole, ints))
        if len(partial):
            raise InvalidUsage(
                f"column {name!r}: date64 value {partial[0].as_py()} (ms) is not a whole number "
                f"of days; date64 values must be (Arrow's format says so, and Parquet stores "
                f"dates as days)"
            )
    elif pa.types.is_time32(t):
        ints, lo, hi = col.cast(pa.int32()), -(2**31) // 1000 + 1, (2**31 - 1) // 1000
    else:
        ints, lo, hi = col.cast(pa.int64()), -(2**63) // 1000 + 1, (2**63 - 1) // 1000
    mm = pc.min_max(ints)
    vmin, vmax = mm["min"].as_py(), mm["max"].as_py()
    if vmin < lo or vmax > hi:
        bad = vmin if vmin < lo else vmax
        raise InvalidUsage(
            f"column {name!r}: {t} value {bad} is out of the range persist can store exactly "
            f"([{lo}, {hi}]; Parquet stores {t} in {'days' if t == pa.date64() else 'ms'})"
        )


def _lower_upper_text(lower: int, upper: int | None) -> str:
    return f"[{lower}, {'None' if upper is None else upper})"


def prepare_updates(
    data: object,
    schema: pa.Schema,
    lower: int,
    upper: int | None,
    names: tuple[str, str] = ("lower", "upper"),
) -> pa.Table:
    """Checks ``data`` against the shard schema and ``[lower, upper)``; returns the updates with
    columns in schema order, ``_time`` as uint64 and ``_diff`` as int64 (1 where omitted).
    ``names`` are what the caller calls the two bounds, for messages."""
    table = shape_updates(data, schema)
    if table.num_rows:
        if lower == upper:
            # No time fits: the bounds are the mistake, whatever the times are.
            raise InvalidUsage(
                f"{names[1]} {upper} equals {names[0]} {lower}, which leaves no time for "
                f"updates: every _time must be >= {names[0]} and < {names[1]}, so {names[1]} "
                f"must be above {names[0]} (only empty updates may keep the upper where it is)"
            )
        mm = pc.min_max(table.column(TIME))
        tmin, tmax = mm["min"].as_py(), mm["max"].as_py()
        if tmin < lower or (upper is not None and tmax >= upper):
            bad = tmin if tmin < lower else tmax
            raise InvalidUsage(
                f"_time {bad} is outside [{names[0]}, {names[1]}) = "
                f"{_lower_upper_text(lower, upper)}: every _time must be >= {names[0]} and "
                f"< {names[1]}"
            )
    return table


def rows_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of updates whose time is kept elsewhere (streamed writes before their LSN):
    the data columns, then ``_diff``."""
    return pa.schema([*schema, pa.field(DIFF, pa.int64(), nullable=False)])


def shape_updates(
    data: object,
    schema: pa.Schema,
    *,
    time: int | None = None,
    keep_time: bool = True,
    safe_casts: bool = False,
    check_sums: bool = True,
) -> pa.Table:
    """The one way Arrow data becomes a shard's updates: ``compare_and_append``, ``append`` and
    ``batch`` (through ``prepare_updates``), streaming writes and the Spark writer all shape
    what they are given here, so that what one accepts the others accept too.

    ``data`` (a Table or RecordBatch) holds the shard's columns, in any order, plus ``_diff``
    (optional, any integer type; 1 where omitted) and ``_time`` (any integer type), which is
    required unless ``time`` is given: then every row gets ``time`` and a ``_time`` column is
    refused. A data column must have the shard's type or, with ``safe_casts``, a type pyarrow
    casts to it without changing a value; nullable data may fill a NOT NULL field when it holds
    no null. Returns the data columns in schema order, ``_time`` (unless ``keep_time`` is false)
    and ``_diff``, typed as ``full_schema`` (or ``rows_schema``) says.

    Whatever a later step would refuse is refused here, as ``InvalidUsage`` naming the column
    and the reason: nulls where they can't be, values Parquet can't hold exactly, and updates
    whose diffs, summed per row, overflow int64 (``DiffOverflow``; ``check_sums`` False skips
    that for data made of writes each checked on its own, which get times of their own later:
    their rows never sum across writes)."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if not isinstance(data, pa.Table):
        raise InvalidUsage(
            f"updates must be a pyarrow.Table or RecordBatch, not {type(data).__name__}"
        )
    names = data.column_names
    if len(set(names)) != len(names):
        raise InvalidUsage(f"updates have duplicate column names: {names}")
    if time is not None and TIME in names:
        raise InvalidUsage(
            f"these updates can't carry {TIME!r}: their time is given ({time}) by the writer"
        )
    expected = set(schema.names) | ({TIME} if time is None else set())
    missing = expected - set(names)
    if missing:
        raise InvalidUsage(f"updates lack column(s) {sorted(missing)}")
    extra = set(names) - expected - {DIFF}
    if extra:
        reserved = sorted(n for n in extra if n.startswith("_"))
        if reserved:
            raise InvalidUsage(
                f"column(s) {reserved} use the reserved '_' prefix (only _time and _diff are allowed)"
            )
        raise InvalidUsage(f"updates have column(s) {sorted(extra)} that the schema lacks")

    arrays: list[pa.ChunkedArray] = [
        _conformed(data.column(field.name), field, safe_casts) for field in schema
    ]
    n = data.num_rows
    if time is None:
        arrays.append(_times(data.column(TIME)))
    elif time < 0 or time >= 1 << 64:
        raise InvalidUsage(f"a time must be in [0, 2^64), not {time}")
    elif keep_time:
        arrays.append(pa.chunked_array([np.full(n, time, dtype=np.uint64)], type=pa.uint64()))
    if DIFF in names:
        arrays.append(_diffs(data.column(DIFF)))
    else:
        arrays.append(pa.chunked_array([np.ones(n, dtype=np.int64)], type=pa.int64()))
    with_time = time is None or keep_time
    table = pa.Table.from_arrays(
        arrays, schema=full_schema(schema) if with_time else rows_schema(schema)
    )
    if DIFF in names and n > 1 and check_sums:
        # Rows of one time (``time`` given) sum by their data alone.
        _check_diff_sums(table, [*schema.names, TIME] if with_time else schema.names)
    return table


class EdgeCheck:
    """What ``shape_updates(data, schema, time=t, keep_time=False)`` would refuse of a write,
    found at the edge without shaping it: a streaming server checks every write before it
    acknowledges it and shapes many at once later (``shape_rows``). The checks of a write's
    schema are made once per schema (by shaping an empty table of it); those of its values
    (nulls, ``_diff`` and Parquet ranges, diff sums) on every write."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._plans: dict[pa.Schema, tuple[list[int], int | None, list[int]] | InvalidUsage] = {}

    def __call__(self, batch: pa.RecordBatch) -> None:
        """``InvalidUsage`` if shaping ``batch`` would fail; else None."""
        plan = self._plans.get(batch.schema)
        if plan is None:
            plan = self._plans[batch.schema] = self._plan(batch.schema)
        if isinstance(plan, InvalidUsage):
            raise plan
        nulls, diff, ranges = plan
        for i in nulls:
            if batch.column(i).null_count:
                raise InvalidUsage(
                    f"column {batch.schema.field(i).name!r} is not nullable but holds nulls"
                )
        for i in ranges:
            _check_parquet_range(batch.schema.field(i).name, pa.chunked_array([batch.column(i)]))
        if diff is not None:
            table = pa.Table.from_batches([batch])
            _diffs(table.column(diff))  # nulls, a uint64 value above int64
            if batch.num_rows > 1:
                shape_updates(table, self.schema, time=0, keep_time=False)

    def _plan(self, given: pa.Schema) -> tuple[list[int], int | None, list[int]] | InvalidUsage:
        try:
            shape_updates(given.empty_table(), self.schema, time=0, keep_time=False)
        except InvalidUsage as exc:
            if len(self._plans) > 64:
                self._plans.clear()  # a client sending ever new schemas: keep it bounded
            return exc
        fields = {f.name: f for f in self.schema}
        nulls = [i for i, f in enumerate(given) if f.name in fields and not fields[f.name].nullable]
        ranges = [i for i, f in enumerate(given) if f.name in fields and _parquet_changes(f.type)]
        return nulls, given.get_field_index(DIFF) if DIFF in given.names else None, ranges


def shape_rows(batches: Sequence[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    """Writes checked by ``EdgeCheck``, shaped together: ``rows_schema(schema)``, in order (each
    run of batches of one schema shaped at once)."""
    tables: list[pa.Table] = []
    start = 0
    for i in range(1, len(batches) + 1):
        if i == len(batches) or batches[i].schema != batches[start].schema:
            run = pa.Table.from_batches(batches[start:i])
            # Each write's sums were checked at the edge; rows of two writes get two LSNs,
            # so they never sum together.
            tables.append(shape_updates(run, schema, time=0, keep_time=False, check_sums=False))
            start = i
    if not tables:
        return rows_schema(schema).empty_table()
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _conformed(col: pa.ChunkedArray, field: pa.Field, safe_casts: bool) -> pa.ChunkedArray:
    if col.type != field.type:
        if not safe_casts and not lossless(col.type, field.type):
            raise InvalidUsage(
                f"column {field.name!r} has type {col.type}, the shard's schema says "
                f"{field.type}: {refusal(col.type, field.type)}"
            )
        try:
            col = col.cast(field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            if pa.types.is_timestamp(col.type) and pa.types.is_timestamp(field.type):
                raise InvalidUsage(
                    f"column {field.name!r}: a {col.type} value is out of the range "
                    f"{field.type} can hold ({exc})"
                ) from None
            raise InvalidUsage(
                f"column {field.name!r} ({col.type}) can't be stored as {field.type} without "
                f"changing a value: {exc}"
            ) from None
    if not field.nullable and col.null_count:
        raise InvalidUsage(f"column {field.name!r} is not nullable but holds nulls")
    if _parquet_changes(field.type):
        _check_parquet_range(field.name, col)
    return col


def _times(times: pa.ChunkedArray) -> pa.ChunkedArray:
    if not pa.types.is_integer(times.type):
        raise InvalidUsage(f"_time must be an unsigned integer column, not {times.type}")
    if times.null_count:
        raise InvalidUsage("_time holds nulls")
    if len(times):
        tmin = pc.min(times).as_py()
        if tmin < 0:
            raise InvalidUsage(f"_time holds a negative time ({tmin})")
    return times.cast(pa.uint64())


def _diffs(diffs: pa.ChunkedArray) -> pa.ChunkedArray:
    if not pa.types.is_integer(diffs.type):
        raise InvalidUsage(f"_diff must be an int64 column, not {diffs.type}")
    if diffs.null_count:
        raise InvalidUsage("_diff holds nulls")
    try:
        return diffs.cast(pa.int64())
    except pa.ArrowInvalid as exc:
        raise InvalidUsage(f"_diff does not fit in int64: {exc}") from exc


def _check_diff_sums(table: pa.Table, keys: Sequence[str]) -> None:
    """``DiffOverflow`` if updates of ``table`` equal on ``keys`` sum outside int64: found now,
    not when a later step consolidates them (a group commit, a merge). Free unless the diffs
    are huge."""
    diffs = table.column(DIFF)
    lo, hi = (v.as_py() for v in pc.min_max(diffs).values())
    if table.num_rows * max(-lo, hi) <= _I64_MAX:
        return
    sort_consolidate(table, keys)


def at_times(rows: pa.Table, counts: Sequence[int], time: int) -> pa.Table:
    """Writes' shaped ``rows`` (write ``i``: the next ``counts[i]`` rows) as updates, write
    ``i`` at ``time + i``: a group commit's updates. Each write has a time of its own, so rows
    of two writes never sum together (each one's sums were checked at the edge)."""
    n = len(counts)
    times = np.repeat(np.arange(time, time + n, dtype=np.uint64), np.asarray(counts, np.int64))
    at = rows.schema.get_field_index(DIFF)
    return rows.add_column(at, pa.field(TIME, pa.uint64(), nullable=False), pa.array(times))


def refused_writes(
    writes: Sequence[Write[pa.RecordBatch]], schema: pa.Schema, time: int
) -> dict[int, str]:
    """The writes of a group (write ``i`` at ``time + i``) that fail on their own what its
    commit does to them (shaping and consolidation), by LSN, with why: what a commit refused
    although the edge let it pass."""
    bad: dict[int, str] = {}
    for i, w in enumerate(writes):
        try:
            table = shape_updates(w.payload, schema, time=time + i)
            sort_consolidate(table, [*schema.names, TIME])
        except Exception as exc:
            bad[w.lsn] = f"{type(exc).__name__}: {exc}"
    return bad
