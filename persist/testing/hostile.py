"""Hostile arguments for persist's public calls: wrong types, extreme sizes and values, forged
bytes. Each strategy draws valid values too (often), so a call gets past its first check and
the hostile argument meets the deeper ones.

A call given any of them must either accept it (and then its data reads back exactly) or refuse
it with ``InvalidUsage``; and the shard must still open and read afterwards, for everyone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from hypothesis import strategies as st

from persist.testing.strategies import values

__all__ = [
    "HUGE_TEXT",
    "config_overrides",
    "forged",
    "frontiers",
    "junk",
    "purposes",
    "schemas_to_round_trip",
    "shard_ids",
    "update_tables",
]


class _Huge(str):
    """A long string that prints short (in Hypothesis's reports of a failing example)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"'{self[:1]}' * {len(self)}"


HUGE_TEXT: str = _Huge("x" * 5_000_000)
"""A 5 MB string: larger than anything the state should take in."""

_BIG_INTS = [-1, -(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.5, 1e300]


class _Opaque:
    """An object persist has never heard of."""

    def __repr__(self) -> str:
        return "<opaque>"


def junk() -> st.SearchStrategy[object]:
    """Values of the wrong type or out of range for almost any argument."""
    return st.one_of(
        st.sampled_from(_BIG_INTS),
        st.sampled_from(_FLOATS),
        st.sampled_from([None, True, False, b"", b"\xff\x00", "", "\ud800", HUGE_TEXT]),
        st.builds(_Opaque),
        st.lists(st.integers(0, 3), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    )


def frontiers(valid: st.SearchStrategy[int | None]) -> st.SearchStrategy[object]:
    """A frontier argument: mostly ``valid`` (so the call's other arguments get checked too),
    junk otherwise."""
    return st.one_of(valid, valid, valid, junk())


def purposes() -> st.SearchStrategy[object]:
    return st.one_of(
        st.text(max_size=8),
        st.just(_Huge("p" * 10_000)),
        junk(),
    )


def shard_ids(valid: str) -> st.SearchStrategy[object]:
    """``valid`` or a string/object that is no shard id (or an id of no shard)."""
    return st.one_of(
        st.just(valid),
        st.sampled_from(["", "s", "s" + "0" * 36, valid.upper(), valid + "\ud800", valid[:-1]]),
        junk(),
    )


def forged(data: bytes) -> st.SearchStrategy[object]:
    """Bytes posing as ``data``: truncated, flipped, extended, or nothing like it."""

    def flip(at: int) -> bytes:
        if not data:
            return b"\x00"
        i = at % len(data)
        return data[:i] + bytes([data[i] ^ 0x41]) + data[i + 1 :]

    return st.one_of(
        st.integers(0, max(0, len(data) - 1)).map(lambda n: data[:n]),
        st.integers(0, 10**6).map(flip),
        st.just(data + b"\x00"),
        st.binary(max_size=40),
        st.sampled_from([b"\x80", b"\xc0", b"\x91\xc0", b"\xde\x00\x00", b"\x93\x01\x02\x03"]),
        junk(),
    )


def schemas_to_round_trip() -> st.SearchStrategy[pa.Schema]:
    """Schemas of types a user may well store, beyond those ``strategies.schemas`` draws."""
    types = [
        pa.timestamp("s", tz="UTC"),
        pa.timestamp("ms", tz="Europe/Paris"),
        pa.timestamp("ns"),
        pa.date64(),
        pa.time32("s"),
        pa.time64("us"),
        pa.duration("ms"),
        pa.float16(),
        pa.large_binary(),
        pa.decimal128(38, 0),
        pa.dictionary(pa.int32(), pa.string()),
        pa.list_(pa.int64()),
        pa.struct([("a", pa.int64())]),
        pa.null(),
    ]
    return st.builds(
        # pyarrow refuses a non-nullable field of the null type.
        lambda t, nullable: pa.schema([pa.field("v", t, nullable or t == pa.null())]),
        st.sampled_from(types),
        st.booleans(),
    )


def _hostile_value(dtype: pa.DataType) -> st.SearchStrategy[object]:
    """Legal values of ``dtype`` at its edges: NaN, inf, -0.0, empty and huge strings."""
    if pa.types.is_floating(dtype):
        return st.sampled_from(_FLOATS)
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return st.sampled_from(["", "\x00", "é中", _Huge("y" * 1_000_000)])
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
        return st.sampled_from([b"", b"\x00" * 3, b"\xff" * 100_000])
    return values(dtype)


@st.composite
def update_tables(
    draw: st.DrawFn, schema: pa.Schema, lower: int, upper: int | None
) -> tuple[object, str]:
    """Something passed as updates, and what is hostile about it (``"valid"`` if nothing):
    edge values in every column, bad ``_time`` / ``_diff`` columns, missing, extra and
    mistyped columns, diffs that overflow int64 when summed, or no table at all."""
    hi = lower + 3 if upper is None else upper
    n = draw(st.integers(0, 3))
    cols: dict[str, pa.Array] = {}
    for f in schema:
        vals = draw(
            st.lists(
                st.one_of(_hostile_value(f.type), st.none() if f.nullable else values(f.type)),
                min_size=n,
                max_size=n,
            )
        )
        cols[f.name] = pa.array(vals, f.type)
    # Times must fit uint64 (a bound drawn hostile may lie beyond it; then there are none).
    hi = min(hi, 2**64)
    times = draw(st.lists(st.integers(lower, max(lower, hi - 1)), min_size=n, max_size=n))
    if hi <= lower:
        n, times = 0, []
        cols = {k: v.slice(0, 0) for k, v in cols.items()}
    cols["_time"] = pa.array(times, pa.uint64())
    cols["_diff"] = pa.array(draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)), pa.int64())
    kind = draw(
        st.sampled_from(
            [
                *["valid"] * 8,
                "no _diff",
                "_time int64",
                "_time negative",
                "_time float",
                "_time string",
                "_time null",
                "_time out of range",
                "_diff int32",
                "_diff uint64 huge",
                "_diff null",
                "_diff float",
                "_diff overflow",
                "missing column",
                "extra column",
                "reserved column",
                "mistyped column",
                "columns reordered",
                "record batch",
                "not a table",
            ]
        )
    )
    edits: dict[str, Callable[[], Any]] = {
        "no _diff": lambda: cols.pop("_diff"),
        "_time int64": lambda: cols.update(_time=pa.array(times, pa.int64())),
        "_time negative": lambda: cols.update(_time=pa.array([-1] * n, pa.int64())),
        "_time float": lambda: cols.update(_time=pa.array([float(t) for t in times])),
        "_time string": lambda: cols.update(_time=pa.array([str(t) for t in times])),
        "_time null": lambda: cols.update(_time=pa.array([None] * n, pa.uint64())),
        "_time out of range": lambda: cols.update(_time=pa.array([2**64 - 1] * n, pa.uint64())),
        "_diff int32": lambda: cols.update(_diff=pa.array([1] * n, pa.int32())),
        "_diff uint64 huge": lambda: cols.update(_diff=pa.array([2**64 - 1] * n, pa.uint64())),
        "_diff null": lambda: cols.update(_diff=pa.array([None] * n, pa.int64())),
        "_diff float": lambda: cols.update(_diff=pa.array([math.nan] * n)),
        "_diff overflow": lambda: cols.update(_diff=pa.array([2**63 - 1] * n, pa.int64())),
        "missing column": lambda: cols.pop(schema.names[0]),
        "extra column": lambda: cols.update(extra=pa.array([1] * n)),
        "reserved column": lambda: cols.update(_extra=pa.array([1] * n)),
        "mistyped column": lambda: cols.update({schema.names[0]: pa.array(["z"] * n)}),
    }
    if kind in edits:
        edits[kind]()
    if kind == "columns reordered":
        cols = dict(reversed(list(cols.items())))
    if kind == "not a table":
        return draw(st.one_of(junk(), st.just({k: v.to_pylist() for k, v in cols.items()}))), kind
    table = pa.table(cols)
    if kind == "record batch":
        return table.to_batches()[0] if table.num_rows else table, kind
    return table, kind


def config_overrides() -> st.SearchStrategy[dict[str, object]]:
    """``PersistConfig`` keyword arguments, one of them hostile (a clock returning a float, a
    negative lease, ...)."""
    names = [
        "lease_duration_s",
        "heartbeat_interval_s",
        "poll_interval_s",
        "rollup_interval",
        "part_target_bytes",
        "io_concurrency",
        "compaction_enabled",
        "retry_attempts",
        "retry_initial_delay_s",
    ]
    clocks: list[Callable[[], object]] = [
        lambda: 1.7e12,
        lambda: -5,
        lambda: 2**64,
        lambda: None,
        lambda: "now",
        lambda: True,
        lambda: math.nan,
    ]
    return st.one_of(
        st.builds(lambda n, v: {n: v}, st.sampled_from(names), junk()),
        st.builds(lambda c: {"now_ms": c}, st.sampled_from(clocks)),
        st.just({"now_ms": 5}),
        st.just({"lease_duration_s": -1.0}),
        st.just({"lease_duration_s": 1e-9}),
        st.just({"lease_duration_s": 1e300}),
    )
