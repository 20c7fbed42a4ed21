"""Arrow kernels for updates: validation, sort + consolidation, time advancement, part codec.

Updates are tables of the shard schema's columns plus ``_time`` (uint64) and ``_diff`` (int64).
Everything here is vectorized pyarrow/numpy (no per-row Python) and pure: no I/O, no clock.
The heavy calls release the GIL, so the runtime runs them in worker threads.

A part (a Parquet file of a batch) holds no zero diff and is either a sorted run, sorted by
(data columns..., ``_time``) and consolidated (no two rows share data and time), or an unsorted
run: its rows as they were written, which a big write stores so that it costs one encode and no
sort (``encode_part(unsorted=True)`` marks it in the footer). ``decode_part`` hands every part back
as a sorted run, sorting and consolidating an unsorted one, so every reader sees sorted runs.
Reading exploits that: when the parts of a read line up end to end in sort order (the common
case: one append's parts, or appends of increasing keys), merging them needs no sort at all,
only a linear pass.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist.core.arrow import keyrange
from persist.core.arrow.casts import storable_schema
from persist.core.arrow.keyrange import encode_keys
from persist.errors import IntegrityError, InvalidUsage

TIME = "_time"
DIFF = "_diff"

__all__ = [
    "DIFF",
    "TIME",
    "DiffOverflow",
    "adjacent_equal",
    "advance_times",
    "advance_to_since",
    "as_rows",
    "check_schema",
    "consolidate_sorted",
    "decode_part",
    "drop_zero_diffs",
    "encode_part",
    "full_schema",
    "may_overflow",
    "merge_consolidate",
    "part_row_group_rows",
    "sort_consolidate",
    "strictly_ascending",
]


class DiffOverflow(InvalidUsage):
    """The diffs of equal updates sum to a number outside int64, which ``_diff`` can't hold.

    Raised instead of a wrapped-around sum: by a write whose own updates overflow (found as
    its parts are consolidated, before anything is committed), by a read whose contents would,
    and by a merge (which is then abandoned).
    """


def check_schema(schema: object) -> pa.Schema:
    """The shard schema, if it is one persist can store; else ``InvalidUsage``."""
    if not isinstance(schema, pa.Schema):
        raise InvalidUsage(f"schema must be a pyarrow.Schema, not {type(schema).__name__}")
    if len(schema) == 0:
        raise InvalidUsage("schema must have at least one column")
    return _check_fields(storable_schema(schema))  # views, dictionaries: stored as values


def _check_fields(schema: pa.Schema) -> pa.Schema:
    names = schema.names
    if len(set(names)) != len(names):
        raise InvalidUsage(f"schema has duplicate column names: {names}")
    for field in schema:
        if field.name.startswith("_"):
            raise InvalidUsage(
                f"column {field.name!r}: names starting with '_' are reserved for persist"
            )
        # Consolidation sorts rows and compares neighbours: every column must support both.
        probe = pa.nulls(2, field.type)
        try:
            pc.sort_indices(pa.table({"c": probe}), sort_keys=[("c", "ascending")])
            pc.equal(probe.slice(0, 1), probe.slice(1))
        except (pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise InvalidUsage(
                f"column {field.name!r} has type {field.type}, which persist can't sort and "
                f"compare (nested types such as lists, structs and maps aren't supported yet)"
            ) from exc
        problem = _parquet_problem(field.type)
        if problem is not None:
            raise InvalidUsage(
                f"column {field.name!r} has type {field.type}, which persist can't store "
                f"exactly: {problem}"
            )
    return schema.remove_metadata()


@functools.lru_cache(maxsize=256)
def _parquet_problem(t: pa.DataType) -> str | None:
    """Why a part can't hold type ``t`` and read it back as ``t``; None if it can.

    Found by trying: the Parquet writer refuses some types the kernels accept (a zero-width
    fixed_size_binary), and reading maps some to others (``decode_part`` maps those back).
    """
    probe = pa.table({"c": pa.nulls(1, t), DIFF: pa.array([1], pa.int64())})
    try:
        data = encode_part(probe)
        back = decode_part(data, checksum(data), "(probe)")
    except (pa.ArrowException, OSError, IntegrityError) as exc:
        return str(exc)
    if back.schema.field("c").type != t:
        return f"Parquet reads it back as {back.schema.field('c').type}"
    return None


def full_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of stored updates: the data columns, then ``_time`` and ``_diff``."""
    return pa.schema(
        [
            *schema,
            pa.field(TIME, pa.uint64(), nullable=False),
            pa.field(DIFF, pa.int64(), nullable=False),
        ]
    )


