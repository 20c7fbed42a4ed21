"""consensus: compare-and-set, one after another, on one key.

Every system appends ``cas_ops`` entries to one key, each conditional on the previous one being
the head (expected seqno ``i``, new seqno ``i + 1``), carrying a payload the size of a persist
state diff. The systems run in lockstep rounds (op ``i`` of every system, then ``i + 1``).

Subjects (``persist.location``, called directly, without the rest of persist):

- ``persist PostgresConsensus``: ``compare_and_set`` through its connection pool (psycopg 3 async,
  prepared statements, one autocommit statement with ``FOR KEY SHARE`` on the head row);
- ``persist SqliteConsensus``: ``compare_and_set`` (WAL, ``synchronous=FULL``, a dedicated
  thread).

Baselines, on the same table layout ``(shard text, seqno bigint, data bytea, PRIMARY KEY
(shard, seqno))``:

- ``pg conditional insert`` (the limit): one psycopg 3 async connection, prepared,
  ``INSERT ... SELECT ... WHERE (SELECT max(seqno) ...) = expected``: the least one linearized
  Postgres commit costs;
- ``pg conditional insert FOR KEY SHARE``: persist's own statement on one bare connection (what
  the head-row lock costs);
- ``pg conditional insert via pool``: persist's statement through a ``psycopg_pool`` pool of the
  same settings (what borrowing a pooled connection costs);
- ``sqlite conditional insert`` (the limit of the SQLite one): the same statement on a bare
  ``sqlite3`` connection (WAL, ``synchronous=FULL``), inline;
- ``sqlite conditional insert in a thread``: the same, each call sent to one worker thread (what
  the hop off the event loop costs).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from benches._common import (
    BASELINE,
    SUBJECT,
    Context,
    PgConn,
    System,
    SystemBudgets,
    comparison,
    latency_stats,
    machine_info,
    pg_cas_insert,
    pg_drop_table,
    pg_settings,
    ratio,
    ratio_entry,
    resilient,
    select_systems,
)
from persist.location.postgres import PostgresConsensus
from persist.location.sqlite import SqliteConsensus

NAME = "consensus"
PAYLOAD_BYTES = 700  # about one compare_and_append state diff
KEY = "s00000000-0000-4000-8000-000000000000"
TARGET = 0.7

PG = "persist PostgresConsensus"
SQLITE = "persist SqliteConsensus"
PG_INSERT = "pg conditional insert"
PG_LOCK = "pg conditional insert FOR KEY SHARE"
PG_POOL = "pg conditional insert via pool"
SQLITE_INSERT = "sqlite conditional insert"
SQLITE_THREAD = "sqlite conditional insert in a thread"

_DDL = (
    'CREATE TABLE "{t}" (shard text NOT NULL, seqno bigint NOT NULL, data bytea NOT NULL, '
    "PRIMARY KEY (shard, seqno))"
)
_BARE = (
    'INSERT INTO "{t}" (shard, seqno, data) SELECT %s, %s, %s '
    'WHERE (SELECT max(seqno) FROM "{t}" WHERE shard = %s) = %s'
)
# persist's statement (persist/location/postgres.py), with the same casts.
_LOCKED = (
    'INSERT INTO "{t}" (shard, seqno, data) SELECT %s::text, %s::bigint, %s::bytea '
    'WHERE (SELECT seqno FROM "{t}" WHERE shard = %s::text '
    "ORDER BY seqno DESC LIMIT 1 FOR KEY SHARE) = %s::bigint"
)
_SQLITE_DDL = (
    "CREATE TABLE IF NOT EXISTS consensus (shard TEXT NOT NULL, seqno INTEGER NOT NULL, "
    "data BLOB NOT NULL, PRIMARY KEY (shard, seqno)) WITHOUT ROWID"
)
_SQLITE_CAS = (
    "INSERT INTO consensus (shard, seqno, data) SELECT ?, ?, ? "
    "WHERE (SELECT max(seqno) FROM consensus WHERE shard = ?) IS ?"
)


class CasTarget(Protocol):
    async def first(self, payload: bytes) -> None:
        """Writes seqno 1 (untimed: creates tables, opens connections)."""

    async def cas(self, expected: int, payload: bytes) -> None:
        """Writes seqno ``expected + 1`` iff the head is ``expected``; raises if it did not."""

    async def close(self) -> dict[str, Any]:
        """Releases everything (drops tables); extra figures (may be empty)."""


class PersistCas:
    def __init__(self, consensus: Any, drop: tuple[str, str] | None) -> None:
        self.consensus = consensus
        self.drop = drop

    async def _cas(self, expected: int | None, payload: bytes) -> None:
        seqno = 1 if expected is None else expected + 1

        async def op() -> None:
            if not await self.consensus.compare_and_set(KEY, expected, payload):
                raise RuntimeError(f"compare_and_set {expected} -> {seqno} lost")

        async def landed() -> bool:
            head = await self.consensus.head(KEY)
            return head is not None and head.seqno == seqno

        await resilient(op, "compare_and_set", landed)

    async def first(self, payload: bytes) -> None:
        await self._cas(None, payload)

    async def cas(self, expected: int, payload: bytes) -> None:
        await self._cas(expected, payload)

    async def close(self) -> dict[str, Any]:
        try:
            await self.consensus.close()
        finally:
            if self.drop:
                await pg_drop_table(*self.drop)
        return {}


class PgInsert:
    """A bare conditional INSERT on one connection, or through a pool."""

    def __init__(self, ctx: Context, table: str, sql: str, pooled: bool) -> None:
        self.ctx = ctx
        self.table = table
        self.sql = sql.format(t=table)
        self.pooled = pooled
        self.conn: Any = None
        self.pool: Any = None

    async def first(self, payload: bytes) -> None:
        setup = PgConn(self.ctx.postgres_uri)

        async def create() -> None:
            await setup.execute(_DDL.format(t=self.table))
            await setup.execute(
                f'INSERT INTO "{self.table}" (shard, seqno, data) VALUES (%s, 1, %s) '
                "ON CONFLICT DO NOTHING",
                (KEY, payload),
            )

        try:
            await resilient(create, f"creating {self.table}")
        finally:
            await setup.close()
        if self.pooled:
            from psycopg_pool import AsyncConnectionPool

            self.pool = AsyncConnectionPool(
                self.ctx.postgres_uri,
                min_size=1,
                max_size=8,
                open=False,
                kwargs={"autocommit": True, "prepare_threshold": 0},
            )
            await self.pool.open(wait=True)
        else:
            self.conn = await PgConn(self.ctx.postgres_uri).connect()

    async def cas(self, expected: int, payload: bytes) -> None:
        params = (KEY, expected + 1, payload, KEY, expected)
        if not self.pooled:
            await pg_cas_insert(self.conn, self.sql, params, self.table, KEY, expected + 1)
            return

        async def op() -> None:
            async with self.pool.connection() as conn:
                cur = await conn.execute(self.sql, params)
            if cur.rowcount != 1:
                raise RuntimeError(f"conditional insert {expected + 1} did not apply")

        async def landed() -> bool:
            async with self.pool.connection() as conn:
                cur = await conn.execute(
                    f'SELECT max(seqno) FROM "{self.table}" WHERE shard = %s', (KEY,)
                )
                row = await cur.fetchone()
            return row is not None and row[0] == expected + 1

        await resilient(op, "conditional insert via pool", landed)

    async def close(self) -> dict[str, Any]:
        try:
            if self.pool is not None:
                await self.pool.close()
            if self.conn is not None:
                await self.conn.close()
        finally:
            await pg_drop_table(self.ctx.postgres_uri, self.table)
        return {}


class SqliteInsert:
    """The bare SQLite statement (WAL, FULL sync), inline or on one worker thread."""

    def __init__(self, path: str, threaded: bool) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.execute(_SQLITE_DDL)
        self.pool = ThreadPoolExecutor(1) if threaded else None

    def _op(self, expected: int | None, payload: bytes) -> None:
        seqno = 1 if expected is None else expected + 1
        cur = self.conn.execute(_SQLITE_CAS, (KEY, seqno, payload, KEY, expected))
        if cur.rowcount != 1:
            raise RuntimeError(f"conditional insert {seqno} did not apply")

    async def first(self, payload: bytes) -> None:
        self._op(None, payload)

    async def cas(self, expected: int, payload: bytes) -> None:
        if self.pool is None:
            self._op(expected, payload)
        else:
            await asyncio.get_running_loop().run_in_executor(self.pool, self._op, expected, payload)

    async def close(self) -> dict[str, Any]:
        if self.pool is not None:
            self.pool.shutdown()
        self.conn.close()
        return {}


async def _pg_persist(ctx: Context) -> CasTarget:
    table = ctx.table_name("bench_cas_persist")
    return PersistCas(PostgresConsensus(ctx.postgres_uri, table=table), (ctx.postgres_uri, table))


async def _sqlite_persist(ctx: Context) -> CasTarget:
    return PersistCas(SqliteConsensus(str(ctx.workdir / "persist-cas.db")), None)


def _pg(base: str, sql: str, pooled: bool) -> Any:
    async def make(ctx: Context) -> CasTarget:
        return PgInsert(ctx, ctx.table_name(base), sql, pooled)

    return make


def _sqlite(name: str, threaded: bool) -> Any:
    async def make(ctx: Context) -> CasTarget:
        return SqliteInsert(str(ctx.workdir / f"{name}.db"), threaded)

    return make


def systems() -> list[System]:
    """Everything this scenario measures."""
    return [
        System(PG, SUBJECT, _pg_persist, meta={"limit": PG_INSERT}),
        System(SQLITE, SUBJECT, _sqlite_persist, meta={"limit": SQLITE_INSERT}),
        System(PG_INSERT, BASELINE, _pg("bench_cas_bare", _BARE, False), note="the limit"),
        System(PG_LOCK, BASELINE, _pg("bench_cas_lock", _LOCKED, False), note="persist's SQL"),
        System(PG_POOL, BASELINE, _pg("bench_cas_pool", _LOCKED, True), note="+ pool"),
        System(SQLITE_INSERT, BASELINE, _sqlite("bare", False), note="the limit"),
        System(SQLITE_THREAD, BASELINE, _sqlite("thread", True), note="+ thread hop"),
    ]


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    scale = ctx.scale
    chosen, skipped = select_systems(systems(), only_systems)
    n = scale.cas_ops
    payload = np.random.default_rng(5).bytes(PAYLOAD_BYTES)
    ctx.log(f"{NAME}: {n} compare-and-sets on {[s.name for s in chosen]}")
    targets: dict[str, CasTarget] = {}
    samples: dict[str, list[float]] = {s.name: [] for s in chosen}
    budgets = SystemBudgets([s.name for s in chosen], scale.loop_budget_s)
    extras: dict[str, dict[str, Any]] = {}
    dropped: dict[str, int] = {}
    try:
        for s in chosen:
            targets[s.name] = await s.make(ctx)
            await targets[s.name].first(payload)
        # A few untimed rounds: prepared statements, pool connections, WAL files.
        warm = min(20, max(1, n // 50))
        for i in range(1, warm + 1):
            for s in chosen:
                await targets[s.name].cas(i, payload)
        for i in range(warm + 1, warm + 1 + n):
            active = [s for s in chosen if budgets.active(s.name, i - warm - 1)]
            if not active:
                break
            for s in active:
                target = targets[s.name]
                await budgets.sample(
                    s.name, functools.partial(target.cas, i, payload), samples, dropped
                )
            if (i - warm) % max(100, n // 5) == 0:
                ctx.log(f"{NAME}: {i - warm}/{n} rounds")
    finally:
        for name, t in targets.items():
            extras[name] = await t.close()

    by_name = {s.name: s for s in chosen}
    rows: dict[str, dict[str, Any]] = {}
    for name, xs in samples.items():
        st = latency_stats(xs)
        rows[name] = {
            "role": by_name[name].role,
            "p50_ms": st["p50_ms"],
            "p99_ms": st["p99_ms"],
            "mean_ms": st["mean_ms"],
            "ops_per_s": st["per_s"],
            "flatness": st["flatness"],
            "ops": len(xs) + dropped.get(name, 0),
            **({"cut_at": budgets.cut[name]} if name in budgets.cut else {}),
            **({"dropped_samples": dropped[name]} if name in dropped else {}),
            **extras.get(name, {}),
        }

    ratios = []
    comparisons = []
    for s in chosen:
        if s.role != SUBJECT:
            continue
        limit = s.meta["limit"]
        have = limit in rows
        ratios.append(
            ratio_entry(
                f"{s.name} ops/s vs {limit}",
                ratio(rows[s.name]["ops_per_s"], rows[limit]["ops_per_s"]) if have else None,
                f"ops/s({s.name}) / ops/s({limit})",
                at_least=TARGET if s.name == PG else None,
            )
        )
        for figure, metric, better in (
            ("CAS ops/s", "ops_per_s", "higher"),
            ("CAS p50", "p50_ms", "lower"),
            ("CAS p99", "p99_ms", "lower"),
        ):
            comparisons.append(
                comparison(
                    figure,
                    "1/s" if better == "higher" else "ms",
                    better,
                    s.name,
                    rows[s.name][metric],
                    peers={},
                    limit=(limit, rows[limit][metric]) if have else None,
                    limit_at_least=TARGET if (s.name == PG and metric == "ops_per_s") else None,
                    note="peers have no comparable standalone commit",
                )
            )
    for step, base in ((PG_LOCK, PG_INSERT), (PG_POOL, PG_LOCK), (PG, PG_POOL)):
        if step in rows and base in rows:
            ratios.append(
                ratio_entry(
                    f"{step} p50 vs {base} p50",
                    ratio(rows[step]["p50_ms"], rows[base]["p50_ms"]),
                    "what each step adds (time ratio)",
                )
            )
    for step, base in ((SQLITE_THREAD, SQLITE_INSERT), (SQLITE, SQLITE_THREAD)):
        if step in rows and base in rows:
            ratios.append(
                ratio_entry(
                    f"{step} p50 vs {base} p50",
                    ratio(rows[step]["p50_ms"], rows[base]["p50_ms"]),
                    "what each step adds (time ratio)",
                )
            )

    return {
        "scenario": NAME,
        "params": {"ops": n, "payload_bytes": PAYLOAD_BYTES, "warmup_ops": warm},
        "tables": {"": rows},
        "ratios": ratios,
        "comparisons": comparisons,
        "skipped": skipped,
        "notes": [
            "lockstep rounds: op i of every system, then op i+1; one key per system",
            "persist's consensus implementations are called directly (no state machine); the "
            "baselines break the cost down: bare statement -> persist's statement (FOR KEY "
            "SHARE) -> through a pool -> persist",
        ],
        "samples_ms": {k: [round(x * 1e3, 4) for x in v] for k, v in samples.items()},
        "machine": machine_info(
            ctx.scale.name,
            {"postgres": await pg_settings(ctx.postgres_uri), "pid": os.getpid()},
            ctx.workdir,
        ),
    }
