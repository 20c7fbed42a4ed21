"""open_shard: the cost of opening a shard with a long history, from a fresh client.

A shard (file blob + Postgres consensus, default ``PersistConfig``, so ``rollup_interval`` 128)
gets ``open_batches`` appends of one row each (``compare_and_append``, ``_time`` = i). Then,
``open_repeats`` times, each from a FRESH client (new ``persist.connect`` with new Blob and
Consensus instances, so a new Postgres connection pool):

- ``open_ms``: ``persist.connect`` + ``open_leased_reader`` (what an application pays to start
  reading), with the blob gets (rollups read) and consensus entries scanned (diffs read) it
  made, counted by wrappers around the Blob and Consensus handed to ``persist.connect``;
- ``inspect_ms``: ``persist.connect`` + ``client.inspect`` (the bare state load), and
  ``inspect_warm_ms``: a second ``inspect`` on that client (connection already open; the state
  is still reloaded from the rollup and the diffs after it).

Baseline ``raw read floor``: a fresh psycopg connection that SELECTs the same consensus entries
persist scans (those after the latest rollup) plus a plain read of the rollup file: the bytes an
open must move, with no decoding and no state machine.

A peer (e.g. Delta Lake: open a table with that many commits) is added by appending a ``System``
to ``systems()`` whose ``make`` returns an ``OpenTarget``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow.dataset as pads

import persist
from benches._common import (
    BASELINE,
    SCHEMA,
    SUBJECT,
    Budget,
    Context,
    CountingBlob,
    CountingConsensus,
    IoCounts,
    System,
    latency_stats,
    machine_info,
    make_updates,
    pg_drop_table,
    pg_settings,
    ratio,
    ratio_entry,
)
from persist.core import keys
from persist.location.file import FileBlob
from persist.location.postgres import PostgresConsensus

NAME = "open_shard"
PERSIST = "persist[file+postgres]"
FLOOR = "raw read floor"


class OpenTarget(Protocol):
    async def build(self, batches: int, budget: Budget, hint: dict[str, Any]) -> dict[str, Any]:
        """Creates the history (``batches`` small appends); figures about it. Subjects run
        first; a baseline gets the subjects' ``hint`` (what to read)."""

    def hint(self) -> dict[str, Any]:
        """What a baseline needs to read the same things (subjects only; may be empty)."""

    async def open_once(self) -> dict[str, float]:
        """One open from a fresh client: ``*_ms`` timings and counts."""

    async def close(self) -> dict[str, Any]:
        """Releases everything; extra figures worth reporting (may be empty)."""


