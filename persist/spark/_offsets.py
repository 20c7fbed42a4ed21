"""A stream's offsets as positions in the shard's updates, and the reads between two of them.

Pure functions (no I/O, no Spark), so that the arithmetic that keeps a stream exact is tested on
its own.

The stream visits the updates in buckets, each a range of times, and each bucket's keys in key
order. The first bucket, from frontier 0, is the snapshot at ``as_of`` (its times ``[0,
as_of + 1)``, advanced to ``as_of``); each later one a range of times ``[f, g)``, at their own
times. An offset is a position in that order:

- ``{"frontier": f}``: every update below ``f`` has been emitted (nothing, for 0).
- ``{"frontier": f, "until": g, "key": hex}``: every update below ``f``, plus those of the bucket
  ``[f, g)`` whose key sorts below ``key`` (``core.arrow.keyrange.encode_keys`` of one key, in hex).
  Such an offset may also carry ``"version": v``: the shard's schema version the key is in (its
  columns, and so its sort order, are that version's; offsets checkpointed before versions
  existed carry none).

The reads from one position to the next take each update between them exactly once: key ranges
``[k1, k2)``, ``[k2, k3)``, ... tile a bucket's keys, and buckets tile the times. A bucket's
bounds are values (times, a key), not positions in parts, so the same two offsets read the same
rows before and after a restart, whatever compaction did meanwhile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from persist.core.arrow.keyrange import Key, decode_keys, encode_keys
from persist.core.frontier import check_below_upper
from persist.core.read.rowbounds import RowBounds
from persist.errors import IntegrityError, InvalidUsage

__all__ = ["Position", "Read", "next_position", "reads", "settled"]

_MAX_TIME = 2**63
_PARTIAL = {"frontier", "until", "key"}
_VERSIONED = {*_PARTIAL, "version"}


@dataclass(frozen=True)
class Position:
    """Everything below ``frontier`` emitted; with ``key``, also the updates of the bucket
    ``[frontier, until)`` with keys below ``key`` (encoded in schema ``version``'s columns;
    None: not recorded)."""

    frontier: int
    until: int | None = None
    key: bytes | None = None
    version: int | None = None

    @classmethod
    def parse(cls, offset: Mapping[str, Any]) -> Position:
        """The position of a stream offset (``InvalidUsage`` if it is not one of ours)."""
        if not isinstance(offset, Mapping) or set(offset) not in (
            {"frontier"},
            _PARTIAL,
            _VERSIONED,
        ):
            raise InvalidUsage(f"not a persist stream offset: {offset!r}")
        frontier = _time(offset, "frontier")
        if "key" not in offset:
            return cls(frontier)
        until = _time(offset, "until")
        version = _time(offset, "version") if "version" in offset else None
        raw = offset["key"]
        try:
            key = bytes.fromhex(raw) if isinstance(raw, str) else b""
        except ValueError:
            key = b""
        if not key or until <= frontier:
            raise InvalidUsage(f"not a persist stream offset: {offset!r}")
        return cls(frontier, until, key, version)

    def to_offset(self) -> dict[str, Any]:
        """The offset Spark records: always built in the same key order, since Spark tells
        offsets apart by their JSON."""
        if self.key is None:
            return {"frontier": self.frontier}
        out: dict[str, Any] = {
            "frontier": self.frontier,
            "until": self.until,
            "key": self.key.hex(),
        }
        if self.version is not None:
            out["version"] = self.version
        return out

    def in_version(self, version: int) -> Position:
        """This position, read by a stream whose reader is at schema ``version``: a key
        position records it; ``InvalidUsage`` if its key is in another version's columns (a
        query restarted from its checkpoint after the shard evolved, inside a micro-batch
        cut by key)."""
        if self.key is None:
            return self
        if self.version is None:
            return dataclasses.replace(self, version=version)
        if self.version != version:
            raise InvalidUsage(
                f"this stream's checkpoint stopped inside a micro-batch cut by key in schema "
                f"version {self.version} of the shard, whose reads are now in version "
                f"{version}: its key can't be placed in the new columns' order, so the rest "
                "of that micro-batch can't be read. Start the query anew (a new checkpoint)"
            )
        return self


def _time(offset: Mapping[str, Any], name: str) -> int:
    value = offset[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_TIME:
        raise InvalidUsage(f"not a persist stream offset ({name} {value!r}): {dict(offset)!r}")
    return value


@dataclass(frozen=True)
class Read:
    """One read of a micro-batch: the updates at times ``[lower, upper)`` at their own times,
    or (``snapshot``, ``lower`` 0) the contents as of ``upper - 1``; of the keys in
    ``[lower_key, upper_key)`` (encoded; empty: unbounded)."""

    lower: int
    upper: int
    snapshot: bool
    lower_key: bytes = b""
    upper_key: bytes = b""


def _bucket(lower: int, upper: int, lower_key: bytes, upper_key: bytes) -> Read:
    return Read(lower, upper, lower == 0, lower_key, upper_key)


def reads(start: Position, end: Position, as_of: int | None) -> list[Read]:
    """What the micro-batch from ``start`` to ``end`` reads: every update after ``start`` and
    not after ``end``, each once. From frontier 0 to a frontier ``e``, the snapshot is at
    ``as_of`` (the option; None: ``e - 1``) and the updates after it follow."""
    if start == end:
        return []
    same_bucket = end.key is not None and (end.frontier, end.until) == (
        start.frontier,
        start.until,
    )
    past = start.frontier if start.until is None else start.until
    if not same_bucket and end.frontier < past:
        raise InvalidUsage(f"stream offsets out of order: {start} then {end}")
    out: list[Read] = []
    frontier = start.frontier
    if start.key is not None:
        assert start.until is not None
        if same_bucket:
            assert end.key is not None
            return [_bucket(start.frontier, start.until, start.key, end.key)]
        out.append(_bucket(start.frontier, start.until, start.key, b""))
        frontier = start.until
    stop = end.frontier
    if frontier == 0 and not (end.key is not None and stop == 0):
        snapshot_at = stop - 1 if as_of is None else as_of
        check_below_upper(snapshot_at, stop)
        out.append(Read(0, snapshot_at + 1, True))
        frontier = snapshot_at + 1
    if frontier < stop:
        out.append(Read(frontier, stop, False))
    if end.key is not None:
        assert end.until is not None
        out.append(_bucket(end.frontier, end.until, b"", end.key))
    return out


def settled(
    start: Position, upper: int, max_rows: int | None, as_of: int | None
) -> Position | None:
    """The end of the micro-batch from ``start`` when the shard's ``upper`` alone tells it:
    ``start`` itself when nothing after it is readable yet, ``upper`` when there is no row
    limit. None: ``next_position`` must cut it."""
    if start == Position(0) and as_of is not None and upper <= as_of:
        return start  # the snapshot at as_of is not readable yet
    if start.key is None and upper <= start.frontier:
        return start
    if max_rows is None:
        return Position(upper)
    return None


def next_position(
    start: Position, upper: int, max_rows: int, as_of: int | None, bounds: RowBounds
) -> Position:
    """The end of the micro-batch from ``start``, of about ``max_rows`` rows of what lies
    below ``upper`` (``bounds``: of the times ``[start.frontier, upper)``).

    A batch is charged the rows of the parts whose times it takes whole
    (``RowBounds.frontier_within``) and, in a bucket cut by key, of the index segments that
    start in its key range (``RowBounds.key_within``). It is charged at most ``max_rows``,
    unless the smallest step the parts' times and index keys can cut is charged more: then it
    is that step. So consecutive batches are charged more than ``max_rows`` together, and
    every call with something below ``upper`` still to emit moves past ``start``. A batch that
    finishes a bucket goes on through later times while its charge allows, but cuts no new
    bucket by key: it ends at a frontier."""
    if start.key is not None:
        assert start.until is not None
        bucket = bounds.between(start.frontier, start.until)
        cut, rows = bucket.key_within(_decode(start.key, bounds), max_rows)
        if cut is not None:
            return Position(start.frontier, start.until, encode_keys(cut))
        return _extend(start.until, upper, max_rows - rows, bounds)
    if start.frontier == 0:
        until = upper if as_of is None else as_of + 1
        assert until <= upper
        cut, rows = bounds.between(0, until).key_within(None, max_rows)
        if cut is not None:
            return Position(0, until, encode_keys(cut))
        return _extend(until, upper, max_rows - rows, bounds)
    times = bounds.between(start.frontier, upper)
    frontier = times.frontier_within(max_rows)
    if frontier > start.frontier:
        return Position(frontier)
    # The parts holding start.frontier alone bound more than max_rows: cut their bucket by key.
    until = times.next_frontier()
    cut, _ = bounds.between(start.frontier, until).key_within(None, max_rows)
    if cut is None:
        return Position(until)
    return Position(start.frontier, until, encode_keys(cut))


def _extend(frontier: int, upper: int, budget: int, bounds: RowBounds) -> Position:
    """From a finished bucket at ``frontier``: on through the times that fit ``budget``."""
    if budget <= 0 or frontier >= upper:
        return Position(frontier)
    return Position(max(frontier, bounds.between(frontier, upper).frontier_within(budget)))


def _decode(key: bytes, bounds: RowBounds) -> Key:
    try:
        return decode_keys(key, bounds.schema)
    except IntegrityError:
        raise InvalidUsage("a stream offset's key is not one of this shard's keys") from None
