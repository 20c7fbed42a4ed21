"""The write-ahead log of a shard's streaming writes: what makes a write ``LOCAL_DISK``.

The directory (``--wal-dir``, ``WalDir``) holds a lock file (one server at a time), the server's
id (its identity in shard states: made once, never changed), a clean-stop marker while no
server runs after a clean drain, and one sub-directory per shard, named by its shard id.

A shard's directory holds append-only segment files ``<first lsn>-<n>.seg``. A segment is::

    header:  "PWAL3\\n"  u32 n  u32 m  u32 crc32(the header but this and the synced mark)
             schema (n bytes: Arrow IPC)  zeros (0..19 bytes: the mark never crosses a sector)
             synced mark: u64 synced_end  u64 synced_last_lsn  u32 crc32(the 16 bytes before)
             predecessor (m bytes, 0: none): u64 end  u64 last_lsn  its file name (UTF-8)
    record:  marker (8 bytes)  u32 length  u32 crc32(payload)  u32 crc32(the 16 bytes before)
             payload (length bytes: a msgpack ``WalRecord``)
    record:  ...

(integers little-endian; an LSN of ``2**64 - 1`` stands for none). A record's rows are one Arrow
IPC record batch message under the header's schema. A segment holds rows of one version of the
shard's schema: the header's schema says which (``VERSION_KEY`` in its metadata; none: version 0,
as every segment written before versions), and the log rolls to a new segment before an append
of another version's writes. Records are appended a flush at a time and
the file is fsynced once per flush (group fsync). The log rolls to a new segment when a group
commit is cut, and a segment is deleted once every write in it is resolved (committed, or set
aside in ``quarantine/``): from then on the shard's state (``stream_upper``, the recorded seqs)
remembers what the log did.

How far a segment was fsynced is on record, so that bytes lost after they were acknowledged are
never taken for an append a crash tore:

- **The synced mark**: each append first rewrites the mark in place (``pwrite``) with where the
  segment's previous append ended and its highest LSN up to there (that append's fsync
  returned), then writes its records; its one fsync makes both durable. So the mark says "up to
  ``synced_end`` was fsynced and acknowledged", and only the newest append lies past it. A new
  segment's mark says nothing is synced past its header.
- **The predecessor**: a segment's header records the segment of its log before it (after a
  roll, or a failed append that abandoned it): its name and where its last successful append
  ended. A restarted log's first segment records the newest segment it recovered, where the
  good records recovery found in it end (fsynced first). So every segment but the newest has
  its whole fsynced length on record in a durable place that is not itself.

A segment is never truncated or reopened: each is created under a name no other segment had
(the LSN reservation, ``lsn-floor``, keeps a restarted server's LSNs above every LSN it handed
out before, and ``n`` tells apart the segments a failed append leaves behind), and named only
once its header is whole and fsynced (written as ``<name>.tmp``, then hard-linked, never over an
existing file). After a failed append the segment is abandoned, not written again: its tail may
be torn.

Recovery reads every segment record by record and never raises for bad bytes, nor cuts or
deletes a file. At a bad record (header checksum wrong, length impossible, payload checksum
wrong, payload undecodable) it looks for the next marker whose two checksums hold and goes on
from there: the marker may occur by chance inside a payload, the checksums reject such a hit
(a record whose header holds but whose payload does not is skipped whole, by its length).

- A segment's **synced end** is the larger of its own mark's and its successor's record of it.
  Bytes before it that are not good records, or missing (the file ends before it), are
  **damage**, whatever the previous run was: the note names the writes lost (the LSNs after the
  last good record up to the synced last LSN, in ``lsn_before``/``lsn_after`` and the why). A
  mark whose checksum does not hold is damage itself; its segment's tail is then judged as if it
  had no mark (unless its successor records its end), as are segments of earlier formats.
- Past the synced end, bytes after the last good record that hold no further good record are a
  **torn tail** (a crash mid-append: never fsynced, so never acknowledged) when the previous run
  did not stop cleanly and they are zeros, or the start of one record cut short by the end of
  the file or by zeros from a block boundary on (blocks allotted and never written); otherwise,
  and always when a good record follows them, they are **damage**.
- A segment header that does not hold is damage (the records are then read with the shard's
  schema, or another segment's). A segment named as earlier releases named them
  (``<first lsn>.<n>.seg``, ``<first lsn>.seg``) was made under its name, so when the run was
  not clean and the whole file is zeros or a header cut short, it is a crash right after the
  file was made (torn).
- A damaged segment is copied to ``quarantine/<segment file name>`` with a note
  (``<segment file name>.json``: the bad byte ranges, why, the LSNs of the good records around
  each) before recovery returns. The original stays a normal segment: its good records are
  committed and it goes like any other.
- Segments of earlier formats are still read: ``PWAL2`` (the header above without ``m``, the
  mark and the predecessor: ``"PWAL2\\n" u32 n u32 crc32(magic, n, schema) schema``), and
  ``PWAL1`` (records ``[u32 length][u32 crc32][payload]``, no header checksum), where the first
  bad record ends the segment and what follows is reported as above.

**What stays undetectable**: the newest append of the newest segment (past its synced mark: at
most one group fsync's worth of writes, acknowledged ``LOCAL_DISK`` once that fsync returned)
can be cut off, or zeroed from a block boundary to the end of the file, without a trace: that is
what an append torn by a crash before its fsync returned leaves, and nothing durable says
otherwise until the next append or roll. Lost so, those writes are reported at most as a torn
tail (a warning), or not at all when the cut falls where the newest append starts.

A write found twice (logged again after a failed append) appears twice: the caller counts it
once (by LSN).

This module holds ``Wal``, one shard's log (appending, rolling, dropping, the LSN floor, the
quarantine); the format's code is in ``_wal_format``, recovery in ``_wal_recover``, ``WalDir``
in ``_wal_dir``. Their names that other modules use are importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist.core.arrow.shaping import rows_schema, shape_rows
from persist.core.stream.durability import Write
from persist.errors import ExternalError
from persist.flight._wal_dir import WalDir
from persist.flight._wal_format import (
    MARKER,
    QUARANTINE,
    Predecessor,
    Segment,
    WalRecord,
    decode_rows,
    encode_rows,
    frame,
    fsync_dir,
    now_iso,
    parse_header,
    segment_header,
    segment_name,
    segment_order,
    synced_mark,
    u32,
    version_of,
    version_tag,
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
    "version_of",
    "version_tag",
]

FLOOR_FILE = "lsn-floor"
_FLOOR = struct.Struct("<QI")  # the LSN floor, crc32 of it


class Wal:
    """One shard's log. Not thread-safe: the shard's stream calls it from one worker thread at a
    time (its methods block on the file system)."""

    def __init__(self, directory: Path, schema: pa.Schema, segments: list[Segment]) -> None:
        self.directory = directory
        self.schema = schema  # of the rows of an append that names none
        self._schema = schema  # of the current segment's rows (its header's)
        self.closed: list[Segment] = list(segments)  # recovered ones, until resolved
        self._current: Segment | None = None
        self._file: int | None = None
        self._made = 0
        self._started = False  # whether a segment was made yet (the recovered ones adopted)
        self._prev: Predecessor | None = None  # what the next segment made records
        self._mark_at = 0  # the current segment's synced mark
        self._synced = 0  # where its last successful append ends (fsynced)
        self._marked = 0  # what its mark says

    # --- writing -------------------------------------------------------------------------------

    def append(
        self, records: list[WalRecord], data: bytes, schema: pa.Schema | None = None
    ) -> None:
        """Appends framed ``data`` (``frame(records)``, rows of ``schema``, by default the
        log's) and fsyncs: when this returns, the records survive a crash of the process or the
        machine. On failure the segment is abandoned (the next append starts a new one) and
        ``ExternalError`` raised. Rows of another schema than the current segment's (its
        metadata too: the schema version) go to a new segment.

        Before the records, the segment's synced mark is set to where the previous append
        ended (fsynced: its fsync returned), so this append's one fsync makes both durable."""
        first = min(r.lsns[0] for r in records)
        schema = self.schema if schema is None else schema
        if self._file is not None and not schema.equals(self._schema, check_metadata=True):
            self.roll()
        try:
            if self._file is None:
                self._schema = schema
                self._open(first)
            assert self._file is not None and self._current is not None
            if self._marked != self._synced:
                mark = synced_mark(self._synced, self._current.last_lsn)
                if os.pwrite(self._file, mark, self._mark_at) != len(mark):
                    raise OSError(errno.EIO, "the synced mark was written short")
                self._marked = self._synced
            view = memoryview(data)
            while view:
                written = os.write(self._file, view)
                view = view[written:]
            os.fsync(self._file)
        except OSError as exc:
            where = self._current.path if self._current is not None else self.directory
            self.roll()
            raise ExternalError(f"the WAL {where} failed: {exc}", determinate=False) from exc
        self._synced += len(data)
        self._current.last_lsn = max(self._current.last_lsn, max(r.lsns[-1] for r in records))

    def roll(self) -> None:
        """Ends the current segment: later writes go to a new one, whose header records where
        this one's last successful append ended."""
        if self._file is not None:
            fd, self._file = self._file, None
            # Abandoned either way: what it holds was fsynced, or never acked.
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._current is not None:
            seg, self._current = self._current, None
            seg.end = self._synced
            self._prev = Predecessor(seg.path.name, seg.end, seg.last_lsn)
            self.closed.append(seg)

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
        if self._current is not None:
            self.roll()  # closed (``close``) and written again
        if not self._started:
            self._started = True
            self._prev = self._adopt()
            for stale in self.directory.glob("*.seg.tmp"):  # a crash while one was made
                with contextlib.suppress(OSError):
                    stale.unlink()
        header = segment_header(self._schema, self._prev)
        while True:
            self._made += 1
            path = self.directory / segment_name(first_lsn, self._made)
            if not path.exists() and self._make(path, header):
                break
        head, _ = parse_header(header)
        assert head is not None and head.mark_at is not None
        self._mark_at = head.mark_at
        self._synced = self._marked = len(header)
        self._current = Segment(path, first_lsn)

    def _make(self, path: Path, header: bytes) -> bool:
        """Makes ``path`` a segment holding ``header``, named only once the header is fsynced
        (so a named segment's header is never torn: cut short, it is damage) and never over an
        existing file (one holding a write not yet committed must not be cut), and opens it for
        appending; False (nothing made) if the name is taken."""
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        named = False
        try:
            view = memoryview(header)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
                named = True
            tmp.unlink()
            if named:
                fsync_dir(self.directory)  # the new name survives a crash too
        except OSError:
            os.close(fd)
            # It holds no record: nothing to keep.
            with contextlib.suppress(OSError):
                tmp.unlink()
            if named:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        if not named:
            os.close(fd)
            return False
        self._file = fd
        return True

    def _adopt(self) -> Predecessor | None:
        """The recovered segment the first segment made follows (the newest; its records up to
        where recovery found them end, fsynced now), so a later recovery holds it to them."""
        known = [s for s in self.closed if s.end >= 0]
        if not known:
            return None
        seg = max(known, key=lambda s: segment_order(s.path.name))
        try:
            fd = os.open(seg.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            return None  # gone (resolved), or not known fsynced: not recorded
        return Predecessor(seg.path.name, seg.end, seg.last_lsn)

    def append_writes(
        self, writes: list[Write[pa.RecordBatch]], schemas: Mapping[int, pa.Schema]
    ) -> None:
        """Appends ``writes`` (in LSN order; each of its own version of the shard's schema,
        ``version_of``, whose data columns ``schemas`` gives): a record per writer id, one
        fsync, per version (in the order the versions come): a segment holds one version's."""
        by_version: dict[int, dict[str, list[Write[pa.RecordBatch]]]] = {}
        for w in writes:
            by_version.setdefault(version_of(w.payload), {}).setdefault(w.writer_id, []).append(w)
        for version, by_writer in by_version.items():
            schema = rows_schema(schemas[version]).with_metadata(version_tag(version))
            records = []
            for writer_id, ws in by_writer.items():
                rows = shape_rows([w.payload for w in ws], schemas[version])
                records.append(
                    WalRecord(
                        [w.lsn for w in ws],
                        writer_id,
                        [w.seq for w in ws],
                        [w.payload.num_rows for w in ws],
                        encode_rows(rows),
                    )
                )
            self.append(records, frame(records), schema)

    def unpacked(
        self, record: WalRecord, schema: pa.Schema | None = None
    ) -> list[tuple[int, int, pa.RecordBatch]]:
        """A record's writes: ``(lsn, seq, rows)``, its rows read under ``schema`` (its
        segment's, ``Recovery.schema_of``; by default the log's): they keep its version."""
        rows = decode_rows(record.rows, self.schema if schema is None else schema)
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
        damage. A segment shorter than its synced end, or whose bytes before it are not good
        records, is damage whatever ``clean`` is. A damaged segment is copied into
        ``quarantine/`` before this returns; one that cannot be read or copied is left out of
        ``segments`` (so never deleted: it is read again at the next start). Each segment's
        ``end`` is where its good records end (or its synced end, if further): a ``Wal`` given
        them records the newest's in the first segment it makes."""
        return recover_directory(directory, schema_hint, clean)
