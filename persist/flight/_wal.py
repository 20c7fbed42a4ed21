"""The write-ahead log of a shard's streaming writes: what makes a write ``LOCAL_DISK``.

One directory per shard under ``--wal-dir``, holding append-only segment files
``<first lsn>.<n>.seg``. A segment starts with a header (magic, the Arrow schema of the writes'
rows) and holds records ``[u32 length][u32 crc32][msgpack WalRecord]``; a record's rows are one
Arrow IPC record batch message under that schema. Records are appended a flush at a time and the
file is fsynced once per flush (group fsync). The log rolls to a new segment when a group commit
is cut, and a segment is deleted once every write in it is resolved (committed, or set aside in
``quarantine/``): from then on the shard's state (``stream_upper``, the recorded seqs) remembers
what the log did.

A segment is never truncated or reopened: each is created with ``O_EXCL`` under a name no other
segment had (the LSN reservation, ``lsn-floor``, keeps a restarted server's LSNs above every LSN
it handed out before, and ``n`` tells apart the segments a failed append leaves behind). After a
failed append the segment is abandoned, not written again: its tail may be torn, and recovery
stops reading a segment at its first bad record.

Recovery reads every segment; the first record whose length or checksum does not hold ends the
segment (a torn write at a crash: it was never fsynced, so never acknowledged ``LOCAL_DISK``),
and the file is cut there. A write found twice (logged again after a failed append) counts once.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa

from persist.core.durability import Write
from persist.core.shaping import shape_rows
from persist.errors import ExternalError

__all__ = ["Segment", "Wal", "WalRecord", "decode_rows", "encode_rows", "frame"]

MAGIC = b"PWAL1\n"
_HEAD = struct.Struct("<II")  # length, crc32 of the payload
_FLOOR = struct.Struct("<QI")  # the LSN floor, crc32 of it
_MAX_RECORD = 1 << 31
FLOOR_FILE = "lsn-floor"
QUARANTINE = "quarantine"


class WalRecord(msgspec.Struct, array_like=True):
    """Writes of one writer id logged together: write ``i`` is ``counts[i]`` rows (in order) of
    ``rows`` at LSN ``lsns[i]``, named ``(writer_id, seqs[i])`` (seq -1: unnamed)."""

    lsns: list[int]
    writer_id: str
    seqs: list[int]
    counts: list[int]
    rows: bytes  # one Arrow IPC record batch message (schema in the segment's header)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WalRecord)


def encode_rows(table: pa.Table) -> bytes:
    batches = table.combine_chunks().to_batches()
    batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
    data: bytes = batch.serialize().to_pybytes()
    return data


def decode_rows(data: bytes, schema: pa.Schema) -> pa.RecordBatch:
    return pa.ipc.read_record_batch(pa.py_buffer(data), schema)


def frame(records: list[WalRecord]) -> bytes:
    """``records`` as the bytes appended to a segment."""
    out = bytearray()
    for record in records:
        payload = _encoder.encode(record)
        out += _HEAD.pack(len(payload), zlib.crc32(payload))
        out += payload
    return bytes(out)


@dataclass
class Segment:
    path: Path
    first_lsn: int
    last_lsn: int = -1  # highest LSN written to it (-1: none)


class Wal:
    """One shard's log. Not thread-safe: the shard's stream calls it from one worker thread at a
    time (its methods block on the file system)."""

    def __init__(self, directory: Path, schema: pa.Schema, segments: list[Segment]) -> None:
        self.directory = directory
        self.schema = schema
        self._header = MAGIC + _u32(len(s := schema.serialize().to_pybytes())) + s
        self.closed: list[Segment] = list(segments)  # recovered ones, until resolved
        self._current: Segment | None = None
        self._file: int | None = None
        self._made = 0

    # --- writing -------------------------------------------------------------------------------

    def append(self, records: list[WalRecord], data: bytes) -> None:
        """Appends framed ``data`` (``frame(records)``) and fsyncs: when this returns, the
        records survive a crash of the process or the machine. On failure the segment is
        abandoned (the next append starts a new one) and ``ExternalError`` raised."""
        first = min(r.lsns[0] for r in records)
        try:
            if self._file is None:
                self._open(first)
            assert self._file is not None and self._current is not None
            view = memoryview(data)
            while view:
                written = os.write(self._file, view)
                view = view[written:]
            os.fsync(self._file)
        except OSError as exc:
            where = self._current.path if self._current is not None else self.directory
            self.roll()
            raise ExternalError(f"the WAL {where} failed: {exc}", determinate=False) from exc
        self._current.last_lsn = max(self._current.last_lsn, max(r.lsns[-1] for r in records))

    def roll(self) -> None:
        """Ends the current segment: later writes go to a new one."""
        if self._file is not None:
            fd, self._file = self._file, None
            # Abandoned either way: what it holds was fsynced, or never acked.
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._current is not None:
            self.closed.append(self._current)
            self._current = None

    def drop_below(self, resolved: int) -> int:
        """Deletes the closed segments whose every write is resolved (LSNs below
        ``resolved``); returns how many went."""
        keep, gone = [], 0
        for seg in self.closed:
            if seg.last_lsn < resolved:
                seg.path.unlink(missing_ok=True)
                gone += 1
            else:
                keep.append(seg)
        self.closed = keep
        return gone

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def _open(self, first_lsn: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            self._made += 1
            path = self.directory / f"{first_lsn:020d}.{self._made}.seg"
            try:
                # Never an existing file: one holding a write not yet committed must not be cut.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                continue
        try:
            os.write(fd, self._header)
            os.fsync(fd)
            _fsync_dir(self.directory)  # the new name survives a crash too
        except OSError:
            os.close(fd)
            raise
        self._file = fd
        self._current = Segment(path, first_lsn)

    def append_writes(self, writes: list[Write[pa.RecordBatch]], schema: pa.Schema) -> None:
        """One append of ``writes`` (in LSN order; rows of the shard's ``schema``): a record
        per writer id, one fsync."""
        by_writer: dict[str, list[Write[pa.RecordBatch]]] = {}
        for w in writes:
            by_writer.setdefault(w.writer_id, []).append(w)
        records = []
        for writer_id, ws in by_writer.items():
            rows = shape_rows([w.payload for w in ws], schema)
            records.append(
                WalRecord(
                    [w.lsn for w in ws],
                    writer_id,
                    [w.seq for w in ws],
                    [w.payload.num_rows for w in ws],
                    encode_rows(rows),
                )
            )
        self.append(records, frame(records))

    def unpacked(self, record: WalRecord) -> list[tuple[int, int, pa.RecordBatch]]:
        """A record's writes: ``(lsn, seq, rows)``."""
        rows = decode_rows(record.rows, self.schema)
        out = []
        at = 0
        for lsn, seq, count in zip(record.lsns, record.seqs, record.counts, strict=True):
            out.append((lsn, seq, rows.slice(at, count)))
            at += count
        return out

    # --- the LSN floor and the quarantine --------------------------------------------------------

    @staticmethod
    def read_floor(directory: Path) -> int:
        """The LSN reservation last made durable: no LSN below it may be handed out again."""
        path = directory / FLOOR_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(data) == _FLOOR.size:
            floor, crc = _FLOOR.unpack(data)
            if zlib.crc32(data[:8]) == crc:
                return int(floor)
        raise ExternalError(
            f"{path} is damaged: delete it only if no server ever streamed here", determinate=True
        )

    def write_floor(self, floor: int) -> None:
        """Makes ``floor`` the durable LSN reservation (written aside, fsynced, renamed)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (FLOOR_FILE + ".tmp")
        body = struct.pack("<Q", floor)
        try:
            with open(tmp, "wb") as f:
                f.write(body + struct.pack("<I", zlib.crc32(body)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / FLOOR_FILE)
            _fsync_dir(self.directory)
        except OSError as exc:
            raise ExternalError(
                f"the WAL {self.directory} failed: {exc}", determinate=True
            ) from exc

    def quarantine(self, write: Write[pa.RecordBatch], why: str) -> Path:
        """Sets one write that can never be committed aside, with why, before its segment goes:
        a segment of its own under ``quarantine/`` (its rows as they came, under their own
        schema: readable with ``Wal.recover``) and a note."""
        where = self.directory / QUARANTINE
        where.mkdir(parents=True, exist_ok=True)
        lsn, rows = write.lsn, write.payload
        path = where / f"{lsn:020d}.seg"
        record = WalRecord([lsn], write.writer_id, [write.seq], [rows.num_rows], b"")
        record.rows = rows.serialize().to_pybytes()
        header = rows.schema.serialize().to_pybytes()
        data = MAGIC + _u32(len(header)) + header + frame([record])
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        note = {"lsn": lsn, "writer_id": record.writer_id, "seq": record.seqs[0], "why": why}
        with open(path.with_suffix(".json"), "w") as f:
            f.write(json.dumps(note) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(where)
        return path

    # --- recovery ------------------------------------------------------------------------------

    @staticmethod
    def recover(directory: Path) -> tuple[pa.Schema | None, list[WalRecord], list[Segment]]:
        """Every intact record of every segment in ``directory`` (in LSN order), the schema of
        their rows, and the segments with the LSNs they hold. A torn tail is cut off its file."""
        records: list[WalRecord] = []
        segments: list[Segment] = []
        schema: pa.Schema | None = None
        paths = sorted(directory.glob("*.seg")) if directory.is_dir() else []
        for path in paths:
            data = path.read_bytes()
            if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
                path.unlink()  # torn before its header was synced: it held no synced record
                continue
            n = _read_u32(data, len(MAGIC))
            start = len(MAGIC) + 4
            try:
                seg_schema = pa.ipc.read_schema(pa.py_buffer(data[start : start + n]))
            except (pa.ArrowInvalid, ValueError):
                path.unlink()
                continue
            schema = schema or seg_schema
            at = start + n
            seg = Segment(path, first_lsn=-1)
            while at + _HEAD.size <= len(data):
                length, crc = _HEAD.unpack_from(data, at)
                payload = data[at + _HEAD.size : at + _HEAD.size + length]
                if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
                    break
                try:
                    record = _decoder.decode(payload)
                except msgspec.DecodeError:
                    break
                records.append(record)
                seg.last_lsn = max(seg.last_lsn, *record.lsns)
                at += _HEAD.size + length
            if at != len(data):
                with open(path, "r+b") as f:
                    f.truncate(at)
                    os.fsync(f.fileno())
            segments.append(seg)
        records.sort(key=lambda r: r.lsns[0])
        return schema, records, segments


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _read_u32(data: bytes, at: int) -> int:
    value: int = struct.unpack_from("<I", data, at)[0]
    return value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
