"""scale: how costs move as a shard grows, and as writers are added.

**Growth.** Every system gets ``scale_batches`` one-row appends (``_time`` = ``i``), in lockstep
rounds. At ``scale_points`` points on the way (and once early, after 10 batches) it records
the append latency of the appends since the previous point (p50, p99) and the time to open the
table from a fresh client (median of ``scale_open_repeats``):

- persist (file blob + Postgres / SQLite consensus): ``persist.connect`` with new Blob and
  Consensus instances + ``open_leased_reader`` (what open_shard measures);
- Delta Lake: ``DeltaTable(dir)`` (loads the last checkpoint and the log after it);
- Iceberg: a new ``SqlCatalog`` + ``load_table`` (reads the table's metadata file);
- ``parquet+fsync`` (baseline): one file per append + fsync of file and directory; it has no
  "open".

Flat curves mean incremental state (diffs + rollups) and compaction keep the per-append and
per-open costs independent of the shard's age. Each system's time (appends and opens) is charged
to its own budget (``loop_budget_s``); a system whose budget runs out stops growing, and its
curve ends where it stopped (``reached``).

**Concurrent writers.** For N in ``scale_writers``: N writers, each appending
``scale_writer_appends`` tables of ``small_rows`` rows to its own shard / table, all at once;
aggregate appends/s = all appends / wall time. persist: one client, N shards, N asyncio tasks
(one process, as an application would); the synchronous peers and the Parquet baseline: N
threads. Each system's shards/tables are created and written once (untimed) first.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import persist
from benches._common import (
    BASELINE,
    PEER,
    RECOVERIES,
    SCHEMA,
    SUBJECT,
    Context,
    System,
    SystemBudgets,
    close_client,
    comparison,
    fsync_dir,
    fsync_file,
    machine_info,
    make_updates,
    persist_append,
    pg_drop_table,
    pg_settings,
    resilient,
    select_systems,
    with_time,
)
from benches.peers import DELTA, DELTA_NAME, ICEBERG, ICEBERG_NAME, DeltaStore, IcebergStore
from persist.location.file import FileBlob
from persist.location.postgres import PostgresConsensus
from persist.location.sqlite import SqliteConsensus

NAME = "scale"
PG = "persist[file+postgres]"
SQLITE = "persist[file+sqlite]"
PARQUET = "parquet+fsync"


class GrowTarget(Protocol):
    async def append(self, i: int, table: pa.Table) -> None:
        """Appends ``table`` (times ``[i, i + 1)``) to the growing table."""

    async def open_fresh(self) -> float | None:
        """Opens the table from a fresh client: the seconds the open took (teardown not
        counted), or ``None`` if this system has no open."""

    async def close(self) -> dict[str, Any]:
        """Releases everything; extra figures (may be empty)."""


class WriterSet(Protocol):
    async def run(self, tables: list[pa.Table], deadline: float) -> tuple[float, list[float]]:
        """Each of the N writers appends ``tables`` in order (stopping at ``deadline``, a
        ``time.monotonic()``), all at once; returns the wall time and every append's latency."""

    async def close(self) -> None: ...


# --- persist -----------------------------------------------------------------------------------


class PersistLocation:
    """A file blob + a consensus (Postgres or SQLite) under ``root``; fresh instances on demand."""

    def __init__(self, ctx: Context, root: Path, kind: str) -> None:
        self.ctx = ctx
        self.root = root
        self.kind = kind
        root.mkdir(parents=True, exist_ok=True)
        self.table = ctx.table_name(f"bench_scale_{root.name.replace('-', '_')}")

    def parts(self) -> tuple[FileBlob, Any]:
        blob = FileBlob(str(self.root / "blob"))
        if self.kind == "postgres":
            return blob, PostgresConsensus(self.ctx.postgres_uri, table=self.table)
        return blob, SqliteConsensus(str(self.root / "consensus.db"))

    async def connect(self) -> persist.PersistClient:
        blob, consensus = self.parts()
        return await persist.connect(blob, consensus)

    async def drop(self) -> None:
        if self.kind == "postgres":
            await pg_drop_table(self.ctx.postgres_uri, self.table)