def _sort_keys(names: Sequence[str]) -> list[tuple[str, str]]:
    return [(n, "ascending") for n in names]


def adjacent_equal(table: pa.Table, keys: Sequence[str]) -> np.ndarray:
    """``out[i]`` is True when rows ``i`` and ``i + 1`` are equal on ``keys``.

    Rows compare as values, as members of a set: nulls equal nulls and every NaN equals every
    other NaN (whatever its sign or payload), where IEEE equality says a NaN equals nothing.
    That matches the sort's order, which ties all NaNs (after every number) as it ties -0.0 and
    0.0, so equal rows are adjacent once sorted.
    """
    n = table.num_rows
    eq: pa.Array | None = None
    for name in keys:
        col = table.column(name)
        a, b = col.slice(0, n - 1), col.slice(1)
        e = pc.equal(a, b)
        if pa.types.is_floating(col.type):
            nan = pc.is_nan(col)
            if pc.any(nan).as_py():
                # Null where either side is null: the null check below decides those.
                e = pc.or_kleene(e, pc.and_(nan.slice(0, n - 1), nan.slice(1)))
        if col.null_count:
            e = pc.if_else(pc.is_valid(e), e, pc.and_(pc.is_null(a), pc.is_null(b)))
        eq = e if eq is None else pc.and_(eq, e)
    assert eq is not None  # keys is never empty: schemas have a column
    if isinstance(eq, pa.ChunkedArray):
        eq = eq.combine_chunks()
    out: np.ndarray = eq.to_numpy(zero_copy_only=False)
    return out


