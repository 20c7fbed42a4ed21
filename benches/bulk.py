"""bulk: one big write, then one big read.

``bulk_rows`` rows (int64 key ascending, 16-char string, random int64 value; all at ``_time`` 0)
are written by each system, then read back whole. Every system gets the same in-memory Arrow
table; MB/s is measured against that table's in-memory size (``input_MB``, including ``_time``).

Systems (``meta["batches"]``: written as that many appends of ``rows / batches`` rows, slice
``j`` at ``_time`` ``j``):

- ``persist[file+sqlite]``: ONE ``compare_and_append(table, 0, 1)`` (persist cuts it into parts of
  ``part_target_bytes`` and encodes/writes them ``io_concurrency`` at a time), read back with
  ``ReadHandle.snapshot_and_fetch(0)``;
- ``persist[file+sqlite] Nx appends``: the same rows as ``bulk_batches`` appends, read back with
  ``snapshot_and_fetch(N - 1)``: what reading many batches costs next to one;
- ``parquet``: ``pyarrow.parquet.write_table`` (default options) of the table to one file on the
  same disk, fsync of file and directory; read back with ``pyarrow.dataset(...).to_table()``
  of the same table cut into as many plain Parquet files as persist wrote parts;
- ``parquet 10x files``: the ``bulk_batches`` slices, each ``write_table`` to its own file
  + fsync of file and directory; read back with ``pyarrow.dataset`` over those files; time travel
  = the first half of the files. The limit of the ``Nx`` systems;
- peers (skipped, with the reason recorded, without the bench extra), with the same slices:
  ``delta-lake 10x appends`` (``write_deltalake(dir, slice, mode="append")`` per slice; read with
  ``DeltaTable(dir).to_pyarrow_table()``) and ``iceberg[sql-sqlite] 10x appends``
  (``table.append(slice)`` per slice; read with ``table.scan().to_arrow()``).

Time travel: every ``Nx`` system also reads the version right after slice ``N/2 - 1`` (half the
rows): ``snapshot_and_fetch(N/2 - 1)``, ``DeltaTable(dir, version=N/2 - 1)``,
``scan(snapshot_id=...)``, the first ``N/2`` plain files.

Write repetitions and read repetitions run interleaved across the systems. Reads are from a warm
page cache for every system: the data was just written, and each system reads once untimed
before the timed reads.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import numpy as np
import pyarrow as pa

import persist
from benches.fixtures import disk_bytes, make_updates, slices
from benches.harness import (
    BASELINE,
    PEER,
    SUBJECT,
    Context,
    Run,
    System,
    column,
    ratio,
    timed,
    versus,
)
from benches.harness import ratio_entry as entry
from benches.peers import DELTA, DELTA_NAME, ICEBERG, ICEBERG_NAME
from benches.systems import PARQUET, PERSIST_SQLITE, STORES, ParquetFiles, PersistTable, Stored

NAME = "bulk"
TITLE = "Bulk: 10M rows in 1M-row batches"
PERSIST = PERSIST_SQLITE
TARGET = 0.7
WRITE, READ = "write", "read (warm page cache)"


class ParquetFile(ParquetFiles):
    """Everything in one plain Parquet file (one append), written durably; read back by
    ``pyarrow.dataset`` from the same rows cut into as many files as persist wrote parts."""

    def cut(self, files: int) -> None:
        """Untimed, before the reads: the rows as ``files`` plain files (next to the written
        one, so its disk size stays its own), which the reads then read."""
        import pyarrow.parquet as pq

        table = pq.read_table(self.paths[0])
        step = -(-table.num_rows // files)
        dataset = self.root.with_name(f"{self.root.name}-dataset")
        dataset.mkdir()
        self.paths = [str(dataset / f"{j:05d}.parquet") for j in range(files)]
        for j, path in enumerate(self.paths):
            pq.write_table(table.slice(j * step, step), path)


def systems(batches: int = 10) -> list[System]:
    """Everything this scenario measures. Peers are added here."""
    nx, files = f"{batches}x appends", f"{PARQUET} {batches}x files"

    def persist_table(ctx: Context, tag: str) -> Any:
        return PersistTable.open(ctx, tag, "sqlite", reader=True, report=("parts", "batches"))

    def stored(kind: str) -> Any:
        return lambda ctx, tag: Stored(STORES[kind](ctx.workdir / tag))

    many = {"limit": files, "batches": batches}
    return [
        System(PERSIST, SUBJECT, persist_table, {"limit": PARQUET}),
        System(f"{PERSIST} {nx}", SUBJECT, persist_table, many),
        System(f"{DELTA_NAME} {nx}", PEER, stored(DELTA), many, (DELTA,)),
        System(f"{ICEBERG_NAME} {nx}", PEER, stored(ICEBERG), many, (ICEBERG,)),
        System(PARQUET, BASELINE, lambda ctx, tag: Stored(ParquetFile(ctx.workdir / tag))),
        System(files, BASELINE, stored(PARQUET), many),
    ]


async def _write(store: Any, table: pa.Table, batches: int) -> None:
    for j, piece in enumerate([table] if batches == 1 else slices(table, batches)):
        await store.append(j, piece)


async def _writes(run: Run, table: pa.Table) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each repetition into a fresh location; a system's last one is kept for the reads. After a
    persist write, ``client.maintain`` runs to completion, timed apart (its median is the
    ``maintain_s`` figure), so its background work never overlaps another system's measurement."""
    ctx = run.ctx
    write_s: dict[str, list[float]] = {name: [] for name in run.systems}
    maintain_s: dict[str, list[float]] = {}
    deadline = ctx.deadline()
    for rep in range(ctx.scale.bulk_write_repeats):
        last = rep == ctx.scale.bulk_write_repeats - 1
        for name, s in run.systems.items():
            if name in run.adapters:
                continue
            tag = "".join(c if c.isalnum() else "-" for c in name) + f"-{rep}"
            store = await run.make(name, tag)
            write_s[name].append(
                (await timed(_write(store, table, s.meta.get("batches", 1)), True))[0]
            )
            if isinstance(store, PersistTable):
                maintain_s.setdefault(name, []).append((await timed(store.maintain()))[0])
            run.log(
                f"write {rep + 1} {name}: {write_s[name][-1]:.2f}s"
                + (f" (+ maintain {maintain_s[name][-1]:.2f}s)" if name in maintain_s else "")
            )
            if last or time.monotonic() >= deadline:
                run.adapters[name] = store
            else:
                await store.close()
                shutil.rmtree(ctx.workdir / tag, ignore_errors=True)
        if len(run.adapters) == len(run.systems):
            break
    return write_s, {name: {"maintain_s": float(np.median(xs))} for name, xs in maintain_s.items()}


