"""The systems more than one scenario measures, as adapters with the same methods:

- ``append(i, table)``: durably appends ``table`` (times ``[i, i + 1)``) as the ``i``-th append;
- ``read(after)``: the whole table as of the latest append (``None``) or right after append
  ``after`` (time travel); ``None`` back when the system has no such version or no table;
- ``open_fresh()``: the seconds an open of the table from a fresh client took, or ``None``;
- ``close()``: releases everything; extra figures worth reporting (may be empty).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa

import persist
from benches.fixtures import (
    SCHEMA,
    CountingBlob,
    CountingConsensus,
    IoCounts,
    PgConn,
    close_client,
    persist_append,
    pg_drop_table,
    resilient,
    write_durably,
)
from benches.harness import BASELINE, PEER, SUBJECT, Context, System
from benches.peers import DELTA, DELTA_NAME, ICEBERG, ICEBERG_NAME, DeltaStore, IcebergStore
from persist.location import Blob, Consensus
from persist.location.file import FileBlob
from persist.location.postgres import PostgresConsensus
from persist.location.sqlite import SqliteConsensus

PERSIST_PG = "persist[file+postgres]"
PERSIST_SQLITE = "persist[file+sqlite]"
PARQUET = "parquet"
PARQUET_FSYNC = "parquet+fsync"
# The one key of the bare commits, shaped like a shard id.
KEY = "s00000000-0000-4000-8000-000000000000"


class ParquetFiles:
    """Plain Parquet files, one per append, each written durably (file and directory fsynced),
    read with ``pyarrow.dataset``: the floor of durably writing and reading the data. It has
    the peers' synchronous methods."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.paths: list[str] = []

    def append(self, table: pa.Table) -> None:
        path = self.root / f"{len(self.paths):08d}.parquet"
        write_durably(table, path)
        self.paths.append(str(path))

    def read(self, after_append: int | None = None) -> pa.Table:
        import pyarrow.dataset as pads

        paths = self.paths if after_append is None else self.paths[: after_append + 1]
        return pads.dataset(paths, format="parquet").to_table()

    def open_fresh(self) -> None:
        return None  # plain files have no "open"

    def files(self) -> int:
        return len(self.paths)

    def close(self) -> None:
        return None


STORES: dict[str, Callable[[Path], Any]] = {
    DELTA: DeltaStore,
    ICEBERG: IcebergStore,
    PARQUET: ParquetFiles,
}


