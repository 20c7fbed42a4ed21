"""Damage to a killed streaming server's WAL, for the Flight fault harness
(``test_flight_faults.py``): a bit flip, a truncation or a zeroed 512-byte block at a random byte
of a random segment, and which writes that put at risk.

The segment is read before it is damaged (the format is in ``persist.flight._wal``), so the
harness knows the LSNs of every record the damage touched: only those may be missing after the
restart, and only if the restart reported the damage (an ERROR naming the segment, and the
segment's copy in ``quarantine/``). A write the damage did not touch, or damage nobody reported,
excuses nothing.

A truncation or a zeroed block is done only where the log has on record that the bytes were
fsynced: it starts before the segment's synced end (its synced mark, or what the header of the
segment after it records, the larger). Past that end is the newest append of the newest segment,
the one place where a cut or zeros cannot be told from an append a crash tore before its fsync
returned (``persist.flight._wal`` says so); damage there would lose writes acked ``LOCAL_DISK``
with nothing to report, which is the format's stated limit, not a bug to find. A bit flip goes
anywhere: it is always found.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from persist.flight._wal_format import (
    HEAD,
    MARKER,
    QUARANTINE,
    decode_record,
    parse_header,
    read_mark,
)

__all__ = ["KINDS", "Corruption", "damage", "records"]

KINDS = ("bit flip", "truncation", "zeroed block")
BLOCK = 512


@dataclass
class Corruption:
    """One damage done to one segment of one server's WAL, and what the restart said of it."""

    server: str
    shard: str
    segment: Path
    kind: str
    offset: int  # the random byte
    start: int  # the bytes touched: [start, end)
    end: int
    size: int  # of the segment before
    at_risk: set[int] = field(default_factory=set)  # LSNs of the records the damage touched
    synced: int = -1  # the segment's synced end (bytes on record as fsynced; -1: none)
    header: bool = False  # it touched the segment header
    reported: bool = False  # an ERROR named the segment, and its copy is in quarantine/
    torn: bool = False  # the restart called it a tail torn by a crash (a warning)

    def judge(self, stderr: list[str]) -> None:
        """Reads what the restarted server said of this damage."""
        copy = self.segment.parent / QUARANTINE / self.segment.name
        said = [line for line in stderr if str(self.segment) in line]
        self.reported = copy.exists() and any(
            line.startswith("ERROR") and "is damaged" in line for line in said
        )
        self.torn = any("torn by a crash" in line for line in said)

    def __str__(self) -> str:
        return (
            f"{self.kind} at byte {self.offset} (bytes {self.start}..{self.end} of {self.size}) "
            f"of {self.server}:{self.shard}/{self.segment.name} (synced up to {self.synced}), "
            f"{len(self.at_risk)} LSNs at risk{_span(self.at_risk)}"
            f"{', the header' if self.header else ''}; "
            f"reported {self.reported}, called torn {self.torn}"
        )


def _span(lsns: set[int]) -> str:
    return f" ({min(lsns)}..{max(lsns)})" if lsns else ""


def records(data: bytes) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """Where a segment's header ends, and ``(start, end, lsns)`` of each good record in it (a
    bad one is stepped over to the next marker, as recovery does)."""
    head, _ = parse_header(data)
    if head is None:
        return len(data), []
    at = header_end = head.records_start
    out = []
    while at + HEAD.size <= len(data):
        marker, length, crc, head_crc = HEAD.unpack_from(data, at)
        end = at + HEAD.size + length
        record = None
        if (
            marker == MARKER
            and zlib.crc32(data[at : at + 16]) == head_crc
            and end <= len(data)
            and zlib.crc32(data[at + HEAD.size : end]) == crc
        ):
            record = decode_record(data[at + HEAD.size : end])
        if record is None:
            at = data.find(MARKER, at + 1)
            if at < 0:
                break
            continue
        out.append((at, end, list(record.lsns)))
        at = end
    return header_end, out


def synced_end(data: bytes, recorded: int) -> int:
    """Up to where a segment's bytes are on record as fsynced: its own synced mark, or
    ``recorded`` (what the header of the segment after it says), the larger; -1 if neither."""
    head, _ = parse_header(data)
    own = -1
    if head is not None and head.mark_at is not None:
        mark = read_mark(data, head.mark_at)
        own = -1 if mark is None else mark[0]
    return max(own, recorded)


def damage(wal_dir: Path, server: str, rng: random.Random, kind: str) -> Corruption | None:
    """Damages a random segment of ``wal_dir`` (a stopped server's) at a random byte (a
    truncation or zeroed block only before its synced end); None when it holds no segment with
    a record."""
    every = [(path, path.read_bytes()) for path in sorted(wal_dir.glob("*/*.seg"))]
    recorded: dict[Path, int] = {}  # what the segments after them record of them
    for path, data in every:
        head, _ = parse_header(data)
        if head is not None and head.predecessor is not None:
            before = path.parent / head.predecessor.name
            recorded[before] = max(recorded.get(before, -1), head.predecessor.end)
    segments = [(path, data) for path, data in every if records(data)[1]]
    if not segments:
        return None
    path, data = rng.choice(segments)
    header_end, found = records(data)
    synced = synced_end(data, recorded.get(path, -1))
    limit = len(data)
    if kind == "truncation" and 0 < synced < len(data):
        limit = synced
    elif kind == "zeroed block" and 0 < synced < len(data):
        limit = min(len(data), -(-synced // BLOCK) * BLOCK)  # the block starts before it
    offset = rng.randrange(limit)
    body = bytearray(data)
    if kind == "bit flip":
        start, end = offset, offset + 1
        body[offset] ^= 1 << rng.randrange(8)
    elif kind == "truncation":
        start, end = offset, len(data)
        del body[offset:]
    elif kind == "zeroed block":
        start = offset - offset % BLOCK
        end = min(len(data), start + BLOCK)
        body[start:end] = bytes(end - start)
    else:
        raise ValueError(kind)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, bytes(body), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    c = Corruption(server, path.parent.name, path, kind, offset, start, end, len(data))
    c.header = start < header_end
    c.synced = synced
    for a, b, lsns in found:
        if a < end and start < b:
            c.at_risk.update(lsns)
    return c