class PersistGrow:
    def __init__(self, loc: PersistLocation) -> None:
        self.loc = loc
        self.shard = persist.ShardId.new()
        self.client: persist.PersistClient | None = None
        self.write: persist.WriteHandle | None = None

    @classmethod
    async def make(cls, ctx: Context, kind: str) -> PersistGrow:
        self = cls(PersistLocation(ctx, ctx.workdir / f"grow-{kind}", kind))
        self.client = await self.loc.connect()
        client = self.client
        self.write = await resilient(
            lambda: client.open_writer(self.shard, SCHEMA, purpose="bench-grow"), "open_writer"
        )
        return self

    async def append(self, i: int, table: pa.Table) -> None:
        await persist_append(self.write, table, i, i + 1)

    async def _open_once(self) -> float:
        t0 = time.perf_counter()
        client = await self.loc.connect()
        try:
            read = await client.open_leased_reader(self.shard, SCHEMA, purpose="bench-open")
            took = time.perf_counter() - t0
            await read.expire()
        finally:
            await close_client(client)
        return took

    async def open_fresh(self) -> float | None:
        took: float = await resilient(self._open_once, "open_leased_reader")
        return took

    async def close(self) -> dict[str, Any]:
        assert self.client is not None
        client = self.client
        try:
            info = await resilient(lambda: client.inspect(self.shard), "inspect")
            return {"batches": info["batches"], "parts": info["parts"], "seqno": info["seqno"]}
        finally:
            await close_client(self.client)
            await self.loc.drop()


class PersistWriters:
    def __init__(self, ctx: Context, kind: str, n: int) -> None:
        self.loc = PersistLocation(ctx, ctx.workdir / f"writers-{kind}-{n}", kind)
        self.n = n
        self.client: persist.PersistClient | None = None
        self.handles: list[persist.WriteHandle] = []

    @classmethod
    async def make(cls, ctx: Context, kind: str, n: int) -> PersistWriters:
        self = cls(ctx, kind, n)
        self.client = await self.loc.connect()
        client = self.client
        for _ in range(n):
            w = await resilient(
                lambda: client.open_writer(persist.ShardId.new(), SCHEMA, purpose="bench"),
                "open_writer",
            )
            self.handles.append(w)
        return self

    async def run(self, tables: list[pa.Table], deadline: float) -> tuple[float, list[float]]:
        lat: list[float] = []

        async def writer(w: persist.WriteHandle) -> None:
            start = w.upper
            assert start is not None
            for j, table in enumerate(tables):
                if time.monotonic() >= deadline:
                    return
                table = with_time(table, start + j)
                t0 = time.perf_counter()
                await persist_append(w, table, start + j, start + j + 1)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(w) for w in self.handles))
        return time.perf_counter() - t0, lat

    async def close(self) -> None:
        assert self.client is not None
        try:
            await close_client(self.client)
        finally:
            await self.loc.drop()


# --- peers and the baseline --------------------------------------------------------------------


class PeerGrow:
    def __init__(self, store: Any) -> None:
        self.store = store

    async def append(self, i: int, table: pa.Table) -> None:
        self.store.append(table)

    async def open_fresh(self) -> float | None:
        t0 = time.perf_counter()
        self.store.open_fresh()
        return time.perf_counter() - t0

    async def close(self) -> dict[str, Any]:
        try:
            return {"files": self.store.files()}
        finally:
            self.store.close()


class ParquetGrow:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0

    async def append(self, i: int, table: pa.Table) -> None:
        path = self.dir / f"{i:08d}.parquet"
        pq.write_table(table, path)
        fsync_file(path)
        fsync_dir(self.dir)
        self.count += 1

    async def open_fresh(self) -> float | None:
        return None

    async def close(self) -> dict[str, Any]:
        return {"files": self.count}


class ThreadWriters:
    """N synchronous stores, each appended to from its own thread."""

    def __init__(self, stores: list[Any]) -> None:
        self.stores = stores

    async def run(self, tables: list[pa.Table], deadline: float) -> tuple[float, list[float]]:
        lat: list[float] = []

        def writer(store: Any) -> None:
            for table in tables:
                if time.monotonic() >= deadline:
                    return
                t0 = time.perf_counter()
                store.append(table)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(writer, s) for s in self.stores))
        return time.perf_counter() - t0, lat

    async def close(self) -> None:
        for s in self.stores:
            s.close()


