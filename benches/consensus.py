"""consensus: compare-and-set, one after another, on one key.

Every system appends ``cas_ops`` entries to one key, each conditional on the previous one being
the head (expected seqno ``i``, new seqno ``i + 1``), carrying a payload the size of a persist
state diff, in lock-step rounds (op ``i`` of every system, then ``i + 1``).

Subjects (``persist.location``, called directly, without the rest of persist):

- ``persist PostgresConsensus``: ``compare_and_set`` through its connection pool (psycopg 3 async,
  prepared statements, one autocommit statement with ``FOR KEY SHARE`` on the head row);
- ``persist SqliteConsensus``: ``compare_and_set`` (WAL, ``synchronous=FULL``, a dedicated
  thread).

Baselines, on the same table layout ``(shard text, seqno bigint, data bytea, PRIMARY KEY
(shard, seqno))`` (``benches.systems.PgCas`` / ``SqliteCas``):

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

from collections.abc import Callable
from typing import Any

import numpy as np

from benches.fixtures import resilient
from benches.harness import BASELINE, SUBJECT, Context, Run, System, column, versus
from benches.systems import CAS_SQL, KEY, PersistLocation, PgCas, SqliteCas

NAME = "consensus"
TITLE = "Consensus: compare-and-set"
PAYLOAD_BYTES = 700  # about one compare_and_append state diff
PAYLOAD = np.random.default_rng(5).bytes(PAYLOAD_BYTES)
TARGET = 0.7

PG = "persist PostgresConsensus"
SQLITE = "persist SqliteConsensus"
PG_INSERT = "pg conditional insert"
PG_LOCK = "pg conditional insert FOR KEY SHARE"
PG_POOL = "pg conditional insert via pool"
SQLITE_INSERT = "sqlite conditional insert"
SQLITE_THREAD = "sqlite conditional insert in a thread"
# What each step adds: (step, the one before it).
STEPS = (
    (PG_LOCK, PG_INSERT),
    (PG_POOL, PG_LOCK),
    (PG, PG_POOL),
    (SQLITE_THREAD, SQLITE_INSERT),
    (SQLITE, SQLITE_THREAD),
)

# persist's statement (persist/location/postgres.py), with the same casts.
LOCKED = (
    'INSERT INTO "{t}" (shard, seqno, data) SELECT %s::text, %s::bigint, %s::bytea '
    'WHERE (SELECT seqno FROM "{t}" WHERE shard = %s::text '
    "ORDER BY seqno DESC LIMIT 1 FOR KEY SHARE) = %s::bigint"
)


class PersistCas:
    """persist's own Consensus of ``kind`` (Postgres, a table of its own, or SQLite); commit 0 is
    the empty key."""

    def __init__(self, ctx: Context, kind: str) -> None:
        self.loc = PersistLocation(ctx, ctx.workdir / f"cas-{kind}", kind)
        self.consensus = self.loc.consensus()

    async def cas(self, i: int) -> None:
        async def op() -> None:
            if not await self.consensus.compare_and_set(KEY, i or None, PAYLOAD):
                raise RuntimeError(f"compare_and_set {i} -> {i + 1} lost")

        async def landed() -> bool:
            head = await self.consensus.head(KEY)
            return head is not None and head.seqno == i + 1

        await resilient(op, "compare_and_set", landed)

    async def close(self) -> dict[str, Any]:
        try:
            await self.consensus.close()
        finally:
            await self.loc.drop()
        return {}


def systems() -> list[System]:
    """Everything this scenario measures."""

    def pg(base: str, sql: str = CAS_SQL, pooled: bool = False) -> Callable[[Context], Any]:
        return lambda ctx: PgCas(ctx, base, PAYLOAD, sql, pooled).open()

    def sqlite(name: str, threaded: bool = False) -> Callable[[Context], Any]:
        return lambda ctx: SqliteCas(ctx.workdir / f"{name}.db", PAYLOAD, threaded)

    return [
        System(PG, SUBJECT, lambda ctx: PersistCas(ctx, "postgres"), meta={"limit": PG_INSERT}),
        System(
            SQLITE, SUBJECT, lambda ctx: PersistCas(ctx, "sqlite"), meta={"limit": SQLITE_INSERT}
        ),
        System(PG_INSERT, BASELINE, pg("bench_cas_bare")),
        System(PG_LOCK, BASELINE, pg("bench_cas_lock", LOCKED)),
        System(PG_POOL, BASELINE, pg("bench_cas_pool", LOCKED, pooled=True)),
        System(SQLITE_INSERT, BASELINE, sqlite("bare")),
        System(SQLITE_THREAD, BASELINE, sqlite("thread", threaded=True)),
    ]


async def run(ctx: Context) -> dict[str, Any]:
    n = ctx.scale.cas_ops
    warm = min(20, max(1, n // 50))
    async with Run(ctx, NAME, systems()) as run:
        run.log(f"{n} compare-and-sets on {run.names()}")
        await run.open()
        # Untimed: the first commit creates the key, the next few prepare statements and fill
        # pools and WAL files.
        for i in range(warm + 1):
            for target in run.adapters.values():
                await target.cas(i)
        await run.lockstep(n, op=lambda target, i, _: target.cas(warm + 1 + i))

    rows = {name: run.latency_row(name, "ops_per_s", "ops") for name in run.names()}
    ratios = []
    comparisons = []
    note = "peers have no comparable standalone commit"
    for s in run.names(SUBJECT):
        limit = run.systems[s].meta["limit"]
        target = TARGET if s == PG else None
        name = f"{s} ops/s vs {limit}"
        ratios.append(versus(rows, "ops_per_s", s, limit, "ops/s", name, at_least=target))
        for figure, key, unit in (
            ("CAS ops/s", "ops_per_s", "1/s"),
            ("CAS p50", "p50_ms", "ms"),
            ("CAS p99", "p99_ms", "ms"),
        ):
            goal = ("limit", ">=", TARGET) if (s == PG and key == "ops_per_s") else None
            comparisons.append(run.compare(figure, unit, s, column(rows, key), limit, goal, note))
    ratios += [
        versus(rows, "p50_ms", step, base, "p50", formula="what each step adds (time ratio)")
        for step, base in STEPS
        if step in rows and base in rows
    ]
    return await run.result(
        params={"ops": n, "payload_bytes": PAYLOAD_BYTES, "warmup_ops": warm},
        tables={"": rows},
        ratios=ratios,
        comparisons=comparisons,
        notes=[
            "lockstep rounds: op i of every system, then op i+1; one key per system",
            "persist's consensus implementations are called directly (no state machine); the "
            "baselines break the cost down: bare statement -> persist's statement (FOR KEY "
            "SHARE) -> through a pool -> persist",
        ],
        samples_ms=run.samples_ms(),
    )
