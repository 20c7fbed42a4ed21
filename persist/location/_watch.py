"""Fan-out of pushed consensus changes to the callbacks watching each key.

A callback is called on the event loop that registered it, whichever thread or task learns of
the change (a Postgres listener task, a SQLite watcher thread, a ``MemConsensus`` shared by
several loops), so a watcher never needs a lock of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from persist.location.base import Pushed

__all__ = ["Watchers"]


class _Watch:
    __slots__ = ("callback", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Pushed) -> None:
        self.loop = loop
        self.callback = callback


class Watchers:
    """The watches of one consensus instance, by key. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, list[_Watch]] = {}

    def add(self, key: str, callback: Pushed) -> Callable[[], None]:
        """Registers ``callback`` for ``key`` on the running loop; returns what removes it."""
        watch = _Watch(asyncio.get_running_loop(), callback)
        with self._lock:
            self._by_key.setdefault(key, []).append(watch)

        def remove() -> None:
            with self._lock:
                watches = self._by_key.get(key, [])
                if watch in watches:
                    watches.remove(watch)
                if not watches:
                    self._by_key.pop(key, None)

        return remove

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._by_key)

    def push(self, key: str, seqno: int | None, data: bytes | None) -> None:
        """Tells the watchers of ``key`` of a change (see ``Consensus.watch``)."""
        with self._lock:
            watches = list(self._by_key.get(key, ()))
        for w in watches:
            _call(w, seqno, data)

    def push_all(self) -> None:
        """Tells every watcher that something may have changed (after pushes may have been
        missed, e.g. while a listening connection was re-established)."""
        with self._lock:
            watches = [w for ws in self._by_key.values() for w in ws]
        for w in watches:
            _call(w, None, None)


def _call(w: _Watch, seqno: int | None, data: bytes | None) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is w.loop:
        w.loop.call_soon(w.callback, seqno, data)
        return
    # A closed loop raises RuntimeError: its watcher is gone with it.
    with contextlib.suppress(RuntimeError):
        w.loop.call_soon_threadsafe(w.callback, seqno, data)