async def run(ctx: Context) -> dict[str, Any]:
    n, batches = ctx.scale.bulk_rows, ctx.scale.bulk_batches
    old = max(0, batches // 2 - 1)  # the slice after which time travel looks: half the rows
    old_rows = min(n, -(-n // batches) * (old + 1))
    async with Run(ctx, NAME, systems(batches)) as run:
        run.log(f"generating {n:,} rows")
        t0 = time.perf_counter()
        table = make_updates(n, time=0, seed=11)
        gen_s = time.perf_counter() - t0
        input_mb = table.nbytes / 1e6
        run.log(f"{input_mb:.0f} MB in memory (generated in {gen_s:.1f}s)")
        write_s, maintained = await _writes(run, table)
        parts = (await run.adapters[PERSIST].inspect())["parts"]
        del table
        run.adapters[PARQUET].store.cut(parts)
        reads = await run.read_back(
            {"snapshot": None, "time_travel": old},
            lambda name, kind: n if kind == "snapshot" else old_rows,
            ctx.scale.bulk_read_repeats,
        )
        disk = {name: disk_bytes(store.data) / 1e6 for name, store in run.adapters.items()}
    for name, mb in disk.items():
        run.extras[name]["disk_MB"] = mb

    def rates(xs: list[float], rows: int, key: str = "read_s") -> dict[str, Any]:
        med = float(np.median(xs))
        mb_per_s = input_mb * rows / n / med
        return {key: med, "rows_per_s": rows / med, "MB_per_s": mb_per_s, "repeats": len(xs)}

    tables = {
        WRITE: {
            name: run.row(name, **rates(xs, n, "write_s"), **maintained.get(name, {}))
            for name, xs in write_s.items()
        },
        READ: {
            name: {"role": run.roles[name], **rates(k["snapshot"], n)} for name, k in reads.items()
        },
        f"time-travel read of the version after {old + 1} of {batches} appends (warm page cache)": {
            name: {"role": run.roles[name], "rows": old_rows, **rates(k["time_travel"], old_rows)}
            for name, k in reads.items()
            if "time_travel" in k
        },
    }
    write, read, old_table = tables.values()

    ratios = []
    for s in run.names(SUBJECT, PEER):
        limit = run.systems[s].meta["limit"]
        target = TARGET if run.roles[s] == SUBJECT else None
        name = f"{s} write rows/s vs {limit}"
        ratios.append(versus(write, "rows_per_s", s, limit, "rows/s", name, at_least=target))
        name = f"{s} read rows/s vs {limit} dataset read"
        formula = f"rows/s(read({s})) / rows/s(dataset({limit}).to_table())"
        ratios.append(versus(read, "rows_per_s", s, limit, "", name, formula, at_least=target))
    # The parts' encoding against pyarrow's defaults (issue 21's 1.1x): the one-append shard's
    # whole location (parts, rollups, consensus) over the one plain file of the same rows.
    ratios.append(
        entry(
            f"{PERSIST} bytes on disk vs {PARQUET} (one write_table of the same rows)",
            ratio(disk[PERSIST], disk[PARQUET]),
            f"disk({PERSIST}) / disk({PARQUET})",
            at_most=1.1,
        )
    )
    for s in (s for s in run.names(SUBJECT) if s != PERSIST):
        name = f"{s} read time vs 1 bulk append"
        ratios.append(versus(read, "read_s", s, PERSIST, "read_s", name))

    comparisons = []
    for s in run.names(SUBJECT):
        limit = run.systems[s].meta["limit"]
        note = f"one append; peers: {batches} appends" if s == PERSIST else ""
        for figure, rows_of, goal in (
            ("bulk write rows/s", write, ("limit", ">=", TARGET)),
            ("bulk snapshot read rows/s", read, ("limit", ">=", TARGET)),
            ("bulk time-travel read rows/s", old_table, None),
        ):
            if s in rows_of:
                values = column(rows_of, "rows_per_s")
                comparisons.append(run.compare(figure, "rows/s", s, values, limit, goal, note))

    config = persist.PersistConfig()
    return await run.result(
        params={
            "rows": n,
            "input_MB": input_mb,
            "batches_variant": batches,
            "time_travel_rows": old_rows,
            "write_repeats": ctx.scale.bulk_write_repeats,
            "read_repeats": ctx.scale.bulk_read_repeats,
            "part_target_bytes": config.part_target_bytes,
            "io_concurrency": config.io_concurrency,
        },
        tables=tables,
        ratios=ratios,
        comparisons=comparisons,
        samples_s={
            "write": write_s,
            "read": {name: k["snapshot"] for name, k in reads.items()},
            "time_travel": {
                name: k["time_travel"] for name, k in reads.items() if "time_travel" in k
            },
        },
        notes=[
            f"{n:,} rows, {input_mb:.0f} MB in memory (MB/s is of that); keys ascending",
            "figures are medians over the repeats; write and read repeats interleave systems",
            "after each persist write, client.maintain (compaction, rollup, GC) runs to "
            "completion, timed apart (maintain_s, not in write_s), so persist's background work "
            "never overlaps another system's measurement; reads see the maintained shard",
            "reads are from a warm page cache for every system (just written, one untimed "
            "read first)",
            f"the {PARQUET} read baseline reads {parts} plain Parquet files (= persist's part "
            f"count); {PARQUET} {batches}x files reads its {batches} files",
            "persist stores a _diff column as well (8 bytes/row more than the parquet "
            "baselines); peers store the 3 data columns only (no _time, no _diff) and do not "
            "fsync",
        ],
    )
