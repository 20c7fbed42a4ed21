"""core.arrow.casts: which types are taken for a shard's, because converting loses nothing."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pytest

from persist.core.arrow.casts import differences, lossless, storable_schema

TAKEN = [
    (pa.array(["a", None, "é"], pa.large_string()), pa.string()),
    (pa.array(["a", None, "é"], pa.string_view()), pa.string()),
    (pa.array(["a", None, "é"], pa.string()), pa.large_string()),
    (pa.array([b"a", None, b"\x00"], pa.large_binary()), pa.binary()),
    (pa.array([b"a", None, b"\x00"], pa.binary_view()), pa.binary()),
    (pa.array(["a", None, "a"]).dictionary_encode(), pa.string()),
    (pa.array(["a", None], pa.large_string()).dictionary_encode(), pa.string()),
    (pa.array([-128, None, 127], pa.int8()), pa.int64()),
    (pa.array([0, None, 255], pa.uint8()), pa.int16()),
    (pa.array([0, None, 2**32 - 1], pa.uint32()), pa.int64()),
    (pa.array([0, None, 2**16 - 1], pa.uint16()), pa.uint64()),
    (pa.array([0.1, None, float("inf")], pa.float32()), pa.float64()),
    (pa.array([Decimal("12345678.91"), None], pa.decimal128(10, 2)), pa.decimal128(12, 2)),
    (pa.array([Decimal("-12345678.91"), None], pa.decimal128(10, 2)), pa.decimal128(11, 3)),
    (pa.array([Decimal("0.01"), None], pa.decimal128(10, 2)), pa.decimal256(40, 2)),
    (
        pa.array([0, None, 1_700_000_000_000_000], pa.timestamp("us", "Etc/UTC")),
        pa.timestamp("us", "UTC"),
    ),
    (pa.array([0, None], pa.timestamp("ms", "Etc/GMT")), pa.timestamp("ms", "UTC")),
    (pa.array([["a"], None, []], pa.large_list(pa.large_string())), pa.list_(pa.string())),
    # A coarser timestamp unit into a finer one, the zone kept (or an alias of it).
    (pa.array([-1, None, 1_700_000_000], pa.timestamp("s")), pa.timestamp("us")),
    (pa.array([-1, None, 1_700_000_000_123], pa.timestamp("ms", "UTC")), pa.timestamp("ns", "UTC")),
    (pa.array([0, None, 1_700_000_000], pa.timestamp("s", "Etc/UTC")), pa.timestamp("ms", "UTC")),
    (
        pa.array([0, None, 1_700_000_000_123_456], pa.timestamp("us", "Europe/Paris")),
        pa.timestamp("ns", "Europe/Paris"),
    ),
]
REFUSED = [
    (pa.int64(), pa.int32()),
    (pa.int8(), pa.uint64()),
    (pa.uint64(), pa.int64()),
    (pa.float64(), pa.float32()),
    (pa.int64(), pa.float64()),
    (pa.decimal128(10, 2), pa.decimal128(10, 3)),
    (pa.decimal128(10, 2), pa.decimal128(9, 1)),
    (pa.timestamp("us", "UTC"), pa.timestamp("ms", "UTC")),
    (pa.timestamp("us", "UTC"), pa.timestamp("us", "Europe/Paris")),
    (pa.timestamp("us"), pa.timestamp("us", "UTC")),
    (pa.timestamp("ns"), pa.timestamp("s")),
    (pa.timestamp("ms", "UTC"), pa.timestamp("s", "UTC")),
    (pa.timestamp("s"), pa.timestamp("us", "UTC")),
    (pa.timestamp("s", "UTC"), pa.timestamp("ns")),
    (pa.timestamp("s", "UTC"), pa.timestamp("ms", "Europe/Paris")),
    (pa.string(), pa.binary()),
    (pa.string(), pa.dictionary(pa.int32(), pa.string())),
    (pa.int32(), pa.string()),
]


@pytest.mark.parametrize(("array", "dst"), TAKEN, ids=str)
def test_taken_and_every_value_survives(array: pa.Array, dst: pa.DataType) -> None:
    assert lossless(array.type, dst)
    back = array.cast(dst)
    assert back.type == dst and back.to_pylist() == array.to_pylist()


@pytest.mark.parametrize(("src", "dst"), REFUSED, ids=str)
def test_refused(src: pa.DataType, dst: pa.DataType) -> None:
    assert not lossless(src, dst)


def test_schemas_store_plain_types_and_differences_name_the_fields() -> None:
    given = pa.schema(
        [
            pa.field("k", pa.int64(), nullable=False),
            ("v", pa.string_view()),
            ("d", pa.dictionary(pa.int32(), pa.large_string())),
        ]
    )
    stored = storable_schema(given)
    assert stored.types == [pa.int64(), pa.string(), pa.large_string()]
    assert not stored.field("k").nullable
    assert differences(given, stored) == []
    # Nullability is the data's business (checked when written), not a difference.
    assert differences(pa.schema([("k", pa.int32()), ("v", pa.string())]), stored) == [
        "column 'd' (large_string) is missing",
    ]
    wrong = pa.schema(
        [("k", pa.string()), ("v", pa.string()), ("d", pa.string()), ("x", pa.int8())]
    )
    assert differences(wrong, stored) == [
        "column 'k' is string, the shard's is int64",
        "column 'x' (int8) is not in the shard",
    ]