class PersistOpen:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.root = ctx.workdir / "open-persist"
        self.root.mkdir(parents=True, exist_ok=True)
        self.blob_root = self.root / "blob"
        self.table = ctx.table_name("bench_open_consensus")
        self.shard = persist.ShardId.new()
        self.state: dict[str, Any] = {}
        self.last_diffs_read = 0

    @classmethod
    async def make(cls, ctx: Context) -> PersistOpen:
        return cls(ctx)

    def _connect_parts(self, counts: IoCounts) -> tuple[CountingBlob, CountingConsensus]:
        blob = CountingBlob(FileBlob(str(self.blob_root)), counts)
        consensus = CountingConsensus(
            PostgresConsensus(self.ctx.postgres_uri, table=self.table), counts
        )
        return blob, consensus

    async def build(self, batches: int, budget: Budget, hint: dict[str, Any]) -> dict[str, Any]:
        data = make_updates(batches, time=np.arange(batches, dtype=np.uint64), seed=3)
        blob, consensus = self._connect_parts(IoCounts())
        lat: list[float] = []
        async with await persist.connect(blob, consensus) as client:
            write = await client.open_writer(self.shard, SCHEMA, purpose="bench-build")
            t_start = time.perf_counter()
            for i in range(batches):
                if not budget.left():
                    break
                t0 = time.perf_counter()
                await write.compare_and_append(data.slice(i, 1), i, i + 1)
                lat.append(time.perf_counter() - t0)
                if (i + 1) % max(100, batches // 10) == 0:
                    self.ctx.log(f"{NAME}: built {i + 1}/{batches} batches")
            build_s = time.perf_counter() - t_start
            # Reading the whole history once: as many parts as compaction left.
            read = await client.open_leased_reader(self.shard, SCHEMA, purpose="bench-read")
            as_of = max(len(lat) - 1, 0)
            splits = await read.snapshot(as_of)
            t0 = time.perf_counter()
            contents = await read.snapshot_and_fetch(as_of)
            read_all_s = time.perf_counter() - t0
            if contents.num_rows != len(lat):
                raise RuntimeError(f"read {contents.num_rows} rows of {len(lat)} appended")
            # The same part files read by plain pyarrow: what reading this many files costs
            # without persist (warm page cache: the snapshot just read them).
            part_files = sorted(str(self.blob_root / p.key) for sp in splits for p in sp.parts)
            await read.expire()
            t0 = time.perf_counter()
            plain = pads.dataset(part_files, format="parquet").to_table()
            dataset_s = time.perf_counter() - t0
            if plain.num_rows != len(lat):
                raise RuntimeError(f"dataset read {plain.num_rows} rows of {len(lat)}")
            await write.expire()
            # Let the background rollup in flight (if any) finish, as a live process would.
            await client.maintain(self.shard)
            info = await client.inspect(self.shard)
            rollup_keys = await client.blob.list_keys(keys.rollup_prefix(self.shard))
        entries = await _count_entries(self.ctx.postgres_uri, self.table, str(self.shard))
        latest = info["latest_rollup_seqno"]
        latest_key = next(k for k in rollup_keys if f"/{latest:020d}-" in k)
        sizes = [os.path.getsize(self.blob_root / k) for k in rollup_keys]
        st = latency_stats(lat)
        self.state = {"info": info, "latest_key": latest_key}
        return {
            "batches": len(lat),
            "build_s": build_s,
            "build_appends_per_s": len(lat) / build_s if build_s else 0.0,
            "build_p50_ms": st["p50_ms"],
            "build_flatness": st["flatness"],
            "snapshot_and_fetch_s": read_all_s,
            "dataset_same_parts_s": dataset_s,
            "parts": info["parts"],
            "seqno": info["seqno"],
            "consensus_entries": entries,
            "latest_rollup_seqno": latest,
            "diffs_after_rollup": info["seqno"] - latest,
            "rollup_bytes": os.path.getsize(self.blob_root / latest_key),
            "rollup_blobs_stored": len(rollup_keys),
            "rollup_blobs_MB": sum(sizes) / 1e6,
        }

    def hint(self) -> dict[str, Any]:
        info = self.state["info"]
        return {
            "table": self.table,
            "shard": str(self.shard),
            # Each open adds diffs (register + expire the reader): the floor reads as many of
            # the newest entries as persist's latest open did (or all after the rollup).
            "diffs": lambda: self.last_diffs_read or info["seqno"] - info["latest_rollup_seqno"],
            "rollup_path": str(self.blob_root / self.state["latest_key"]),
        }

    async def open_once(self) -> dict[str, float]:
        out: dict[str, float] = {}
        counts = IoCounts()
        blob, consensus = self._connect_parts(counts)
        t0 = time.perf_counter()
        client = await persist.connect(blob, consensus)
        try:
            read = await client.open_leased_reader(self.shard, SCHEMA, purpose="bench-open")
            out["open_ms"] = (time.perf_counter() - t0) * 1e3
            c = counts.snapshot()
            out["blob_gets"] = c.blob_gets
            out["rollup_MB_read"] = c.blob_get_bytes / 1e6
            out["cons_scans"] = c.cons_scans
            out["diffs_read"] = c.cons_scanned_entries
            self.last_diffs_read = c.cons_scanned_entries
            out["cons_heads"] = c.cons_heads
            out["cons_cas"] = c.cons_cas
            await read.expire()
        finally:
            await client.close()

        counts = IoCounts()
        blob, consensus = self._connect_parts(counts)
        t0 = time.perf_counter()
        client = await persist.connect(blob, consensus)
        try:
            await client.inspect(self.shard)
            out["inspect_ms"] = (time.perf_counter() - t0) * 1e3
            out["inspect_blob_gets"] = counts.blob_gets
            out["inspect_diffs_read"] = counts.cons_scanned_entries
            t1 = time.perf_counter()
            await client.inspect(self.shard)
            out["inspect_warm_ms"] = (time.perf_counter() - t1) * 1e3
        finally:
            await client.close()
        return out

    async def close(self) -> dict[str, Any]:
        await pg_drop_table(self.ctx.postgres_uri, self.table)
        return {}


async def _count_entries(uri: str, table: str, shard: str) -> int:
    import psycopg

    async with await psycopg.AsyncConnection.connect(uri, autocommit=True) as conn:
        cur = await conn.execute(f'SELECT count(*) FROM "{table}" WHERE shard = %s', (shard,))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


class RawReadFloor:
    """Reads what persist's open reads, raw: the consensus rows after the rollup, the rollup."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.hint_: dict[str, Any] = {}

    @classmethod
    async def make(cls, ctx: Context) -> RawReadFloor:
        return cls(ctx)

    async def build(self, batches: int, budget: Budget, hint: dict[str, Any]) -> dict[str, Any]:
        if not hint:
            raise RuntimeError(f"{FLOOR} needs {PERSIST} to run first")
        self.hint_ = hint
        return {}

    def hint(self) -> dict[str, Any]:
        return {}

    async def open_once(self) -> dict[str, float]:
        import psycopg

        h = self.hint_
        t0 = time.perf_counter()
        async with await psycopg.AsyncConnection.connect(
            self.ctx.postgres_uri, autocommit=True
        ) as conn:
            cur = await conn.execute(
                f'SELECT seqno, data FROM "{h["table"]}" WHERE shard = %s '
                "ORDER BY seqno DESC LIMIT %s",
                (h["shard"], h["diffs"]()),
            )
            rows = await cur.fetchall()
        data = Path(h["rollup_path"]).read_bytes()
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "open_ms": ms,
            "inspect_ms": ms,
            "blob_gets": 1,
            "rollup_MB_read": len(data) / 1e6,
            "diffs_read": len(rows),
        }

    async def close(self) -> dict[str, Any]:
        return {}


def systems() -> list[System]:
    """Everything this scenario measures. Peers are added here."""
    return [
        System(PERSIST, SUBJECT, PersistOpen.make),
        System(
            FLOOR,
            BASELINE,
            RawReadFloor.make,
            note="fresh psycopg connection + SELECT of the diffs + read of the rollup file",
        ),
    ]


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    scale = ctx.scale
    chosen = [s for s in systems() if only_systems is None or s.name in only_systems]
    chosen.sort(key=lambda s: s.role == BASELINE)  # subjects build first, baselines follow
    n = scale.open_batches
    adapters: dict[str, OpenTarget] = {}
    built: dict[str, dict[str, Any]] = {}
    opens: dict[str, list[dict[str, float]]] = {s.name: [] for s in chosen}
    extras: dict[str, dict[str, Any]] = {}
    try:
        hint: dict[str, Any] = {}
        for s in chosen:
            adapters[s.name] = await s.make(ctx)
            ctx.log(f"{NAME}: {s.name}: building {n} batches")
            built[s.name] = await adapters[s.name].build(
                n, ctx.budget(2 * scale.loop_budget_s), hint
            )
            hint = hint or adapters[s.name].hint()
        budget = ctx.budget()
        for rep in range(scale.open_repeats):
            if rep and not budget.left():
                break
            for s in chosen:
                opens[s.name].append(await adapters[s.name].open_once())
            ctx.log(
                f"{NAME}: open round {rep + 1}: "
                + ", ".join(f"{k} {v[-1]['open_ms']:.1f}ms" for k, v in opens.items())
            )
    finally:
        for name, a in adapters.items():
            extras[name] = await a.close()

    by_name = {s.name: s for s in chosen}
    open_rows: dict[str, dict[str, Any]] = {}
    for name, samples in opens.items():
        row: dict[str, Any] = {"role": by_name[name].role}
        metrics: list[str] = []
        for sample in samples:
            metrics += [k for k in sample if k not in metrics]
        for m in metrics:
            vals = [x[m] for x in samples if m in x]
            key = f"{m[:-3]}_p50_ms" if m.endswith("_ms") else m
            med = float(np.median(vals))
            row[key] = int(med) if med.is_integer() and not key.endswith("_ms") else med
        row["repeats"] = len(samples)
        open_rows[name] = row

    ratios = []
    if FLOOR in open_rows:
        for s in chosen:
            if s.role == BASELINE:
                continue
            for m in ("open_p50_ms", "inspect_p50_ms"):
                ratios.append(
                    ratio_entry(
                        f"{s.name} {m.split('_')[0]} vs {FLOOR}",
                        ratio(open_rows[s.name].get(m), open_rows[FLOOR]["open_p50_ms"]),
                        f"{m}({s.name}) / open_p50_ms({FLOOR})",
                    )
                )
    if PERSIST in built:
        b = built[PERSIST]
        interval = persist.PersistConfig().rollup_interval
        ratios.append(
            ratio_entry(
                f"{PERSIST} diffs read per open vs rollup_interval",
                ratio(open_rows[PERSIST].get("diffs_read"), float(interval)),
                f"diffs_read / rollup_interval ({interval}); ~<= 1 when rollups keep up",
                at_most=1.1,
            )
        )
        ratios.append(
            ratio_entry(
                f"{PERSIST} snapshot_and_fetch of the history vs dataset read of its part files",
                ratio(b["snapshot_and_fetch_s"], b["dataset_same_parts_s"]),
                f"snapshot_and_fetch_s / dataset_same_parts_s ({b['parts']} parts; time ratio, "
                "lower is better)",
            )
        )
        ratios.append(
            ratio_entry(
                f"{PERSIST} build append flatness",
                b["build_flatness"],
                "median latency of the last 100 one-row appends / of the first 100",
            )
        )

    return {
        "scenario": NAME,
        "params": {
            "batches": n,
            "repeats": scale.open_repeats,
            "rollup_interval": persist.PersistConfig().rollup_interval,
        },
        "tables": {
            "history": {k: {"role": by_name[k].role, **v} for k, v in built.items() if v},
            "open from a fresh client": open_rows,
        },
        "ratios": ratios,
        "notes": [
            "open = persist.connect + open_leased_reader from a fresh client (includes opening "
            "the Postgres pool); inspect = persist.connect + client.inspect",
            "counts per open come from counting wrappers around the Blob and Consensus given "
            "to persist.connect; diffs_read = consensus entries scanned",
            "the floor reads the same diffs and rollup with no decoding; persist's open also "
            "commits one diff (registering the reader), the floor writes nothing",
            "snapshot_and_fetch_s: one read of the whole history right after the build "
            "(parts = blob parts it fetched); dataset_same_parts_s: pyarrow.dataset over those "
            "same part files, right after (warm cache)",
        ],
        "machine": machine_info(
            ctx.scale.name, {"postgres": await pg_settings(ctx.postgres_uri), "pid": os.getpid()}
        ),
        "samples_ms": {
            name: {
                m: [round(x[m], 3) for x in samples if m in x]
                for m in samples[0]
                if m.endswith("_ms")
            }
            if samples
            else {}
            for name, samples in opens.items()
        },
        **({"extras": extras} if any(extras.values()) else {}),
    }
