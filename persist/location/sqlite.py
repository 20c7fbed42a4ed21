"""Consensus in a local SQLite file: the embedded default, safe across processes on one machine."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from persist.errors import ExternalError, InvalidUsage
from persist.location._settle import run_in_thread
from persist.location._watch import Watchers
from persist.location.base import Consensus, Pushed, VersionedData

__all__ = ["SqliteConsensus"]

_T = TypeVar("_T")

_BUSY_TIMEOUT_MS = 30_000
# How long SQLite itself waits for a lock per try. A cancelled call must end before its
# cancellation returns, and sqlite3_interrupt does not end the wait in SQLite's busy handler
# (checked with 3.40: an interrupted statement waiting for the write lock slept out its whole
# busy_timeout, then failed SQLITE_BUSY). So SQLite waits in short slices and the worker retries
# up to _BUSY_TIMEOUT_MS, giving up between tries once the call was cancelled: a cancellation
# waits at most about one slice for a statement stuck on the lock.
_BUSY_SLICE_MS = 100
_SQLITE_BUSY = 5
# How often a watching instance checks whether another connection committed: a read of the
# WAL index (PRAGMA data_version), no I/O, so changes arrive within about this long.
_WATCH_INTERVAL_S = 0.005

_SCHEMA = """
CREATE TABLE IF NOT EXISTS consensus (
    shard TEXT NOT NULL,
    seqno INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (shard, seqno)
) WITHOUT ROWID
"""

# One statement in autocommit mode: SQLite takes the write lock before the statement reads, so
# the head check and the insert are atomic across connections and processes. `IS` compares
# NULL (an empty key) like a value.
_CAS = """
INSERT INTO consensus (shard, seqno, data)
SELECT ?, ?, ?
WHERE (SELECT max(seqno) FROM consensus WHERE shard = ?) IS ?
"""
_HEAD = "SELECT seqno, data FROM consensus WHERE shard = ? ORDER BY seqno DESC LIMIT 1"
_SCAN = "SELECT seqno, data FROM consensus WHERE shard = ? AND seqno >= ? ORDER BY seqno LIMIT ?"
_TRUNCATE = "DELETE FROM consensus WHERE shard = ? AND seqno < ?"


def _busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLITE_BUSY (in any of its extended forms)."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == _SQLITE_BUSY


class SqliteConsensus(Consensus):
    """A Consensus in the SQLite database at ``path`` (WAL mode, ``synchronous=FULL``).

    Each instance owns one connection, used only by its own single worker thread, so the event
    loop never blocks on SQLite and the connection is never shared between threads.

    A cancelled call is settled before its cancellation returns: a call still queued never
    runs; a running one is interrupted (``sqlite3_interrupt``, which rolls back the autocommit
    statement unless it already committed; a statement waiting for the write lock gives up
    within about 0.1 s) and waited for.

    ``watch`` pushes changes from a thread of its own that, while anything is watched, checks
    every 5 ms whether any connection committed (``PRAGMA data_version``) and only then reads
    the heads of the watched keys.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist-sqlite")
        self._closed = False
        self._watchers = Watchers()
        self._watch_lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], _T], *, determinate: bool) -> _T:
        if self._closed:
            raise InvalidUsage("this SqliteConsensus is closed")
        cancelled = threading.Event()

        def on_cancel() -> None:
            # Called only while this call runs in the worker, so no other call's statement is
            # running on the connection (an interrupt lasts only while a statement runs).
            cancelled.set()
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.interrupt()

        return await run_in_thread(
            lambda: self._call(fn, determinate, cancelled),
            executor=self._executor,
            on_cancel=on_cancel,
        )

    def _call(
        self,
        fn: Callable[[sqlite3.Connection], _T],
        determinate: bool,
        cancelled: threading.Event,
    ) -> _T:
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        try:
            conn = self._connection(deadline, cancelled)
        except (sqlite3.Error, OSError) as exc:
            raise ExternalError(
                f"opening SQLite consensus {self._path}: {exc}", determinate=True
            ) from exc
        while True:
            try:
                return fn(conn)
            except sqlite3.Error as exc:
                # SQLITE_BUSY means the write lock was never obtained, so nothing was written
                # and trying again is safe.
                busy = _busy(exc)
                if busy and not cancelled.is_set() and time.monotonic() < deadline:
                    continue
                raise ExternalError(
                    f"SQLite consensus {self._path}: {exc}", determinate=determinate or busy
                ) from exc

    def _connection(self, deadline: float, cancelled: threading.Event) -> sqlite3.Connection:
        if self._conn is None:
            parent = os.path.dirname(os.path.abspath(self._path))
            os.makedirs(parent, exist_ok=True)
            # Switching to WAL and creating the table can meet SQLITE_BUSY without SQLite
            # calling its busy handler (another process doing the same, or recovering the
            # WAL): wait and try again, up to the busy timeout.
            while True:
                try:
                    self._conn = self._open()
                    break
                except sqlite3.OperationalError as exc:
                    if not _busy(exc) or cancelled.is_set() or time.monotonic() > deadline:
                        raise
                    time.sleep(random.uniform(0.005, 0.05))  # in this instance's worker thread
        return self._conn

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: autocommit, so each statement is its own transaction.
        conn = sqlite3.connect(self._path, timeout=_BUSY_SLICE_MS / 1000, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_SLICE_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            # FULL: WAL commits are fsynced, so an acknowledged CAS survives power loss.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(_SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    async def head(self, key: str) -> VersionedData | None:
        def op(conn: sqlite3.Connection) -> VersionedData | None:
            row = conn.execute(_HEAD, (key,)).fetchone()
            return None if row is None else VersionedData(seqno=row[0], data=row[1])

        return await self._run(op, determinate=True)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        new_seqno = 1 if expected_seqno is None else expected_seqno + 1
        params = (key, new_seqno, bytes(data), key, expected_seqno)

        def op(conn: sqlite3.Connection) -> bool:
            try:
                return conn.execute(_CAS, params).rowcount == 1
            except sqlite3.IntegrityError:
                # Unreachable while the write lock serializes writers, but a lost race it is.
                return False

        return await self._run(op, determinate=False)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit < 0:
            raise InvalidUsage(f"scan limit must be >= 0, not {limit}")

        def op(conn: sqlite3.Connection) -> list[VersionedData]:
            rows = conn.execute(_SCAN, (key, from_seqno, limit)).fetchall()
            return [VersionedData(seqno=s, data=d) for s, d in rows]

        return await self._run(op, determinate=True)

    async def truncate(self, key: str, seqno: int) -> int:
        def op(conn: sqlite3.Connection) -> int:
            # The head only grows and is never deleted, so checking it before deleting is safe
            # without holding a lock across both statements.
            row = conn.execute(_HEAD, (key,)).fetchone()
            if row is None:
                raise InvalidUsage(f"cannot truncate {key!r}: it has no entries")
            if seqno > row[0]:
                raise InvalidUsage(f"cannot truncate {key!r} below {seqno}: the head is {row[0]}")
            return conn.execute(_TRUNCATE, (key, seqno)).rowcount

        return await self._run(op, determinate=False)

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None]:
        if self._closed:
            raise InvalidUsage("this SqliteConsensus is closed")
        stop = self._watchers.add(key, on_change)
        with self._watch_lock:
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch_loop, name="persist-sqlite-watch", daemon=True
                )
                self._watcher.start()
        return stop

    def _watch_loop(self) -> None:
        conn: sqlite3.Connection | None = None
        version: int | None = None
        heads: dict[str, int] = {}
        try:
            while not self._closed:
                with self._watch_lock:
                    keys = self._watchers.keys()
                    if not keys:
                        self._watcher = None  # the next watch starts a new thread
                        return
                try:
                    if conn is None:
                        conn = sqlite3.connect(
                            self._path, timeout=_BUSY_SLICE_MS / 1000, isolation_level=None
                        )
                    now = conn.execute("PRAGMA data_version").fetchone()[0]
                    if now != version:
                        version = now
                        for key in keys:
                            row = conn.execute(_HEAD, (key,)).fetchone()
                            if row is not None and heads.get(key) != row[0]:
                                heads[key] = row[0]
                                self._watchers.push(key, row[0], row[1])
                except sqlite3.Error:
                    # Not created yet, or busy: look again from scratch next time.
                    if conn is not None:
                        conn.close()
                    conn, version = None, None
                time.sleep(_WATCH_INTERVAL_S)
        finally:
            if conn is not None:
                conn.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def close_connection() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        try:
            await run_in_thread(close_connection, executor=self._executor)
        finally:
            self._executor.shutdown(wait=False)