class Stored:
    """A synchronous store (``STORES``) as an adapter, called directly like plain Parquet."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.data = store.root
        self.appends = 0

    async def append(self, i: int, table: pa.Table) -> None:
        self.store.append(table)
        self.appends += 1

    async def read(self, after: int | None) -> pa.Table | None:
        if after is not None and after >= self.appends:
            return None
        table: pa.Table = self.store.read(after)
        return table

    async def open_fresh(self) -> float | None:
        t0 = time.perf_counter()
        return None if self.store.open_fresh() is None else time.perf_counter() - t0

    async def close(self) -> dict[str, Any]:
        try:
            return {"files": self.store.files()}
        finally:
            self.store.close()


class PersistLocation:
    """A file blob + a Postgres (a table of its own) or SQLite consensus under ``root``, as new
    instances on every ``parts`` (a fresh client), counted into ``counts`` when given."""

    def __init__(self, ctx: Context, root: Path, kind: str, counts: IoCounts | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ctx, self.root, self.kind, self.counts = ctx, root, kind, counts
        self.table = ctx.table_name(f"bench_{root.name.replace('-', '_')}")

    def parts(self, counts: IoCounts | None = None) -> tuple[Blob, Consensus]:
        counts = counts or self.counts
        blob: Blob = FileBlob(str(self.root / "blob"))
        if counts is None:
            return blob, self.consensus()
        return CountingBlob(blob, counts), CountingConsensus(self.consensus(), counts)

    def consensus(self) -> Consensus:
        if self.kind == "postgres":
            return PostgresConsensus(self.ctx.postgres_uri, table=self.table)
        return SqliteConsensus(str(self.root / "consensus.db"))

    async def connect(self, config: persist.PersistConfig | None = None) -> persist.PersistClient:
        return await persist.connect(*self.parts(), config=config)

    async def writer(self, client: persist.PersistClient) -> persist.WriteHandle:
        """A write handle of a new shard (surviving a restarted database)."""
        write: persist.WriteHandle = await resilient(
            lambda: client.open_writer(persist.ShardId.new(), SCHEMA, purpose="bench"),
            "open_writer",
        )
        return write

    async def drop(self) -> None:
        if self.kind == "postgres":
            await pg_drop_table(self.ctx.postgres_uri, self.table)


class PersistTable:
    """One persist shard. With ``reader``, a read handle holds it from the start at since 0, so
    every version stays readable (time travel); ``report`` names the figures ``close`` gives:
    keys of ``client.inspect``, ``diff_bytes`` and ``blob_sets_per_append`` (``counted``)."""

    def __init__(self, loc: PersistLocation, client: Any, report: Sequence[str]) -> None:
        self.loc, self.client, self.report = loc, client, report
        self.data = loc.root / "blob"
        self.write: persist.WriteHandle
        self.reader: persist.ReadHandle | None = None
        self.appends = 0

    @classmethod
    async def open(
        cls,
        ctx: Context,
        root: str,
        kind: str,
        *,
        report: Sequence[str] = (),
        counted: bool = False,
        reader: bool = False,
        config: persist.PersistConfig | None = None,
    ) -> PersistTable:
        loc = PersistLocation(ctx, ctx.workdir / root, kind, IoCounts() if counted else None)
        self = cls(loc, await loc.connect(config), report)
        if reader:
            opened = await self.client.open(persist.ShardId.new(), SCHEMA, purpose="bench")
            self.write, self.reader = opened
        else:
            self.write = await loc.writer(self.client)
        return self

    async def append(self, i: int, table: pa.Table) -> None:
        await persist_append(self.write, table, i, i + 1)
        self.appends += 1

    async def read(self, after: int | None) -> pa.Table | None:
        reader = self.reader
        if reader is None or (after is not None and after >= self.appends):
            return None
        as_of = self.appends - 1 if after is None else after
        return await resilient(lambda: reader.snapshot_and_fetch(as_of), "snapshot")

    async def open_fresh(self) -> float:
        async def once() -> float:
            t0 = time.perf_counter()
            client = await self.loc.connect()
            try:
                read = await client.open_leased_reader(
                    self.write.shard_id, SCHEMA, purpose="bench-open"
                )
                took = time.perf_counter() - t0  # the teardown below is not the open's
                await read.expire()
            finally:
                await close_client(client)
            return took

        took: float = await resilient(once, "open_leased_reader")
        return took

    async def inspect(self) -> dict[str, Any]:
        info: dict[str, Any] = await resilient(
            lambda: self.client.inspect(self.write.shard_id), "inspect"
        )
        return info

    async def maintain(self) -> None:
        await self.client.maintain(self.write.shard_id)

    async def close(self) -> dict[str, Any]:
        try:
            c = self.loc.counts or IoCounts()
            known = {
                **await self.inspect(),
                "diff_bytes": c.cons_cas_bytes / max(c.cons_cas, 1),
                "blob_sets_per_append": c.blob_sets / max(self.appends, 1),
            }
            return {k: known[k] for k in self.report}
        finally:
            await close_client(self.client)
            await self.loc.drop()


CAS_DDL = (
    'CREATE TABLE IF NOT EXISTS "{t}" (shard text NOT NULL, seqno bigint NOT NULL, '
    "data bytea NOT NULL, PRIMARY KEY (shard, seqno))"
)
CAS_SQL = (
    'INSERT INTO "{t}" (shard, seqno, data) SELECT %s, %s, %s '
    'WHERE (SELECT max(seqno) FROM "{t}" WHERE shard = %s) = %s'
)


class BareCommit:
    """A bare conditional INSERT into a ``(shard, seqno, data)`` table: ``cas(i)`` writes commit
    ``i + 1`` with ``payload`` iff the head is commit ``i`` (the table starts with commit 0).
    As a table adapter, append ``i`` is commit ``i + 1``, and there is nothing to read."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    async def cas(self, i: int) -> None:
        raise NotImplementedError

    async def append(self, i: int, table: pa.Table) -> None:
        await self.cas(i)

    async def read(self, after: int | None) -> None:
        return None


