"""The write-ahead log of a shard's streaming writes: what makes a write ``LOCAL_DISK``.

The directory (``--wal-dir``, ``WalDir``) holds a lock file (one server at a time), the server's
id (its identity in shard states: made once, never changed), a clean-stop marker while no
server runs after a clean drain, and one sub-directory per shard, named by its shard id.

A shard's directory holds append-only segment files ``<first lsn>.<n>.seg``. A segment is::

    header:  "PWAL2\\n"  u32 n  u32 crc32(magic, n, schema)  schema (n bytes: Arrow IPC)
    record:  marker (8 bytes)  u32 length  u32 crc32(payload)  u32 crc32(the 16 bytes before)
             payload (length bytes: a msgpack ``WalRecord``)
    record:  ...

A record's rows are one Arrow IPC record batch message under the header's schema. Records are
appended a flush at a time and the file is fsynced once per flush (group fsync). The log rolls
to a new segment when a group commit is cut, and a segment is deleted once every write in it is
resolved (committed, or set aside in ``quarantine/``): from then on the shard's state
(``stream_upper``, the recorded seqs) remembers what the log did.

A segment is never truncated or reopened: each is created with ``O_EXCL`` under a name no other
segment had (the LSN reservation, ``lsn-floor``, keeps a restarted server's LSNs above every LSN
it handed out before, and ``n`` tells apart the segments a failed append leaves behind). After a
failed append the segment is abandoned, not written again: its tail may be torn.

Recovery reads every segment record by record and never raises for bad bytes, nor cuts or
deletes a file. At a bad record (header checksum wrong, length impossible, payload checksum
wrong, payload undecodable) it looks for the next marker whose two checksums hold and goes on
from there: the marker may occur by chance inside a payload, the checksums reject such a hit
(a record whose header holds but whose payload does not is skipped whole, by its length).

- Bytes after the last good record that hold no further good record are a **torn tail** (a
  crash mid-append: never fsynced, so never acknowledged) when the previous run did not stop
  cleanly and they are zeros, or the start of one record cut short by the end of the file or by
  zeros from a block boundary on (blocks allotted and never written); otherwise, and always
  when a good record follows them, they are **damage**. A segment header that does not hold
  is damage too (the records are then read with the shard's schema, or another segment's),
  unless the run was not clean and the whole file is zeros or a header cut short (a crash
  right after the file was made).
- A damaged segment is copied to ``quarantine/<segment file name>`` with a note
  (``<segment file name>.json``: the bad byte ranges, why, the LSNs of the good records around
  each) before recovery returns. The original stays a normal segment: its good records are
  committed and it goes like any other.
- Segments of the previous format (``PWAL1``: records ``[u32 length][u32 crc32][payload]``, no
  header checksum) are still read; there the first bad record ends the segment, and what follows
  is reported as above.

A write found twice (logged again after a failed append) appears twice: the caller counts it
once (by LSN).

This module holds ``Wal``, one shard's log (appending, rolling, dropping, the LSN floor, the
quarantine); the format's code is in ``_wal_format``, recovery in ``_wal_recover``, ``WalDir``
in ``_wal_dir``. Their names that other modules use are importable from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist.core.durability import Write
from persist.core.shaping import shape_rows
from persist.errors import ExternalError
from persist.flight._wal_dir import WalDir
from persist.flight._wal_format import (
    MARKER,
    QUARANTINE,
    Segment,
    WalRecord,
    decode_rows,
    encode_rows,
    frame,
    fsync_dir,
    now_iso,
    segment_header,
    u32,
    write_durably,
)
from persist.flight._wal_recover import Damage, Recovery, Torn, recover_directory

__all__ = [
    "MARKER",
    "Damage",
    "Recovery",
    "Segment",
    "Torn",
    "Wal",
    "WalDir",
    "WalRecord",
    "decode_rows",
    "encode_rows",
    "frame",
    "segment_header",
]

FLOOR_FILE = "lsn-floor"
_FLOOR = struct.Struct("<QI")  # the LSN floor, crc32 of it


class Wal:
    """One shard's log. Not thread-safe: the shard's stream calls it from one worker thread at a
    time (its methods block on the file system)."""

    def __init__(self, directory: Path, schema: pa.Schema, segments: list[Segment]) -> None:
        self.directory = directory
        self.schema = schema
        self._header = segment_header(schema)
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
            fsync_dir(self.directory)  # the new name survives a crash too
        except OSError:
            os.close(fd)
            # It holds no record: left behind, a clean stop's recovery would call it damage.
            with contextlib.suppress(OSError):
                path.unlink()
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
        body = struct.pack("<Q", floor)
        try:
            write_durably(self.directory / FLOOR_FILE, body + u32(zlib.crc32(body)))
            fsync_dir(self.directory)
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
        write_durably(path, segment_header(rows.schema) + frame([record]))
        note = {
            "lsn": lsn,
            "writer_id": record.writer_id,
            "seq": record.seqs[0],
            "why": why,
            "at": now_iso(),
        }
        write_durably(path.with_suffix(".json"), (json.dumps(note) + "\n").encode())
        fsync_dir(where)
        return path

    @staticmethod
    def list_quarantine(shard_dir: Path) -> list[dict[str, Any]]:
        """Every note under ``quarantine/`` of ``shard_dir``, by file name (by LSN): what was set
        aside and why (a damaged segment's note names no write: lsn, writer_id, seq None)."""
        where = shard_dir / QUARANTINE
        paths = sorted(where.glob("*.json")) if where.is_dir() else []
        out = []
        for path in paths:
            try:
                note = json.loads(path.read_bytes())
                if not isinstance(note, dict):
                    raise ValueError("not an object")
            except (OSError, ValueError) as exc:
                note = {"why": f"the note {path.name} is unreadable: {exc}"}
            out.append({k: note.get(k) for k in ("lsn", "writer_id", "seq", "why", "at")})
        return out

    # --- recovery ------------------------------------------------------------------------------

    @staticmethod
    def recover(directory: Path, schema_hint: pa.Schema | None, clean: bool) -> Recovery:
        """Every good record of every segment in ``directory``, the schema of their rows, the
        segments with the LSNs they hold, and what was damaged or torn (``clean``: the previous
        run stopped cleanly, so nothing can be torn).

        A segment whose header is damaged is read with ``schema_hint`` (the shard's rows
        schema), else with another segment's schema; with neither its records are reported as
        damage. A damaged segment is copied into ``quarantine/`` before this returns; one that
        cannot be read or copied is left out of ``segments`` (so never deleted: it is read
        again at the next start)."""
        return recover_directory(directory, schema_hint, clean)
