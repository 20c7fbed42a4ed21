"""Compaction: does it stall writers, and how much does it rewrite?

Two measurements, both on a file blob + Postgres consensus:

1. **Writers never wait**: small ``compare_and_append`` calls on two shards in lockstep rounds,
   one client with compaction on and one with it off; the p99 of each. Target: the p99 with
   compaction on within 2x of the p99 with it off.
2. **Write amplification**: bytes written to blob (appends, compaction output, rollups) per
   byte the appends wrote, after appending ~1M updates in 1,000-row appends with compaction on
   and a final ``maintain``. The spine bounds it by about ``log2(parts) + 1``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import persist
from benches._common import (
    SCHEMA,
    Context,
    CountingBlob,
    IoCounts,
    close_client,
    latency_stats,
    machine_info,
    make_updates,
    ratio,
    ratio_entry,
    temp_dir,
)
from persist.location import open_blob, open_consensus

NAME = "compaction"

# (appends in the latency run, rows each; appends in the amplification run, rows each)
COUNTS = {
    "smoke": (30, 100, 40, 500),
    "quick": (1_000, 100, 200, 1_000),
    "full": (10_000, 100, 1_000, 1_000),
}


async def _client(ctx: Context, root: Path, compaction: bool, counts: IoCounts) -> Any:
    blob = CountingBlob(open_blob(root.as_uri()), counts)
    consensus = open_consensus(ctx.postgres_uri)
    cfg = persist.PersistConfig(compaction_enabled=compaction)
    return await persist.connect(blob, consensus, config=cfg)


async def _latency(ctx: Context, root: Path, appends: int, rows: int) -> dict[str, Any]:
    systems = {"compaction on": True, "compaction off": False}
    clients, writers, samples = {}, {}, {}
    budget = ctx.budget()
    try:
        for name, on in systems.items():
            clients[name] = await _client(ctx, root / name.replace(" ", "-"), on, IoCounts())
            writers[name] = await clients[name].open_writer(persist.ShardId.new(), SCHEMA)
            samples[name] = []
        for i in range(appends):
            if not budget.left():
                break
            table = make_updates(rows, key_start=i * rows, time=i, seed=11)
            for name in systems:
                t0 = time.perf_counter()
                await writers[name].compare_and_append(table, i, i + 1)
                samples[name].append(time.perf_counter() - t0)
            if (i + 1) % max(10, appends // 10) == 0:
                ctx.log(f"{NAME}: {i + 1}/{appends} rounds")
        out: dict[str, Any] = {}
        for name in systems:
            info = await clients[name].inspect(writers[name].shard_id)
            out[name] = {
                "role": "subject" if systems[name] else "baseline",
                **latency_stats(samples[name]),
                "appends": len(samples[name]),
                "batches_at_end": info["batches"],
                "parts_at_end": info["parts"],
            }
        return out
    finally:
        for c in clients.values():
            await close_client(c)


async def _amplification(ctx: Context, root: Path, appends: int, rows: int) -> dict[str, Any]:
    counts = IoCounts()
    client = await _client(ctx, root, True, counts)
    try:
        write = await client.open_writer(persist.ShardId.new(), SCHEMA)
        shard = write.shard_id
        appended_bytes = 0
        budget = ctx.budget()
        done = 0
        for i in range(appends):
            if not budget.left():
                break
            before = counts.blob_set_bytes
            # Keys spread over a wide range, so merges interleave rather than concatenate.
            table = make_updates(rows, key_start=(i * 7919) % appends * rows, time=i, seed=13)
            batch = await write.batch(table, i, i + 1)
            appended_bytes += counts.blob_set_bytes - before
            await write.compare_and_append_batch([batch], i, i + 1)
            done += 1
        await client.maintain(shard)
        info = await client.inspect(shard)
        written = counts.blob_set_bytes
        return {
            "updates": done * rows,
            "appends": done,
            "appended_MB": appended_bytes / 1e6,
            "blob_written_MB": written / 1e6,
            "write_amplification": ratio(written, appended_bytes),
            "bound_log2_parts_plus_1": math.log2(max(done, 1)) + 1,
            "batches_at_end": info["batches"],
            "bytes_at_end_MB": info["bytes"] / 1e6,
        }
    finally:
        await close_client(client)


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    lat_appends, lat_rows, amp_appends, amp_rows = COUNTS[ctx.scale.name]
    with temp_dir(ctx.workdir, NAME) as root:
        ctx.log(f"{NAME}: {lat_appends} appends of {lat_rows} rows, compaction on vs off")
        latency = await _latency(ctx, root / "latency", lat_appends, lat_rows)
        ctx.log(f"{NAME}: {amp_appends} appends of {amp_rows} rows for write amplification")
        amp = await _amplification(ctx, root / "amplification", amp_appends, amp_rows)
    on, off = latency["compaction on"], latency["compaction off"]
    ratios = [
        ratio_entry(
            "p99 with compaction on vs off",
            ratio(on["p99_ms"], off["p99_ms"]),
            "p99(compaction on) / p99(compaction off)",
            at_most=2.0,
        ),
        ratio_entry(
            "p50 with compaction on vs off",
            ratio(on["p50_ms"], off["p50_ms"]),
            "p50(compaction on) / p50(compaction off)",
        ),
        ratio_entry(
            "write amplification vs log2(parts) + 1",
            ratio(amp["write_amplification"], amp["bound_log2_parts_plus_1"]),
            "(blob bytes written / bytes appended) / (log2(appended parts) + 1)",
            at_most=1.0,
        ),
    ]
    return {
        "scenario": NAME,
        "machine": machine_info(ctx.scale.name, workdir=ctx.workdir),
        "params": {
            "latency_appends": lat_appends,
            "latency_rows": lat_rows,
            "amplification_appends": amp_appends,
            "amplification_rows": amp_rows,
        },
        "tables": {
            "append latency (lockstep rounds, file blob + Postgres)": latency,
            "write amplification": {"persist[file+postgres]": {"role": "subject", **amp}},
        },
        "ratios": ratios,
        "notes": [
            "both latency shards run in one process in lockstep, so the compacting one's "
            "merges (in worker threads) compete with both for the same 2 cores",
            "blob bytes written count every blob set: appended parts, compaction output, rollups",
        ],
    }
