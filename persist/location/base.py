"""The location interfaces: ``Blob``, ``Consensus`` and the entries a consensus log holds.

Implementations import these from here (not from the package, which opens implementations by
URI), so that no implementation module and the package import each other.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import msgspec
import pyarrow.fs as pafs

from persist.location._keys import validate_key

__all__ = ["Blob", "Consensus", "Pushed", "VersionedData"]


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

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the value at ``key`` (fewer where the value is shorter), or
        None when there is none. The default reads the whole value; backends read only the
        range (a split reads just the row groups of a part that hold its keys)."""
        data = await self.get(key)
        return None if data is None else data[start:end]

    @abc.abstractmethod
    async def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` at ``key`` atomically and durably (it survives a crash once this returns)."""

    async def set_new(self, key: str, value: bytes) -> None:
        """Stores ``value`` at a key that nothing reads before this returns, durably like
        ``set`` (persist writes parts so: a state names a part only once it is written).

        It need not be atomic: a failure or crash midway may leave part of ``value`` at
        ``key``, where ``set`` leaves the old value or none. Calling it again for the same key
        and value (a retry) must store the value. The default is ``set``; a backend overrides
        it where atomicity costs extra (a file blob writes in place, without a temp file and a
        rename).
        """
        await self.set(key, value)

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Removes ``key``. Deleting a key that does not exist is not an error."""

    def uri(self, key: str) -> str | None:
        """Where the value at ``key`` is stored, as a URI another program can open (a query
        engine reading a part with its own Parquet reader): ``file:///abs/path`` for a file
        blob, ``s3://bucket/prefix/key`` for S3. None when no other program can reach it (the
        value lives in this process's memory): the default. Naming does no I/O and says
        nothing of whether a value is stored there. ``InvalidUsage`` for an invalid key.
        """
        validate_key(key)
        return None

    def arrow_location(self) -> tuple[pafs.FileSystem, Callable[[str], str]] | None:
        """A ``pyarrow.fs`` filesystem that reaches this blob's values, and the path of a key
        in it: what lets pyarrow (and DuckDB, Polars through it) scan parts in place. None
        (the default) when nothing outside this object can read them. No I/O."""
        return None

    @abc.abstractmethod
    async def list_keys(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``, sorted."""

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        """Every key that starts with ``prefix``, with the size of its value in bytes (what
        the store holds for it). The default reads every value; backends list the sizes."""
        sizes: dict[str, int] = {}
        for key in await self.list_keys(prefix):
            data = await self.get(key)
            if data is not None:
                sizes[key] = len(data)
        return sizes

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


Pushed = Callable[[int | None, bytes | None], None]
"""``on_change(seqno, data)``: a key's log changed (see ``Consensus.watch``)."""


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

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        """Pushes changes of ``key``'s log, made through this instance or any other over the
        same location: ``on_change(seqno, data)`` is called on the calling task's event loop
        after the entry at ``seqno`` was appended, with its ``data`` when the backend carries
        it (else None). ``(None, None)`` means "something may have changed": pushes may have
        been missed (e.g. while a connection was re-established).

        Best effort: a change may be pushed late, twice, out of order, or not at all, so a
        caller that waits on pushes must also poll now and then. Returns what ends the watch,
        or None when this consensus cannot push (the default; callers then poll).
        """
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections and threads. The consensus is unusable afterwards."""
