"""The bytes of the WAL: segment headers (with their synced mark and the record of the segment
before), framed ``WalRecord``s (the format is described in ``persist.flight._wal``'s docstring),
segment names, ``Segment``, and how the WAL's files are written durably. What the log, its
recovery (``_wal_recover``) and its directory (``_wal_dir``) share.
"""

from __future__ import annotations

import datetime
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa

MAGIC = b"PWAL3\n"
MAGIC_V2 = b"PWAL2\n"  # segments written before the synced mark: still read
MAGIC_V1 = b"PWAL1\n"  # the previous release's segments: still read
MARKER = b"\xa7PWrec\xe1\x5c"  # starts every record: where recovery picks up after damage
# magic, schema length, length of the record of the segment before (0: none), crc32 of the
# header but its synced mark
SEG_HEAD = struct.Struct("<6sIII")
SEG_HEAD_V2 = struct.Struct("<6sII")  # magic, schema length, crc32 of magic + length + schema
MARK = struct.Struct("<QQI")  # synced end, synced last LSN, crc32 of the 16 bytes before
PRED = struct.Struct("<QQ")  # the segment before: its final synced end, last LSN; then its name
NO_LSN = (1 << 64) - 1  # a synced last LSN when no record is synced
HEAD = struct.Struct("<8sIII")  # marker, length, crc32 of the payload, crc32 of the 16 before
HEAD_V1 = struct.Struct("<II")  # length, crc32 of the payload
MAX_RECORD = 1 << 31
QUARANTINE = "quarantine"  # a shard directory's sub-directory of what was set aside
SECTOR = 512  # the mark never straddles one of these boundaries: it is written whole or not
# ``<first lsn>-<n>.seg``: a segment named only once its header was whole and fsynced; the names
# of earlier releases (``<first lsn>.<n>.seg``, ``<first lsn>.seg``) were made before.
_NAME = re.compile(r"(\d+)(?:([.-])(\d+))?\.seg")


# A streamed write of schema version n > 0 carries n under this key in its schema's metadata,
# in the ledger and in the WAL (a segment's header schema); a write without it is of version 0.
# The version can't be told from the columns: a field dropped and added back under its name
# makes two versions look alike.
VERSION_KEY = b"persist.schema_version"


def version_of(rows: pa.RecordBatch | pa.Table | pa.Schema) -> int:
    """The schema version of a streamed write's rows (``version_tag``), or of a WAL schema."""
    metadata = (rows if isinstance(rows, pa.Schema) else rows.schema).metadata
    raw = None if metadata is None else metadata.get(VERSION_KEY)
    return 0 if raw is None else int(raw)


def version_tag(version: int) -> pa.KeyValueMetadata | None:
    """The schema metadata that marks rows of ``version`` (None for version 0: no mark)."""
    return None if version == 0 else pa.KeyValueMetadata({VERSION_KEY: str(version).encode()})


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


