"""The plumbing the scenarios share: the data they write, durable writes to the disk under
test, counting wrappers around a Blob and a Consensus, surviving a restarted database, and
Postgres helpers."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.location import Blob, Consensus, Pushed, VersionedData

# --- data --------------------------------------------------------------------------------------

# The data columns every scenario writes: an int64 key, a 16-char string, an int64 value.
SCHEMA = pa.schema([("key", pa.int64()), ("s", pa.string()), ("value", pa.int64())])
_MIX = np.int64(-7046029254386353131)  # odd 64-bit constant: key -> pseudo-random string


def make_updates(
    n: int, *, key_start: int = 0, time: int | np.ndarray = 0, seed: int = 0
) -> pa.Table:
    """``n`` updates of ``SCHEMA`` plus ``_time`` (uint64), built vectorized (no per-row Python).

    ``key`` ascends from ``key_start`` (distinct across calls with disjoint ranges); ``s`` is a
    16-char decimal string derived from the key by a multiplicative hash (so it does not sort
    like the key and compresses like an id column); ``value`` is random.
    """
    keys = np.arange(key_start, key_start + n, dtype=np.int64)
    with np.errstate(over="ignore"):
        mixed = (keys * _MIX) & np.int64((1 << 53) - 1)  # < 10**16: at most 16 digits
    s = pc.utf8_lpad(pc.cast(pa.array(mixed), pa.string()), 16, "0")
    values = np.random.default_rng(seed + key_start).integers(0, 1 << 40, size=n, dtype=np.int64)
    times = np.full(n, time, dtype=np.uint64) if np.isscalar(time) else np.asarray(time, np.uint64)
    return pa.table({"key": keys, "s": s, "value": values, "_time": times})


def keyed_rows(n: int, part: int, parts: int, rng: np.random.Generator) -> pa.Table:
    """Part ``part`` of ``parts`` of a keyed table: ``k`` unique over all parts (shuffled),
    ``g`` int64 of 100 values, ``v`` float64."""
    return pa.table(
        {
            "k": rng.permutation(n).astype(np.int64) * parts + part,
            "g": rng.integers(0, 100, n),
            "v": rng.random(n),
        }
    )


class NoAdapter:
    """The adapter of a system a scenario measures by itself (nothing to open or close)."""

    async def close(self) -> dict[str, Any]:
        return {}


def with_time(table: pa.Table, time: int) -> pa.Table:
    """``table`` with every ``_time`` set to ``time``."""
    col = pa.array(np.full(table.num_rows, time, dtype=np.uint64), type=pa.uint64())
    return table.set_column(table.schema.get_field_index("_time"), "_time", col)


def slices(table: pa.Table, batches: int) -> list[pa.Table]:
    """``table`` cut into ``batches`` slices, slice ``j`` at ``_time`` ``j``."""
    step = -(-table.num_rows // batches)
    return [with_time(table.slice(j * step, step), j) for j in range(batches)]


# --- the disk ----------------------------------------------------------------------------------


def fsync(path: str | os.PathLike[str], directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(table: pa.Table, path: Path) -> None:
    """``pyarrow.parquet.write_table`` (default options), then fsync of the file and of its
    directory: the floor of durably writing the data."""
    import pyarrow.parquet as pq

    pq.write_table(table, path)
    fsync(path)
    fsync(path.parent, directory=True)


def disk_bytes(path: Path) -> int:
    """The size of every file under a directory."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- counting location wrappers ----------------------------------------------------------------


@dataclass
class IoCounts:
    """What went through a ``CountingBlob`` / ``CountingConsensus``."""

    blob_gets: int = 0
    blob_get_bytes: int = 0
    blob_sets: int = 0
    blob_set_bytes: int = 0
    cons_heads: int = 0
    cons_cas: int = 0
    cons_cas_bytes: int = 0
    cons_scans: int = 0
    cons_scanned_entries: int = 0


class CountingBlob(Blob):
    """A Blob that counts the gets and sets (and their bytes) going to the Blob it wraps."""

    def __init__(self, inner: Blob, counts: IoCounts) -> None:
        self.inner, self.counts = inner, counts

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        self.counts.blob_gets += 1
        self.counts.blob_get_bytes += len(data) if data is not None else 0
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        data = await self.inner.get_range(key, start, end)
        self.counts.blob_gets += 1
        self.counts.blob_get_bytes += len(data) if data is not None else 0
        return data

    async def set(self, key: str, value: bytes) -> None:
        await self.inner.set(key, value)
        self.counts.blob_sets += 1
        self.counts.blob_set_bytes += len(value)

    async def set_new(self, key: str, value: bytes) -> None:
        await self.inner.set_new(key, value)
        self.counts.blob_sets += 1
        self.counts.blob_set_bytes += len(value)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list_keys(self, prefix: str) -> list[str]:
        return await self.inner.list_keys(prefix)

    async def delete_partial_writes(self, prefix: str, older_than_s: float) -> int:
        return await self.inner.delete_partial_writes(prefix, older_than_s)

    async def close(self) -> None:
        await self.inner.close()