class PgCas(BareCommit):
    """``sql`` (by default ``CAS_SQL``) in Postgres, on one psycopg 3 async connection or
    through a ``psycopg_pool`` pool of the same settings (``pooled``)."""

    def __init__(
        self, ctx: Context, base: str, payload: bytes, sql: str = CAS_SQL, pooled: bool = False
    ) -> None:
        super().__init__(payload)
        self.ctx, self.table, self.pooled = ctx, ctx.table_name(base), pooled
        self.sql = sql.format(t=self.table)
        self.conn = PgConn(ctx.postgres_uri)
        self.pool: Any = None

    async def open(self) -> PgCas:
        """Creates the table with commit 0 (on the connection the statements then use)."""
        await self.conn.value(CAS_DDL.format(t=self.table))
        insert = f'INSERT INTO "{self.table}" VALUES (%s, 0, %s) ON CONFLICT DO NOTHING'
        await self.conn.value(insert, (KEY, b""))
        if self.pooled:
            from psycopg_pool import AsyncConnectionPool

            await self.conn.close()
            uri, kwargs = self.ctx.postgres_uri, {"autocommit": True, "prepare_threshold": 0}
            self.pool = AsyncConnectionPool(uri, min_size=1, max_size=8, open=False, kwargs=kwargs)
            await self.pool.open(wait=True)
        return self

    async def cas(self, i: int) -> None:
        """Survives a restarted server."""
        params = (KEY, i + 1, self.payload, KEY, i)

        async def op() -> None:
            if self.pool is None:
                cur = await self.conn.execute(self.sql, params)
            else:
                async with self.pool.connection() as conn:
                    cur = await conn.execute(self.sql, params)
            if cur.rowcount != 1:
                raise RuntimeError(f"conditional insert {i + 1} into {self.table} did not apply")

        async def landed() -> bool:
            head = f'SELECT max(seqno) FROM "{self.table}" WHERE shard = %s'
            return bool(await self.conn.value(head, (KEY,)) == i + 1)

        await resilient(op, f"conditional insert into {self.table}", landed)

    async def close(self) -> dict[str, Any]:
        try:
            if self.pool is not None:
                await self.pool.close()
            await self.conn.close()
        finally:
            await pg_drop_table(self.ctx.postgres_uri, self.table)
        return {}


class SqliteCas(BareCommit):
    """The same statement on a bare ``sqlite3`` connection configured like persist's SQLite
    consensus (WAL, ``synchronous=FULL``): inline, or each call sent to one worker thread
    (``threaded``)."""

    def __init__(self, path: Path, payload: bytes, threaded: bool = False) -> None:
        super().__init__(payload)
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.execute(
            "CREATE TABLE consensus (shard TEXT NOT NULL, seqno INTEGER NOT NULL, "
            "data BLOB NOT NULL, PRIMARY KEY (shard, seqno)) WITHOUT ROWID"
        )
        self.conn.execute("INSERT INTO consensus VALUES (?, 0, x'')", (KEY,))
        self.pool = ThreadPoolExecutor(1) if threaded else None
        self.sql = CAS_SQL.format(t="consensus").replace("%s", "?")

    def _cas(self, i: int) -> None:
        cur = self.conn.execute(self.sql, (KEY, i + 1, self.payload, KEY, i))
        if cur.rowcount != 1:
            raise RuntimeError(f"conditional insert {i + 1} did not apply")

    async def cas(self, i: int) -> None:
        if self.pool is None:
            self._cas(i)
        else:
            await asyncio.get_running_loop().run_in_executor(self.pool, self._cas, i)

    async def close(self) -> dict[str, Any]:
        if self.pool is not None:
            self.pool.shutdown()
        self.conn.close()
        return {}


def table_systems(
    tag: str, meta: Callable[[str], dict[str, Any]] = lambda kind: {}, **persist_options: Any
) -> list[System]:
    """persist on file + Postgres and on file + SQLite (``PersistTable`` with
    ``persist_options``), Delta Lake, Iceberg and plain Parquet files + fsync (``Stored``),
    under ``<workdir>/<tag>-<kind>``; ``meta(kind)`` is each one's ``System.meta``."""

    def make(kind: str) -> Callable[[Context], Any]:
        if kind in ("postgres", "sqlite"):
            return lambda ctx: PersistTable.open(ctx, f"{tag}-{kind}", kind, **persist_options)
        return lambda ctx: Stored(STORES[kind](ctx.workdir / f"{tag}-{kind}"))

    systems = (
        (PERSIST_PG, SUBJECT, "postgres"),
        (PERSIST_SQLITE, SUBJECT, "sqlite"),
        (DELTA_NAME, PEER, DELTA),
        (ICEBERG_NAME, PEER, ICEBERG),
        (PARQUET_FSYNC, BASELINE, PARQUET),
    )
    return [
        System(name, role, make(kind), meta=meta(kind), requires=(kind,) if role == PEER else ())
        for name, role, kind in systems
    ]
