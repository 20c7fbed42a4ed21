"""How parts are encoded for engines as well as for persist, and that what was written before
(parts in the older encoding, states without diff bounds) still reads."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist.core.arrow import keyrange
from persist.core.arrow import updates as up

# STATE_IMPORT#
from persist.core.arrow.keyrange import encode_keys
from persist.core.read.scan import Consolidation, plan_scan
from persist.core.shard import codec
from persist.core.shard.types import PartRef
from tests.damaged import flip_in_data_page, random_values

GOLDEN = Path(__file__).parent / "golden"
SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("price", pa.decimal128(15, 2)),
        ("qty", pa.decimal128(5, 2)),
        ("big", pa.decimal128(30, 4)),
        ("s", pa.string()),
    ]
)
NAMES = SCHEMA.names


def part(n: int) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "price": pa.array([Decimal(i) / 100 for i in range(n)], pa.decimal128(15, 2)),
            "qty": pa.array([Decimal(i % 500) / 10 for i in range(n)], pa.decimal128(5, 2)),
            "big": pa.array([Decimal(i) * 10**20 for i in range(n)], pa.decimal128(30, 4)),
            "s": pa.array([f"s{i % 13}" for i in range(n)]),
            up.TIME: pa.array([3] * n, pa.uint64()),
            up.DIFF: pa.array([1] * n, pa.int64()),
        },
        schema=up.full_schema(SCHEMA),
    )


def physical(meta: pq.FileMetaData) -> dict[str, str]:
    return {meta.schema.column(i).name: meta.schema.column(i).physical_type for i in range(7)}


def test_parts_store_decimals_as_integers_with_statistics_everywhere() -> None:
    t = part(2000)
    data = up.encode_part(t, row_group_rows=700, key_names=NAMES)
    meta = pq.read_metadata(pa.BufferReader(data))
    assert physical(meta) == {
        "k": "INT64",
        "price": "INT64",
        "qty": "INT32",
        "big": "FIXED_LEN_BYTE_ARRAY",  # over 18 digits: no integer holds it
        "s": "BYTE_ARRAY",
        "_time": "INT64",
        "_diff": "INT64",
    }
    assert meta.num_row_groups == 3
    for g in range(3):
        group = meta.row_group(g)
        assert all(group.column(i).is_stats_set for i in range(7))
    assert meta.row_group(1).column(0).statistics.min == 700
    assert up.ROW_GROUP_KEYS in (meta.metadata or {})
    back = up.decode_part(data, up.checksum(data), "p", schema=up.full_schema(SCHEMA))
    assert back.equals(t)
    # The page index is there for engines that skip pages by value.
    file = pq.ParquetFile(pa.BufferReader(data))
    assert file.metadata.row_group(0).column(0).has_offset_index


def test_small_parts_keep_their_cheap_encoding() -> None:
    t = part(3)
    data = up.encode_part(t, dictionary=False)
    meta = pq.read_metadata(pa.BufferReader(data))
    group = meta.row_group(0)
    stats = {meta.schema.column(i).name: group.column(i).is_stats_set for i in range(7)}
    assert stats == {n: n == up.TIME for n in up.full_schema(SCHEMA).names}
    assert not any(group.column(i).has_dictionary_page for i in range(7))
    assert physical(meta)["price"] == "INT64"
    assert up.decode_part(data, up.checksum(data), "p").equals(t)


def test_parts_without_dictionaries_can_keep_statistics_everywhere() -> None:
    """The encoding of small merge outputs (``compact.PLAIN_OUTPUT_BYTES``): engines skip by
    value as in a full part, only the dictionaries are left out."""
    t = part(2000)
    data = up.encode_part(t, dictionary=False, statistics=True, row_group_rows=700)
    meta = pq.read_metadata(pa.BufferReader(data))
    for g in range(3):
        group = meta.row_group(g)
        assert all(group.column(i).is_stats_set for i in range(7))
        assert not any(group.column(i).has_dictionary_page for i in range(7))
        assert all(group.column(i).has_offset_index for i in range(7))
    assert up.decode_part(data, up.checksum(data), "p", schema=up.full_schema(SCHEMA)).equals(t)


def old_encoding(table: pa.Table, group: int) -> bytes:
    """A part as persist wrote them before: decimals as fixed-length byte arrays, statistics on
    ``_time`` only, 16 KiB dictionary pages, no page index."""
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(
        sink,
        table.schema,
        compression="snappy",
        write_statistics=[up.TIME],
        write_page_checksum=True,
        dictionary_pagesize_limit=16 << 10,
    ) as writer:
        writer.write_table(table, row_group_size=group)
        at = pa.array([*range(0, table.num_rows, group), table.num_rows - 1], pa.int64())
        writer.add_key_value_metadata(
            {up.ROW_GROUP_KEYS: encode_keys(table.select(NAMES).take(at))}
        )
    return bytes(sink.getvalue().to_pybytes())


def test_parts_in_the_older_encoding_still_decode() -> None:
    t = part(2000)
    data = old_encoding(t, 500)
    assert physical(pq.read_metadata(pa.BufferReader(data)))["price"] == "FIXED_LEN_BYTE_ARRAY"
    full = up.full_schema(SCHEMA)
    assert up.decode_part(data, up.checksum(data), "old", schema=full).equals(t)
    assert up.decode_part(data, up.checksum(data), "old").equals(t)
    some = up.decode_row_groups(pa.BufferReader(data), [1, 2], "old", schema=full)
    assert some.equals(t.slice(500, 1000))


def test_row_groups_are_large_but_a_key_range_can_still_skip_some() -> None:
    mib = 1 << 20
    target = up.PART_ROW_GROUP_BYTES
    assert up.part_row_group_rows(1000, 100 << 10) == 1000  # small: one group
    # Over keyrange.ROW_GROUP_BYTES, at least two (a key range reads such a part by group).
    assert up.part_row_group_rows(1000, keyrange.ROW_GROUP_BYTES + 1) == 500
    assert up.part_row_group_rows(1000, target) == 500
    # A part of part_target_bytes (64 MiB) in groups of about the target.
    rows = up.part_row_group_rows(640_000, 64 * mib)
    assert rows == -(-640_000 // -(-64 * mib // target))
    assert 0.5 * target <= rows * (64 * mib / 640_000) <= target


# --- states written before the diff bounds ----------------------------------------------------


def test_states_written_before_diff_bounds_decode_with_them_unknown() -> None:
    state = codec.decode_rollup((GOLDEN / "rollup_v1.bin").read_bytes())
    (batch,) = state.batches.values()
    (ref,) = batch.parts
    assert (ref.min_diff, ref.max_diff) == (None, None)
    # Nothing is known of its diffs, and its times (0 to 4) may hold a row twice: a scan sums.
    scan = plan_scan(state, 4)
    assert scan.min_diff is None and scan.max_diff is None
    assert scan.contents is Consolidation.SUM and scan.updates is Consolidation.SUM
    diff = codec.decode_diff((GOLDEN / "diff_v1.bin").read_bytes())
    (_, added) = diff.batches[0]
    assert added is not None and added.parts[0].min_diff is None


class _PartRefBefore(msgspec.Struct, frozen=True, array_like=True):
    """``PartRef`` as readers before the diff bounds knew it."""

    key: str
    rows: int
    size: int
    checksum: str
    min_time: int
    max_time: int
    nbytes: int = 0
    inline: bytes = b""
    key_index: bytes = b""


def test_states_with_diff_bounds_decode_for_readers_that_predate_them() -> None:
    ref = PartRef("s/w/x/b-00000", 3, 100, "crc32:00000000", 0, 4, 99, b"", b"ix", -1, 2)
    data = msgspec.msgpack.encode(ref)
    before = msgspec.msgpack.decode(data, type=_PartRefBefore)
    assert (before.key, before.max_time, before.key_index) == (ref.key, 4, b"ix")
    assert msgspec.msgpack.decode(data, type=PartRef) == ref
    # And the older encoding reads as unknown bounds.
    old = msgspec.msgpack.encode(before)
    assert msgspec.msgpack.decode(old, type=PartRef) == msgspec.structs.replace(
        ref, min_diff=None, max_diff=None
    )


@pytest.mark.parametrize("n", [1, 2])
def test_a_one_row_part_stays_small_enough_to_write_inline(n: int) -> None:
    # A one-row append of a few columns must stay within the 4 KiB written inline.
    data = up.encode_part(part(n).select(["k", "s", up.TIME, up.DIFF]), dictionary=False)
    assert len(data) <= 4096


@pytest.mark.parametrize("dictionary", [True, False])
def test_a_damaged_part_fails_page_verification_and_never_reads_as_other_rows(
    dictionary: bool,
) -> None:
    # Every part carries page checksums, a part of one row group too: an engine that verifies
    # them (as persist's native reads do) fails on a flipped bit in any page instead of
    # answering other rows. The whole-file CRC only guards reads through persist.
    t = part(4000).append_column("x", random_values(4000))
    data = up.encode_part(t, dictionary=dictionary)
    assert pq.read_metadata(pa.BufferReader(data)).num_row_groups == 1
    with pytest.raises(OSError, match="CRC checksum verification failed"):
        pq.read_table(pa.BufferReader(flip_in_data_page(data)), page_checksum_verification=True)
    # A flip anywhere in the pages (their headers are not checksummed, and may still parse):
    # the verified read fails or answers the same rows, never others.
    group = pq.read_metadata(pa.BufferReader(data)).row_group(0)
    chunks = [group.column(i) for i in range(group.num_columns)]
    starts = [
        c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks
    ]
    start = min(starts)
    end = max(at + c.total_compressed_size for at, c in zip(starts, chunks, strict=True))
    wrong = []
    for at in range(start, end, 97):
        damaged = bytearray(data)
        damaged[at] ^= 0x10
        try:
            back = pq.read_table(pa.BufferReader(bytes(damaged)), page_checksum_verification=True)
        except (OSError, pa.ArrowException):
            continue
        if not back.equals(t):
            wrong.append(at)
    assert wrong == []


def test_only_columns_whose_values_repeat_get_a_dictionary() -> None:
    """Spark's reader decodes a column chunk of dictionary pages then plain ones (pyarrow's
    fallback once the dictionary page fills) a third slower than a plain one: a column of
    mostly distinct values is written plain, one whose values repeat with a dictionary."""
    n = 100_000
    table = pa.table(
        {
            "key": pa.array(range(n), pa.int64()),
            "group": pa.array([i % 100 for i in range(n)], pa.int64()),
            "tag": pa.array([f"tag-{i % 7}" for i in range(n)], pa.string()),
            # Repeating, but 10,000 distinct values of 200 bytes overflow one dictionary page.
            "blob": pa.array([f"{i % 10_000:0200d}" for i in range(n)], pa.string()),
            "flag": pa.array([i % 2 == 0 for i in range(n)], pa.bool_()),
        }
    )
    assert up.dictionary_columns(table) == ["group", "tag"]
    nested = table.append_column("xs", pa.array([[i] for i in range(n)], pa.list_(pa.int64())))
    assert up.dictionary_columns(nested) is True
    meta = pq.read_metadata(pa.BufferReader(up.encode_part(table)))
    has_dictionary = {
        meta.schema.column(i).name: meta.row_group(0).column(i).has_dictionary_page
        for i in range(meta.num_columns)
    }
    assert has_dictionary == {
        "key": False, "group": True, "tag": True, "blob": False, "flag": False
    }  # fmt: skip
