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

Adapters: persist's ``build(batches, deadline)`` makes the history, then the floor is made with
it (what to read); ``open_once()`` gives one open's ``*_ms`` timings and counts, ``close()``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pyarrow.dataset as pads

import persist
from benches.fixtures import SCHEMA, IoCounts, make_updates, pg_value
from benches.harness import BASELINE, SUBJECT, Context, Run, System, latency_stats, ratio, timed
from benches.harness import ratio_entry as entry
from benches.systems import PERSIST_PG, PersistLocation
from persist.core.shard import keys

NAME = "open_shard"
TITLE = "Opening a shard with a long history"
PERSIST = PERSIST_PG
FLOOR = "raw read floor"


class PersistOpen:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.loc = PersistLocation(ctx, ctx.workdir / "open-persist", "postgres")
        self.shard = persist.ShardId.new()
        self.info: dict[str, Any] = {}
        self.rollup = self.loc.root  # the latest rollup's file, once built
        self.last_diffs_read = 0

    async def build(self, batches: int, deadline: float) -> dict[str, Any]:
        data = make_updates(batches, time=np.arange(batches, dtype=np.uint64), seed=3)
        lat: list[float] = []
        blob_root = self.loc.root / "blob"
        async with await self.loc.connect() as client:
            write = await client.open_writer(self.shard, SCHEMA, purpose="bench-build")
            t_start = time.perf_counter()
            for i in range(batches):
                if time.monotonic() >= deadline:
                    break
                lat.append((await timed(write.compare_and_append(data.slice(i, 1), i, i + 1)))[0])
                if (i + 1) % max(100, batches // 10) == 0:
                    self.ctx.log(f"{NAME}: built {i + 1}/{batches} batches")
            build_s = time.perf_counter() - t_start
            # Reading the whole history once: as many parts as compaction left.
            read = await client.open_leased_reader(self.shard, SCHEMA, purpose="bench-read")
            as_of = max(len(lat) - 1, 0)
            splits = await read.snapshot(as_of)
            read_all_s, contents = await timed(read.snapshot_and_fetch(as_of))
            if contents.num_rows != len(lat):
                raise RuntimeError(f"read {contents.num_rows} rows of {len(lat)} appended")
            # The same part files read by plain pyarrow: what reading this many files costs
            # without persist (warm page cache: the snapshot just read them). Parts kept inline
            # in the state are written out as files of their own for it.
            inline_dir = self.loc.root / "inline-parts"
            inline_dir.mkdir(exist_ok=True)
            part_files = []
            for p in (p for sp in splits for p in sp.parts):
                path = blob_root / p.key
                if p.inline:
                    path = inline_dir / f"{len(part_files)}.parquet"
                    path.write_bytes(p.inline)
                part_files.append(str(path))
            await read.expire()
            t0 = time.perf_counter()
            plain = pads.dataset(part_files, format="parquet").to_table()
            dataset_s = time.perf_counter() - t0
            if plain.num_rows != len(lat):
                raise RuntimeError(f"dataset read {plain.num_rows} rows of {len(lat)}")
            await write.expire()
            # Let the background rollup in flight (if any) finish, as a live process would.
            await client.maintain(self.shard)
            info = self.info = await client.inspect(self.shard)
            rollup_keys = await client.blob.list_keys(keys.rollup_prefix(self.shard))
        count = f'SELECT count(*) FROM "{self.loc.table}" WHERE shard = %s'
        entries = await pg_value(self.ctx.postgres_uri, count, (str(self.shard),))
        latest = info["latest_rollup_seqno"]
        self.rollup = blob_root / next(k for k in rollup_keys if f"/{latest:020d}-" in k)
        st = latency_stats(lat)
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
            "consensus_entries": int(entries or 0),
            "latest_rollup_seqno": latest,
            "diffs_after_rollup": info["seqno"] - latest,
            "rollup_bytes": os.path.getsize(self.rollup),
            "rollup_blobs_stored": len(rollup_keys),
            "rollup_blobs_MB": sum(os.path.getsize(blob_root / k) for k in rollup_keys) / 1e6,
        }

    async def open_once(self) -> dict[str, float]:
        out: dict[str, float] = {}
        counts = IoCounts()
        t0 = time.perf_counter()
        async with await persist.connect(*self.loc.parts(counts)) as client:
            read = await client.open_leased_reader(self.shard, SCHEMA, purpose="bench-open")
            out["open_ms"] = (time.perf_counter() - t0) * 1e3
            out["blob_gets"] = counts.blob_gets
            out["rollup_MB_read"] = counts.blob_get_bytes / 1e6
            out["cons_scans"] = counts.cons_scans
            out["diffs_read"] = self.last_diffs_read = counts.cons_scanned_entries
            out["cons_heads"] = counts.cons_heads
            out["cons_cas"] = counts.cons_cas
            await read.expire()

        counts = IoCounts()
        t0 = time.perf_counter()
        async with await persist.connect(*self.loc.parts(counts)) as client:
            await client.inspect(self.shard)
            out["inspect_ms"] = (time.perf_counter() - t0) * 1e3
            out["inspect_blob_gets"] = counts.blob_gets
            out["inspect_diffs_read"] = counts.cons_scanned_entries
            out["inspect_warm_ms"] = (await timed(client.inspect(self.shard)))[0] * 1e3
        return out

    async def close(self) -> dict[str, Any]:
        await self.loc.drop()
        return {}


