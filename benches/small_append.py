"""small_append: many small ``compare_and_append`` calls, one after another.

Each append writes ``small_rows`` rows (int64 key, 16-char string, int64 value; ``_time`` = the
append index ``i``, bounds ``[i, i + 1)``). Every system appends the same tables; the systems run
in lockstep rounds (round ``i``: every system does its append ``i``), so noise on the shared
machine hits them alike.

Systems (adapters implement ``Appender``):

- persist on a file blob with Postgres consensus, and with SQLite consensus (subjects);
- ``parquet+fsync``: ``pyarrow.parquet.write_table`` of the same table to a new file in one
  directory, then fsync of the file and of the directory (the floor of durably writing the data);
- ``pg conditional insert``: one single-statement conditional INSERT into a
  ``(shard, seqno, data bytea)`` table over one psycopg 3 async connection (the floor of one
  linearized metadata commit in Postgres);
- ``sqlite conditional insert``: the same statement in SQLite (WAL, ``synchronous=FULL``).

Peers (``benches.peers``; skipped, with the reason recorded, when the bench extra is missing):

- ``delta-lake``: ``write_deltalake(dir, rows, mode="append")`` per append;
- ``iceberg[sql-sqlite]``: ``table.append(rows)`` per append, SQL catalog on SQLite.

"vs limit" = persist p50 / (parquet+fsync p50 + conditional-insert p50): how far persist is from
doing its two unavoidable durable steps back to back with nothing else.

Each system's measured time is charged to its own budget (``loop_budget_s``); a system whose
budget runs out stops appending (``cut_at`` in its row) while the others go on, so a peer whose
appends slow down as its table grows can't make the run unbounded. Its figures then cover the
appends it made (on a smaller table than the others: in its favour).

After the appends, every table-like system is read back (warm page cache; one untimed read,
then ``bulk_read_repeats`` timed rounds, interleaved): the latest version (``snapshot``) and,
as time travel, the version right after append ``k`` = half of the appends the slowest system
made (the same rows for everyone). Baseline: ``pyarrow.dataset`` over the same plain Parquet
files (all of them / the first ``k + 1``).

A peer is added by appending a ``System`` to ``systems()`` whose ``make`` returns an
``Appender``; it is then measured and reported like persist.
"""

from __future__ import annotations

import functools
import gc
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

import persist
from benches._common import (
    BASELINE,
    PEER,
    SCHEMA,
    SUBJECT,
    Context,
    CountingBlob,
    CountingConsensus,
    PgConn,
    System,
    SystemBudgets,
    close_client,
    comparison,
    fsync_dir,
    fsync_file,
    latency_stats,
    machine_info,
    make_updates,
    persist_append,
    pg_cas_insert,
    pg_drop_table,
    pg_settings,
    ratio,
    ratio_entry,
    resilient,
    select_systems,
)
from benches.peers import DELTA, DELTA_NAME, ICEBERG, ICEBERG_NAME, DeltaStore, IcebergStore
from persist.location.file import FileBlob
from persist.location.postgres import PostgresConsensus
from persist.location.sqlite import SqliteConsensus

NAME = "small_append"

# Payload of the bare conditional inserts: about the size of one persist state diff of a
# compare_and_append (the persist systems report their measured mean as diff_bytes).
DIFF_LIKE_BYTES = 700

PARQUET = "parquet+fsync"
PG_INSERT = "pg conditional insert"
SQLITE_INSERT = "sqlite conditional insert"


class Appender(Protocol):
    async def append(self, i: int, table: pa.Table) -> None:
        """Durably appends ``table`` (times ``[i, i + 1)``), as the ``i``-th append."""

    async def read(self, after_append: int | None) -> pa.Table | None:
        """The whole table as of the latest append (``None``) or as of right after append
        ``after_append`` (time travel); ``None`` from systems that store no table."""

    async def close(self) -> dict[str, Any]:
        """Releases everything; extra figures worth reporting (may be empty)."""


# --- persist -----------------------------------------------------------------------------------