class ParquetStore:
    """Plain Parquet files + fsync, with the peers' synchronous ``append`` interface."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def append(self, table: pa.Table) -> None:
        path = self.dir / f"{self.count:08d}.parquet"
        pq.write_table(table, path)
        fsync_file(path)
        fsync_dir(self.dir)
        self.count += 1

    def close(self) -> None:
        return None


# --- the systems -------------------------------------------------------------------------------


async def _grow_peer(ctx: Context, kind: str) -> GrowTarget:
    root = ctx.workdir / f"grow-{kind}"
    return PeerGrow(DeltaStore(root) if kind == DELTA else IcebergStore(root))


async def _grow_parquet(ctx: Context) -> GrowTarget:
    return ParquetGrow(ctx.workdir / "grow-parquet")


async def _writers_threads(ctx: Context, kind: str, n: int) -> WriterSet:
    base = ctx.workdir / f"writers-{kind}-{n}"
    if kind == DELTA:
        stores: list[Any] = [DeltaStore(base / str(j)) for j in range(n)]
    elif kind == ICEBERG:
        stores = [IcebergStore(base / str(j)) for j in range(n)]
    else:
        stores = [ParquetStore(base / str(j)) for j in range(n)]
    return ThreadWriters(stores)


def systems() -> list[System]:
    """Everything this scenario measures: ``make`` gives the growth target, ``meta["writers"]``
    makes the N-writer set."""
    return [
        System(
            PG,
            SUBJECT,
            lambda ctx: PersistGrow.make(ctx, "postgres"),
            meta={"writers": lambda ctx, n: PersistWriters.make(ctx, "postgres", n)},
        ),
        System(
            SQLITE,
            SUBJECT,
            lambda ctx: PersistGrow.make(ctx, "sqlite"),
            meta={"writers": lambda ctx, n: PersistWriters.make(ctx, "sqlite", n)},
        ),
        System(
            DELTA_NAME,
            PEER,
            lambda ctx: _grow_peer(ctx, DELTA),
            meta={"writers": lambda ctx, n: _writers_threads(ctx, DELTA, n)},
            requires=(DELTA,),
        ),
        System(
            ICEBERG_NAME,
            PEER,
            lambda ctx: _grow_peer(ctx, ICEBERG),
            meta={"writers": lambda ctx, n: _writers_threads(ctx, ICEBERG, n)},
            requires=(ICEBERG,),
        ),
        System(
            PARQUET,
            BASELINE,
            _grow_parquet,
            note="file per append + fsync; no open",
            meta={"writers": lambda ctx, n: _writers_threads(ctx, "parquet", n)},
        ),
    ]


def sample_points(batches: int, points: int) -> list[int]:
    """Where growth is sampled: early on a log scale (10, 30, 100, 300, ... below the first
    step, so peers that slow down early still get a curve), then every ``batches / points``."""
    step = max(1, batches // max(1, points))
    early = {x for x in (10, 30, 100, 300) if x < step}
    out = {min(10, batches)} | early | {min(batches, k * step) for k in range(1, points + 1)}
    return sorted(out)


async def _grow(
    ctx: Context, chosen: list[System]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int], dict[str, dict[str, Any]]]:
    scale = ctx.scale
    n = scale.scale_batches
    points = sample_points(n, scale.scale_points)
    data = make_updates(n, time=np.arange(n, dtype=np.uint64), seed=13)
    targets: dict[str, GrowTarget] = {}
    curves: dict[str, list[dict[str, Any]]] = {s.name: [] for s in chosen}
    bucket: dict[str, list[float]] = {s.name: [] for s in chosen}
    done = dict.fromkeys(curves, 0)
    budgets = SystemBudgets(list(curves), scale.loop_budget_s)
    extras: dict[str, dict[str, Any]] = {}
    ctx.log(f"{NAME}: growing to {n} one-row batches on {list(curves)}; points {points}")
    try:
        for s in chosen:
            targets[s.name] = await s.make(ctx)
        for i in range(n):
            active = [s.name for s in chosen if budgets.active(s.name, i)]
            if not active:
                break
            row = data.slice(i, 1)
            for name in active:
                mark = RECOVERIES.count
                t0 = time.perf_counter()
                await targets[name].append(i, row)
                dt = time.perf_counter() - t0
                budgets.charge(name, dt)
                done[name] = i + 1
                if RECOVERIES.count == mark:  # else it timed a database outage: not a sample
                    bucket[name].append(dt)
            if i + 1 in points:
                for name in active:
                    opens: list[float] = []
                    for _ in range(scale.scale_open_repeats):
                        mark = RECOVERIES.count
                        t0 = time.perf_counter()
                        took = await targets[name].open_fresh()
                        budgets.charge(name, time.perf_counter() - t0)
                        if took is None:
                            break
                        if RECOVERIES.count == mark:
                            opens.append(took)
                    xs = np.asarray(bucket[name]) * 1e3
                    curves[name].append(
                        {
                            "batches": i + 1,
                            "append_p50_ms": float(np.percentile(xs, 50)),
                            "append_p99_ms": float(np.percentile(xs, 99)),
                            "appends_in_bucket": len(xs),
                            "open_ms": float(np.median(opens)) * 1e3 if opens else None,
                        }
                    )
                    bucket[name] = []
                ctx.log(
                    f"{NAME}: {i + 1} batches: "
                    + ", ".join(
                        f"{k} {v[-1]['append_p50_ms']:.1f}ms/"
                        + (f"{v[-1]['open_ms']:.0f}ms" if v[-1]["open_ms"] is not None else "-")
                        for k, v in curves.items()
                        if v and v[-1]["batches"] == i + 1
                    )
                )
        for name, cut in budgets.cut.items():
            ctx.log(f"{NAME}: {name} stopped by its time budget at {cut} batches")
    finally:
        for name, t in targets.items():
            extras[name] = await t.close()
    return curves, done, extras


async def _writers(ctx: Context, chosen: list[System]) -> dict[str, list[dict[str, Any]]]:
    scale = ctx.scale
    per = scale.scale_writer_appends
    rows = scale.small_rows
    tables = [make_updates(rows, key_start=j * rows, time=0, seed=17) for j in range(per + 1)]
    out: dict[str, list[dict[str, Any]]] = {s.name: [] for s in chosen}
    for n in scale.scale_writers:
        for s in chosen:
            ws: WriterSet = await s.meta["writers"](ctx, n)
            outage = False
            try:
                # Untimed: creates the shards/tables and warms connections.
                await ws.run(tables[:1], time.monotonic() + scale.loop_budget_s)
                for _attempt in range(2):
                    mark = RECOVERIES.count
                    wall, lat = await ws.run(tables[1:], time.monotonic() + scale.loop_budget_s)
                    if RECOVERIES.count == mark:
                        break
                    outage = True  # it timed a database outage: measure once more
            finally:
                await ws.close()
            done = len(lat)
            out[s.name].append(
                {
                    "writers": n,
                    "appends": done,
                    "wall_s": wall,
                    "appends_per_s": done / wall if wall > 0 else None,
                    "append_p50_ms": float(np.percentile(lat, 50)) * 1e3 if lat else None,
                    "append_p99_ms": float(np.percentile(lat, 99)) * 1e3 if lat else None,
                    "complete": done == n * per,
                    **({"remeasured_after_outage": True} if outage else {}),
                }
            )
        ctx.log(
            f"{NAME}: {n} writers: "
            + ", ".join(f"{k} {v[-1]['appends_per_s']:.0f}/s" for k, v in out.items() if v)
        )
    return out


def _at(curve: list[dict[str, Any]], batches: int, key: str) -> float | None:
    for p in curve:
        if p["batches"] == batches:
            v = p.get(key)
            return float(v) if v is not None else None
    return None


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    chosen, skipped = select_systems(systems(), only_systems)
    curves, reached, extras = await _grow(ctx, chosen)
    writers = await _writers(ctx, chosen)
    by_name = {s.name: s for s in chosen}

    growth_rows: dict[str, dict[str, Any]] = {}
    for name, curve in curves.items():
        if not curve:
            continue
        first, last = curve[0], curve[-1]
        growth_rows[name] = {
            "role": by_name[name].role,
            "reached": reached[name],
            f"append_p50_ms@{first['batches']}": first["append_p50_ms"],
            "append_p50_ms@last": last["append_p50_ms"],
            "append_p99_ms@last": last["append_p99_ms"],
            "append_growth": last["append_p50_ms"] / first["append_p50_ms"],
            f"open_ms@{first['batches']}": first["open_ms"],
            "open_ms@last": last["open_ms"],
            "open_growth": (
                last["open_ms"] / first["open_ms"]
                if last["open_ms"] is not None and first["open_ms"]
                else None
            ),
            **extras.get(name, {}),
        }
    writer_rows: dict[str, dict[str, Any]] = {}
    for name, pts in writers.items():
        row: dict[str, Any] = {"role": by_name[name].role}
        for p in pts:
            row[f"appends_per_s@{p['writers']}"] = p["appends_per_s"]
        for p in pts:
            row[f"p50_ms@{p['writers']}"] = p["append_p50_ms"]
        if pts and pts[0]["appends_per_s"]:
            row["speedup@max"] = (pts[-1]["appends_per_s"] or 0) / pts[0]["appends_per_s"]
        writer_rows[name] = row

    peers = [s.name for s in chosen if s.role == PEER]
    comparisons = []
    # Compared at: the last point every system reached, the last point the furthest peer
    # reached, and persist's last point.
    common = max(
        (
            p["batches"]
            for p in curves.get(PG, curves.get(SQLITE, []))
            if all(_at(curves[n], p["batches"], "append_p50_ms") is not None for n in curves)
        ),
        default=None,
    )
    furthest = max((curves[p][-1]["batches"] for p in peers if curves[p]), default=None)
    for s in chosen:
        if s.role != SUBJECT or not curves[s.name]:
            continue
        top = curves[s.name][-1]["batches"]
        for at in sorted({b for b in (common, furthest, top) if b is not None}):
            for figure, key, limit in (
                ("1-row append p50", "append_p50_ms", PARQUET),
                ("open from a fresh client", "open_ms", None),
            ):
                missing = [p for p in peers if _at(curves[p], at, key) is None]
                comparisons.append(
                    comparison(
                        f"{figure} @ {at:,} batches",
                        "ms",
                        "lower",
                        s.name,
                        _at(curves[s.name], at, key),
                        peers={p: _at(curves[p], at, key) for p in peers},
                        limit=(limit, _at(curves[limit], at, key))
                        if limit and limit in curves
                        else None,
                        note=(
                            "not reached within their time budget by: " + ", ".join(missing)
                            if missing
                            else ""
                        ),
                    )
                )
        for p in writers[s.name]:
            n = p["writers"]

            def rate(name: str, n: int = n) -> float | None:
                return next(
                    (x["appends_per_s"] for x in writers.get(name, []) if x["writers"] == n),
                    None,
                )

            comparisons.append(
                comparison(
                    f"appends/s, {n} concurrent writer{'s' if n > 1 else ''}",
                    "1/s",
                    "higher",
                    s.name,
                    p["appends_per_s"],
                    peers={q: rate(q) for q in peers},
                    limit=(PARQUET, rate(PARQUET)) if PARQUET in writers else None,
                )
            )

    scale = ctx.scale
    return {
        "scenario": NAME,
        "params": {
            "batches": scale.scale_batches,
            "points": sample_points(scale.scale_batches, scale.scale_points),
            "open_repeats": scale.scale_open_repeats,
            "writers": list(scale.scale_writers),
            "appends_per_writer": scale.scale_writer_appends,
            "rows_per_writer_append": scale.small_rows,
            "per_system_budget_s": scale.loop_budget_s,
            "rollup_interval": persist.PersistConfig().rollup_interval,
        },
        "tables": {
            "growth (one-row appends; @last = the last point each reached)": growth_rows,
            f"concurrent writers ({scale.scale_writer_appends} appends of {scale.small_rows} "
            "rows each, one shard/table per writer)": writer_rows,
        },
        "ratios": [],
        "comparisons": comparisons,
        "skipped": skipped,
        "curves": curves,
        "writers": writers,
        "notes": [
            "growth: lockstep rounds of one-row appends; append p50/p99 are of the appends "
            "since the previous point; open = median of fresh-client opens at the point",
            "a system whose time budget ran out stops growing: its curve ends at 'reached'",
            "writers: persist runs N asyncio tasks on one client; peers and parquet run N "
            "threads (their libraries are synchronous)",
        ],
        "machine": machine_info(
            ctx.scale.name,
            {"postgres": await pg_settings(ctx.postgres_uri), "pid": os.getpid()},
            ctx.workdir,
        ),
    }
