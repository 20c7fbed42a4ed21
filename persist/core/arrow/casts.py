"""Which Arrow types persist takes in place of a shard's type, because converting loses nothing.

Tools hand over the same data in different clothes: Polars and DuckDB give ``large_string`` or
``string_view``, pyarrow reads ``tpchgen-cli`` files as views, Parquet readers give dictionary
columns, one library says ``Etc/UTC`` where another says ``UTC``, one writes timestamps in
seconds where the shard keeps microseconds. Every write path (through
``core.arrow.shaping``) and ``open`` (``client``) accept a type that ``lossless`` says converts
without changing a value; anything else stays refused, naming the column and both types.
Pure: no I/O.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = ["differences", "lossless", "refusal", "storable", "storable_schema"]

# Names of the UTC zone that different libraries write (IANA links and aliases).
_UTC = frozenset(
    {
        "utc",
        "etc/utc",
        "z",
        "+00:00",
        "gmt",
        "etc/gmt",
        "zulu",
        "etc/zulu",
        "uct",
        "etc/uct",
        "universal",
        "etc/universal",
        "etc/gmt+0",
        "etc/gmt-0",
        "etc/gmt0",
        "gmt0",
    }
)


# Timestamp units, coarsest first: a value in one is a whole number of any finer one.
_UNITS = ("s", "ms", "us", "ns")
_UNIT_WORDS = {"s": "second", "ms": "millisecond", "us": "microsecond", "ns": "nanosecond"}


def _same_zone(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (a.lower() in _UTC and b.lower() in _UTC)


def _int_fits(src: pa.DataType, dst: pa.DataType) -> bool:
    if not (pa.types.is_integer(src) and pa.types.is_integer(dst)):
        return False
    if pa.types.is_signed_integer(src) and not pa.types.is_signed_integer(dst):
        return False
    src_bits, dst_bits = int(src.bit_width), int(dst.bit_width)
    if pa.types.is_unsigned_integer(src) and pa.types.is_signed_integer(dst):
        return dst_bits > src_bits
    return dst_bits >= src_bits


def lossless(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether every value of type ``src`` converts to ``dst`` unchanged (and so is taken
    where a shard's column has type ``dst``). A coarser timestamp unit is taken into a finer
    one: its values are whole numbers of the finer unit, but the finer unit's int64 reaches
    less far (nanoseconds end in the year 2262), so converting may still refuse a value out
    of that range."""
    if src == dst:
        return True
    if pa.types.is_dictionary(src):
        return lossless(src.value_type, dst)
    if pa.types.is_dictionary(dst):
        return False
    text = (pa.string(), pa.large_string(), pa.string_view())
    binary = (pa.binary(), pa.large_binary(), pa.binary_view())
    if (src in text and dst in text) or (src in binary and dst in binary):
        return True
    if _int_fits(src, dst):
        return True
    if pa.types.is_floating(src) and pa.types.is_floating(dst):
        return bool(dst.bit_width >= src.bit_width)
    if pa.types.is_decimal(src) and pa.types.is_decimal(dst):
        # Same or more fraction digits, and as many integer digits: every value fits as is.
        return bool(
            dst.scale >= src.scale and dst.precision - dst.scale >= src.precision - src.scale
        )
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        return _UNITS.index(src.unit) <= _UNITS.index(dst.unit) and _same_zone(src.tz, dst.tz)
    if pa.types.is_list(dst) or pa.types.is_large_list(dst):
        if pa.types.is_list(src) or pa.types.is_large_list(src) or pa.types.is_list_view(src):
            return lossless(src.value_type, dst.value_type)
        return False
    if pa.types.is_struct(src) and pa.types.is_struct(dst):
        if [f.name for f in src] != [f.name for f in dst]:
            return False
        return all(lossless(a.type, b.type) for a, b in zip(src, dst, strict=True))
    return False


def refusal(src: pa.DataType, dst: pa.DataType) -> str:
    """Why data of type ``src`` is not taken where a shard's column has type ``dst`` (for a
    pair ``lossless`` refuses), as a clause for a message that has named both types."""
    if pa.types.is_dictionary(src):
        return refusal(src.value_type, dst)
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        if (src.tz is None) != (dst.tz is None):
            return (
                "one has a time zone and the other has none, so the same value would stand "
                "for another instant (give the data the shard's time zone, or none)"
            )
        if not _same_zone(src.tz, dst.tz):
            return (
                f"their time zones differ ({src.tz} and {dst.tz}); convert the data to "
                f"{dst.tz} first"
            )
        return (
            f"{src.unit} is a finer unit than {dst.unit}: storing the values as {dst} would "
            f"drop what lies below a {_UNIT_WORDS[dst.unit]} (persist converts a timestamp "
            f"only into the same or a finer unit)"
        )
    return (
        "persist converts only where no value can change: views, large and dictionary types "
        "to plain ones, narrower integers, floats and decimals to wider ones, timestamps to "
        "a finer unit, a time zone's aliases"
    )


def storable(t: pa.DataType) -> pa.DataType:
    """The type a shard stores for data given as ``t``: views and dictionaries as their plain
    values (a shard's schema holds no view or dictionary type), the rest as they are."""
    if pa.types.is_dictionary(t):
        return storable(t.value_type)
    if t == pa.string_view():
        return pa.string()
    if t == pa.binary_view():
        return pa.binary()
    return t


def storable_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with ``storable`` types (names, nullability and metadata kept)."""
    return pa.schema([f.with_type(storable(f.type)) for f in schema], metadata=schema.metadata)


def differences(given: pa.Schema, stored: pa.Schema) -> list[str]:
    """Why data of schema ``given`` can't be taken as a shard's ``stored`` schema, field by
    field (empty: it can: the same names, in any order, each type ``lossless``; a nullable
    column fills a NOT NULL one if its data holds no null, checked when written)."""
    problems: list[str] = []
    have = {f.name: f for f in given}
    for f in stored:
        g = have.pop(f.name, None)
        if g is None:
            problems.append(f"column {f.name!r} ({f.type}) is missing")
        elif not lossless(g.type, f.type):
            problems.append(f"column {f.name!r} is {g.type}, the shard's is {f.type}")
    problems += [f"column {n!r} ({g.type}) is not in the shard" for n, g in have.items()]
    return problems
