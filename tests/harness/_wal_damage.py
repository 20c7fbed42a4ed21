"""Damage to a killed streaming server's WAL, for the Flight fault harness
(``test_flight_faults.py``): a bit flip, a truncation or a zeroed 512-byte block at a random byte
of a random segment, and which writes that put at risk.

The segment is read before it is damaged (the format is in ``persist.flight._wal``), so the
harness knows the LSNs of every record the damage touched: only those may be missing after the
restart, and only if the restart reported the damage (an ERROR naming the segment, and the
segment's copy in ``quarantine/``). A write the damage did not touch, or damage nobody reported,
excuses nothing.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from persist.flight._wal_format import HEAD, MARKER, QUARANTINE, SEG_HEAD, decode_record

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
            f"of {self.server}:{self.shard}/{self.segment.name}, {len(self.at_risk)} LSNs at "
            f"risk{_span(self.at_risk)}{', the header' if self.header else ''}; "
            f"reported {self.reported}, called torn {self.torn}"
        )


def _span(lsns: set[int]) -> str:
    return f" ({min(lsns)}..{max(lsns)})" if lsns else ""


def records(data: bytes) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """Where a segment's header ends, and ``(start, end, lsns)`` of each good record in it (a
    bad one is stepped over to the next marker, as recovery does)."""
    if len(data) < SEG_HEAD.size:
        return len(data), []
    _, n, _ = SEG_HEAD.unpack_from(data)
    at = header_end = min(len(data), SEG_HEAD.size + n)
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


def damage(wal_dir: Path, server: str, rng: random.Random, kind: str) -> Corruption | None:
    """Damages a random segment of ``wal_dir`` (a stopped server's) at a random byte; None when
    it holds no segment with a record."""
    segments = []
    for path in sorted(wal_dir.glob("*/*.seg")):
        data = path.read_bytes()
        if records(data)[1]:
            segments.append((path, data))
    if not segments:
        return None
    path, data = rng.choice(segments)
    header_end, found = records(data)
    offset = rng.randrange(len(data))
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
    for a, b, lsns in found:
        if a < end and start < b:
            c.at_risk.update(lsns)
    return c