class PersistAppender:
    def __init__(
        self,
        client: persist.PersistClient,
        write: persist.WriteHandle,
        blob: CountingBlob,
        consensus: CountingConsensus,
        drop: str | None,
        ctx: Context,
    ) -> None:
        self.client = client
        self.write = write
        self.blob = blob
        self.consensus = consensus
        self.drop = drop
        self.ctx = ctx
        self.appends = 0
        self.reader: persist.ReadHandle

    @classmethod
    async def open(cls, ctx: Context, consensus_kind: str) -> PersistAppender:
        root = ctx.workdir / f"small-persist-{consensus_kind}"
        root.mkdir(parents=True, exist_ok=True)
        blob = CountingBlob(FileBlob(str(root / "blob")))
        drop = None
        if consensus_kind == "postgres":
            drop = ctx.table_name("bench_small_consensus")
            inner: Any = PostgresConsensus(ctx.postgres_uri, table=drop)
        else:
            inner = SqliteConsensus(str(root / "consensus.db"))
        consensus = CountingConsensus(inner, blob.counts)
        client = await persist.connect(blob, consensus)
        write, read = await client.open(persist.ShardId.new(), SCHEMA, purpose="bench")
        self = cls(client, write, blob, consensus, drop, ctx)
        # Held from the start at since 0, so every version stays readable (time travel).
        self.reader = read
        return self

    async def append(self, i: int, table: pa.Table) -> None:
        await persist_append(self.write, table, i, i + 1)
        self.appends += 1

    async def read(self, after_append: int | None) -> pa.Table | None:
        as_of = self.appends - 1 if after_append is None else after_append
        return await resilient(lambda: self.reader.snapshot_and_fetch(as_of), "snapshot")

    async def close(self) -> dict[str, Any]:
        c = self.blob.counts
        extra: dict[str, Any] = {
            "diff_bytes": c.cons_cas_bytes / max(c.cons_cas, 1),
            "blob_sets_per_append": c.blob_sets / max(self.appends, 1),
        }
        try:
            info = await resilient(lambda: self.client.inspect(self.write.shard_id), "inspect")
            extra["rollups"] = info["rollups"]
            extra["batches"] = info["batches"]
            extra["parts"] = info["parts"]
        finally:
            await close_client(self.client)
            if self.drop:
                await pg_drop_table(self.ctx.postgres_uri, self.drop)
        return extra


# --- baselines ---------------------------------------------------------------------------------


class ParquetFsyncAppender:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: list[str] = []

    async def append(self, i: int, table: pa.Table) -> None:
        path = self.dir / f"{i:08d}.parquet"
        pq.write_table(table, path)
        fsync_file(path)
        fsync_dir(self.dir)
        self.files.append(str(path))

    async def read(self, after_append: int | None) -> pa.Table | None:
        files = self.files if after_append is None else self.files[: after_append + 1]
        return pads.dataset(files, format="parquet").to_table()

    async def close(self) -> dict[str, Any]:
        return {"files": len(self.files)}


class PeerAppender:
    """A peer store (``benches.peers``) as an ``Appender``: calls it directly (it is
    synchronous), like the plain-Parquet baseline."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def append(self, i: int, table: pa.Table) -> None:
        self.store.append(table)

    async def read(self, after_append: int | None) -> pa.Table | None:
        return self.store.read(after_append)

    async def close(self) -> dict[str, Any]:
        try:
            return {"files": self.store.files()}
        finally:
            self.store.close()


class PgConditionalInsert:
    """The bare Postgres commit: ``INSERT ... SELECT ... WHERE (SELECT max(seqno) ...) = %s``."""

    def __init__(self, ctx: Context, conn: Any, table: str) -> None:
        self.ctx = ctx
        self.conn = conn
        self.table = table
        self.shard = "bench-shard"
        self.payload = np.random.default_rng(1).bytes(DIFF_LIKE_BYTES)
        t = f'"{table}"'
        self.sql = (
            f"INSERT INTO {t} (shard, seqno, data) SELECT %s, %s, %s "
            f"WHERE (SELECT max(seqno) FROM {t} WHERE shard = %s) = %s"
        )

    @classmethod
    async def open(cls, ctx: Context) -> PgConditionalInsert:
        table = ctx.table_name("bench_cas_limit")
        conn = PgConn(ctx.postgres_uri)
        self = cls(ctx, conn, table)

        async def create() -> None:
            await conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{table}" (shard text NOT NULL, '
                "seqno bigint NOT NULL, data bytea NOT NULL, PRIMARY KEY (shard, seqno))"
            )
            await conn.execute(
                f'INSERT INTO "{table}" (shard, seqno, data) VALUES (%s, 0, %s) '
                "ON CONFLICT DO NOTHING",
                (self.shard, b""),
            )

        await resilient(create, f"creating {table}")
        return self

    async def append(self, i: int, table: pa.Table) -> None:
        params = (self.shard, i + 1, self.payload, self.shard, i)
        await pg_cas_insert(self.conn, self.sql, params, self.table, self.shard, i + 1)

    async def read(self, after_append: int | None) -> pa.Table | None:
        return None

    async def close(self) -> dict[str, Any]:
        try:
            await pg_drop_table(self.ctx.postgres_uri, self.table)
        finally:
            await self.conn.close()
        return {"payload_bytes": DIFF_LIKE_BYTES}


class SqliteConditionalInsert:
    """The bare SQLite commit, configured like persist's SQLite consensus (WAL, FULL sync)."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(str(path), isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.execute(
            "CREATE TABLE t (shard TEXT NOT NULL, seqno INTEGER NOT NULL, data BLOB NOT NULL, "
            "PRIMARY KEY (shard, seqno)) WITHOUT ROWID"
        )
        self.conn.execute("INSERT INTO t VALUES ('bench-shard', 0, x'')")
        self.payload = np.random.default_rng(1).bytes(DIFF_LIKE_BYTES)
        self.sql = (
            "INSERT INTO t (shard, seqno, data) SELECT ?, ?, ? "
            "WHERE (SELECT max(seqno) FROM t WHERE shard = ?) = ?"
        )

    async def append(self, i: int, table: pa.Table) -> None:
        cur = self.conn.execute(self.sql, ("bench-shard", i + 1, self.payload, "bench-shard", i))
        if cur.rowcount != 1:
            raise RuntimeError(f"conditional insert {i + 1} did not apply")

    async def read(self, after_append: int | None) -> pa.Table | None:
        return None

    async def close(self) -> dict[str, Any]:
        self.conn.close()
        return {"payload_bytes": DIFF_LIKE_BYTES}