def decode_record(payload: bytes) -> WalRecord | None:
    """The record a payload holds; None if it holds none."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError:
        return None


def frame(records: list[WalRecord]) -> bytes:
    """``records`` as the bytes appended to a segment."""
    out = bytearray()
    for record in records:
        payload = _encoder.encode(record)
        head = MARKER + struct.pack("<II", len(payload), zlib.crc32(payload))
        out += head + u32(zlib.crc32(head)) + payload
    return bytes(out)


@dataclass(frozen=True)
class Predecessor:
    """What a segment's header records of the segment of its log before it: its file name, the
    end of its last successful append (fsynced) and the highest LSN up to there (-1: none)."""

    name: str
    end: int
    last_lsn: int


@dataclass(frozen=True)
class SegHeader:
    """A segment header that holds (``PWAL3`` or ``PWAL2``)."""

    records_start: int
    schema: bytes
    mark_at: int | None = None  # where its synced mark is (``PWAL3``)
    predecessor: Predecessor | None = None


def segment_header(schema: pa.Schema, predecessor: Predecessor | None = None) -> bytes:
    """The bytes a segment whose rows are of ``schema`` starts with (its synced mark: nothing
    after the header is synced yet)."""
    s: bytes = schema.serialize().to_pybytes()
    at = mark_offset(len(s))
    pad = bytes(at - SEG_HEAD.size - len(s))
    pred = b""
    if predecessor is not None:
        body = PRED.pack(predecessor.end, _lsn_out(predecessor.last_lsn))
        pred = body + predecessor.name.encode()
    head = MAGIC + u32(len(s)) + u32(len(pred))
    crc = zlib.crc32(pred, zlib.crc32(pad, zlib.crc32(s, zlib.crc32(head))))
    return head + u32(crc) + s + pad + synced_mark(at + MARK.size + len(pred), -1) + pred


def mark_offset(schema_len: int) -> int:
    """Where the synced mark of a ``PWAL3`` segment is: right after the schema, or at the next
    sector boundary when it would straddle one (zeros between)."""
    at = SEG_HEAD.size + schema_len
    return at + (SECTOR - at % SECTOR if at % SECTOR > SECTOR - MARK.size else 0)


def synced_mark(end: int, last_lsn: int) -> bytes:
    """A synced mark: the segment's bytes up to ``end`` (its records up to LSN ``last_lsn``,
    -1: none) are fsynced."""
    body = struct.pack("<QQ", end, _lsn_out(last_lsn))
    return body + u32(zlib.crc32(body))


def read_mark(data: bytes, at: int) -> tuple[int, int] | None:
    """The synced mark at ``at`` (end, last LSN: -1 for none); None if it does not hold."""
    if at + MARK.size > len(data):
        return None
    end, last, crc = MARK.unpack_from(data, at)
    if zlib.crc32(data[at : at + 16]) != crc:
        return None
    return int(end), -1 if last == NO_LSN else int(last)


def parse_header(data: bytes) -> tuple[SegHeader | None, str]:
    """The ``PWAL3`` or ``PWAL2`` header ``data`` starts with; else None and why it does not
    hold. The synced mark is not checked (it has its own checksum: ``read_mark``)."""
    if data.startswith(MAGIC_V2):
        if len(data) < SEG_HEAD_V2.size:
            return None, "the segment header is cut short"
        _, n, crc = SEG_HEAD_V2.unpack_from(data)
        end = SEG_HEAD_V2.size + n
        if end > len(data):
            return None, "the segment header's length is impossible"
        if zlib.crc32(data[SEG_HEAD_V2.size : end], zlib.crc32(data[:10])) != crc:
            return None, "the segment header's checksum does not match"
        return SegHeader(end, data[SEG_HEAD_V2.size : end]), ""
    if len(data) < SEG_HEAD.size:
        return None, "the segment header is cut short"
    magic, n, m, crc = SEG_HEAD.unpack_from(data)
    if magic != MAGIC:
        return None, "the segment header's magic is wrong"
    at = mark_offset(n)
    end = at + MARK.size + m
    if end > len(data) or 0 < m < PRED.size:
        return None, "the segment header's length is impossible"
    if header_crc(data, n, m) != crc:
        return None, "the segment header's checksum does not match"
    pred = None
    if m:
        p_end, p_last = PRED.unpack_from(data, at + MARK.size)
        name = data[at + MARK.size + PRED.size : end].decode(errors="replace")
        pred = Predecessor(name, int(p_end), -1 if p_last == NO_LSN else int(p_last))
    return SegHeader(end, data[SEG_HEAD.size : SEG_HEAD.size + n], at, pred), ""


def header_crc(data: bytes, n: int, m: int) -> int:
    """The checksum of a ``PWAL3`` header: all of it but the checksum and the synced mark."""
    at = mark_offset(n)
    crc = zlib.crc32(data[SEG_HEAD.size : at], zlib.crc32(data[:14]))
    return zlib.crc32(data[at + MARK.size : at + MARK.size + m], crc)


def header_size(data: bytes) -> int | None:
    """How long the header ``data`` starts with says it is (any format, whether it holds or
    not); None when too little of it is there to say."""
    for magic, size in ((MAGIC, SEG_HEAD.size), (MAGIC_V2, SEG_HEAD_V2.size), (MAGIC_V1, 10)):
        if data.startswith(magic) and len(data) >= size:
            n = read_u32(data, len(magic))
            if magic == MAGIC:
                return mark_offset(n) + MARK.size + read_u32(data, 10)
            return size + n
    return None


def _lsn_out(lsn: int) -> int:
    return NO_LSN if lsn < 0 else lsn


def segment_name(first_lsn: int, n: int) -> str:
    """The name of the ``n``-th segment a log made, its first LSN ``first_lsn``."""
    return f"{first_lsn:020d}-{n}.seg"


def made_whole(name: str) -> bool:
    """Whether a segment of this name was named only once its header was whole and fsynced (so
    a header cut short is damage, never a segment torn while being made)."""
    m = _NAME.fullmatch(name)
    return m is not None and m[2] == "-"


def segment_order(name: str) -> tuple[int, int]:
    """Where a segment's name puts it in its log: by first LSN, then by ``n``."""
    m = _NAME.fullmatch(name)
    return (-1, -1) if m is None else (int(m[1]), int(m[3] or 0))


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def read_u32(data: bytes, at: int) -> int:
    value: int = struct.unpack_from("<I", data, at)[0]
    return value


@dataclass
class Segment:
    """A segment file and the LSNs written to it."""

    path: Path
    first_lsn: int
    last_lsn: int = -1  # highest LSN written to it (-1: none)
    # Where its records end as far as they are known fsynced (-1: not known): set when the log
    # rolls past it, and by recovery; the log's next segment records it.
    end: int = -1


# --- writing files -------------------------------------------------------------------------------


def write_durably(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, all or nothing (written aside, fsynced, renamed; the
    caller fsyncs the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()
