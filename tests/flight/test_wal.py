"""The streaming WAL: group-fsynced records, rolled segments, and a torn tail cut at recovery."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from persist.flight._stream import recovered_writes
from persist.flight._wal import Wal, WalRecord, encode_rows, frame

SCHEMA = pa.schema([("k", pa.int64()), ("_diff", pa.int64())])


def _record(lsns: list[int], writer: str = "w") -> WalRecord:
    n = len(lsns)
    table = pa.table({"k": pa.array(lsns, pa.int64()), "_diff": pa.array([1] * n, pa.int64())})
    return WalRecord(lsns, writer, [lsn * 10 for lsn in lsns], [1] * n, encode_rows(table))


def test_records_survive_rolls_and_committed_segments_go(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA)
    first = [_record([1, 2]), _record([3])]
    wal.append(first, frame(first))
    wal.roll()
    second = [_record([4, 5, 6], "x")]
    wal.append(second, frame(second))
    wal.close()
    _, writes, paths = recovered_writes(tmp_path / "s")
    assert len(paths) == 2
    assert [(lsn, w, seq, t["k"].to_pylist()) for lsn, w, seq, t in writes] == [
        (1, "w", 10, [1]),
        (2, "w", 20, [2]),
        (3, "w", 30, [3]),
        (4, "x", 40, [4]),
        (5, "x", 50, [5]),
        (6, "x", 60, [6]),
    ]
    wal.drop_committed(4)  # the first segment's writes are all committed; the open one stays
    assert not paths[0].exists()
    assert paths[1].exists()


def test_a_torn_tail_is_cut_at_every_byte(tmp_path: Path) -> None:
    wal = Wal(tmp_path / "s", SCHEMA)
    whole = [_record([1]), _record([2, 3])]
    wal.append(whole, frame(whole))
    wal.close()
    (segment,) = (tmp_path / "s").glob("*.seg")
    data = segment.read_bytes()
    last = len(frame([whole[1]]))
    for cut in range(len(data) - last, len(data)):
        segment.write_bytes(data[:cut])
        _, writes, _ = recovered_writes(tmp_path / "s")
        assert [w[0] for w in writes] == [1], cut  # only the intact record
        assert segment.stat().st_size == len(data) - last  # the torn bytes are cut off
    # A flipped byte inside the last record is caught by its checksum.
    for i in range(len(data) - last + 8, len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        segment.write_bytes(bytes(bad))
        _, writes, _ = recovered_writes(tmp_path / "s")
        assert [w[0] for w in writes] == [1], i
