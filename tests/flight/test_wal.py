"""The streaming WAL: group-fsynced records, rolled segments that are never reopened or cut,
a torn tail cut at recovery, the durable LSN floor, and the quarantine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest

import persist
from persist.core.durability import Write
from persist.flight._wal import Wal, WalRecord, encode_rows, frame

SCHEMA = pa.schema([("k", pa.int64()), ("_diff", pa.int64())])


def _record(lsns: list[int], writer: str = "w") -> WalRecord:
    n = len(lsns)
    table = pa.table({"k": pa.array(lsns, pa.int64()), "_diff": pa.array([1] * n, pa.int64())})
    return WalRecord(lsns, writer, [lsn * 10 for lsn in lsns], [1] * n, encode_rows(table))


def _lsns(directory: Path) -> list[int]:
    _, records, _ = Wal.recover(directory)
    return [lsn for r in records for lsn in r.lsns]


def test_records_survive_rolls_and_resolved_segments_go(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])
    first = [_record([1, 2]), _record([3])]
    wal.append(first, frame(first))
    wal.roll()
    second = [_record([4, 5, 6], "x")]
    wal.append(second, frame(second))
    wal.close()
    schema, records, segments = Wal.recover(tmp_path / "s")
    assert schema == SCHEMA
    assert [(s.last_lsn, s.path.exists()) for s in segments] == [(3, True), (6, True)]
    assert [(r.lsns, r.writer_id, r.seqs) for r in records] == [
        ([1, 2], "w", [10, 20]),
        ([3], "w", [30]),
        ([4, 5, 6], "x", [40, 50, 60]),
    ]
    # A restarted server adopts the segments; each goes once every write in it is resolved.
    again = Wal(tmp_path / "s", SCHEMA, segments)
    assert again.drop_below(4) == 1
    assert not segments[0].path.exists() and segments[1].path.exists()
    assert again.drop_below(7) == 1
    assert _lsns(tmp_path / "s") == []


def test_a_torn_tail_is_cut_at_every_byte(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA, [])
    whole = [_record([1]), _record([2, 3])]
    wal.append(whole, frame(whole))
    wal.close()
    (segment,) = (tmp_path / "s").glob("*.seg")
    data = segment.read_bytes()
    last = len(frame([whole[1]]))
    for cut in range(len(data) - last, len(data)):
        segment.write_bytes(data[:cut])
        assert _lsns(tmp_path / "s") == [1], cut  # only the intact record
        assert segment.stat().st_size == len(data) - last  # the torn bytes are cut off
    # A flipped byte inside the last record is caught by its checksum.
    for i in range(len(data) - last + 8, len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        segment.write_bytes(bytes(bad))
        assert _lsns(tmp_path / "s") == [1], i


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
    assert sorted(set(_lsns(tmp_path / "s"))) == [1, 2]


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
    assert note == {
        "lsn": 12,
        "writer_id": "feed",
        "seq": 120,
        "why": "column 'k' is not nullable but holds nulls",
    }
    schema, records, _ = Wal.recover(path.parent)
    assert schema == rows.schema and [r.lsns for r in records] == [[12]]
    assert Wal(path.parent, rows.schema, []).unpacked(records[0])[0][2].equals(rows)
    # It is not a segment of the log: recovery of the shard does not see it.
    assert _lsns(tmp_path / "s") == []
