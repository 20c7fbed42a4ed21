"""Encoding of everything persist stores or hands around: framed, checksummed, versioned.

Frame: ``b"PRS"`` + kind (1 byte) + format version (1 byte) + BLAKE2b-128 of the payload
(16 bytes) + payload (msgpack, by msgspec). A frame that fails any check raises
``IntegrityError``: corrupt metadata is never used. Decoders keep reading every version ever
written; ``tests/core/test_codec.py`` decodes frozen bytes of each version to hold that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgspec

from persist.core.shard.diff import StateDiff, apply_diffs
from persist.core.shard.types import PartRef, State
from persist.errors import IntegrityError, InvalidUsage

T = TypeVar("T")

MAGIC = b"PRS"
HEADER_LEN = len(MAGIC) + 2 + 16

KIND_DIFF = b"D"
KIND_ROLLUP = b"R"
KIND_BATCH = b"B"
KIND_SPLIT = b"S"
KIND_CATALOG = b"C"

FORMAT_VERSION = 1
# Frames that hold schema versions (``State.schemas``, ``StateDiff.schemas``, a split's
# ``shapes``, a batch of parts of a version above 0) are written as format 2: a release that
# predates versions refuses them loudly instead of reading a part in the wrong columns.
EVOLVED_FORMAT_VERSION = 2
# Frames that reference an unsorted run (``PartRef.unsorted``: a state or diff holding a batch
# with one, a batch of them, a split reading one) are written as format 3: a release that
# predates unsorted runs would take the part for a sorted one and merge it wrongly.
UNSORTED_FORMAT_VERSION = 3
# Frames that reference a part a merge wrote apart (``PartRef.alone``) are written as format 4:
# a release that predates it would take a merged batch's two sorted runs for one.
ALONE_FORMAT_VERSION = 4
_READABLE = (FORMAT_VERSION, EVOLVED_FORMAT_VERSION, UNSORTED_FORMAT_VERSION, ALONE_FORMAT_VERSION)
_KIND_NAMES = {
    KIND_DIFF: "state diff",
    KIND_ROLLUP: "state rollup",
    KIND_BATCH: "batch",
    KIND_SPLIT: "split",
    KIND_CATALOG: "catalog",
}


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _format(obj: Any) -> int:
    """The format version a frame of ``obj`` is written in (see ``EVOLVED_FORMAT_VERSION``,
    ``UNSORTED_FORMAT_VERSION``, ``ALONE_FORMAT_VERSION``): the newest any of it needs."""
    parts = list(_parts_of(obj))
    if any(p.alone for p in parts):
        return ALONE_FORMAT_VERSION
    if any(p.unsorted for p in parts):
        return UNSORTED_FORMAT_VERSION
    if getattr(obj, "schemas", None) or getattr(obj, "shapes", None) is not None:
        return EVOLVED_FORMAT_VERSION
    hollow = getattr(obj, "hollow", None)
    if hollow is not None and any(p.schema_version for p in hollow.parts):
        return EVOLVED_FORMAT_VERSION
    return FORMAT_VERSION


def _parts_of(obj: Any) -> Iterator[PartRef]:
    """The parts a frame's object references: a state's or a diff's batches, a batch's, or a
    split's."""
    batches = getattr(obj, "batches", None)
    if isinstance(batches, dict):
        batches = batches.values()
    elif isinstance(batches, list):
        batches = (b for _, b in batches if b is not None)
    else:
        hollow = getattr(obj, "hollow", None)
        batches = () if hollow is None else (hollow,)
    for b in batches:
        yield from b.parts
    parts = getattr(obj, "parts", None)
    if isinstance(parts, (tuple, list)):
        yield from (p for p in parts if isinstance(p, PartRef))


def encode_frame(kind: bytes, obj: Any) -> bytes:
    payload = msgspec.msgpack.encode(obj)
    return b"".join((MAGIC, kind, bytes([_format(obj)]), _digest(payload), payload))


def decode_frame(kind: bytes, data: bytes, typ: type[T]) -> T:
    name = _KIND_NAMES[kind]
    if len(data) < HEADER_LEN or data[:3] != MAGIC:
        raise IntegrityError(f"not a persist {name}: bad header")
    if data[3:4] != kind:
        raise IntegrityError(f"expected a persist {name}, found kind {data[3:4]!r}")
    version = data[4]
    payload = memoryview(data)[HEADER_LEN:]
    if _digest(payload) != data[5:HEADER_LEN]:
        raise IntegrityError(f"persist {name} failed its checksum")
    if version not in _READABLE:
        # The formats decode alike (each only adds fields the one before has defaults for).
        raise IntegrityError(
            f"persist {name} has format version {version}; this persist reads "
            f"{' and '.join(map(str, _READABLE))}"
        )
    try:
        return msgspec.msgpack.decode(payload, type=typ)
    except msgspec.DecodeError as exc:
        raise IntegrityError(f"persist {name} could not be decoded: {exc}") from exc


_DIFF_DECODER = msgspec.msgpack.Decoder(StateDiff)


def encode_diff(diff: StateDiff) -> bytes:
    """The framed diff, checked to decode as one: a value of the wrong type (a purpose that
    is not text, a float clock) raises ``InvalidUsage`` here instead of being committed where
    it would make every later open of the shard fail."""
    try:
        payload = msgspec.msgpack.encode(diff)
        _DIFF_DECODER.decode(payload)
    except (msgspec.MsgspecError, UnicodeEncodeError, OverflowError, TypeError) as exc:
        raise InvalidUsage(f"a value can't be stored in the shard's state: {exc}") from None
    return b"".join((MAGIC, KIND_DIFF, bytes([_format(diff)]), _digest(payload), payload))


def decode_diff(data: bytes) -> StateDiff:
    return decode_frame(KIND_DIFF, data, StateDiff)


def encode_rollup(state: State) -> bytes:
    return encode_frame(KIND_ROLLUP, state)


def decode_rollup(data: bytes) -> State:
    return decode_frame(KIND_ROLLUP, data, State)


def decode_handed(kind: bytes, data: object, typ: type[T]) -> T:
    """Decodes bytes a caller handed in (a batch or split from ``to_bytes``): bad bytes are the
    caller's mistake, so they raise ``InvalidUsage``."""
    name = _KIND_NAMES[kind]
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidUsage(f"a persist {name} is decoded from bytes, not {type(data).__name__}")
    try:
        return decode_frame(kind, bytes(data), typ)
    except IntegrityError as exc:
        raise InvalidUsage(f"not a valid persist {name}: {exc}") from exc


def replay(state: State, entries: Sequence[tuple[int, bytes]]) -> State:
    """``state`` after the diffs stored at consensus seqnos ``entries`` (``(seqno, frame)``, in
    order, the first right after ``state``): each decoded, checked to be the diff to its own
    seqno, and applied. ``IntegrityError`` for one that is not, or does not follow."""
    diffs = [decode_diff(data) for _, data in entries]
    for (seqno, _), diff in zip(entries, diffs, strict=True):
        if diff.seqno_to != seqno:
            raise IntegrityError(
                f"consensus entry {state.shard_id}@{seqno} holds a diff to {diff.seqno_to}"
            )
    try:
        return apply_diffs(state, diffs)
    except ValueError as exc:
        raise IntegrityError(str(exc)) from exc