class CountingConsensus(Consensus):
    """A Consensus that counts the heads, compare-and-sets (and bytes) and scans (and entries)
    going to the one it wraps."""

    def __init__(self, inner: Consensus, counts: IoCounts) -> None:
        self.inner, self.counts = inner, counts

    async def head(self, key: str) -> VersionedData | None:
        self.counts.cons_heads += 1
        return await self.inner.head(key)

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        self.counts.cons_cas += 1
        self.counts.cons_cas_bytes += len(data)
        return await self.inner.compare_and_set(key, expected_seqno, data)

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        entries = await self.inner.scan(key, from_seqno, limit)
        self.counts.cons_scans += 1
        self.counts.cons_scanned_entries += len(entries)
        return entries

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.inner.truncate(key, seqno)

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        return self.inner.watch(key, on_change)

    async def close(self) -> None:
        await self.inner.close()


# --- surviving a restarted database ------------------------------------------------------------


class Recoveries:
    """Operations that had to be retried because the database connection was lost (the shared
    Postgres of the test machines is restarted by crash tests). A measuring loop compares
    ``count`` before and after an operation and drops that sample (it timed the outage, not the
    system); the runner reports the events with each scenario."""

    def __init__(self) -> None:
        self.count = 0
        self.events: list[str] = []

    def note(self, what: str, exc: BaseException) -> None:
        self.count += 1
        if len(self.events) < 50:
            stamp = time.strftime("%H:%M:%S")
            self.events.append(f"{stamp} {what}: {type(exc).__name__}: {str(exc)[:120]}")


RECOVERIES = Recoveries()
RECOVERY_ATTEMPTS = 60
RECOVERY_DELAY_S = 0.5


def _lost_connection(exc: BaseException) -> bool:
    import psycopg

    from persist.errors import ExternalError, IntegrityError

    if isinstance(exc, psycopg.OperationalError):
        return True
    return isinstance(exc, ExternalError) and not isinstance(exc, IntegrityError)


async def resilient(
    op: Callable[[], Awaitable[Any]],
    what: str,
    landed: Callable[[], Awaitable[bool]] | None = None,
) -> Any:
    """``await op()``, retried (every ``RECOVERY_DELAY_S``, for about 30 s) while it fails with a
    lost database connection (``psycopg.OperationalError``, or persist's ``ExternalError``
    after its own retries). ``landed`` says whether an attempt that failed took effect anyway
    (then it is not repeated)."""
    for attempt in range(RECOVERY_ATTEMPTS):
        try:
            return await op()
        except Exception as exc:
            if not _lost_connection(exc) or attempt == RECOVERY_ATTEMPTS - 1:
                raise
            RECOVERIES.note(what, exc)
            await asyncio.sleep(RECOVERY_DELAY_S)
            if landed is not None:
                try:
                    if await landed():
                        return None
                except Exception as again:
                    if not _lost_connection(again):
                        raise
    raise AssertionError("unreachable")


async def persist_append(write: Any, table: pa.Table, lower: int, upper: int) -> None:
    """``write.compare_and_append(table, lower, upper)``, surviving a database restart: a retry
    after an indeterminate failure that finds the upper already at ``upper`` means the first
    attempt landed (the only writer of the shard is this one)."""
    from persist.errors import UpperMismatch

    async def op() -> None:
        try:
            await write.compare_and_append(table, lower, upper)
        except UpperMismatch as exc:
            if exc.current != upper:
                raise

    await resilient(op, "compare_and_append")


async def close_client(client: Any, timeout_s: float = 60.0) -> None:
    """``await client.close()``, bounded: a close that hangs (a persist bug) fails the scenario
    instead of the whole run."""
    try:
        await asyncio.wait_for(client.close(), timeout_s)
    except TimeoutError as exc:
        raise RuntimeError(
            f"persist client.close() did not finish within {timeout_s:g} s (a background task "
            "ignored cancellation?)"
        ) from exc


# --- Postgres ----------------------------------------------------------------------------------


class PgConn:
    """One psycopg async connection (autocommit, prepared statements) that reconnects when the
    server drops it. ``execute`` is for idempotent statements or ones whose caller checks."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.conn: Any = None

    async def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        import psycopg

        try:
            if self.conn is None or self.conn.closed:
                self.conn = await psycopg.AsyncConnection.connect(
                    self.uri, autocommit=True, prepare_threshold=0
                )
            return await self.conn.execute(sql, params)
        except psycopg.OperationalError:
            await self.close()
            raise

    async def value(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """The first value of an idempotent statement's first row (``None`` without rows),
        surviving a restarted server."""

        async def op() -> Any:
            cur = await self.execute(sql, params)
            row = await cur.fetchone() if cur.description else None
            return row[0] if row else None

        return await resilient(op, sql.split(" ", 1)[0])

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
            self.conn = None


async def pg_value(uri: str, sql: str, params: Sequence[Any] = ()) -> Any:
    """``PgConn.value`` on a connection of its own."""
    conn = PgConn(uri)
    try:
        return await conn.value(sql, params)
    finally:
        await conn.close()


async def pg_drop_table(uri: str, table: str) -> None:
    await pg_value(uri, f'DROP TABLE IF EXISTS "{table}"')
