"""Consensus in a PostgreSQL table, via psycopg 3 and an async connection pool."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import psycopg.errors
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from persist.errors import ExternalError, InvalidUsage
from persist.location._redact import redact
from persist.location._settle import run_in_task
from persist.location._watch import Watchers
from persist.location.base import Consensus, Pushed, VersionedData

__all__ = ["PostgresConsensus"]

log = logging.getLogger("persist")

_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

# SQLSTATE classes the server reports while aborting the statement's transaction: when one of
# these comes back, the autocommit statement certainly did not commit. Anything else (a lost
# connection, admin shutdown, internal errors) may have hit after the commit.
_ROLLED_BACK_CLASSES = frozenset({"22", "23", "40", "42"})

# NOTIFY payloads must be shorter than 8000 bytes. A change whose entry does not fit is pushed
# without its data (the watcher reads it); one whose key does not fit wakes every watcher.
_PAYLOAD_LIMIT = 7999
_WAKE_ALL = "*"
_RELISTEN_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def _payload(key: str, seqno: int, data: bytes) -> str:
    """``seqno:base64(data):key``; the data is left out when it does not fit."""
    with_data = f"{seqno}:{base64.b64encode(data).decode()}:{key}"
    if len(with_data.encode()) <= _PAYLOAD_LIMIT:
        return with_data
    without = f"{seqno}::{key}"
    return without if len(without.encode()) <= _PAYLOAD_LIMIT else _WAKE_ALL


def _channel(table: str) -> str:
    # A channel name is an identifier: at most 63 bytes, or Postgres truncates it.
    name = f"persist_{table}"
    return name if len(name) <= 63 else f"persist_{hashlib.sha256(table.encode()).hexdigest()[:32]}"


class PostgresConsensus(Consensus):
    """A Consensus in the table ``table`` (created on first use) of the database at ``conninfo``.

    Every compare-and-set is a single autocommit statement, so it is linearizable across any
    number of connections, processes and machines. The same statement notifies the table's
    channel (``NOTIFY``, delivered at commit) with the new entry, so ``watch`` pushes changes
    through one listening connection per instance, opened by the first watch.

    A cancelled call is settled before its cancellation returns: psycopg asks the server to
    cancel the statement and waits (up to 5 s, then it closes the connection and the outcome is
    unknown) for it to end; writes run in a task of their own, so that a second cancellation
    does not cut that wait short.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table: str = "consensus",
        min_size: int = 1,
        max_size: int = 8,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if not _TABLE_NAME.fullmatch(table):
            raise InvalidUsage(f"table must be a plain SQL identifier, not {table!r}")
        self._conninfo = conninfo
        self._table = table
        self._min_size = min_size
        self._max_size = max_size
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._pool: AsyncConnectionPool | None = None
        self._open_lock = asyncio.Lock()
        self._closed = False
        self._channel = _channel(table)
        self._watchers = Watchers()
        self._listener: asyncio.Task[None] | None = None

        t = f'"{table}"'
        self._create_sql = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            "shard text NOT NULL, seqno bigint NOT NULL, data bytea NOT NULL, "
            "PRIMARY KEY (shard, seqno))"
        )
        # Each CAS is one statement that notifies only if its insert happened: the outer
        # SELECT has a row exactly when the INSERT did.
        notify = "SELECT pg_notify(%s::text, %s::text) FROM ins"
        self._cas_first_sql = (
            f"WITH ins AS (INSERT INTO {t} (shard, seqno, data) SELECT %s::text, 1, %s::bytea "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE shard = %s::text) RETURNING seqno) "
            + notify
        )
        # Locking the head row (FOR KEY SHARE) closes a race with truncate: without it, a writer
        # whose statement snapshot still shows head n could insert n+1 after a concurrent
        # writer appended n+1 and n+2 and truncated n+1 away, since the unique index no longer
        # holds n+1. With the lock, the truncate's DELETE of n conflicts with us: either we
        # wait for it and then find our head gone (no insert), or it waits for our commit and
        # our insert of n+1 hits the still-present n+1 (unique violation).
        self._cas_next_sql = (
            f"WITH ins AS (INSERT INTO {t} (shard, seqno, data) "
            "SELECT %s::text, %s::bigint, %s::bytea "
            f"WHERE (SELECT seqno FROM {t} WHERE shard = %s::text "
            "ORDER BY seqno DESC LIMIT 1 FOR KEY SHARE) = %s::bigint RETURNING seqno) " + notify
        )
        self._head_sql = (
            f"SELECT seqno, data FROM {t} WHERE shard = %s::text ORDER BY seqno DESC LIMIT 1"
        )
        self._head_seqno_sql = (
            f"SELECT seqno FROM {t} WHERE shard = %s::text ORDER BY seqno DESC LIMIT 1"
        )
        self._scan_sql = (
            f"SELECT seqno, data FROM {t} WHERE shard = %s::text AND seqno >= %s::bigint "
            "ORDER BY seqno LIMIT %s::bigint"
        )
        self._truncate_sql = f"DELETE FROM {t} WHERE shard = %s::text AND seqno < %s::bigint"

    def __repr__(self) -> str:
        return f"PostgresConsensus({redact(self._conninfo)!r}, table={self._table!r})"

    async def _get_pool(self) -> AsyncConnectionPool:
        if self._closed:
            raise InvalidUsage("this PostgresConsensus is closed")
        if self._pool is not None:
            return self._pool
        async with self._open_lock:
            if self._pool is None:
                pool = AsyncConnectionPool(
                    self._conninfo,
                    min_size=self._min_size,
                    max_size=self._max_size,
                    open=False,
                    timeout=self._timeout,
                    # prepare_threshold=0: every statement is prepared on first use per
                    # connection; the CAS then costs one round trip with no parsing.
                    kwargs={"autocommit": True, "prepare_threshold": 0},
                    name=f"persist-consensus-{self._table}",
                )
                try:
                    with _translate("connecting to", self._conninfo, may_have_happened=False):
                        # One plain connection first: a server that is down or a database
                        # that doesn't exist fails here at once, with libpq's own words (the
                        # pool would retry in silence until its timeout).
                        probe = await psycopg.AsyncConnection.connect(
                            self._probe_conninfo(), autocommit=True
                        )
                        await probe.close()
                        await pool.open(wait=True, timeout=self._timeout)
                        async with pool.connection() as conn:
                            await self._create_schema(conn)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
        return self._pool

    def _probe_conninfo(self) -> str:
        # libpq's connect_timeout, unless the URI sets its own.
        if "connect_timeout" in self._conninfo:
            return self._conninfo
        return make_conninfo(self._conninfo, connect_timeout=max(1, round(self._connect_timeout)))

    async def _create_schema(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        cur = await conn.execute("SELECT to_regclass(%s)", (f'"{self._table}"',))
        row = await cur.fetchone()
        if row is not None and row[0] is not None:
            return
        # CREATE TABLE IF NOT EXISTS is not safe against concurrent creators (they can collide
        # on the catalog's unique indexes), so creators queue on an advisory lock.
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"persist.consensus.{self._table}",),
            )
            await conn.execute(self._create_sql)

    async def head(self, key: str) -> VersionedData | None:
        pool = await self._get_pool()
        with _translate("reading the head of", self._conninfo, may_have_happened=False, key=key):
            async with pool.connection() as conn:
                cur = await conn.execute(self._head_sql, (key,))
                row = await cur.fetchone()
        return None if row is None else VersionedData(seqno=row[0], data=row[1])

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        return await run_in_task(self._compare_and_set(key, expected_seqno, data))

    async def _compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        pool = await self._get_pool()
        with _translate("compare-and-set on", self._conninfo, may_have_happened=True, key=key):
            async with pool.connection() as conn:
                seqno = 1 if expected_seqno is None else expected_seqno + 1
                note = (self._channel, _payload(key, seqno, data))
                try:
                    if expected_seqno is None:
                        cur = await conn.execute(self._cas_first_sql, (key, data, key, *note))
                    else:
                        cur = await conn.execute(
                            self._cas_next_sql,
                            (key, seqno, data, key, expected_seqno, *note),
                        )
                except psycopg.errors.UniqueViolation:
                    # A concurrent writer appended the same seqno first.
                    return False
                return cur.rowcount == 1

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        if limit < 0:
            raise InvalidUsage(f"scan limit must be >= 0, not {limit}")
        pool = await self._get_pool()
        with _translate("scanning", self._conninfo, may_have_happened=False, key=key):
            async with pool.connection() as conn:
                cur = await conn.execute(self._scan_sql, (key, from_seqno, limit))
                rows = await cur.fetchall()
        return [VersionedData(seqno=s, data=d) for s, d in rows]

    async def truncate(self, key: str, seqno: int) -> int:
        return await run_in_task(self._truncate(key, seqno))

    async def _truncate(self, key: str, seqno: int) -> int:
        pool = await self._get_pool()
        with _translate("truncating", self._conninfo, may_have_happened=True, key=key):
            async with pool.connection() as conn:
                cur = await conn.execute(self._head_seqno_sql, (key,))
                row = await cur.fetchone()
                # The head only grows and is never deleted, so this check stays true while
                # the DELETE runs in its own statement.
                if row is None:
                    raise InvalidUsage(f"cannot truncate {key!r}: it has no entries")
                head: int = row[0]
                if seqno > head:
                    raise InvalidUsage(f"cannot truncate {key!r} below {seqno}: the head is {head}")
                cur = await conn.execute(self._truncate_sql, (key, seqno))
                return cur.rowcount

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None]:
        if self._closed:
            raise InvalidUsage("this PostgresConsensus is closed")
        stop = self._watchers.add(key, on_change)
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"persist-listen-{self._table}"
            )
        return stop

    async def _listen(self) -> None:
        """Holds the listening connection, re-establishing it with backoff for as long as this
        instance is open. After each LISTEN every watcher is woken: pushes may have been missed
        while there was no connection."""
        failures = 0
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                async with conn:
                    await conn.execute(f'LISTEN "{self._channel}"')
                    failures = 0
                    self._watchers.push_all()
                    async for note in conn.notifies():
                        self._dispatch(note.payload)
            except (psycopg.Error, OSError) as exc:
                delay = _RELISTEN_DELAYS_S[min(failures, len(_RELISTEN_DELAYS_S) - 1)]
                failures += 1
                log.info(
                    "persist: listening on %s failed (%s); again in %ss",
                    self._channel,
                    redact(str(exc), self._conninfo),
                    delay,
                )
                await asyncio.sleep(delay)

    def _dispatch(self, payload: str) -> None:
        if payload == _WAKE_ALL:
            self._watchers.push_all()
            return
        try:
            seqno, b64, key = payload.split(":", 2)
            change = int(seqno), base64.b64decode(b64, validate=True) if b64 else None
        except ValueError:
            # Not one of ours (anyone may NOTIFY the channel): it can't end the listening,
            # and whatever it meant, watchers find out by reading.
            self._watchers.push_all()
            return
        self._watchers.push(key, *change)

    async def close(self) -> None:
        self._closed = True
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


@contextmanager
def _translate(
    what: str, conninfo: str, *, may_have_happened: bool, key: str | None = None
) -> Iterator[None]:
    """Translates psycopg failures into ``ExternalError`` with the right determinacy, and
    without ``conninfo``'s secrets (libpq may quote a part of it it could not parse)."""
    target = "Postgres consensus" if key is None else f"Postgres consensus key {key!r}"
    try:
        yield
    except PoolTimeout as exc:
        # No connection was obtained, so no statement was sent.
        said = redact(str(exc), conninfo)
        raise ExternalError(f"{what} {target}: {said}", determinate=True) from (
            exc if said == str(exc) else None
        )
    except psycopg.Error as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # psycopg answers a cancelled await by cancelling the query on the server, which
            # then fails as QueryCanceled: that is our cancellation, not a backend failure.
            raise asyncio.CancelledError() from exc
        rolled_back = (exc.sqlstate or "")[:2] in _ROLLED_BACK_CLASSES
        said = redact(str(exc), conninfo)
        # A cause that quotes a secret would show it in every traceback: it is left out then.
        raise ExternalError(
            f"{what} {target}: {said}", determinate=rolled_back or not may_have_happened
        ) from (exc if said == str(exc) else None)
