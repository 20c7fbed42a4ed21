"""Recovery of a shard's WAL: reading its segments (``PWAL3``, ``PWAL2`` and ``PWAL1``) record
by record, holding each to what its synced mark and its successor's header say was fsynced,
telling damage from a torn tail, and copying a damaged segment into ``quarantine/``. The format
and the rules are in ``persist.flight._wal``'s docstring; ``Wal.recover`` is the way in.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from persist.flight._wal_format import (
    HEAD,
    HEAD_V1,
    MAGIC,
    MAGIC_V1,
    MAGIC_V2,
    MARK,
    MARKER,
    MAX_RECORD,
    QUARANTINE,
    SEG_HEAD,
    Segment,
    WalRecord,
    decode_record,
    decode_rows,
    fsync_dir,
    header_size,
    made_whole,
    mark_offset,
    now_iso,
    parse_header,
    read_mark,
    read_u32,
)

__all__ = ["Damage", "Recovery", "Torn", "recover_directory"]

_BLOCK = 512  # the file system writes whole blocks (of a multiple of this)
# More zeros than a record ends with, even with a bit flipped: its rows end with the ``_diff``
# column (small int64s: up to 7 zero bytes each).
_MIN_HOLE = 64


@dataclass
class Damage:
    """Bytes of a segment that held something and no longer hold it (never a torn tail)."""

    path: Path  # the segment
    offset: int  # ``offset + nbytes`` may be past the end of a segment cut short
    nbytes: int
    why: str
    quarantined_as: Path | None  # the segment's copy (None: none could be made, see ``recover``)
    lsn_before: int | None = None  # the highest LSN of the good record just before it
    # The lowest LSN of the good record just after it; for fsynced bytes gone from the end of a
    # segment (cut off, zeroed), the highest LSN the synced marks say they held (the writes
    # lost are those after ``lsn_before`` up to it).
    lsn_after: int | None = None


@dataclass
class Torn:
    """The tail of a segment a crash cut in the middle of an append (never acknowledged)."""

    path: Path
    offset: int
    nbytes: int


@dataclass
class Recovery:
    schema: pa.Schema | None  # of the first segment's rows (None: no segment, no hint)
    records: list[WalRecord]  # by first LSN; a write may appear twice (count it by LSN)
    segments: list[Segment]
    damage: list[Damage] = field(default_factory=list)
    torn: list[Torn] = field(default_factory=list)
    # The schema each record's rows were read under (its segment's), by its first LSN: a
    # write is of one schema version, so every copy of it is of the same.
    schemas: dict[int, pa.Schema] = field(default_factory=dict)

    def schema_of(self, record: WalRecord) -> pa.Schema | None:
        """The schema ``record``'s rows are read under: its segment's, whose metadata names
        their version of the shard's schema (``version_of``)."""
        return self.schemas.get(record.lsns[0], self.schema)