def consolidate_sorted(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Sums the diffs of adjacent rows equal on ``keys`` and drops zero sums.

    ``table`` must be sorted by ``keys`` (equal rows adjacent).
    """
    n = table.num_rows
    if n == 0:
        return table
    diffs = table.column(DIFF).to_numpy()
    if n > 1:
        same = adjacent_equal(table, keys)
        if same.any():
            starts = np.concatenate(([0], np.flatnonzero(~same) + 1))
            sums = np.add.reduceat(diffs, starts)
            _check_sums(table, diffs, starts)
            keep = sums != 0
            idx = starts[keep]
            out = table.take(pa.array(idx))
            return out.set_column(
                out.schema.get_field_index(DIFF), out.schema.field(DIFF), pa.array(sums[keep])
            )
    return _drop_zero_diffs(table, diffs)


_I64_MAX = 2**63 - 1


def may_overflow(diffs: np.ndarray) -> bool:
    """Whether some run of equal rows among updates with these diffs could sum outside int64
    (rows x the largest magnitude reaches ``2**63``): only then must a write consolidate its
    updates to know it may store them."""
    if len(diffs) == 0:
        return False
    magnitude = max(-int(diffs.min()), int(diffs.max()))
    return len(diffs) * magnitude > _I64_MAX


def drop_zero_diffs(table: pa.Table) -> pa.Table:
    """``table`` without its updates whose diff is zero (they change nothing)."""
    return _drop_zero_diffs(table, table.column(DIFF).to_numpy())


def _check_sums(table: pa.Table, diffs: np.ndarray, starts: np.ndarray) -> None:
    """``DiffOverflow`` if the diffs of a run (``starts``: where runs begin) sum outside int64.

    ``np.add.reduceat`` wraps around; a wrapped sum is still right when the true one fits
    (addition is exact modulo 2**64), so only the total of each run matters. Usually a bound
    rules overflow out at once: no run can reach ``2**63`` when rows x the largest magnitude
    stays below it. Otherwise each run is summed exactly in two halves.
    """
    n = len(diffs)
    if not may_overflow(diffs):
        return
    magnitude = max(-int(diffs.min()), int(diffs.max()))
    lengths = np.diff(starts, append=n)
    if int(lengths.max()) * magnitude <= _I64_MAX:
        return
    # d == high * 2**32 + low with 0 <= low < 2**32: summing each half can't wrap (a run of
    # 2**31 rows would need 32 GiB for its times and diffs alone), and the true sum is
    # (high_sum + carry) * 2**32 + (low_sum mod 2**32), which fits iff high_sum + carry does.
    low = np.add.reduceat(diffs & 0xFFFF_FFFF, starts)
    high = np.add.reduceat(diffs >> 32, starts) + (low >> 32)
    bad = np.flatnonzero((high < -(2**31)) | (high >= 2**31))
    if len(bad):
        run = int(bad[0])
        begin, end = int(starts[run]), int(starts[run]) + int(lengths[run])
        total = sum(int(d) for d in diffs[begin:end])
        try:
            row = _short(table.slice(begin, 1).drop_columns([DIFF]).to_pylist()[0])
        except (pa.ArrowException, ValueError, OverflowError):  # values Python can't hold
            row = f"at position {begin}"
        raise DiffOverflow(
            f"the diffs of {end - begin} updates of the row {row} sum to {total}, "
            f"which does not fit in _diff (int64); persist refuses it rather than wrap around"
        )


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _drop_zero_diffs(table: pa.Table, diffs: np.ndarray) -> pa.Table:
    """``table`` without its rows whose diff (``diffs``, its ``_diff`` column) is zero."""
    zero = diffs == 0
    if zero.any():
        return table.filter(pa.array(~zero))
    return table


def _sort(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    idx = pc.sort_indices(table, sort_keys=_sort_keys(keys))
    # Already sorted input (the common case for keyed appends) costs no copy.
    if np.array_equal(idx.to_numpy(), np.arange(table.num_rows)):
        return table
    return table.take(idx)


def strictly_ascending(column: pa.ChunkedArray) -> bool:
    """Whether ``column`` has no nulls and each value is less than the next."""
    n = len(column)
    if column.null_count:
        return False
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        # numpy: under half the time of the compute kernels on a small append's key column.
        # A NaN compares false both ways, as in ``pc.less``: such a column is sorted to find out.
        values = column.to_numpy()
        return bool(np.all(values[1:] > values[:-1]))
    try:
        ascending = pc.all(pc.less(column.slice(0, n - 1), column.slice(1))).as_py()
    except pa.ArrowNotImplementedError:  # a type without an order kernel: sort to find out
        return False
    return bool(ascending)


def sort_consolidate(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Sorts by ``keys`` and consolidates: each distinct ``keys`` row once, no zero diffs."""
    if table.num_rows <= 1:
        return consolidate_sorted(table, keys)
    if strictly_ascending(table.column(keys[0])):
        # Keyed appends often come in key order: already sorted, and no two rows are equal.
        return _drop_zero_diffs(table, table.column(DIFF).to_numpy())
    return consolidate_sorted(_sort(table, keys), keys)


def _chain_order(tables: Sequence[pa.Table], keys: Sequence[str]) -> list[int] | None:
    """An order in which the (sorted) tables, concatenated, are sorted; None if there is none."""
    if len(tables) == 1:
        return [0]
    firsts = pa.concat_tables([t.select(keys).slice(0, 1) for t in tables])
    order: list[int] = pc.sort_indices(firsts, sort_keys=_sort_keys(keys)).to_pylist()
    ends = pa.concat_tables(
        [
            piece
            for i in order
            for piece in (
                tables[i].select(keys).slice(0, 1),
                tables[i].select(keys).slice(tables[i].num_rows - 1, 1),
            )
        ]
    )
    check = pc.sort_indices(ends, sort_keys=_sort_keys(keys)).to_numpy()
    if np.array_equal(check, np.arange(len(check))):
        return order
    return None


def merge_consolidate(
    tables: Sequence[pa.Table], keys: Sequence[str], *, distinct: bool = False
) -> pa.Table:
    """Consolidates the union of ``tables``, each sorted by ``keys``, into one sorted table.

    ``distinct``: the caller knows that no row appears twice among them and no diff is zero
    (e.g. ``core.read.scan.distinct_rows``), so tables that chain in key order are only
    concatenated."""
    if not tables:
        raise ValueError("merge_consolidate needs at least one table (possibly empty)")
    template = tables[0]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return template
    order = _chain_order(tables, keys)
    if order is not None:
        merged = pa.concat_tables([tables[i] for i in order])
        return merged if distinct else consolidate_sorted(merged, keys)
    return sort_consolidate(pa.concat_tables(tables), keys)


def as_rows(updates: pa.Table, hint: str = "") -> pa.Table:
    """Consolidated updates as the rows they stand for: the data columns, each row repeated by
    its diff. A negative diff (a row retracted more than it was added) raises ``InvalidUsage``
    naming the row, with ``hint`` after it."""
    diff = updates.column(DIFF).to_numpy()
    if diff.size and diff.min() < 0:
        at = int(np.argmin(diff))
        row = updates.slice(at, 1).drop_columns([TIME]).to_pylist()[0]
        raise InvalidUsage(f"row {row} has a negative multiplicity{hint}")
    data = updates.drop_columns([TIME, DIFF])
    if diff.size and diff.max() > 1:
        data = data.take(pa.array(np.repeat(np.arange(len(diff)), diff)))
    return data


def advance_times(table: pa.Table, as_of: int, max_time: int | None = None) -> pa.Table:
    """Keeps the updates at times ``<= as_of`` and moves their times to ``as_of``.

    Sortedness by (data..., time) is kept, as sortedness by data alone.
    """
    if max_time is None or max_time > as_of:
        table = table.filter(pc.less_equal(table.column(TIME), pa.scalar(as_of, pa.uint64())))
    idx = table.schema.get_field_index(TIME)
    return table.set_column(
        idx,
        table.schema.field(TIME),
        pa.array(np.full(table.num_rows, as_of, dtype=np.uint64)),
    )


def advance_to_since(table: pa.Table, since: int) -> pa.Table:
    """Moves times below ``since`` up to ``since``; sortedness by (data..., time) is kept, since
    two rows of the same data keep their relative order."""
    times = table.column(TIME)
    if table.num_rows == 0 or pc.min(times).as_py() >= since:
        return table
    advanced = pc.max_element_wise(times, pa.scalar(since, pa.uint64()))
    return table.set_column(table.schema.get_field_index(TIME), table.schema.field(TIME), advanced)


def filter_times(table: pa.Table, lower: int, upper: int | None) -> pa.Table:
    """The updates with ``lower <= _time < upper``."""
    t = table.column(TIME)
    mask = pc.greater_equal(t, pa.scalar(lower, pa.uint64()))
    if upper is not None:
        mask = pc.and_(mask, pc.less(t, pa.scalar(upper, pa.uint64())))
    return table.filter(mask)


def checksum(data: bytes | memoryview) -> str:
    """A part's checksum: CRC-32, tagged with its name.

    It guards against corruption and misplaced blobs, not against someone who can write the
    blob store (they could rewrite the state as well); CRC-32 runs about four times as fast as
    SHA-256 here, and reads verify every byte. Parts written before carry a bare truncated
    SHA-256 hex digest, which ``decode_part`` still verifies.
    """
    return f"crc32:{zlib.crc32(data):08x}"


def _verified(data: bytes, expected: str) -> bool:
    if expected.startswith("crc32:"):
        return checksum(data) == expected
    return hashlib.sha256(data).hexdigest()[:32] == expected


# The footer key under which a part of several row groups records the first key of each row
# group and then its last key (``core.arrow.keyrange.encode_keys``): a key range finds its row groups.
ROW_GROUP_KEYS = b"persist.row_group_keys"
# The footer key that marks a part as an unsorted run (``encode_part(unsorted=True)``).
UNSORTED = b"persist.unsorted"

# Decoded bytes per row group of a part in blob (``part_row_group_rows``). Parts are read by
# engines with their own Parquet readers as well as by persist, and the two pull apart: each row
# group keeps its own dictionaries, so small groups cost size (a lineitem-like part of 64 MiB
# was 1.36x pyarrow's default file in 1 MiB groups, 1.18x in 8 MiB, 1.12x in 16 MiB, 1.08x in
# 24 MiB ones), while a key range reads whole row groups of the parts it straddles (``fetch``):
# at each end of its range, about one group beyond it per sorted run. (Spark's CPU time was the
# same from 8 MiB groups up.) A part of ``part_target_bytes`` (64 MiB) holds three groups of
# about 21 MiB: some 120,000 rows of lineitem, as DuckDB writes them (122,880 rows).
PART_ROW_GROUP_BYTES = 24 << 20


def part_row_group_rows(rows: int, nbytes: int) -> int:
    """Rows per row group for a part of ``rows`` rows and ``nbytes`` decoded bytes: as few
    groups as hold at most ``PART_ROW_GROUP_BYTES`` each, and at least two once the part is over
    ``keyrange.ROW_GROUP_BYTES``, the size from which a key range reads a part by row group
    (``fetch.by_row_group``)."""
    groups = max(1, -(-nbytes // PART_ROW_GROUP_BYTES))
    if nbytes > keyrange.ROW_GROUP_BYTES:
        groups = max(2, groups)
    return max(1, -(-rows // groups))


# Rows, spread evenly over a part, whose distinct values decide which columns get a dictionary,
# and the bytes those values may take: half pyarrow's dictionary page limit, past which it falls
# back to plain pages in the middle of a column chunk.
_DICTIONARY_SAMPLE_ROWS = 64 * 1024
_DICTIONARY_MAX_BYTES = 1 << 19


def dictionary_columns(table: pa.Table) -> list[str] | bool:
    """The columns of ``table`` worth a dictionary: those whose values repeat (at most half of
    the rows of an evenly spread sample distinct, so that the sample holds about every value
    there is) and whose distinct values fit one dictionary page with room to spare. A column of
    mostly distinct values gains nothing from one, costs its encoder a hash table, and is
    stored as dictionary pages until the page fills and plain ones after it: Spark's reader
    decodes such a mixed column chunk a third slower than a plain one (Spark's own writer
    falls back to plain for the whole chunk). True (every column) when a column is nested:
    its leaves are named by paths this does not judge."""
    n = table.num_rows
    if n > _DICTIONARY_SAMPLE_ROWS:
        at = np.arange(_DICTIONARY_SAMPLE_ROWS, dtype=np.int64) * n // _DICTIONARY_SAMPLE_ROWS
        sample = table.take(pa.array(at))
    else:
        sample = table
    rows = sample.num_rows
    chosen = []
    for name, column in zip(table.column_names, sample.columns, strict=True):
        kind = column.type
        if pa.types.is_nested(kind):
            return True
        if rows == 0 or pa.types.is_boolean(kind) or pa.types.is_null(kind):
            continue
        try:
            distinct = pc.count_distinct(column, mode="all").as_py()
        except pa.ArrowNotImplementedError:
            chosen.append(name)  # a type Arrow can't count: as every column was before
            continue
        try:
            width = max(1, kind.bit_width // 8)
        except ValueError:  # variable width: what a value takes on average
            width = max(1, column.nbytes // rows)
        if distinct * 2 <= rows and distinct * width <= _DICTIONARY_MAX_BYTES:
            chosen.append(name)
    return chosen


def encode_part(
    table: pa.Table,
    *,
    dictionary: bool = True,
    statistics: bool | None = None,
    row_group_rows: int | None = None,
    key_names: Sequence[str] = (),
    page_checksums: bool = True,
    unsorted: bool = False,
) -> bytes:
    """Parquet bytes of a sorted, consolidated part, in row groups of ``row_group_rows`` rows
    (default: one row group), for persist and for engines that read parts themselves.

    ``unsorted``: ``table`` is an unsorted run (any order, rows not consolidated, no zero
    diff); its footer says so (``UNSORTED``), so that ``decode_part`` sorts it, and it records no
    row-group keys (its row groups cover no key range).

    Decimals of up to 18 digits are stored as integers (INT32/INT64), as Spark writes them
    itself: engines read them faster than the fixed-length byte arrays pyarrow writes by
    default, and they decode to the same Arrow type. Every column carries statistics, and a page index, so an engine can skip
    row groups and pages by value (``_time <= as_of`` above all).

    ``dictionary`` gives a dictionary to the columns ``dictionary_columns`` chooses.
    ``dictionary=False`` is the encoding of small parts, which small appends write and
    compaction soon rewrites: no dictionary (a third less encode time) and, unless
    ``statistics``, statistics on ``_time`` only (on every column they would cost a one-row part
    a quarter more bytes and time, and push it past what is written inline). ``statistics``
    (default: as ``dictionary``) writes statistics on every column and the page index.

    Every page carries a CRC-32 checksum: the part's own checksum (of the whole file) guards
    only reads through persist, while a key range reads some row groups of a part and engines
    read parts with their own Parquet readers, which verify pages instead. Given the data
    columns ``key_names``, a part of several row groups records their first keys in its footer
    (``ROW_GROUP_KEYS``), from which a key range finds its row groups. ``page_checksums=False``
    leaves them out (as most parts written before them lack them): for measuring their cost.
    """
    rows = max(table.num_rows, 1)
    group = rows if row_group_rows is None else max(1, min(row_group_rows, rows))
    every = dictionary if statistics is None else statistics
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(
        sink,
        table.schema,
        compression="snappy",
        use_dictionary=dictionary_columns(table) if dictionary else False,
        store_decimal_as_integer=True,
        write_statistics=True if every else [TIME],
        write_page_index=every,
        write_page_checksum=page_checksums,
    ) as writer:
        writer.write_table(table, row_group_size=group)
        if unsorted:
            writer.add_key_value_metadata({UNSORTED: b"1"})
        elif key_names and group < rows:
            at = pa.array([*range(0, rows, group), rows - 1], pa.int64())
            keys = encode_keys(table.select(list(key_names)).take(at))
            writer.add_key_value_metadata({ROW_GROUP_KEYS: keys})
    data: bytes = sink.getvalue().to_pybytes()
    return data


def decode_part(
    data: bytes,
    expected_checksum: str,
    key: str,
    *,
    schema: pa.Schema | None = None,
    use_threads: bool = False,
) -> pa.Table:
    """The table in a part, after verifying its checksum (``IntegrityError`` if it fails).

    Its columns have the types the part was written with: ``schema`` (the shard's full schema)
    when given, else the Arrow schema the part records. Parquet has no seconds unit and keeps
    dates as days, and pyarrow's reader does not undo that, so columns of those types are cast
    back (exactly: ``core.arrow.shaping`` lets in only values that survive the round trip).
    ``use_threads`` decodes its columns in parallel: for reads of fewer parts than cores.
    """
    if not _verified(data, expected_checksum):
        raise IntegrityError(f"blob {key} failed its checksum: it is corrupt or was replaced")
    try:
        # ParquetFile reads a small part in a quarter of read_table's time (no dataset layer).
        # Its pages go unverified: the part's checksum has just covered every byte of them.
        file = pq.ParquetFile(pa.BufferReader(data))
        table = _typed(file, file.read(use_threads=use_threads), schema)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise IntegrityError(f"blob {key} could not be decoded as Parquet: {exc}") from exc
    return _as_sorted_run(file, table)


def _as_sorted_run(file: pq.ParquetFile, table: pa.Table) -> pa.Table:
    """A decoded part as a sorted run: sorted and consolidated when its footer marks it as an
    unsorted run (``DiffOverflow`` if equal updates sum outside int64)."""
    if UNSORTED not in (file.metadata.metadata or {}):
        return table
    return sort_consolidate(table, [n for n in table.column_names if n != DIFF])


def decode_row_groups(
    source: object, groups: Sequence[int], key: str, *, schema: pa.Schema | None = None
) -> pa.Table:
    """The rows of some row groups of a part (``source``: a file-like object over its bytes, or
    the parts of them these row groups and the footer need), each page verified by its
    checksum (``IntegrityError`` if one fails). Typed as ``decode_part``'s."""
    try:
        file = pq.ParquetFile(source, pre_buffer=False, page_checksum_verification=True)
        table = _typed(file, file.read_row_groups(list(groups)), schema)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise IntegrityError(f"blob {key}'s row groups could not be decoded: {exc}") from exc
    # Only parts with a key index are read by row group, and an unsorted run has none; sorted
    # anyway, so that no reader is ever handed rows out of order.
    return _as_sorted_run(file, table)


def _typed(file: pq.ParquetFile, table: pa.Table, schema: pa.Schema | None) -> pa.Table:
    target = schema if schema is not None else _written_schema(file, table.schema)
    # Types, and nullability: a reader a later version let nulls in to is shown nullable.
    if not table.schema.equals(target):
        table = table.cast(target)
    if table.schema.metadata:  # the footer's row-group keys are not the shard's
        table = table.replace_schema_metadata(None)
    return table


def _written_schema(file: pq.ParquetFile, decoded: pa.Schema) -> pa.Schema:
    """The Arrow schema of the table a part was written from (pyarrow records it in the file)."""
    if not any(_parquet_read_as(t) for t in decoded.types):
        return decoded
    recorded = (file.metadata.metadata or {}).get(b"ARROW:schema")
    if recorded is None:  # not written by pyarrow: nothing better to go by
        return decoded
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(recorded)))


def _parquet_read_as(t: pa.DataType) -> bool:
    """Whether ``t`` may be what pyarrow reads back for a type ``core.arrow.shaping`` range-checks."""
    return bool(
        t == pa.date32() or ((pa.types.is_timestamp(t) or pa.types.is_time32(t)) and t.unit == "ms")
    )
