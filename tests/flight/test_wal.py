"""The streaming WAL: group-fsynced records, rolled segments that are never reopened or cut,
recovery that reads past damage (and tells it from a torn tail, by the synced marks and what each
segment's successor records of it) and keeps damaged segments aside, the previous formats, the
durable LSN floor, the quarantine and the WAL directory."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest

import persist
from persist.core.stream.durability import Write
from persist.flight._wal import (
    MARKER,
    Recovery,
    Wal,
    WalDir,
    WalRecord,
    encode_rows,
    frame,
    segment_header,
)
from persist.flight._wal_format import (
    MARK,
    SECTOR,
    Predecessor,
    Segment,
    mark_offset,
    parse_header,
    read_mark,
    segment_order,
)

SCHEMA = pa.schema([("k", pa.int64()), ("_diff", pa.int64())])
BLOBS = pa.schema([("k", pa.int64()), ("b", pa.binary()), ("_diff", pa.int64())])


def _record(lsns: list[int], writer: str = "w", rows: int = 1) -> WalRecord:
    n = len(lsns) * rows
    k = pa.array([lsn for lsn in lsns for _ in range(rows)], pa.int64())
    table = pa.table({"k": k, "_diff": pa.array([1] * n, pa.int64())})
    return WalRecord(
        lsns, writer, [lsn * 10 for lsn in lsns], [rows] * len(lsns), encode_rows(table)
    )


def _recover(directory: Path, clean: bool = False, hint: pa.Schema | None = SCHEMA) -> Recovery:
    return Wal.recover(directory, hint, clean)


def _lsns(directory: Path) -> list[int]:
    return [lsn for r in _recover(directory).records for lsn in r.lsns]


def _segment(
    directory: Path, appends: list[list[WalRecord]], schema: pa.Schema = SCHEMA
) -> tuple[Path, bytes, list[int]]:
    """One segment holding ``appends``: its path, bytes, and where each record starts (then
    where the last ends)."""
    wal = Wal(directory, schema, [])
    for records in appends:
        wal.append(records, frame(records))
    wal.close()
    (path,) = directory.glob("*.seg")
    starts = [len(segment_header(schema))]
    for records in appends:
        for r in records:
            starts.append(starts[-1] + len(frame([r])))
    data = path.read_bytes()
    assert starts[-1] == len(data)
    return path, data, starts


def _ends(start: int, appends: list[list[WalRecord]]) -> list[int]:
    """Where each append of ``appends`` ends, the first one starting at ``start``."""
    out = []
    for records in appends:
        start += len(frame(records))
        out.append(start)
    return out


def _paths(directory: Path) -> list[Path]:
    """The segments of ``directory``, in the order their log made them."""
    return sorted(directory.glob("*.seg"), key=lambda p: segment_order(p.name))


def _no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is checked is how bytes are read, not how they are made durable: quicker."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def _v2_segment(schema: pa.Schema, records: list[WalRecord]) -> bytes:
    """A segment as written before the synced mark (``PWAL2``: no mark, no predecessor)."""
    s: bytes = schema.serialize().to_pybytes()
    head = b"PWAL2\n" + struct.pack("<I", len(s))
    return head + struct.pack("<I", zlib.crc32(s, zlib.crc32(head))) + s + frame(records)


def _v1_segment(schema: pa.Schema, records: list[WalRecord]) -> bytes:
    """A segment as the previous release wrote it (``PWAL1``: no marker, no header checksum)."""
    s = schema.serialize().to_pybytes()
    out = b"PWAL1\n" + struct.pack("<I", len(s)) + s
    for r in records:
        payload = msgspec.msgpack.encode(r)
        out += struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    return out


def test_records_survive_rolls_and_resolved_segments_go(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])
    first = [_record([1, 2]), _record([3])]
    wal.append(first, frame(first))
    wal.roll()
    second = [_record([4, 5, 6], "x")]
    wal.append(second, frame(second))
    wal.close()
    got = _recover(tmp_path / "s", clean=True, hint=None)
    assert got.schema == SCHEMA and got.damage == [] and got.torn == []
    assert [(s.last_lsn, s.path.exists()) for s in got.segments] == [(3, True), (6, True)]
    assert [(r.lsns, r.writer_id, r.seqs) for r in got.records] == [
        ([1, 2], "w", [10, 20]),
        ([3], "w", [30]),
        ([4, 5, 6], "x", [40, 50, 60]),
    ]
    # A restarted server adopts the segments; each goes once every write in it is resolved.
    again = Wal(tmp_path / "s", SCHEMA, got.segments)
    assert again.drop_below(4) == 1
    assert not got.segments[0].path.exists() and got.segments[1].path.exists()
    assert again.drop_below(7) == 1
    assert _lsns(tmp_path / "s") == []


def test_a_record_cut_short_is_torn_after_a_crash_and_damage_after_a_clean_stop(
    tmp_path: Path,
) -> None:
    """Faults: the file cut at every byte of its last record."""
    path, data, starts = _segment(tmp_path / "s", [[_record([1]), _record([2, 3])]])
    last = starts[1]
    for cut in range(last + 1, len(data)):
        path.write_bytes(data[:cut])
        crashed = _recover(tmp_path / "s")
        assert [r.lsns for r in crashed.records] == [[1]], cut  # only the intact record
        assert [(t.offset, t.nbytes) for t in crashed.torn] == [(last, cut - last)], cut
        assert crashed.damage == [], cut
        assert path.stat().st_size == cut  # never cut
        clean = _recover(tmp_path / "s", clean=True)
        assert [r.lsns for r in clean.records] == [[1]], cut
        assert [(d.offset, d.nbytes) for d in clean.damage] == [(last, cut - last)], cut
        assert clean.torn == [], cut
    # Cut at a record's end: nothing torn, nothing damaged.
    path.write_bytes(data[:last])
    got = _recover(tmp_path / "s", clean=True)
    assert [r.lsns for r in got.records] == [[1]] and got.damage == got.torn == []


def test_a_failed_append_abandons_its_segment_and_never_cuts_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])
    ok = [_record([1])]
    wal.append(ok, frame(ok))
    real_fsync = os.fsync
    calls = {"n": 0}

    def failing_fsync(fd: int) -> None:
        calls["n"] += 1
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    retry = [_record([2])]
    with pytest.raises(persist.ExternalError) as e:
        wal.append(retry, frame(retry))
    assert e.value.determinate is False and calls["n"] == 1
    monkeypatch.setattr(os, "fsync", real_fsync)
    # The same writes again go to a new segment (the old one may be torn after the failure);
    # the first segment, holding LSN 1, is neither reopened nor cut.
    wal.append(retry, frame(retry))
    wal.close()
    paths = sorted((tmp_path / "s").glob("*.seg"))
    assert len(paths) == 2
    assert _lsns(tmp_path / "s").count(1) == 1
    # Record 2 was written to both segments (the failed fsync may have kept it): found twice,
    # which recovery's caller (the ledger) counts once.
    assert sorted(_lsns(tmp_path / "s")) == [1, 2, 2]
    # The new segment records where the abandoned one's last successful append ended: bytes
    # before are held to it (a cut there is damage), the failed append's past it are not.
    first, second = _paths(tmp_path / "s")
    data = first.read_bytes()
    end = len(segment_header(SCHEMA)) + len(frame(ok))
    head, _ = parse_header(second.read_bytes())
    assert head is not None and head.predecessor == Predecessor(first.name, end, 1)
    assert len(data) == end + len(frame(retry))
    first.write_bytes(data[:-3])
    got = _recover(tmp_path / "s")
    assert [(t.path, t.offset) for t in got.torn] == [(first, end)] and got.damage == []
    first.write_bytes(data[: end - 3])
    got = _recover(tmp_path / "s")
    assert got.torn == [] and [r.lsns for r in got.records] == [[2]]
    assert [(d.path, d.offset, d.nbytes, d.lsn_after) for d in got.damage] == [
        (first, len(segment_header(SCHEMA)), len(frame(ok)), 1)
    ]


def test_a_segment_whose_header_fails_to_write_is_not_left_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(persist.ExternalError):
        wal.append([_record([1])], frame([_record([1])]))
    assert list((tmp_path / "s").glob("*.seg")) == []


def test_segment_names_are_never_reused(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    first = Wal(directory, SCHEMA, [])
    a = [_record([7])]
    first.append(a, frame(a))
    first.close()
    # A second log of the same directory (a restart) starting at the same LSN: a new file.
    second = Wal(directory, SCHEMA, [])
    second.append(a, frame(a))
    second.close()
    assert len(list(directory.glob("*.seg"))) == 2
    assert _lsns(directory) == [7, 7]
    # What a crash while a segment was made leaves (its header, not yet named) goes.
    (directory / f"{9:020d}-1.seg.tmp").write_bytes(segment_header(SCHEMA)[:5])
    third = Wal(directory, SCHEMA, [])
    third.append(a, frame(a))
    third.close()
    assert list(directory.glob("*.tmp")) == [] and len(list(directory.glob("*.seg"))) == 3


def test_every_single_bit_flip_is_found_and_every_intact_record_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults: every single-bit flip of a segment header (magic, schema length, the length of
    the record of the segment before, checksum, schema, synced mark, that record: the segment
    follows another, the log rolled) and of its first two records (marker, length, payload
    checksum, header checksum, payload), one at a time; and a flip in every byte of its last
    record (a bit each), where damage could pass for a torn tail. The previous run did not stop
    cleanly throughout, so nothing is excused as torn that does not look torn."""
    _no_fsync(monkeypatch)
    directory = tmp_path / "s"
    diffs = pa.schema([("_diff", pa.int64())])  # small records: fewer bits to flip

    def rec(lsns: list[int], writer: str) -> WalRecord:
        rows = encode_rows(pa.table({"_diff": pa.array([1] * len(lsns), pa.int64())}))
        return WalRecord(lsns, writer, lsns, [1] * len(lsns), rows)

    wal = Wal(directory, diffs, [])
    wal.append([rec([1], "w")], frame([rec([1], "w")]))
    wal.roll()
    appends = [[rec([3, 5], "w"), rec([4], "x")], [rec([6], "x"), rec([7, 8], "w")]]
    for batch in appends:
        wal.append(batch, frame(batch))
    wal.close()
    before, path = _paths(directory)
    data = path.read_bytes()
    head, _ = parse_header(data)
    assert head is not None and head.mark_at is not None
    assert head.predecessor == Predecessor(before.name, before.stat().st_size, 1)
    starts = [head.records_start]
    for one in [one for rs in appends for one in rs]:
        starts.append(starts[-1] + len(frame([one])))
    assert starts[-1] == len(data)
    assert read_mark(data, head.mark_at) == (starts[2], 5)  # the first append: fsynced
    records = [r.lsns for rs in appends for r in rs]
    spans = list(itertools.pairwise(starts))  # each record's bytes
    copy = directory / "quarantine" / path.name
    flips = [(byte, bit) for byte in range(starts[2]) for bit in range(8)]
    flips += [(byte, byte % 8) for byte in range(starts[-2], len(data))]
    for byte, bit in flips:
        bad = bytearray(data)
        bad[byte] ^= 1 << bit
        with open(path, "r+b") as f:  # in place: quicker than a new file each time
            f.write(bad)
        got = _recover(directory, hint=diffs)
        intact = [lsns for lsns, (a, b) in zip(records, spans, strict=True) if not a <= byte < b]
        where = (byte, bit)
        assert [r.lsns for r in got.records] == [[1], *intact], where
        assert got.torn == [], where
        assert any(d.offset <= byte < d.offset + d.nbytes for d in got.damage), where
        assert {d.quarantined_as for d in got.damage} == {copy}, where
        assert copy.read_bytes() == bad, where  # copied anew (each flip's bytes differ)
        assert path.stat().st_size == len(data), where  # left in place, uncut
        assert [s.path for s in got.segments] == [before, path], where