def recover_directory(directory: Path, schema_hint: pa.Schema | None, clean: bool) -> Recovery:
    """``Wal.recover`` (see there): what the segments in ``directory`` hold."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".seg"))
    except (FileNotFoundError, NotADirectoryError):
        names = []
    paths = [directory / n for n in names if (directory / n).is_file()]
    recorded = _recorded(paths)
    out = Recovery(None, [], [])
    waiting: list[_Read] = []  # header damaged, no schema yet (their bytes are kept)
    for path in paths:
        r = _read_segment(path, clean, recorded.get(path.name))
        if out.schema is None:
            out.schema = r.schema
        if r.schema is not None:
            _settle(r, r.schema, directory, out)
        elif schema_hint is not None:
            _settle(r, schema_hint, directory, out)
        else:
            waiting.append(r)
    for r in waiting:
        _settle(r, out.schema, directory, out)
    if out.schema is None:
        out.schema = schema_hint
    out.records.sort(key=lambda rec: rec.lsns[0])
    out.segments.sort(key=lambda seg: seg.path)
    out.damage.sort(key=lambda d: (d.path, d.offset))
    return out


def _settle(r: _Read, schema: pa.Schema | None, directory: Path, out: Recovery) -> None:
    """Adds what was read of one segment to ``out``, its rows read under ``schema``."""
    _check_rows(r, schema)
    if r.torn is not None:
        out.torn.append(Torn(r.path, r.torn[0], r.torn[1] - r.torn[0]))
    keep = True
    if r.bad:
        copy = _quarantine_segment(r, directory)
        keep = copy is not None
        out.damage += [Damage(r.path, a, b - a, why, copy, *_lsns(r, a, b)) for a, b, why in r.bad]
    if keep:
        seg = Segment(r.path, first_lsn=-1, end=r.end)
        for f in r.found:
            seg.last_lsn = max(seg.last_lsn, *f.record.lsns)
        out.segments.append(seg)
    out.records += [f.record for f in r.found]
    if schema is not None:
        out.schemas.update((f.record.lsns[0], schema) for f in r.found)


# --- reading a segment ---------------------------------------------------------------------------


@dataclass
class _Found:
    record: WalRecord
    offset: int
    end: int


@dataclass
class _Synced:
    """A durable statement that a segment's bytes up to ``end`` were fsynced (its records up to
    LSN ``last_lsn``; -1: none), and whose it is."""

    end: int
    last_lsn: int
    source: str


@dataclass
class _Read:
    """One segment as read: its good records and its bad and torn byte ranges."""

    path: Path
    data: bytes = b""
    schema: pa.Schema | None = None  # its header's, when the header holds
    found: list[_Found] = field(default_factory=list)
    bad: list[tuple[int, int, str]] = field(default_factory=list)  # [start, end), why
    torn: tuple[int, int] | None = None
    unreadable: bool = False
    start: int = 0  # where its records start (0: its header does not hold)
    mark: _Synced | None = None  # its own synced mark, when it holds
    end: int = -1  # where its records end, as far as they are known fsynced
    lost: dict[int, int] = field(default_factory=dict)  # bad range start -> last LSN lost


def _recorded(paths: list[Path]) -> dict[str, _Synced]:
    """What the headers of ``paths`` record of the segments before them, by file name (the
    largest end when two do)."""
    out: dict[str, _Synced] = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read(SEG_HEAD.size)
                size = header_size(data) if data.startswith(MAGIC) else None
                if size is None or size > MAX_RECORD:
                    continue
                data += f.read(size - len(data))
        except OSError:
            continue  # reported when it is read
        head, _ = parse_header(data)
        p = head.predecessor if head is not None else None
        if p is not None and (p.name not in out or out[p.name].end < p.end):
            out[p.name] = _Synced(p.end, p.last_lsn, f"the header of {path.name}, made after it,")
    return out


def _read_segment(path: Path, clean: bool, recorded: _Synced | None) -> _Read:
    r = _Read(path)
    try:
        r.data = data = path.read_bytes()
    except OSError as exc:
        r.unreadable = True
        r.bad.append((0, _size(path), f"the segment cannot be read: {exc}"))
        return r
    if data.startswith(MAGIC_V1):
        _read_v1(r, clean)
        if r.found or _next_good(data, 0) is None:
            _hold_to_synced(r, recorded)
            return r
        # No record of format 1, records framed as now: a later format's magic, damaged
        # (``PWAL3`` is one bit from ``PWAL1``).
        r = _Read(path, data)
    start, why = _header(r)
    if why is not None:
        first = _next_good(data, 0)
        if first is None and _read_v1(r, clean, damaged_header=why):
            _hold_to_synced(r, recorded)
            return r
        if first is None:
            torn = not clean and not made_whole(path.name) and _header_cut_short(data)
            _whole(r, why, torn=torn)
            _hold_to_synced(r, recorded)
            return r
        r.bad.append((0, first, why))
        start = first
    _read_records(r, start, clean)
    _hold_to_synced(r, recorded)
    return r


def _header(r: _Read) -> tuple[int, str | None]:
    """Where the records start, and why the header does not hold (None: it does). Reads the
    synced mark of a ``PWAL3`` segment."""
    data = r.data
    head, why = parse_header(data)
    if head is None:
        if data.startswith(MAGIC) and len(data) >= SEG_HEAD.size:
            # The mark has its own checksum: one that holds where the header puts it is taken.
            at = mark_offset(read_u32(data, len(MAGIC)))
            got = read_mark(data, at)
            if got is not None and got[0] >= at + MARK.size:
                r.mark = _Synced(got[0], got[1], "its synced mark")
        return 0, why
    r.start = head.records_start
    if head.mark_at is not None:
        at = head.mark_at
        got = read_mark(data, at)
        if got is None or got[0] < head.records_start:
            what = "its checksum does not match" if got is None else "it ends inside the header"
            r.bad.append((at, at + MARK.size, _MARK_DAMAGED.format(what)))
        else:
            r.mark = _Synced(got[0], got[1], "its synced mark")
    r.schema = _schema(head.schema)
    if r.schema is None:
        return 0, "the segment header's schema is undecodable"
    return head.records_start, None


_MARK_DAMAGED = (
    "the segment's synced mark is damaged ({}): how far it was fsynced is not known from it, so "
    "its tail is judged as if it had no mark (bytes cut off its end may pass for an append a "
    "crash cut short) unless the segment made after it records its end"
)


def _hold_to_synced(r: _Read, recorded: _Synced | None) -> None:
    """Holds ``r`` to what was fsynced: bytes up to the larger end its own mark and the next
    segment's header record must be good records; where they are not, or the file ends before,
    it is damage (never a torn tail), naming the writes lost."""
    marks = [m for m in (r.mark, recorded) if m is not None]
    good = max((f.end for f in r.found), default=r.start)
    r.end = good
    if not marks:
        return
    synced = max(marks, key=lambda m: m.end)
    last = max(m.last_lsn for m in marks)
    r.end = max(good, synced.end)
    if good >= synced.end:
        return
    was = [why for a, _, why in r.bad if a >= good]
    if r.torn is not None:
        was.append("it looks like an append cut short")
    r.bad = [b for b in r.bad if b[0] < good]
    r.torn = None
    before = _around(r.found, good, good)[0]
    if len(r.data) < synced.end:
        what = f"the segment ends at byte {len(r.data)}"
    else:
        what = "they do not hold records"
    if last < 0:
        lost = "no write is known lost"
    elif before is None:
        lost = f"the writes logged up to LSN {last} are lost"
    else:
        lost = f"the writes logged after LSN {before} up to LSN {last} are lost"
    if recorded is None or recorded.end < synced.end:
        lost += ", and any of its last append"  # past its own mark: nothing says what
    why = (
        f"bytes {good}..{synced.end} were fsynced (acknowledged LOCAL_DISK: {synced.source} "
        f"says so), and {what}: {lost}"
    )
    if was:
        why += f" ({'; '.join(was)})"
    r.bad.append((good, max(len(r.data), synced.end), why))
    r.bad.sort()
    if last >= 0:
        r.lost[good] = last


def _read_records(r: _Read, at: int, clean: bool) -> None:
    data = r.data
    while at < len(data):
        record, end, why = _record_at(data, at)
        if record is not None:
            r.found.append(_Found(record, at, end))
            at = end
            continue
        # A header that holds gives the record's length: its payload (which may hold marker
        # bytes, even a whole framed record, as row data) is not searched.
        nxt = _next_good(data, end if end > at else at + 1)
        if nxt is None:
            if not clean and _cut_short(data, at):
                r.torn = (at, len(data))
            else:
                r.bad.append((at, len(data), why + "; no good record after it"))
            return
        r.bad.append((at, nxt, why))
        at = nxt


def _record_at(data: bytes, at: int) -> tuple[WalRecord | None, int, str]:
    """The good record at ``at`` and its end; else None, where its payload would end (``at``
    when its header does not hold) and why."""
    if at + HEAD.size > len(data):
        return None, at, "a record is cut short"
    marker, length, crc, head_crc = HEAD.unpack_from(data, at)
    if marker != MARKER:
        return None, at, "no record marker where a record should start"
    if zlib.crc32(data[at : at + 16]) != head_crc:
        return None, at, "a record header's checksum does not match"
    end = at + HEAD.size + length
    if length > MAX_RECORD or end > len(data):
        return None, at, "a record's length is impossible"
    payload = data[at + HEAD.size : end]
    if zlib.crc32(payload) != crc:
        return None, end, "a record's checksum does not match"
    record = decode_record(payload)
    if record is None:
        return None, end, "a record is undecodable"
    return record, end, ""


def _next_good(data: bytes, at: int) -> int | None:
    """Where the first good record at or after ``at`` starts."""
    while (at := data.find(MARKER, at)) >= 0:
        if _record_at(data, at)[0] is not None:
            return at
        at += 1
    return None


def _cut_short(data: bytes, at: int) -> bool:
    """Whether ``data[at:]`` is what an append cut by a crash leaves: the start of one record,
    then perhaps zeros (blocks the file system allotted and never wrote)."""
    if data.count(0, at) == len(data) - at:
        return True
    written = data[at : _written_end(data, at)]
    if len(written) < len(MARKER):
        return MARKER.startswith(written)
    if not written.startswith(MARKER):
        return False
    if len(written) < HEAD.size:
        return True
    _, length, _, head_crc = HEAD.unpack_from(written)
    return bool(zlib.crc32(written[:16]) == head_crc and HEAD.size + length > len(written))


def _header_cut_short(data: bytes) -> bool:
    """Whether ``data`` is what a crash leaves of a segment being made: the start of a header
    (any format's), then perhaps zeros."""
    if data.count(0) == len(data):
        return True
    written = data[: _written_end(data, 0)]
    magic = written[: len(MAGIC)]
    if not any(m.startswith(magic) for m in (MAGIC, MAGIC_V2, MAGIC_V1)):
        return False
    size = header_size(written)
    return size is None or size > len(written)


def _written_end(data: bytes, at: int) -> int:
    """Where the blocks a crash left unwritten start, at or after ``at``: the first block
    boundary after which the file holds only zeros (a few zeros at its very end are as likely
    the last bytes of a record, so at least ``_MIN_HOLE``); the end of the file if none."""
    boundary = -(-len(data.rstrip(b"\0")) // _BLOCK) * _BLOCK
    start = max(at, boundary)
    return start if len(data) - start >= _MIN_HOLE else len(data)


def _read_v1(r: _Read, clean: bool, damaged_header: str | None = None) -> bool:
    """Reads ``r`` as a segment of the previous format: the first bad record ends it. With
    ``damaged_header`` (the magic is not ``PWAL1``, and no record of this format was found),
    only if at least one record holds; returns whether it was read so."""
    data = r.data
    size = len(MAGIC_V1) + 4
    n = read_u32(data, len(MAGIC_V1)) if len(data) >= size else len(data)
    if size + n > len(data):
        if damaged_header is not None:
            return False
        _whole(r, "the segment header is cut short", torn=not clean and _header_cut_short(data))
        return True
    at = size + n
    found: list[_Found] = []
    while at + HEAD_V1.size <= len(data):
        length, crc = HEAD_V1.unpack_from(data, at)
        end = at + HEAD_V1.size + length
        if length > MAX_RECORD or end > len(data) or zlib.crc32(data[at + 8 : end]) != crc:
            break
        record = decode_record(data[at + 8 : end])
        if record is None:
            break
        found.append(_Found(record, at, end))
        at = end
    if damaged_header is not None and not found:
        return False
    r.found = found
    r.start = size + n
    if damaged_header is not None:
        r.bad.append((0, size + n, damaged_header))
    else:
        r.schema = _schema(data[size : size + n])
        if r.schema is None:
            r.bad.append((0, size + n, "the segment header's schema is undecodable"))
    if at < len(data):
        written = data[at : _written_end(data, at)]
        short = len(written) < HEAD_V1.size
        if not clean and (short or HEAD_V1.size + read_u32(written, 0) > len(written)):
            r.torn = (at, len(data))
        else:
            # The old format cannot tell where a later record starts: the rest is unread.
            why = "a record does not hold (format 1: the rest of the segment is not read)"
            r.bad.append((at, len(data), why))
    return True


def _whole(r: _Read, why: str, torn: bool) -> None:
    if torn:
        r.torn = (0, len(r.data))
    else:
        r.bad.append((0, len(r.data), why + "; no good record in the segment"))


def _check_rows(r: _Read, schema: pa.Schema | None) -> None:
    """Moves the records whose rows cannot be read under ``schema`` to the damage."""
    keep = []
    for f in r.found:
        rec = f.record
        if schema is None:
            why = "its rows are unreadable: the segment header is damaged, no schema is known"
        else:
            why = _malformed(rec, schema)
        if why:
            r.bad.append((f.offset, f.end, f"a record (LSN {rec.lsns[0]}..) is lost: {why}"))
        else:
            keep.append(f)
    r.found = keep
    r.bad.sort()


def _malformed(rec: WalRecord, schema: pa.Schema) -> str:
    if not rec.lsns or len(rec.seqs) != len(rec.lsns) or len(rec.counts) != len(rec.lsns):
        return "its writes are malformed"
    try:
        rows = decode_rows(rec.rows, schema)
    except (pa.ArrowException, ValueError, OSError) as exc:
        return f"its rows do not decode under the schema: {exc}"
    if min(rec.counts) < 0 or sum(rec.counts) != rows.num_rows:
        return "its row counts do not match its rows"
    return ""


def _schema(data: bytes) -> pa.Schema | None:
    try:
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowException, ValueError, OSError):
        return None


def _lsns(r: _Read, start: int, end: int) -> tuple[int | None, int | None]:
    """``Damage.lsn_before`` and ``lsn_after`` of bytes ``[start, end)`` of ``r``."""
    before, after = _around(r.found, start, end)
    return before, r.lost.get(start, after)


def _around(found: list[_Found], start: int, end: int) -> tuple[int | None, int | None]:
    """The LSNs of the good records just before and just after bytes ``[start, end)``."""
    before = [f for f in found if f.end <= start]
    after = [f for f in found if f.offset >= end]
    return (
        max(before[-1].record.lsns) if before else None,
        min(after[0].record.lsns) if after else None,
    )


def _quarantine_segment(r: _Read, directory: Path) -> Path | None:
    """Copies a damaged segment (the bytes read) to ``quarantine/`` with a note; None if it
    can't be (the segment must then stay where it is)."""
    if r.unreadable:
        return None
    if directory.name == QUARANTINE:
        return r.path  # read where it was set aside already
    where = directory / QUARANTINE
    copy = where / r.path.name
    ranges = []
    for a, b, why in r.bad:
        before, after = _lsns(r, a, b)
        ranges.append(
            {"offset": a, "nbytes": b - a, "why": why, "lsn_before": before, "lsn_after": after}
        )
    summary = "; ".join(f"bytes {x['offset']}+{x['nbytes']}: {x['why']}" for x in ranges)
    note = {
        "segment": r.path.name,
        "lsn": None,
        "writer_id": None,
        "seq": None,
        "why": f"the segment {r.path.name} ({len(r.data)} bytes) is damaged: {summary}",
        "damage": ranges,
        "at": now_iso(),
    }
    try:
        where.mkdir(parents=True, exist_ok=True)
        # Written in place: until recovery returns, the segment itself is there to copy again.
        _write_synced(copy, r.data)
        _write_synced(where / (r.path.name + ".json"), (json.dumps(note) + "\n").encode())
        fsync_dir(where)
    except OSError:
        return None
    return copy


# --- helpers -------------------------------------------------------------------------------------


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, fsynced (over what it held: the same bytes, mostly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
