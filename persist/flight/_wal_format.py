"""The bytes of the WAL: segment headers and framed ``WalRecord``s (the format is described in
``persist.flight._wal``'s docstring), ``Segment``, and how the WAL's files are written
durably. What the log, its recovery (``_wal_recover``) and its directory (``_wal_dir``) share.
"""

from __future__ import annotations

import datetime
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa

MAGIC = b"PWAL2\n"
MAGIC_V1 = b"PWAL1\n"  # the previous release's segments: still read
MARKER = b"\xa7PWrec\xe1\x5c"  # starts every record: where recovery picks up after damage
SEG_HEAD = struct.Struct("<6sII")  # magic, schema length, crc32 of magic + length + schema
HEAD = struct.Struct("<8sIII")  # marker, length, crc32 of the payload, crc32 of the 16 before
HEAD_V1 = struct.Struct("<II")  # length, crc32 of the payload
MAX_RECORD = 1 << 31
QUARANTINE = "quarantine"  # a shard directory's sub-directory of what was set aside


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


def segment_header(schema: pa.Schema) -> bytes:
    """The bytes a segment whose rows are of ``schema`` starts with."""
    s: bytes = schema.serialize().to_pybytes()
    crc = zlib.crc32(s, zlib.crc32(MAGIC + u32(len(s))))
    return SEG_HEAD.pack(MAGIC, len(s), crc) + s


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
