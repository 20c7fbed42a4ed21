"""In-memory Blob and Consensus, for tests and single-process demos. Nothing is durable."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar

from persist.errors import InvalidUsage
from persist.location._keys import prefix_can_match, validate_key
from persist.location._watch import Watchers
from persist.location.base import Blob, Consensus, Pushed, VersionedData

__all__ = ["MemBlob", "MemConsensus"]


class MemBlob(Blob):
    """A Blob in a dict. ``MemBlob.named(name)`` is shared process-wide, ``MemBlob()`` is private."""

    _registry: ClassVar[dict[str, MemBlob]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    @classmethod
    def named(cls, name: str) -> MemBlob:
        """The process-wide instance called ``name`` (created on first use)."""
        with cls._registry_lock:
            blob = cls._registry.get(name)
            if blob is None:
                blob = cls._registry[name] = cls()
            return blob

    async def get(self, key: str) -> bytes | None:
        validate_key(key)
        return self._data.get(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        validate_key(key)
        data = self._data.get(key)
        return None if data is None else data[start:end]

    async def set(self, key: str, value: bytes) -> None:
        validate_key(key)
        # Copy so a caller mutating a bytearray/memoryview afterwards cannot change stored data.
        self._data[key] = bytes(value)

    async def delete(self, key: str) -> None:
        validate_key(key)
        self._data.pop(key, None)

    def uri(self, key: str) -> None:
        """None: the values live in this process's memory, where no other program reads."""
        validate_key(key)
        return None

    async def list_keys(self, prefix: str) -> list[str]:
        if not prefix_can_match(prefix):
            return []
        return sorted(k for k in list(self._data) if k.startswith(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        if not prefix_can_match(prefix):
            return {}
        return {k: len(v) for k, v in sorted(list(self._data.items())) if k.startswith(prefix)}


class MemConsensus(Consensus):
    """A Consensus in a dict of lists. ``named(name)`` is shared process-wide."""

    _registry: ClassVar[dict[str, MemConsensus]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._logs: dict[str, list[VersionedData]] = {}
        # Named instances may be reached from several event loops (e.g. a sync facade's thread),
        # so read-compare-append must also be atomic across threads, not just across tasks.
        self._lock = threading.Lock()
        self._watchers = Watchers()

    @classmethod
    def named(cls, name: str) -> MemConsensus:
        """The process-wide instance called ``name`` (created on first use)."""
        with cls._registry_lock:
            consensus = cls._registry.get(name)
            if consensus is None:
                consensus = cls._registry[name] = cls()
            return consensus

    async def head(self, key: str) -> VersionedData | None:
        with self._lock:
            log = self._logs.get(key)
            return log[-1] if log else None

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        with self._lock:
            log = self._logs.setdefault(key, [])
            current = log[-1].seqno if log else None
            if current != expected_seqno:
                return False
            entry = VersionedData(seqno=1 if current is None else current + 1, data=bytes(data))
            log.append(entry)
        self._watchers.push(key, entry.seqno, entry.data)
        return True

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None]:
        return self._watchers.add(key, on_change)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit < 0:
            raise InvalidUsage(f"scan limit must be >= 0, not {limit}")
        with self._lock:
            log = self._logs.get(key, [])
            return [e for e in log if e.seqno >= from_seqno][:limit]

    async def truncate(self, key: str, seqno: int) -> int:
        with self._lock:
            log = self._logs.get(key)
            if not log:
                raise InvalidUsage(f"cannot truncate {key!r}: it has no entries")
            if seqno > log[-1].seqno:
                raise InvalidUsage(
                    f"cannot truncate {key!r} below {seqno}: the head is {log[-1].seqno}"
                )
            keep = [e for e in log if e.seqno >= seqno]
            self._logs[key] = keep
            return len(log) - len(keep)
