"""The write-ahead log of a shard's streaming writes: what makes a write ``LOCAL_DISK``.

One directory per shard under ``--wal-dir``, holding append-only segment files
``<first lsn>.seg``. A segment starts with a header (magic, the Arrow schema of the writes'
rows) and holds records ``[u32 length][u32 crc32][msgpack WalRecord]``; a record's rows are one
Arrow IPC record batch message under that schema. Records are appended by a group of writes at
a time and the file is fsynced once for the whole group (group fsync). The log rolls to a new
segment when a group commit is cut, and a segment is deleted once every write in it is
committed (its LSNs are below the shard's ``stream_upper``): the commit, not the log, then
remembers the writes (``core.streams``).

Recovery reads every segment; the first record whose length or checksum does not hold ends the
segment (a torn write at a crash: it was never fsynced, so never acknowledged ``LOCAL_DISK``),
and the file is cut there.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa

from persist.errors import ExternalError

__all__ = ["Segment", "Wal", "WalRecord", "decode_rows", "encode_rows"]

MAGIC = b"PWAL1\n"
_HEAD = struct.Struct("<II")  # length, crc32 of the payload
_MAX_RECORD = 1 << 31


class WalRecord(msgspec.Struct, array_like=True):
    """A bunch of writes from one call, logged together: write ``i`` is ``counts[i]`` rows (in
    order) of ``rows`` at LSN ``lsns[i]``, named ``(writer_id, seqs[i])`` (seq -1: unnamed)."""

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

    def __init__(self, directory: Path, schema: pa.Schema) -> None:
        self.directory = directory
        self.schema = schema
        self._header = MAGIC + _u32(len(s := schema.serialize().to_pybytes())) + s
        self.closed: list[Segment] = []
        self._current: Segment | None = None
        self._file: int | None = None

    # --- writing -------------------------------------------------------------------------------

    def append(self, records: list[WalRecord], data: bytes) -> None:
        """Appends framed ``data`` (``frame(records)``) and fsyncs: when this returns, the
        records survive a crash of the process or the machine."""
        if self._file is None:
            self._open(records[0].lsns[0])
        assert self._file is not None and self._current is not None
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._file, view)
                view = view[written:]
            os.fsync(self._file)
        except OSError as exc:
            raise ExternalError(
                f"the WAL {self._current.path} failed: {exc}", determinate=False
            ) from exc
        self._current.last_lsn = max(self._current.last_lsn, max(r.lsns[-1] for r in records))

    def roll(self) -> None:
        """Ends the current segment: later writes go to a new one."""
        if self._file is not None and self._current is not None:
            os.close(self._file)
            self._file = None
            self.closed.append(self._current)
            self._current = None

    def drop_committed(self, stream_upper: int) -> None:
        """Deletes the closed segments whose every write is committed."""
        keep = []
        for seg in self.closed:
            if seg.last_lsn < stream_upper:
                seg.path.unlink(missing_ok=True)
            else:
                keep.append(seg)
        self.closed = keep

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def _open(self, first_lsn: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{first_lsn:020d}.seg"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, self._header)
        os.fsync(fd)
        _fsync_dir(self.directory)  # the new name survives a crash too
        self._file = fd
        self._current = Segment(path, first_lsn)

    # --- recovery ------------------------------------------------------------------------------

    @staticmethod
    def recover(directory: Path) -> tuple[pa.Schema | None, list[WalRecord], list[Path]]:
        """Every intact record of every segment in ``directory`` (in LSN order), the schema of
        their rows, and the segment files. A torn tail is cut off its file."""
        records: list[WalRecord] = []
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
            while at + _HEAD.size <= len(data):
                length, crc = _HEAD.unpack_from(data, at)
                payload = data[at + _HEAD.size : at + _HEAD.size + length]
                if length > _MAX_RECORD or len(payload) != length or zlib.crc32(payload) != crc:
                    break
                try:
                    records.append(_decoder.decode(payload))
                except msgspec.DecodeError:
                    break
                at += _HEAD.size + length
            if at != len(data):
                with open(path, "r+b") as f:
                    f.truncate(at)
                    os.fsync(f.fileno())
        records.sort(key=lambda r: r.lsns[0])
        return schema, records, paths


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