def test_the_synced_mark_is_never_split_by_a_sector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark is rewritten in place: it lies in one 512-byte sector (a power cut writes it
    whole or not at all). A schema whose end leaves too little of its sector moves the mark to
    the next; a flip in the zeros between is damage (the header's checksum holds them)."""
    _no_fsync(monkeypatch)
    for n in range(4096):
        at = mark_offset(n)
        assert at // SECTOR == (at + MARK.size - 1) // SECTOR and 0 <= at - 18 - n < MARK.size
    for size in range(SECTOR):
        schema = SCHEMA.with_metadata({"pad": "x" * size})
        n = len(schema.serialize())
        if mark_offset(n) > 18 + n:
            break
    directory = tmp_path / "s"
    path, data, _ = _segment(directory, [[_record([1])], [_record([2])]], schema)
    head, _ = parse_header(data)
    assert head is not None and head.mark_at == mark_offset(n) and head.mark_at % SECTOR == 0
    for byte in range(18 + n, head.mark_at):
        bad = bytearray(data)
        bad[byte] ^= 0x20
        path.write_bytes(bad)
        got = _recover(directory, hint=schema)
        assert [r.lsns for r in got.records] == [[1], [2]], byte
        assert [(d.offset, "header" in d.why) for d in got.damage] == [(0, True)], byte


def test_a_cut_into_what_was_fsynced_is_damage_naming_the_writes_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults: the file cut at every byte of a segment of five appends. Before its newest append
    (fsynced and acknowledged: the segment's synced mark says so) a cut is damage whatever
    ``clean`` is, record boundaries included, naming the writes lost; inside the newest append
    it is a torn tail unless the previous run stopped cleanly; right where the newest append
    starts nothing tells (the one cut the format cannot see); into the header it is damage (a
    segment is named only once its header is whole), the writes lost unnamed (the mark is
    gone)."""
    directory = tmp_path / "s"
    appends = [
        [_record([1])],
        [_record([2, 4]), _record([3], "x")],
        [_record([5])],
        [_record([6]), _record([7], "x")],
        [_record([8, 9])],
    ]
    path, data, starts = _segment(directory, appends)
    _no_fsync(monkeypatch)
    synced = _ends(starts[0], appends)[-2]  # where the newest append starts
    head, _ = parse_header(data)
    assert head is not None and head.mark_at is not None
    assert read_mark(data, head.mark_at) == (synced, 7)
    records = [r.lsns for rs in appends for r in rs]
    copy = directory / "quarantine" / path.name
    for cut in range(starts[0], len(data)):
        path.write_bytes(data[:cut])
        kept = sum(end <= cut for end in starts[1:])
        at = starts[kept]  # where the first record not whole starts
        before = max(records[kept - 1]) if kept else None
        for clean in (False, True):
            got = _recover(directory, clean)
            where = (cut, clean)
            assert [r.lsns for r in got.records] == records[:kept], where
            if cut < synced:
                assert got.torn == [], where
                (d,) = got.damage
                assert (d.offset, d.offset + d.nbytes) == (at, synced), where
                assert (d.lsn_before, d.lsn_after) == (before, 7), where
                assert "fsynced" in d.why and "up to LSN 7 are lost" in d.why, where
                assert d.quarantined_as == copy, where
            elif cut == synced:
                assert got.damage == got.torn == [], where
            elif clean:
                assert [(d.offset, d.nbytes) for d in got.damage] == [(at, cut - at)], where
                assert got.torn == [], where
            else:
                assert [(t.offset, t.nbytes) for t in got.torn] == [(at, cut - at)], where
                assert got.damage == [], where
            assert path.stat().st_size == cut, where  # never cut further
    for cut in range(starts[0]):
        path.write_bytes(data[:cut])
        for clean in (False, True):
            got = _recover(directory, clean)
            assert got.records == got.torn == [], (cut, clean)
            assert [(d.offset, d.nbytes) for d in got.damage] == [(0, cut)], (cut, clean)


def test_zeros_over_what_was_fsynced_are_damage_naming_the_writes_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults: a 512-byte block zeroed at every block of a segment of eight appends (as the
    fault harness does: the last one ends with the file), and the file zeroed from every block
    boundary to its end (blocks allotted, never written). Zeros over bytes before the newest
    append are damage whatever ``clean`` is, and at the end of the file name the writes lost;
    zeros at the end from inside the newest append on are a torn tail unless clean."""
    directory = tmp_path / "s"
    appends = [[_record([lsn], rows=40)] for lsn in range(1, 9)]
    path, data, starts = _segment(directory, appends)
    _no_fsync(monkeypatch)
    synced = starts[7]
    spans = list(itertools.pairwise(starts))
    blocks = [(at, min(len(data), at + 512)) for at in range(0, len(data), 512)]
    blocks += [(at, len(data)) for at in range(512, len(data), 512)]
    assert any(a >= synced for a, _ in blocks[-3:]) and any(a < synced for a, _ in blocks[-3:])
    for a, b in blocks:
        path.write_bytes(data[:a] + bytes(b - a) + data[b:])
        intact = [[i + 1] for i, (x, y) in enumerate(spans) if y <= a or x >= b]
        for clean in (False, True):
            got = _recover(directory, clean)
            where = (a, b, clean)
            assert [r.lsns for r in got.records] == intact, where
            if b == len(data) and a >= synced:
                if not clean and b - a >= 64:
                    assert [(t.offset, t.nbytes) for t in got.torn] == [(synced, b - synced)]
                    assert got.damage == [], where
                else:
                    assert got.torn == [] and got.damage, where
                continue
            assert got.torn == [], where
            assert any(d.offset < b and a < d.offset + d.nbytes for d in got.damage), where
            if b == len(data):
                (d,) = [d for d in got.damage if d.offset + d.nbytes == len(data)]
                assert d.lsn_after == 7 and "up to LSN 7 are lost" in d.why, where


def test_a_segment_the_log_rolled_past_is_held_to_its_whole_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Faults: the file cut at every byte of a segment the log rolled past, its newest append
    included (the next segment's header records where that ended), record boundaries too:
    damage whatever ``clean`` is, naming the writes lost; the next segment is not touched."""
    directory = tmp_path / "s"
    wal = Wal(directory, SCHEMA, [])
    appends = [[_record([1])], [_record([2, 3])], [_record([4]), _record([5], "x")]]
    for batch in appends:
        wal.append(batch, frame(batch))
    wal.roll()
    wal.append([_record([6])], frame([_record([6])]))
    wal.close()
    first, second = _paths(directory)
    assert [p.name for p in (first, second)] == [f"{1:020d}-1.seg", f"{6:020d}-2.seg"]
    assert list(directory.glob("*.tmp")) == []  # named once whole
    data = first.read_bytes()
    head, _ = parse_header(data)
    nxt, _ = parse_header(second.read_bytes())
    assert head is not None and head.predecessor is None
    assert nxt is not None and nxt.predecessor == Predecessor(first.name, len(data), 5)
    starts = [head.records_start]
    for one in [one for rs in appends for one in rs]:
        starts.append(starts[-1] + len(frame([one])))
    assert starts[-1] == len(data)
    _no_fsync(monkeypatch)
    records = [r.lsns for rs in appends for r in rs]
    assert _recover(directory).damage == []
    for cut in range(starts[0], len(data)):
        first.write_bytes(data[:cut])
        kept = sum(end <= cut for end in starts[1:])
        before = max(records[kept - 1]) if kept else None
        for clean in (False, True):
            got = _recover(directory, clean)
            where = (cut, clean)
            assert [r.lsns for r in got.records] == [*records[:kept], [6]], where
            assert got.torn == [], where
            (d,) = got.damage
            assert (d.path, d.offset, d.offset + d.nbytes) == (first, starts[kept], len(data))
            assert (d.lsn_before, d.lsn_after) == (before, 5), where
            assert second.name in d.why and "up to LSN 5 are lost" in d.why, where


def test_a_restarted_log_records_the_segment_it_recovered(tmp_path: Path) -> None:
    """A segment a crashed run left, its newest append torn: the restarted log's first segment
    records where its good records end (fsynced first), so a cut there after another crash is
    damage, though it was the newest segment of its run; the torn bytes past them stay a torn
    tail (never acknowledged)."""
    directory = tmp_path / "s"
    path, data, starts = _segment(directory, [[_record([1])], [_record([2])]])
    path.write_bytes(data + frame([_record([3])])[:30])
    got = _recover(directory)
    assert [(t.offset, t.nbytes) for t in got.torn] == [(len(data), 30)]
    assert [(s.path, s.end, s.last_lsn) for s in got.segments] == [(path, len(data), 2)]
    wal = Wal(directory, SCHEMA, got.segments)
    wal.append([_record([4])], frame([_record([4])]))
    wal.close()
    old, new = _paths(directory)
    head, _ = parse_header(new.read_bytes())
    assert old == path and head is not None
    assert head.predecessor == Predecessor(path.name, len(data), 2)
    again = _recover(directory)
    assert [r.lsns for r in again.records] == [[1], [2], [4]] and again.damage == []
    assert [(t.offset, t.nbytes) for t in again.torn] == [(len(data), 30)]
    # Its newest append cut off where it starts: nothing in the segment itself tells.
    path.write_bytes(data[: starts[1]])
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1], [4]] and got.torn == []
    (d,) = got.damage
    assert (d.path, d.offset, d.nbytes, d.lsn_before, d.lsn_after) == (
        path,
        starts[1],
        len(data) - starts[1],
        1,
        2,
    )


def test_a_damaged_synced_mark_is_damage_and_its_tail_is_judged_as_before(tmp_path: Path) -> None:
    """Faults: a segment's synced mark flipped, and its file cut inside what the mark said was
    fsynced: the mark is damage; the cut is judged as if there were no mark (a torn tail after
    a crash), unless the segment after it records its end."""
    directory = tmp_path / "s"
    path, data, starts = _segment(directory, [[_record([1])], [_record([2])], [_record([3])]])
    head, _ = parse_header(data)
    assert head is not None and head.mark_at is not None
    bad = bytearray(data)
    bad[head.mark_at + 3] ^= 0x08
    cut = starts[2] - 7  # inside the second append (fsynced: the mark said so)
    path.write_bytes(bytes(bad[:cut]))
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1]]
    assert [(t.offset, t.nbytes) for t in got.torn] == [(starts[1], cut - starts[1])]
    (d,) = got.damage
    assert (d.offset, d.nbytes) == (head.mark_at, MARK.size) and "synced mark" in d.why
    assert "judged as if it had no mark" in d.why
    clean = _recover(directory, clean=True)
    assert [(d.offset, d.nbytes) for d in clean.damage] == [
        (head.mark_at, MARK.size),
        (starts[1], cut - starts[1]),
    ]
    # The segment after it records its end: the cut is damage again, named by that record.
    nxt = Wal(directory, SCHEMA, [Segment(path, 1, last_lsn=3, end=len(data))])
    nxt.append([_record([4])], frame([_record([4])]))
    nxt.close()
    got = _recover(directory)
    assert got.torn == [] and [r.lsns for r in got.records] == [[1], [4]]
    assert [(d.offset, d.lsn_before, d.lsn_after) for d in got.damage] == [
        (head.mark_at, None, 1),
        (starts[1], 1, 3),
    ]


def test_a_zeroed_block_in_the_middle_is_damage_and_at_the_end_torn_unless_clean(
    tmp_path: Path,
) -> None:
    """Faults: a 512-byte block of zeros inside the segment; the file's last block zeroed
    (blocks allotted, never written), after a crash and after a clean stop."""
    directory = tmp_path / "s"
    appends = [[_record([lsn], rows=40)] for lsn in range(1, 9)]
    path, data, starts = _segment(directory, appends)
    assert starts[2] - starts[1] > 600  # a block fits in a record and a half
    # The middle: from inside record 3 into record 4; 5 and on follow, so it is damage.
    at = (starts[3] + 100) // 512 * 512
    assert starts[2] < at < starts[3] < at + 512 < starts[4]
    path.write_bytes(data[:at] + bytes(512) + data[at + 512 :])
    for clean in (False, True):
        got = _recover(directory, clean)
        assert [r.lsns for r in got.records] == [[1], [2], [5], [6], [7], [8]]
        assert got.torn == []
        (d,) = got.damage
        assert (d.offset, d.offset + d.nbytes) == (starts[2], starts[4])
        assert (d.lsn_before, d.lsn_after) == (2, 5)
        assert d.quarantined_as == directory / "quarantine" / path.name
    # The end: the last block (inside record 8) never written.
    at = (len(data) - 64) // 512 * 512
    assert starts[7] < at
    path.write_bytes(data[:at] + bytes(len(data) - at))
    crashed = _recover(directory, clean=False)
    assert [r.lsns[0] for r in crashed.records] == [1, 2, 3, 4, 5, 6, 7]
    assert [(t.offset, t.nbytes) for t in crashed.torn] == [(starts[7], len(data) - starts[7])]
    assert crashed.damage == []
    clean = _recover(directory, clean=True)
    assert [r.lsns[0] for r in clean.records] == [1, 2, 3, 4, 5, 6, 7]
    assert clean.torn == [] and [(d.offset, d.lsn_before) for d in clean.damage] == [(starts[7], 7)]
    # An all-zero block after the last record (a torn append that wrote nothing).
    path.write_bytes(data + bytes(512))
    assert [(t.offset, t.nbytes) for t in _recover(directory).torn] == [(len(data), 512)]
    assert [(d.offset, d.nbytes) for d in _recover(directory, clean=True).damage] == [
        (len(data), 512)
    ]


def test_marker_bytes_in_row_data_are_not_taken_for_records(tmp_path: Path) -> None:
    """Faults: row data holding the marker, a whole framed record of other writes, and many
    markers; intact, then with the payload of the record holding them damaged, then with the
    next record's marker damaged (recovery searching through that row data)."""
    directory = tmp_path / "s"

    def rec(lsn: int, blob: bytes, writer: str = "w") -> WalRecord:
        table = pa.table({"k": [lsn], "b": pa.array([blob], pa.binary()), "_diff": [1]})
        return WalRecord([lsn], writer, [lsn], [1], encode_rows(table.cast(BLOBS)))

    fake = frame([rec(99, b"", "fake")])
    blobs = [MARKER, MARKER * 40, fake, b"x" + fake[:30] + MARKER + fake]
    records = [rec(i + 1, b) for i, b in enumerate(blobs)] + [rec(9, b"end")]
    wal = Wal(directory, BLOBS, [])
    wal.append(records, frame(records))
    wal.close()
    (path,) = directory.glob("*.seg")
    data = path.read_bytes()
    got = Wal.recover(directory, None, clean=False)
    assert [r.lsns for r in got.records] == [[1], [2], [3], [4], [9]]
    assert got.damage == got.torn == []
    reader = Wal(directory, BLOBS, [])
    assert [reader.unpacked(r)[0][2]["b"][0].as_py() for r in got.records] == [*blobs, b"end"]
    # Record 3's payload (holding a whole framed record) damaged: its header still holds, so
    # it is skipped by its length, not searched.
    third = data.index(fake) - 40
    starts = [i for i in range(len(data)) if data.startswith(MARKER, i)]
    header_at = max(i for i in starts if i < third)
    bad = bytearray(data)
    bad[third] ^= 1
    path.write_bytes(bad)
    got = Wal.recover(directory, BLOBS, clean=False)
    assert [r.lsns for r in got.records] == [[1], [2], [4], [9]]
    assert [d.offset for d in got.damage] == [header_at]
    # Record 4's marker damaged: recovery searches on from there, through row data holding
    # markers, a framed record cut short and a whole one. The checksums reject all but the
    # whole framed record, which is taken for a record (the one thing a fixed marker cannot
    # tell: a record's exact bytes as row data, with that record's header damaged); record 9
    # follows, and every intact record is there.
    fourth = len(frame(records[:3])) + len(segment_header(BLOBS))
    bad = bytearray(data)
    bad[fourth] ^= 1
    path.write_bytes(bad)
    got = Wal.recover(directory, BLOBS, clean=False)
    assert [r.lsns for r in got.records] == [[1], [2], [3], [9], [99]]
    assert got.damage[0].offset == fourth and len(got.damage) == 2


def test_a_damaged_segment_header_is_read_with_the_schema_hint(tmp_path: Path) -> None:
    """Faults: the schema in a segment's header flipped, with a hint, with another segment's
    header to go by, and with neither."""
    directory = tmp_path / "s"
    path, data, starts = _segment(directory, [[_record([1]), _record([2])]])
    bad = bytearray(data)
    bad[20] ^= 0xFF
    path.write_bytes(bad)
    got = _recover(directory, hint=SCHEMA)
    assert got.schema == SCHEMA and [r.lsns for r in got.records] == [[1], [2]]
    assert [(d.offset, d.nbytes, d.lsn_after) for d in got.damage] == [(0, starts[0], 1)]
    assert "header" in got.damage[0].why
    # No hint and no other segment: the records cannot be read; reported, not dropped.
    got = _recover(directory, hint=None)
    assert got.schema is None and got.records == []
    assert [d.offset for d in got.damage] == [0, starts[0], starts[1]]
    assert all("no schema" in d.why for d in got.damage[1:])
    assert [s.path for s in got.segments] == [path]
    # Another segment's header gives the schema.
    other = Wal(directory, SCHEMA, [])
    other.append([_record([3])], frame([_record([3])]))
    other.close()
    got = _recover(directory, hint=None)
    assert got.schema == SCHEMA and [r.lsns for r in got.records] == [[1], [2], [3]]
    assert len(got.damage) == 1


def test_a_segment_torn_while_being_made(tmp_path: Path) -> None:
    """Faults: a segment file holding only part of its header, or zeros, or nothing. Named as
    earlier releases named segments (made under their name, so torn while being made after a
    crash), and as now (named only once the header is whole and fsynced: damage)."""
    directory = tmp_path / "s"
    directory.mkdir()
    header = segment_header(SCHEMA)
    v2 = _v2_segment(SCHEMA, [])
    # A crash before the header's block was written leaves zeros (the file's size may be set).
    cases = [b"", header[:3], header[:12], header[:20], header[:-1], v2[:12], v2[:-1]]
    cases += [bytes(len(header)), bytes(512)]
    for name, whole in ((f"{1:020d}.1.seg", False), (f"{1:020d}-1.seg", True)):
        path = directory / name
        for data in cases:
            path.write_bytes(data)
            got = _recover(directory)
            assert got.records == [], data
            if whole:
                assert got.torn == [] and [d.nbytes for d in got.damage] == [len(data)], data
            else:
                assert got.damage == [], data
                assert [(t.offset, t.nbytes) for t in got.torn] == [(0, len(data))], data
            clean = _recover(directory, clean=True)
            assert clean.torn == [] and [d.nbytes for d in clean.damage] == [len(data)], data
            assert path.read_bytes() == data
        path.unlink()


def test_a_segment_written_before_the_synced_mark_recovers(tmp_path: Path) -> None:
    """Faults (``PWAL2``: no synced mark, no record of the segment before): a record cut short
    at the end (torn unless clean), a cut at a record's end (nothing tells, as before), a
    flipped byte mid-segment (damage, read past), a flipped header checksum (read with the
    hint)."""
    directory = tmp_path / "s"
    directory.mkdir()
    records = [_record([1, 2]), _record([3], "x"), _record([4])]
    data = _v2_segment(SCHEMA, records)
    starts = [len(_v2_segment(SCHEMA, []))]
    for r in records:
        starts.append(starts[-1] + len(frame([r])))
    path = directory / f"{1:020d}.1.seg"
    path.write_bytes(data)
    got = _recover(directory, clean=True, hint=None)
    assert got.schema == SCHEMA and [r.lsns for r in got.records] == [[1, 2], [3], [4]]
    assert got.damage == got.torn == [] and got.segments[0].last_lsn == 4
    path.write_bytes(data[:-5])
    got = _recover(directory)
    assert [(t.offset, t.nbytes) for t in got.torn] == [(starts[2], len(data) - 5 - starts[2])]
    assert [d.offset for d in _recover(directory, clean=True).damage] == [starts[2]]
    path.write_bytes(data[: starts[2]])
    got = _recover(directory, clean=True)
    assert [r.lsns for r in got.records] == [[1, 2], [3]] and got.damage == got.torn == []
    bad = bytearray(data)
    bad[starts[1] + 30] ^= 0x01
    path.write_bytes(bad)
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1, 2], [4]]
    assert [(d.offset, d.lsn_before, d.lsn_after) for d in got.damage] == [(starts[1], 2, 4)]
    bad = bytearray(data)
    bad[11] ^= 0x01  # the header's checksum
    path.write_bytes(bad)
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1, 2], [3], [4]]
    assert [(d.offset, d.nbytes) for d in got.damage] == [(0, starts[0])]