class RawReadFloor:
    """Reads what persist's open (``source``, built) reads, raw: the consensus rows after the
    rollup, the rollup."""

    def __init__(self, ctx: Context, source: PersistOpen) -> None:
        self.ctx, self.source = ctx, source

    async def open_once(self) -> dict[str, float]:
        import psycopg

        src, info = self.source, self.source.info
        # Each open adds diffs (register + expire the reader): the floor reads as many of the
        # newest entries as persist's latest open did (or all after the rollup).
        diffs = src.last_diffs_read or info["seqno"] - info["latest_rollup_seqno"]
        t0 = time.perf_counter()
        async with await psycopg.AsyncConnection.connect(
            self.ctx.postgres_uri, autocommit=True
        ) as conn:
            cur = await conn.execute(
                f'SELECT seqno, data FROM "{src.loc.table}" WHERE shard = %s '
                "ORDER BY seqno DESC LIMIT %s",
                (str(src.shard), diffs),
            )
            rows = await cur.fetchall()
        data = src.rollup.read_bytes()
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
    """Everything this scenario measures: persist, and the floor made with it (``make(ctx,
    source)``), which reads what persist's open reads."""
    return [System(PERSIST, SUBJECT, PersistOpen), System(FLOOR, BASELINE, RawReadFloor)]


async def run(ctx: Context) -> dict[str, Any]:
    scale = ctx.scale
    n = scale.open_batches
    async with Run(ctx, NAME, systems()) as run:
        source = run.adapters[PERSIST] = await run.make(PERSIST)
        run.log(f"{PERSIST}: building {n} batches")
        built = await source.build(n, ctx.deadline(2 * scale.loop_budget_s))
        run.adapters[FLOOR] = await run.make(FLOOR, source)
        opens: dict[str, list[dict[str, float]]] = {name: [] for name in run.adapters}

        async def round_(rep: int) -> None:
            for name, adapter in run.adapters.items():
                opens[name].append(await adapter.open_once())
            run.log(
                f"open round {rep + 1}: "
                + ", ".join(f"{k} {v[-1]['open_ms']:.1f}ms" for k, v in opens.items())
            )

        await run.repeat(scale.open_repeats, round_)

    open_rows: dict[str, dict[str, Any]] = {}
    for name, samples in opens.items():
        row: dict[str, Any] = {"role": run.roles[name]}
        for m in dict.fromkeys(k for sample in samples for k in sample):
            key = f"{m[:-3]}_p50_ms" if m.endswith("_ms") else m
            med = float(np.median([x[m] for x in samples if m in x]))
            row[key] = int(med) if med.is_integer() and not key.endswith("_ms") else med
        open_rows[name] = row | {"repeats": len(samples)}

    ratios = [
        entry(
            f"{s} {m.split('_')[0]} vs {FLOOR}",
            ratio(open_rows[s].get(m), open_rows[FLOOR]["open_p50_ms"]),
            f"{m}({s}) / open_p50_ms({FLOOR})",
        )
        for s in run.names(SUBJECT)
        for m in ("open_p50_ms", "inspect_p50_ms")
    ]
    interval = persist.PersistConfig().rollup_interval
    ratios += [
        entry(
            f"{PERSIST} diffs read per open vs rollup_interval",
            ratio(open_rows[PERSIST].get("diffs_read"), float(interval)),
            f"diffs_read / rollup_interval ({interval}); ~<= 1 when rollups keep up",
            at_most=1.1,
        ),
        entry(
            f"{PERSIST} snapshot_and_fetch of the history vs dataset read of its part files",
            ratio(built["snapshot_and_fetch_s"], built["dataset_same_parts_s"]),
            f"snapshot_and_fetch_s / dataset_same_parts_s ({built['parts']} parts; time ratio, "
            "lower is better)",
        ),
        entry(
            f"{PERSIST} build append flatness",
            built["build_flatness"],
            "median latency of the last 100 one-row appends / of the first 100",
        ),
    ]

    return await run.result(
        params={"batches": n, "repeats": scale.open_repeats, "rollup_interval": interval},
        tables={
            "history": {PERSIST: {"role": SUBJECT, **built}},
            "open from a fresh client": open_rows,
        },
        ratios=ratios,
        notes=[
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
        samples_ms={
            name: {
                m: [round(x[m], 3) for x in samples if m in x]
                for m in (samples[0] if samples else {})
                if m.endswith("_ms")
            }
            for name, samples in opens.items()
        },
    )
