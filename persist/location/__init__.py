"""Where persist keeps things: a Blob store for data and a Consensus log for metadata.

These two interfaces are the only way persist touches the outside world. Every implementation
translates its backend's failures into :class:`persist.ExternalError` at this boundary (with
``determinate`` telling whether the operation may have happened) and is run through the same
conformance suite (:mod:`persist.location.testing`).

- ``Blob``: a durable ``str -> bytes`` map. Keys are written once and never modified, so it
  need not be linearizable; ``set`` is atomic (a ``get`` sees the old value or the new one).
- ``Consensus``: per key, a linearizable log of ``(seqno, data)`` entries appended by
  compare-and-set on the latest seqno.

Both settle a cancelled call before its cancellation returns: once the ``CancelledError`` is
raised to the caller, the call's effect has happened or never will, so reading the location
then tells its outcome (persist settles indeterminate outcomes that way). A backend whose calls
run in threads must wait for the thread (``persist.location._settle``), not just abandon it.
"""

from __future__ import annotations

import abc
from urllib.parse import parse_qs, urlsplit

import msgspec

from persist.errors import InvalidUsage

__all__ = [
    "Blob",
    "Consensus",
    "VersionedData",
    "open_blob",
    "open_consensus",
]


class VersionedData(msgspec.Struct, frozen=True):
    """One consensus entry: ``data`` written at ``seqno``."""

    seqno: int
    data: bytes


class Blob(abc.ABC):
    """A durable key -> bytes store. Keys are ``/``-separated ASCII paths.

    Every call, when cancelled, is settled before its ``CancelledError`` reaches the caller: a
    cancelled ``set`` or ``delete`` has taken effect by then or never will.
    """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The value at ``key``, or None when there is none."""

    @abc.abstractmethod
    async def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` at ``key`` atomically and durably (it survives a crash once this returns)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Removes ``key``. Deleting a key that does not exist is not an error."""

    @abc.abstractmethod
    async def list_keys(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""

    async def delete_partial_writes(self, prefix: str, older_than_s: float) -> int:
        """Deletes leftovers of ``set`` calls that died half way (e.g. a killed process's temp
        files) for keys under ``prefix``, untouched for more than ``older_than_s`` seconds;
        returns how many it deleted. Never touches a key.

        The age keeps it off a ``set`` still in progress: pass more than any ``set`` can take.
        The default does nothing, for backends whose ``set`` leaves nothing behind.
        """
        return 0

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and threads. The blob is unusable afterwards."""


class Consensus(abc.ABC):
    """A linearizable, durable log of versioned entries per key.

    Seqnos start at 1. ``compare_and_set(key, expected, data)`` appends ``data`` at ``expected + 1``
    (at 1 when ``expected`` is None, meaning the key must hold no entry) iff the latest entry of
    ``key`` is at ``expected``.

    Every call, when cancelled, is settled before its ``CancelledError`` reaches the caller: a
    cancelled ``compare_and_set`` or ``truncate`` has taken effect by then or never will (a
    statement still queued on a lock must be called off, not left to run).
    """

    @abc.abstractmethod
    async def head(self, key: str) -> VersionedData | None:
        """The latest entry of ``key``, or None when it has none."""

    @abc.abstractmethod
    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        """Appends ``data`` iff the head seqno is ``expected_seqno``; True when it was appended.

        False is determinate (nothing was written). A failure raises ``ExternalError``, and an
        indeterminate one means the entry may have been written.
        """

    @abc.abstractmethod
    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        """Up to ``limit`` entries with ``seqno >= from_seqno``, in seqno order."""

    @abc.abstractmethod
    async def truncate(self, key: str, seqno: int) -> int:
        """Deletes the entries below ``seqno``; returns how many were deleted.

        ``seqno`` above the head raises ``InvalidUsage`` (the head is never truncated away).
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and threads. The consensus is unusable afterwards."""


def _query(uri: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlsplit(uri).query).items()}


def _check_uri(what: str, uri: object) -> str:
    if not isinstance(uri, str):
        raise InvalidUsage(f"a {what} location is a URI string, not {type(uri).__name__}")
    return uri


def open_blob(uri: str) -> Blob:
    """A Blob for ``file:///abs/dir``, ``s3://bucket/prefix?endpoint_url=..&region=..`` or ``mem://name``."""
    parts = urlsplit(_check_uri("blob", uri))
    if parts.scheme == "file":
        from persist.location.file import FileBlob

        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise InvalidUsage(f"a file blob URI is file:///absolute/dir, not {uri!r}")
        return FileBlob(parts.path)
    if parts.scheme == "s3":
        from persist.location.s3 import S3Blob

        if not parts.netloc:
            raise InvalidUsage(f"an S3 blob URI is s3://bucket/prefix, not {uri!r}")
        q = _query(uri)
        return S3Blob(
            bucket=parts.netloc,
            prefix=parts.path.strip("/"),
            endpoint_url=q.get("endpoint_url"),
            region=q.get("region"),
        )
    if parts.scheme == "mem":
        from persist.location.mem import MemBlob

        return MemBlob.named(parts.netloc + parts.path)
    raise InvalidUsage(f"unknown blob URI scheme in {uri!r} (use file://, s3:// or mem://)")


def open_consensus(uri: str) -> Consensus:
    """A Consensus for ``postgresql://...``, ``sqlite:///abs/path.db`` or ``mem://name``."""
    parts = urlsplit(_check_uri("consensus", uri))
    if parts.scheme in ("postgres", "postgresql"):
        from persist.location.postgres import PostgresConsensus

        return PostgresConsensus(uri)
    if parts.scheme == "sqlite":
        from persist.location.sqlite import SqliteConsensus

        if not parts.path.startswith("/"):
            raise InvalidUsage(f"a SQLite consensus URI is sqlite:///absolute/path.db, not {uri!r}")
        return SqliteConsensus(parts.path)
    if parts.scheme == "mem":
        from persist.location.mem import MemConsensus

        return MemConsensus.named(parts.netloc + parts.path)
    raise InvalidUsage(
        f"unknown consensus URI scheme in {uri!r} (use postgresql://, sqlite:/// or mem://)"
    )