def test_a_segment_of_the_previous_format_recovers(tmp_path: Path) -> None:
    """Faults (format 1): a record cut short at the end; a flipped byte mid-segment (which
    ends it, as that format always did); a flipped magic; an undecodable schema."""
    directory = tmp_path / "s"
    directory.mkdir()
    records = [_record([1, 2]), _record([3], "x"), _record([4])]
    data = _v1_segment(SCHEMA, records)
    path = directory / "00000000000000000001.seg"
    path.write_bytes(data)
    got = _recover(directory, clean=True, hint=None)
    assert got.schema == SCHEMA and [r.lsns for r in got.records] == [[1, 2], [3], [4]]
    assert got.damage == got.torn == [] and got.segments[0].last_lsn == 4
    assert Wal(directory, SCHEMA, []).unpacked(got.records[0])[1][0] == 2
    path.write_bytes(data[:-5])
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1, 2], [3]] and len(got.torn) == 1
    assert len(_recover(directory, clean=True).damage) == 1
    assert path.read_bytes() == data[:-5]
    bad = bytearray(data)
    middle = len(data) - len(msgspec.msgpack.encode(records[2])) - 20
    bad[middle] ^= 0x10
    path.write_bytes(bad)
    got = _recover(directory)
    assert [r.lsns for r in got.records] == [[1, 2]]
    (d,) = got.damage
    assert d.lsn_before == 2 and d.offset + d.nbytes == len(data) and "format 1" in d.why
    assert (directory / "quarantine" / path.name).read_bytes() == bad
    # The header damaged: its records are still found, and read with the hint.
    header = len(_v1_segment(SCHEMA, []))
    for at, flip in ((2, 0x04), (14, 0xFF)):  # the magic; the schema's message length
        bad = bytearray(data)
        bad[at] ^= flip
        path.write_bytes(bad)
        got = _recover(directory, hint=SCHEMA)
        assert [r.lsns for r in got.records] == [[1, 2], [3], [4]], at
        assert [(d.offset, d.nbytes) for d in got.damage] == [(0, header)], at
        got = _recover(directory, hint=None)
        assert got.records == [] and len(got.damage) == 4, at


