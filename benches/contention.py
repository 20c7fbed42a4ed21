"""contention: writers on one shard, as many commits/s as consensus allows, with no livelock.

For N in ``contention_writers``, N spawned processes (``benches.procs``: started together once
all are ready, so imports and connects are not timed) race to commit to ONE shard / key for
``contention_window_s`` (at most ``contention_attempts`` attempts each), on fresh tables / files:

- persist (file blob + Postgres / SQLite consensus): a ``persist.connect`` client and
  ``open_writer`` each, on the shard the parent created; each loops ``compare_and_append(one
  row, upper, upper + 1)`` and on ``UpperMismatch`` takes ``exc.current`` and tries again;
- the limit, what consensus allows: bare conditional INSERTs (``benches.systems.CAS_SQL``, a
  persist diff's size of payload), a connection each; a lost race reads the head and goes on.

Reported (never asserted), per system and N: commits/s, refusals (lost races)/s, the fewest and
most commits of one writer (no livelock: min > 0); persist's commits/s over the bare INSERT's
on the same database and N, and min / mean commits per writer.

**One process.** Then, per persist system and N: N write handles of ONE client (one process)
on one shard, each looping ``append_next`` of one row for the same window. Calls of one
client's handles are committed in groups (``internal/appends.py``), so they do not race;
reported: appends/s, and its ratio to one handle's appends/s in the same run (the issue-33
direction "group commit across handles of one process"; racing, 8 handles made a sixth of one).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg

import persist
from benches.fixtures import (
    RECOVERIES,
    SCHEMA,
    PgConn,
    close_client,
    make_updates,
    pg_drop_table,
    resilient,
)
from benches.harness import BASELINE, SUBJECT, Context, Run, System, ratio, ratio_entry
from benches.procs import Spec, report_done, run_child, run_processes, started
from benches.small_append import DIFF_LIKE_BYTES, PAYLOAD
from benches.systems import (
    CAS_SQL,
    KEY,
    PERSIST_PG,
    PERSIST_SQLITE,
    PersistLocation,
    PgCas,
    SqliteCas,
)

NAME = "contention"
TITLE = "Contention: writers on one shard"
PG_RACE = "pg conditional insert"
SQLITE_RACE = "sqlite conditional insert"
HEAD_SQL = 'SELECT max(seqno) FROM "{t}" WHERE shard = %s'


@dataclass(frozen=True)
class _PersistRacer:
    """One writer of the shard, in a client of its own."""

    client: persist.PersistClient
    write: persist.WriteHandle

    @classmethod
    async def open(cls, spec: Spec, shard: str) -> _PersistRacer:
        client = await PersistLocation(spec.ctx, spec.root, spec.kind).connect()
        try:
            sid = persist.ShardId(shard)
            open_writer = functools.partial(client.open_writer, sid, SCHEMA, purpose="bench")
            return cls(client, await resilient(open_writer, "open_writer"))
        except BaseException:
            await close_client(client)
            raise

    async def head(self) -> int:
        upper = await self.write.fetch_recent_upper()
        assert upper is not None  # nobody finalizes the shard
        return upper

    async def commit(self, upper: int) -> tuple[bool, int]:
        """Whether the commit at ``upper`` won, and the upper this writer knows after it."""
        try:
            table = make_updates(1, key_start=upper, time=upper)  # a key per commit
            await self.write.compare_and_append(table, upper, upper + 1)
            return True, upper + 1
        except persist.UpperMismatch as exc:
            assert exc.current is not None
            return False, exc.current

    async def close(self) -> None:
        await close_client(self.client)


class _BareRacer:
    """``CAS_SQL`` on the key, on one connection: psycopg (autocommit) to the Postgres table
    ``where``, or ``sqlite3`` to the database file ``where`` (in WAL mode: ``SqliteCas``)."""

    def __init__(self, spec: Spec, where: str) -> None:
        pg = spec.kind == "postgres"
        self.pg = PgConn(spec.ctx.postgres_uri) if pg else None
        # A busy timeout: a writer waits for the write lock, as persist's consensus does.
        self.db = None if pg else sqlite3.connect(where, timeout=30, isolation_level=None)
        if self.db is not None:
            self.db.execute("PRAGMA synchronous = FULL")
        table, mark = (where, "%s") if pg else ("consensus", "?")
        sql = (s.format(t=table).replace("%s", mark) for s in (CAS_SQL, HEAD_SQL))
        self.cas, self.head_sql = sql

    async def _execute(self, sql: str, params: tuple[Any, ...]) -> Any:
        if self.pg is not None:
            return await self.pg.execute(sql, params)
        assert self.db is not None  # blocking: the process has nothing else to do
        return self.db.execute(sql, params)

    async def head(self) -> int:
        cur = await self._execute(self.head_sql, (KEY,))
        return int((await cur.fetchone() if self.pg else cur.fetchone())[0])

    async def commit(self, head: int) -> tuple[bool, int]:
        try:
            cur = await self._execute(self.cas, (KEY, head + 1, PAYLOAD, KEY, head))
            if cur.rowcount == 1:
                return True, head + 1
        except (psycopg.errors.UniqueViolation, sqlite3.IntegrityError):
            pass  # both saw the same head and the other inserted first: a lost race too
        return False, await self.head()

    async def close(self) -> None:
        if self.pg is not None:
            await self.pg.close()
        elif self.db is not None:
            self.db.close()


@dataclass(frozen=True)
class _Target:
    """The shard (persist) or key (bare insert) one N races on, in tables / files of its own;
    each writer process gets a copy."""

    spec: Spec
    bare: bool
    where: str  # the shard id; the bare insert's Postgres table or SQLite file

    @classmethod
    async def make(cls, ctx: Context, kind: str, bare: bool, n: int) -> _Target:
        spec = Spec(ctx, kind, ctx.workdir / f"{'race' if bare else 'shard'}-{kind}-{n}")
        loc = PersistLocation(ctx, spec.root, kind)  # makes the directory
        if bare and kind == "postgres":
            cas = await PgCas(ctx, f"bench_race_{n}", PAYLOAD).open()  # the table, commit 0
            await cas.conn.close()
            return cls(spec, bare, cas.table)
        if bare:
            await SqliteCas(spec.root / "race.db", PAYLOAD).close()  # the database, commit 0
            return cls(spec, bare, str(spec.root / "race.db"))
        client = await loc.connect()
        try:
            return cls(spec, bare, (await loc.writer(client)).shard_id)
        finally:
            await close_client(client)  # its writer's heartbeats would race the measured ones

    async def racer(self) -> _PersistRacer | _BareRacer:
        if self.bare:
            return _BareRacer(self.spec, self.where)
        return await _PersistRacer.open(self.spec, self.where)

    async def stored(self) -> int:
        """The commits the shard / key holds: its upper / head seqno (both start at 0)."""
        racer = await self.racer()
        try:
            head: int = await resilient(racer.head, "read the head")
            return head
        finally:
            await racer.close()

    async def drop(self) -> None:
        if self.bare and self.spec.kind == "postgres":
            await pg_drop_table(self.spec.ctx.postgres_uri, self.where)
        else:
            await PersistLocation(self.spec.ctx, self.spec.root, self.spec.kind).drop()


async def _race(target: _Target, j: int, out: Any, go: Any) -> None:
    racer = await target.racer()
    try:
        upper = await resilient(racer.head, "read the head")
        if not await started(j, out, go):
            return  # the parent gave up
        scale, mark, commits, refusals = target.spec.ctx.scale, RECOVERIES.count, 0, 0
        deadline = time.monotonic() + scale.contention_window_s
        for _ in range(scale.contention_attempts):
            if time.monotonic() >= deadline:
                break
            won, upper = await resilient(functools.partial(racer.commit, upper), "commit")
            commits, refusals = commits + won, refusals + (not won)
        report_done(out, j, mark, commits, refusals)
    finally:
        await racer.close()


def _child(target: _Target, j: int, out: Any, go: Any) -> None:
    run_child(j, out, _race(target, j, out, go))


def systems() -> list[System]:
    def make(kind: str, bare: bool) -> Callable[[Context, int], Awaitable[_Target]]:
        return lambda ctx, n: _Target.make(ctx, kind, bare, n)

    return [
        System(PERSIST_PG, SUBJECT, make("postgres", False), meta={"limit": PG_RACE}),
        System(PERSIST_SQLITE, SUBJECT, make("sqlite", False), meta={"limit": SQLITE_RACE}),
        System(PG_RACE, BASELINE, make("postgres", True)),
        System(SQLITE_RACE, BASELINE, make("sqlite", True)),
    ]


def row_name(name: str, n: int) -> str:
    return f"{name}, {n} writer{'s' if n > 1 else ''}"


async def _race_n(run: Run, name: str, n: int) -> dict[str, Any]:
    target: _Target = await run.make(name, n)
    try:
        args = [(target, j) for j in range(n)]
        t0, done = await run_processes(_child, args, run.ctx.scale.contention_window_s)
        stored = await target.stored()
    finally:
        await target.drop()
    wall = max(end for _, _, end, *_ in done) - t0
    commits = [c for _, _, _, c, *_ in done]
    refusals = sum(r for _, _, _, _, r, *_ in done)
    rates = {"commits_per_s": sum(commits) / wall, "refusals_per_s": refusals / wall}
    per_writer = {"min_commits_per_writer": min(commits), "max_commits_per_writer": max(commits)}
    totals = {"commits": sum(commits), "refusals": refusals, "stored_commits": stored}
    return run.row(name, writers=n, **rates, **per_writer, **totals, wall_s=wall)


async def _one_process(run: Run, name: str, n: int) -> dict[str, Any]:
    """N handles of one client on one shard, each looping ``append_next`` of one row."""
    target: _Target = await run.make(name, n)
    loc = PersistLocation(target.spec.ctx, target.spec.root, target.spec.kind)
    client = await loc.connect()
    try:
        sid = persist.ShardId(target.where)
        handles = [await client.open_writer(sid, SCHEMA, purpose="bench") for _ in range(n)]
        scale = run.ctx.scale
        one = make_updates(1, key_start=0, time=0).drop_columns(["_time"])
        counts = [0] * n

        async def loop(j: int, deadline: float) -> None:
            for _ in range(scale.contention_attempts):
                if time.monotonic() >= deadline:
                    return
                await handles[j].append_next(one)
                counts[j] += 1

        t0 = time.monotonic()
        deadline = t0 + scale.contention_window_s
        await asyncio.gather(*(loop(j, deadline) for j in range(n)))
        wall = time.monotonic() - t0
        stored = await handles[0].fetch_recent_upper()
    finally:
        await close_client(client)
        await target.drop()
    return run.row(
        name,
        writers=n,
        appends_per_s=sum(counts) / wall,
        appends=sum(counts),
        min_appends_per_handle=min(counts),
        stored_commits=stored,
        wall_s=wall,
    )


async def run(ctx: Context) -> dict[str, Any]:
    sc = ctx.scale
    rows: dict[str, dict[str, Any]] = {}
    points: dict[str, list[dict[str, Any]]] = {}
    one_process: dict[str, dict[str, Any]] = {}
    async with Run(ctx, NAME, systems()) as run:
        for n in sc.contention_writers:
            for name in run.names():  # one N's systems back to back: noise hits them alike
                run.log(f"{row_name(name, n)} on one shard for {sc.contention_window_s:g} s")
                rows[row_name(name, n)] = row = await _race_n(run, name, n)
                points.setdefault(name, []).append(row)
        # One process: N handles of one client, from 1 handle (the baseline) up.
        for n in sorted({1, *sc.contention_writers}):
            for name in run.names(SUBJECT):
                run.log(
                    f"{row_name(name, n)} of one client: append_next for {sc.contention_window_s:g} s"
                )
                one_process[row_name(name, n)] = await _one_process(run, name, n)

    ratios, comparisons, top = [], [], max(sc.contention_writers)
    for s in run.names(SUBJECT):
        lim = run.systems[s].meta["limit"]
        for n in sc.contention_writers:
            r, base = rows[row_name(s, n)], rows[row_name(lim, n)]
            ratios += [
                ratio_entry(
                    f"{row_name(s, n)}: commits/s vs what consensus allows ({lim})",
                    ratio(r["commits_per_s"], base["commits_per_s"]),
                    f"commits/s({s}) / commits/s({lim}), {n} racing processes each",
                ),
                ratio_entry(
                    f"{row_name(s, n)}: every writer committed (min / mean commits per writer)",
                    ratio(r["min_commits_per_writer"], r["commits"] / n),
                    "min(commits of a writer) / (commits / N): > 0 no writer starved, 1 even",
                ),
            ]
        for n in sc.contention_writers:
            if n > 1:
                r, base = one_process[row_name(s, n)], one_process[row_name(s, 1)]
                ratios.append(
                    ratio_entry(
                        f"{row_name(s, n)} of one client: append_next appends/s vs 1 handle's",
                        ratio(r["appends_per_s"], base["appends_per_s"]),
                        f"appends/s of {n} handles of one client / of 1 handle, one shard",
                    )
                )
        comparisons.append(
            run.compare(
                f"commits/s, {top} writers on one shard",
                "1/s",
                s,
                {s: rows[row_name(s, top)]["commits_per_s"]},
                (lim, rows[row_name(lim, top)]["commits_per_s"]),
                note="no fixed target: as many as consensus allows (bare INSERTs racing)",
            )
        )
    return await run.result(
        params={
            "writers": list(sc.contention_writers),
            "window_s": sc.contention_window_s,
            "max_attempts_per_writer": sc.contention_attempts,
            "bare_payload_bytes": DIFF_LIKE_BYTES,
        },
        tables={
            "": rows,
            "handles of one client (one process), append_next on one shard": one_process,
        },
        ratios=ratios,
        comparisons=comparisons,
        points=points,
        notes=[
            "a spawned process per writer (its own client / connection), all started together "
            "once ready; each stops after window_s or max_attempts_per_writer attempts; rates "
            "are over the start to the last stop; refusals: persist's UpperMismatch, the bare "
            "insert's lost races",
            "stored_commits: the shard's upper / the key's head seqno afterwards (= commits when "
            "every counted commit landed once)",
        ],
    )
