"""Compaction: does it stall writers, and how much does it rewrite?

Two measurements, both on a file blob + Postgres consensus:

1. **Writers never wait**: small ``compare_and_append`` calls on two shards in lock-step rounds,
   one client with compaction on and one with it off; the p99 of each. Target: the p99 with
   compaction on within 2x of the p99 with it off.
2. **Write amplification**: bytes written to blob (appends, compaction output, rollups) per
   byte the appends wrote, after appending ~1M updates in 1,000-row appends with compaction on
   and a final ``maintain``. The spine bounds it by about ``log2(parts) + 1``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import persist
from benches.fixtures import make_updates
from benches.harness import BASELINE, SUBJECT, Context, Run, System, latency_stats, ratio, versus
from benches.harness import ratio_entry as entry
from benches.systems import PERSIST_PG, PersistTable

NAME = "compaction"
TITLE = "Compaction: writer stalls and write amplification"
ON, OFF = "compaction on", "compaction off"

# (appends in the latency run, rows each; appends in the amplification run, rows each)
COUNTS = {
    "smoke": (30, 100, 40, 500),
    "quick": (1_000, 100, 200, 1_000),
    "full": (10_000, 100, 1_000, 1_000),
}


def systems() -> list[System]:
    def shard(on: bool) -> Callable[[Context], Any]:
        config = persist.PersistConfig(compaction_enabled=on)
        report = ("batches", "parts")
        tag = f"latency-{'on' if on else 'off'}"
        return lambda ctx: PersistTable.open(
            ctx, tag, "postgres", report=report, counted=True, config=config
        )

    return [System(ON, SUBJECT, shard(True)), System(OFF, BASELINE, shard(False))]


async def _amplification(ctx: Context, appends: int, rows: int) -> dict[str, Any]:
    store = await PersistTable.open(ctx, "amplification", "postgres", counted=True)
    counts, write = store.loc.counts, store.write
    assert counts is not None
    try:
        appended_bytes = 0
        deadline = ctx.deadline()
        done = 0
        for i in range(appends):
            if time.monotonic() >= deadline:
                break
            before = counts.blob_set_bytes
            # Keys spread over a wide range, so merges interleave rather than concatenate.
            table = make_updates(rows, key_start=(i * 7919) % appends * rows, time=i, seed=13)
            batch = await write.batch(table, i, i + 1)
            appended_bytes += counts.blob_set_bytes - before
            await write.compare_and_append_batch([batch], i, i + 1)
            done += 1
        await store.maintain()
        info = await store.inspect()
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
        await store.close()


async def run(ctx: Context) -> dict[str, Any]:
    lat_appends, lat_rows, amp_appends, amp_rows = COUNTS[ctx.scale.name]
    async with Run(ctx, NAME, systems()) as run:
        run.log(f"{lat_appends} appends of {lat_rows} rows, compaction on vs off")
        await run.open()
        await run.lockstep(
            lat_appends,
            lambda i: make_updates(lat_rows, key_start=i * lat_rows, time=i, seed=11),
            together=True,
        )
    latency = {
        name: {
            "role": run.roles[name],
            **latency_stats(xs),
            "appends": len(xs),
            "batches_at_end": run.extras[name]["batches"],
            "parts_at_end": run.extras[name]["parts"],
        }
        for name, xs in run.samples.items()
    }
    run.log(f"{amp_appends} appends of {amp_rows} rows for write amplification")
    amp = await _amplification(ctx, amp_appends, amp_rows)
    return await run.result(
        params={
            "latency_appends": lat_appends,
            "latency_rows": lat_rows,
            "amplification_appends": amp_appends,
            "amplification_rows": amp_rows,
        },
        tables={
            "append latency (lockstep rounds, file blob + Postgres)": latency,
            "write amplification": {PERSIST_PG: {"role": SUBJECT, **amp}},
        },
        ratios=[
            versus(latency, "p99_ms", ON, OFF, "p99", "p99 with compaction on vs off", at_most=2.0),
            versus(latency, "p50_ms", ON, OFF, "p50", "p50 with compaction on vs off"),
            entry(
                "write amplification vs log2(parts) + 1",
                ratio(amp["write_amplification"], amp["bound_log2_parts_plus_1"]),
                "(blob bytes written / bytes appended) / (log2(appended parts) + 1)",
                at_most=1.0,
            ),
        ],
        notes=[
            "both latency shards run in one process in lockstep, so the compacting one's "
            "merges (in worker threads) compete with both for the same 2 cores",
            "blob bytes written count every blob set: appended parts, compaction output, rollups",
        ],
    )