def test_the_damage_note_says_where_and_why(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    path, data, starts = _segment(directory, [[_record([1]), _record([2]), _record([3])]])
    bad = bytearray(data)
    bad[starts[1] + 30] ^= 0x01
    path.write_bytes(bad)
    (d,) = _recover(directory).damage
    assert d.quarantined_as is not None
    note = json.loads(d.quarantined_as.with_name(path.name + ".json").read_text())
    assert note["damage"] == [
        {
            "offset": starts[1],
            "nbytes": starts[2] - starts[1],
            "why": "a record's checksum does not match",
            "lsn_before": 1,
            "lsn_after": 3,
        }
    ]
    (listed,) = Wal.list_quarantine(directory)
    assert listed["lsn"] is listed["writer_id"] is listed["seq"] is None
    assert path.name in listed["why"] and "checksum" in listed["why"]
    assert datetime.datetime.fromisoformat(listed["at"]).utcoffset() == datetime.timedelta(0)
    # Beside the writes set aside, by LSN.
    rows = pa.record_batch([pa.array([2], pa.int64())], names=["k"])
    Wal(directory, SCHEMA, []).quarantine(Write(2, None, "w", 20, 8, rows, 0), "no")
    Wal(directory, SCHEMA, []).quarantine(Write(0, None, "w", 0, 8, rows, 0), "no")
    assert [n["lsn"] for n in Wal.list_quarantine(directory)] == [0, None, 2]


def test_the_lsn_floor_is_durable_and_checked(tmp_path: Path) -> None:
    directory = tmp_path / "s"
    assert Wal.read_floor(directory) == 0
    wal = Wal(directory, SCHEMA, [])
    wal.write_floor(4096)
    wal.write_floor(8192)
    assert Wal.read_floor(directory) == 8192
    (directory / "lsn-floor").write_bytes(b"\x00" * 12)
    with pytest.raises(persist.ExternalError, match="damaged"):
        Wal.read_floor(directory)


def test_a_quarantined_write_is_kept_readable_with_why(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])
    # Its rows as they came (here a null where the shard allows none), under their own schema.
    rows = pa.record_batch([pa.array([None], pa.int64())], names=["k"])
    write = Write(12, None, "feed", 120, rows.nbytes, rows, 0)
    path = wal.quarantine(write, "column 'k' is not nullable but holds nulls")
    note = json.loads(path.with_suffix(".json").read_text())
    at = datetime.datetime.fromisoformat(note.pop("at"))
    assert at.utcoffset() == datetime.timedelta(0)
    assert note == {
        "lsn": 12,
        "writer_id": "feed",
        "seq": 120,
        "why": "column 'k' is not nullable but holds nulls",
    }
    got = Wal.recover(path.parent, None, clean=True)
    assert got.schema == rows.schema and [r.lsns for r in got.records] == [[12]]
    assert Wal(path.parent, rows.schema, []).unpacked(got.records[0])[0][2].equals(rows)
    # It is not a segment of the log: recovery of the shard does not see it.
    assert _lsns(tmp_path / "s") == []
    assert Wal.list_quarantine(tmp_path / "s") == [
        {"lsn": 12, "writer_id": "feed", "seq": 120, "why": note["why"], "at": at.isoformat()}
    ]
    assert Wal.list_quarantine(tmp_path / "nowhere") == []


