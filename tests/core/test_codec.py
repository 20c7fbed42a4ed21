"""State encodings: roundtrips, corruption is refused, and every version ever written decodes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st_

from persist.core.shard import codec
from persist.core.shard.diff import StateDiff, apply_diff
from persist.core.shard.types import (
    HollowBatch,
    PartRef,
    ReaderState,
    RollupRef,
    SchemaVersion,
    State,
    WriterState,
)
from persist.errors import IntegrityError
from persist.internal.batch import Batch
from persist.internal.fetch import Split

GOLDEN = Path(__file__).parent / "golden"


def golden_state() -> State:
    """A state exercising every field; its v1 bytes are frozen in golden/rollup_v1.bin."""
    part = PartRef("s/w/wid/bid/00000", 3, 1234, "ab" * 16, 0, 4)
    return State(
        shard_id="s00000000-0000-0000-0000-000000000001",
        seqno=9,
        schema=b"\x01\x02schema",
        since=2,
        upper=5,
        writers={"w1": WriterState("ingest", 60_000, 1_700_000_000_000, "t1", 5)},
        readers={"r1": ReaderState("query", 2, 7, 60_000, 1_700_000_000_000)},
        batches={"b1": HollowBatch("b1", 0, 5, 0, (part,))},
        rollups={1: RollupRef(1, "s/rollup/1"), 8: RollupRef(8, "s/rollup/8")},
        finalized=False,
    )


def golden_diff() -> StateDiff:
    part = PartRef("s/w/wid/b2/00000", 1, 99, "cd" * 16, 5, 5)
    return StateDiff(
        shard_id="s00000000-0000-0000-0000-000000000001",
        seqno_from=9,
        seqno_to=10,
        latest_rollup=RollupRef(8, "s/rollup/8"),
        upper=[6],
        writers=[("w1", WriterState("ingest", 60_000, 1_700_000_000_500, "t2", 6))],
        batches=[("b2", HollowBatch("b2", 5, 6, 0, (part,)))],
        readers=[("r9", None)],
    )


def test_golden_v1_rollup_still_decodes() -> None:
    assert codec.decode_rollup((GOLDEN / "rollup_v1.bin").read_bytes()) == golden_state()


def test_golden_v1_diff_still_decodes() -> None:
    data = (GOLDEN / "diff_v1.bin").read_bytes()
    diff = codec.decode_diff(data)
    assert diff == golden_diff()
    after = apply_diff(golden_state(), diff)
    assert after.upper == 6 and set(after.batches) == {"b1", "b2"}


def test_roundtrip() -> None:
    assert codec.decode_rollup(codec.encode_rollup(golden_state())) == golden_state()
    assert codec.decode_diff(codec.encode_diff(golden_diff())) == golden_diff()


@given(st_.data())
def test_any_bit_flip_or_truncation_is_refused(data: st_.DataObject) -> None:
    encoded = bytearray(codec.encode_diff(golden_diff()))
    if data.draw(st_.booleans()):
        i = data.draw(st_.integers(0, len(encoded) - 1))
        encoded[i] ^= 1 << data.draw(st_.integers(0, 7))
    else:
        encoded = encoded[: data.draw(st_.integers(0, len(encoded) - 1))]
    with pytest.raises(IntegrityError):
        codec.decode_diff(bytes(encoded))


def test_wrong_kind_and_future_version_are_refused() -> None:
    rollup = codec.encode_rollup(golden_state())
    with pytest.raises(IntegrityError, match="expected a persist state diff"):
        codec.decode_diff(rollup)
    future = bytearray(rollup)
    future[4] = codec.ALONE_FORMAT_VERSION + 1
    with pytest.raises(IntegrityError, match="format version"):
        codec.decode_rollup(bytes(future))
    with pytest.raises(IntegrityError):
        codec.decode_rollup(b"")


def test_a_state_with_schema_versions_is_written_as_format_2_and_read_back() -> None:
    """A release that predates schema versions reads only format 1: an evolved shard's
    frames are format 2 so that it refuses them instead of misreading parts."""
    plain = golden_state()
    assert codec.encode_rollup(plain)[4] == codec.FORMAT_VERSION
    evolved = msgspec.structs.replace(
        plain, schemas={0: SchemaVersion(b"s0", (0,)), 1: SchemaVersion(b"s1", (0, 1), 7)}
    )
    data = codec.encode_rollup(evolved)
    assert data[4] == codec.EVOLVED_FORMAT_VERSION
    assert codec.decode_rollup(data) == evolved
    diff = msgspec.structs.replace(golden_diff(), schemas=[(1, SchemaVersion(b"s1", (0, 1)))])
    assert codec.encode_diff(diff)[4] == codec.EVOLVED_FORMAT_VERSION
    assert codec.decode_diff(codec.encode_diff(diff)) == diff
    later = bytearray(data)
    later[4] = codec.ALONE_FORMAT_VERSION + 1
    with pytest.raises(IntegrityError, match=f"format version {codec.ALONE_FORMAT_VERSION + 1}"):
        codec.decode_rollup(bytes(later))


def _unsorted_diff() -> StateDiff:
    """``golden_diff`` adding an unsorted run; its format-3 bytes are frozen in
    golden/diff_v3_unsorted.bin."""
    part = PartRef("s/w/wid/b3/00000", 2, 120, "crc32:0badf00d", 6, 6, 4096, unsorted=True)
    return msgspec.structs.replace(
        golden_diff(), batches=[("b3", HollowBatch("b3", 5, 6, 0, (part,)))]
    )


def test_frames_that_reference_an_unsorted_run_are_format_3_and_read_back() -> None:
    """A release that predates unsorted runs would merge one as if it were sorted: every frame
    that references one (a rollup, a diff, a batch, a split) is format 3, which it refuses;
    frames without one keep their older formats."""
    diff = _unsorted_diff()
    data = codec.encode_diff(diff)
    assert data[4] == codec.UNSORTED_FORMAT_VERSION
    assert codec.decode_diff(data) == diff
    # Frozen format-3 bytes (written before parts recorded their merge) still read.
    assert codec.decode_diff((GOLDEN / "diff_v3_unsorted.bin").read_bytes()) == diff
    state = apply_diff(golden_state(), diff)
    rollup = codec.encode_rollup(state)
    assert rollup[4] == codec.UNSORTED_FORMAT_VERSION
    assert codec.decode_rollup(rollup) == state
    # Once no batch holds an unsorted run (compaction rewrote it), the rollup is format 1.
    sorted_again = msgspec.structs.replace(state, batches={"b1": state.batches["b1"]})
    assert codec.encode_rollup(sorted_again)[4] == codec.FORMAT_VERSION
    batch = Batch("s", "w", 5, 6, diff.batches[0][1])  # type: ignore[arg-type]
    assert batch.to_bytes()[4] == codec.UNSORTED_FORMAT_VERSION
    assert Batch.from_bytes(batch.to_bytes()) == batch
    part = diff.batches[0][1].parts[0]  # type: ignore[union-attr]
    schema = pa.schema([("k", pa.int64())]).serialize().to_pybytes()
    split = Split("s", "r", 5, schema, (part,))
    assert split.to_bytes()[4] == codec.UNSORTED_FORMAT_VERSION
    assert Split.from_bytes(split.to_bytes()) == split
    plain = Split("s", "r", 5, schema, (msgspec.structs.replace(part, unsorted=False),))
    assert plain.to_bytes()[4] == codec.FORMAT_VERSION


def _merged_diff() -> StateDiff:
    """``golden_diff`` adding a merge's output of two runs, a part written alone and one of
    the rest; its format-4 bytes are frozen in golden/diff_v4_alone.bin."""
    alone = PartRef("s/c/1-b4-00000", 3, 150, "crc32:0badf00d", 6, 6, 4096, origin="b4", alone=True)
    rest = PartRef("s/c/1-b4-00001", 2, 120, "crc32:0badf00e", 6, 6, 4096, origin="b4")
    batch = HollowBatch("b4", 5, 7, 6, (alone, rest), sorted_run=True)
    return msgspec.structs.replace(golden_diff(), batches=[("b4", batch)])


def test_frames_that_reference_a_part_written_alone_are_format_4_and_read_back() -> None:
    """A release that predates the split of a merge's output would take its two runs for one
    and merge them out of order: every frame that references an alone part is format 4; once
    no part is alone, frames keep their older formats."""
    diff = _merged_diff()
    data = codec.encode_diff(diff)
    assert data[4] == codec.ALONE_FORMAT_VERSION
    assert codec.decode_diff(data) == diff
    assert data == (GOLDEN / "diff_v4_alone.bin").read_bytes()
    state = apply_diff(golden_state(), diff)
    assert codec.encode_rollup(state)[4] == codec.ALONE_FORMAT_VERSION
    assert codec.decode_rollup(codec.encode_rollup(state)) == state
    batch = diff.batches[0][1]
    assert batch is not None
    assert [[p.key for p in run] for run in batch.runs()] == [
        ["s/c/1-b4-00000"],
        ["s/c/1-b4-00001"],
    ]
    # A rest part alone keeps the older format (its origin is no reason to refuse it).
    rest_only = msgspec.structs.replace(batch, parts=batch.parts[1:])
    assert Batch("s", "w", 5, 7, rest_only).to_bytes()[4] == codec.FORMAT_VERSION