# --- the systems -------------------------------------------------------------------------------


async def _parquet(ctx: Context) -> Appender:
    return ParquetFsyncAppender(ctx.workdir / "small-parquet")


async def _sqlite_insert(ctx: Context) -> Appender:
    d = ctx.workdir / "small-sqlite-limit"
    d.mkdir(parents=True, exist_ok=True)
    return SqliteConditionalInsert(d / "limit.db")


async def _delta(ctx: Context) -> Appender:
    return PeerAppender(DeltaStore(ctx.workdir / "small-delta"))


async def _iceberg(ctx: Context) -> Appender:
    return PeerAppender(IcebergStore(ctx.workdir / "small-iceberg"))


def systems() -> list[System]:
    """Everything this scenario measures. Peers are added here."""
    return [
        System(
            "persist[file+postgres]",
            SUBJECT,
            lambda ctx: PersistAppender.open(ctx, "postgres"),
            meta={"limit": [PARQUET, PG_INSERT]},
        ),
        System(
            "persist[file+sqlite]",
            SUBJECT,
            lambda ctx: PersistAppender.open(ctx, "sqlite"),
            meta={"limit": [PARQUET, SQLITE_INSERT]},
        ),
        System(
            DELTA_NAME, PEER, _delta, note="write_deltalake(dir, mode=append)", requires=(DELTA,)
        ),
        System(
            ICEBERG_NAME,
            PEER,
            _iceberg,
            note="table.append, SqlCatalog on SQLite",
            requires=(ICEBERG,),
        ),
        System(PARQUET, BASELINE, _parquet, note="write_table + fsync(file) + fsync(dir)"),
        System(PG_INSERT, BASELINE, PgConditionalInsert.open, note="psycopg 3 async, 1 conn"),
        System(SQLITE_INSERT, BASELINE, _sqlite_insert, note="WAL, synchronous=FULL"),
    ]