def test_the_wal_dir_is_held_by_one_server(tmp_path: Path) -> None:
    first = WalDir.open(tmp_path / "wal")
    held = f"{re.escape(str(tmp_path / 'wal'))} is in use .*pid {os.getpid()}"
    with pytest.raises(persist.InvalidUsage, match=held):
        WalDir.open(tmp_path / "wal")
    first.close(clean=False)
    second = WalDir.open(tmp_path / "wal")
    second.close(clean=False)


def test_the_server_id_is_kept_and_checked(tmp_path: Path) -> None:
    d = WalDir.open(tmp_path / "wal")
    made = d.server_id
    assert made.startswith("srv-") and len(made) == 20 and int(made[4:], 16) >= 0
    d.close(clean=True)
    again = WalDir.open(tmp_path / "wal")
    assert again.server_id == made
    again.close(clean=False)
    other = WalDir.open(tmp_path / "other")
    assert other.server_id != made
    other.close(clean=False)
    # One hex digit changed: caught by its checksum, never made anew.
    path = tmp_path / "wal" / "server-id"
    changed = made[:-1] + ("1" if made[-1] == "0" else "0")
    path.write_text(path.read_text().replace(made, changed))
    with pytest.raises(persist.ExternalError, match="damaged"):
        WalDir.open(tmp_path / "wal")
    assert changed in path.read_text()
    path.unlink()  # the lock went with the failure: the directory opens (with a new id)
    fresh = WalDir.open(tmp_path / "wal")
    assert fresh.server_id not in (made, changed)
    fresh.close(clean=False)


def test_the_clean_stop_marker(tmp_path: Path) -> None:
    d = WalDir.open(tmp_path / "wal")
    assert d.was_clean is False  # a new directory: nothing says the last run drained
    d.close(clean=True)
    d = WalDir.open(tmp_path / "wal")
    assert d.was_clean is True
    d.close(clean=False)
    d = WalDir.open(tmp_path / "wal")
    assert d.was_clean is False
    d.close(clean=True)
    # A server that dies without closing (its lock goes with its process).
    script = "import sys; from persist.flight._wal import WalDir; WalDir.open(sys.argv[1])"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "wal")], check=True)
    d = WalDir.open(tmp_path / "wal")
    assert d.was_clean is False
    d.close(clean=False)


def test_the_shards_are_the_directories_named_by_shard_id(tmp_path: Path) -> None:
    d = WalDir.open(tmp_path / "wal")
    shard = "s" + "0" * 8 + "-0000-0000-0000-" + "0" * 12
    (tmp_path / "wal" / shard).mkdir()
    (tmp_path / "wal" / "not-a-shard").mkdir()
    assert d.shards() == [tmp_path / "wal" / shard]
    d.close(clean=True)
    assert d.shards() == [tmp_path / "wal" / shard]