async def _reads(
    ctx: Context,
    adapters: dict[str, Appender],
    completed: dict[str, int],
    rows: int,
) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Reads every table-like system back: the latest version and, as time travel, the version
    after append ``k`` (the same for all). Returns the timings and ``k``."""
    readers = list(adapters)
    k = max(0, min((completed[n] for n in readers), default=0) // 2 - 1)
    times: dict[str, dict[str, list[float]]] = {}
    # One untimed read of each kind first (warms the page cache, drops the non-table systems).
    for name in readers:
        for kind, after in (("snapshot", None), ("time_travel", k)):
            got = await adapters[name].read(after)
            if got is None:
                break
            want = (completed[name] if after is None else k + 1) * rows
            if got.num_rows != want:
                raise RuntimeError(f"{name} {kind} read {got.num_rows} rows, expected {want}")
            times.setdefault(name, {"snapshot": [], "time_travel": []})
            del got
    budget = ctx.budget()
    for rep in range(ctx.scale.bulk_read_repeats):
        if rep and not budget.left():
            break
        for name in times:
            for kind, after in (("snapshot", None), ("time_travel", k)):
                gc.collect()
                t0 = time.perf_counter()
                got = await adapters[name].read(after)
                times[name][kind].append(time.perf_counter() - t0)
                del got
        ctx.log(
            f"{NAME}: read round {rep + 1}: "
            + ", ".join(f"{n} {v['snapshot'][-1]:.2f}s" for n, v in times.items())
        )
    return times, k


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    scale = ctx.scale
    chosen, skipped = select_systems(systems(), only_systems)
    n, rows = scale.small_appends, scale.small_rows
    ctx.log(f"{NAME}: {n} appends x {rows} rows on {[s.name for s in chosen]}")

    adapters: dict[str, Appender] = {}
    samples: dict[str, list[float]] = {s.name: [] for s in chosen}
    extras: dict[str, dict[str, Any]] = {}
    budgets = SystemBudgets([s.name for s in chosen], scale.loop_budget_s)
    completed = 0
    read_s: dict[str, dict[str, list[float]]] = {}
    dropped: dict[str, int] = {}
    tt_after = 0
    try:
        for s in chosen:
            adapters[s.name] = await s.make(ctx)
        for i in range(n):
            active = [s for s in chosen if budgets.active(s.name, i)]
            if not active:
                break
            table = make_updates(rows, key_start=i * rows, time=i, seed=7)
            for s in active:
                adapter = adapters[s.name]
                await budgets.sample(
                    s.name, functools.partial(adapter.append, i, table), samples, dropped
                )
            completed += 1
            if completed % max(10, n // 10) == 0:
                ctx.log(f"{NAME}: {completed}/{n} rounds")
        for name, cut in budgets.cut.items():
            ctx.log(f"{NAME}: {name} stopped by its time budget after {cut} appends")
        read_s, tt_after = await _reads(
            ctx, adapters, {k: len(v) + dropped.get(k, 0) for k, v in samples.items()}, rows
        )
    finally:
        for name, a in adapters.items():
            extras[name] = await a.close()

    table_rows: dict[str, dict[str, Any]] = {}
    by_name = {s.name: s for s in chosen}
    for name, xs in samples.items():
        st = latency_stats(xs)
        table_rows[name] = {
            "role": by_name[name].role,
            "p50_ms": st["p50_ms"],
            "p99_ms": st["p99_ms"],
            "mean_ms": st["mean_ms"],
            "appends_per_s": st["per_s"],
            "flatness": st["flatness"],
            "appends": len(xs) + dropped.get(name, 0),
            **({"cut_at": budgets.cut[name]} if name in budgets.cut else {}),
            **({"dropped_samples": dropped[name]} if name in dropped else {}),
            **extras.get(name, {}),
        }

    read_rows: dict[str, dict[str, Any]] = {}
    for name, kinds in read_s.items():
        snap = float(np.median(kinds["snapshot"]))
        tt = float(np.median(kinds["time_travel"]))
        snap_rows = (len(samples[name]) + dropped.get(name, 0)) * rows
        tt_rows = (tt_after + 1) * rows
        read_rows[name] = {
            "role": by_name[name].role,
            "snapshot_rows": snap_rows,
            "snapshot_s": snap,
            "snapshot_rows_per_s": snap_rows / snap,
            "time_travel_rows": tt_rows,
            "time_travel_s": tt,
            "time_travel_rows_per_s": tt_rows / tt,
            "repeats": len(kinds["snapshot"]),
        }

    ratios = []
    for s in chosen:
        if s.role == BASELINE:
            continue
        p50 = table_rows[s.name]["p50_ms"]
        if PARQUET in table_rows:
            ratios.append(
                ratio_entry(
                    f"{s.name} p50 vs {PARQUET} p50",
                    ratio(p50, table_rows[PARQUET]["p50_ms"]),
                    f"p50({s.name}) / p50({PARQUET})",
                )
            )
        limit = s.meta.get("limit", [])
        if limit and all(b in table_rows for b in limit):
            den = sum(table_rows[b]["p50_ms"] for b in limit)
            ratios.append(
                ratio_entry(
                    f"{s.name} vs limit",
                    ratio(p50, den),
                    f"p50({s.name}) / (" + " + ".join(f"p50({b})" for b in limit) + ")",
                )
            )
        if s.role == SUBJECT:
            for peer in (p for p in chosen if p.role == PEER):
                ratios.append(
                    ratio_entry(
                        f"{s.name} p50 vs {peer.name} p50",
                        ratio(p50, table_rows[peer.name]["p50_ms"]),
                        f"p50({s.name}) / p50({peer.name})",
                        at_most=PEER_TARGET,
                    )
                )
        ratios.append(
            ratio_entry(
                f"{s.name} flatness",
                table_rows[s.name]["flatness"],
                f"median of last {int(latency_stats(samples[s.name])['flatness_window'])} / "
                "median of first (1.0 = no slowdown)",
            )
        )

    comparisons = _comparisons(chosen, table_rows, read_rows)
    notes = [
        "systems run in lockstep rounds: append i of every system, then append i+1",
        f"bare inserts carry a {DIFF_LIKE_BYTES}-byte payload (persist's own diff size is "
        "in diff_bytes)",
        "persist rollups (and compaction, when it runs) happen in the background and their "
        "cost lands wherever they overlap",
        "peers store the 3 data columns; persist also stores _time and _diff; neither peer "
        "fsyncs its files (persist and parquet+fsync do)",
        f"reads: warm page cache, median of the timed rounds; time travel = the version after "
        f"append {tt_after} ({(tt_after + 1) * rows:,} rows)",
    ]
    for name, cut in budgets.cut.items():
        notes.append(
            f"{name} was stopped by its {scale.loop_budget_s:g} s budget after {cut} appends: "
            "its figures cover those (a smaller table than the others')"
        )
    return {
        "scenario": NAME,
        "params": {
            "appends": n,
            "rows_per_append": rows,
            "completed": completed,
            "cut_by_budget": completed < n,
            "time_travel_after_append": tt_after,
            "per_system_budget_s": scale.loop_budget_s,
        },
        "tables": {"": table_rows, "reads after the appends (warm page cache)": read_rows},
        "ratios": ratios,
        "comparisons": comparisons,
        "skipped": skipped,
        "notes": notes,
        "samples_ms": {k: [round(x * 1e3, 4) for x in v] for k, v in samples.items()},
        "machine": machine_info(
            ctx.scale.name,
            {"postgres": await pg_settings(ctx.postgres_uri), "pid": os.getpid()},
            ctx.workdir,
        ),
    }


PEER_TARGET = 0.5


def _comparisons(
    chosen: list[System],
    table_rows: dict[str, dict[str, Any]],
    read_rows: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    peers = [s.name for s in chosen if s.role == PEER]
    out: list[dict[str, Any]] = []
    for s in chosen:
        if s.role != SUBJECT:
            continue
        row = table_rows[s.name]
        names = s.meta.get("limit", [])
        whole = bool(names) and all(b in table_rows for b in names)

        def lim(metric: str, add: bool, names: list[str] = names) -> tuple[str, float]:
            vals = [table_rows[b][metric] for b in names]
            # latencies add; rates combine as 1 / (1/a + 1/b) (the steps back to back)
            v = sum(vals) if add else 1.0 / sum(1.0 / x for x in vals)
            return (" + ".join(names), v)

        out.append(
            comparison(
                "small append p50",
                "ms",
                "lower",
                s.name,
                row["p50_ms"],
                peers={p: table_rows[p]["p50_ms"] for p in peers},
                limit=lim("p50_ms", True) if whole else None,
                peer_at_most=PEER_TARGET,
            )
        )
        out.append(
            comparison(
                "small append p99",
                "ms",
                "lower",
                s.name,
                row["p99_ms"],
                peers={p: table_rows[p]["p99_ms"] for p in peers},
                limit=lim("p99_ms", True) if whole else None,
            )
        )
        out.append(
            comparison(
                "small appends/s",
                "1/s",
                "higher",
                s.name,
                row["appends_per_s"],
                peers={p: table_rows[p]["appends_per_s"] for p in peers},
                limit=lim("appends_per_s", False) if whole else None,
            )
        )
        if s.name in read_rows:
            r = read_rows[s.name]
            for key, figure in (
                ("snapshot_rows_per_s", "snapshot read after small appends"),
                ("time_travel_rows_per_s", "time-travel read after small appends"),
            ):
                out.append(
                    comparison(
                        figure,
                        "rows/s",
                        "higher",
                        s.name,
                        r[key],
                        peers={p: read_rows[p][key] for p in peers if p in read_rows},
                        limit=(PARQUET, read_rows[PARQUET][key]) if PARQUET in read_rows else None,
                    )
                )
    return out
