"""bulk: one big write, then one big read.

``bulk_rows`` rows (int64 key ascending, 16-char string, random int64 value; all at ``_time`` 0)
are written by each system, then read back whole. Every system gets the same in-memory Arrow
table; MB/s is measured against that table's in-memory size (``input_MB``, including ``_time``).

Systems (adapters implement ``BulkStore``):

- ``persist[file+sqlite]``: ONE ``compare_and_append(table, 0, 1)`` (persist cuts it into parts of
  ``part_target_bytes`` and encodes/writes them ``io_concurrency`` at a time), read back with
  ``ReadHandle.snapshot_and_fetch(0)``;
- ``persist[file+sqlite] Nx appends``: the same rows as ``bulk_batches`` appends of
  ``rows / bulk_batches`` rows (slice ``j`` at ``_time`` ``j``), read back with
  ``snapshot_and_fetch(N - 1)``: what reading many batches costs next to one;
- ``parquet``: ``pyarrow.parquet.write_table`` (default options) of the table to one file on the
  same disk, fsync of file and directory; read back with
  ``pyarrow.dataset.dataset(dir).to_table()`` of a directory holding the same table cut into as
  many plain Parquet files as persist wrote parts.

- ``parquet 10x files``: the same ``bulk_batches`` slices, each ``write_table`` to its own file
  + fsync of file and directory; read back with ``pyarrow.dataset`` over those files; time travel
  = the first half of the files. The limit of the ``Nx`` systems.

Peers (``benches.peers``; skipped, with the reason recorded, without the bench extra), with the
same ``bulk_batches`` slices as the ``Nx`` persist variant:

- ``delta-lake 10x appends``: ``write_deltalake(dir, slice, mode="append")`` per slice; read with
  ``DeltaTable(dir).to_pyarrow_table()``;
- ``iceberg[sql-sqlite] 10x appends``: ``table.append(slice)`` per slice; read with
  ``table.scan().to_arrow()``.

Time travel: every ``Nx`` system also reads the version right after slice ``N/2 - 1`` (half the
rows): ``snapshot_and_fetch(N/2 - 1)``, ``DeltaTable(dir, version=N/2 - 1)``,
``scan(snapshot_id=...)``, the first ``N/2`` plain files.

Write repetitions and read repetitions run interleaved across the systems. Reads are from a warm
page cache for every system: the data was just written, and each system reads once untimed
before the timed reads.

A peer is added by appending a ``System`` to ``systems()`` whose ``make`` returns a
``BulkStore``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Awaitable, Callable
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
    System,
    close_client,
    comparison,
    dir_bytes,
    fsync_dir,
    fsync_file,
    machine_info,
    make_updates,
    ratio,
    ratio_entry,
    select_systems,
    with_time,
)
from benches.peers import DELTA, DELTA_NAME, ICEBERG, ICEBERG_NAME, DeltaStore, IcebergStore
from persist.location.file import FileBlob
from persist.location.sqlite import SqliteConsensus

NAME = "bulk"
PERSIST = "persist[file+sqlite]"
PARQUET = "parquet"
TARGET = 0.7


def multi_name(base: str, batches: int) -> str:
    return f"{base} {batches}x appends"


def parquet_files_name(batches: int) -> str:
    return f"{PARQUET} {batches}x files"


class BulkStore(Protocol):
    async def write(self, table: pa.Table) -> None:
        """Durably writes all of ``table`` (every ``_time`` is 0)."""

    async def settle(self) -> bool:
        """Finishes background work the write started (persist: ``client.maintain``), so it
        does not run into the next system's measurement; ``False`` if there is none."""

    async def prepare_read(self, hint: dict[str, Any]) -> None:
        """Untimed setup before reads (``hint["files"]``: how many parts persist wrote)."""

    async def read(self) -> pa.Table:
        """Everything written, as one table."""

    async def read_old(self) -> pa.Table | None:
        """Time travel: the table right after its write ``N/2 - 1`` (``None``: one version)."""

    async def close(self) -> dict[str, Any]:
        """Releases everything; extra figures worth reporting (may be empty)."""


class PersistBulk:
    def __init__(self, root: Path, batches: int) -> None:
        self.root = root
        self.batches = batches
        self.client: persist.PersistClient | None = None
        self.write_handle: persist.WriteHandle | None = None
        self.read_handle: persist.ReadHandle | None = None
        self.as_of = 0

    @classmethod
    async def open(cls, ctx: Context, tag: str, batches: int = 1) -> PersistBulk:
        root = ctx.workdir / tag
        root.mkdir(parents=True, exist_ok=True)
        self = cls(root, batches)
        self.client = await persist.connect(
            FileBlob(str(root / "blob")), SqliteConsensus(str(root / "consensus.db"))
        )
        self.write_handle, self.read_handle = await self.client.open(
            persist.ShardId.new(), SCHEMA, purpose="bench"
        )
        return self

    async def write(self, table: pa.Table) -> None:
        assert self.write_handle is not None
        if self.batches == 1:
            await self.write_handle.compare_and_append(table, 0, 1)
            self.as_of = 0
            return
        for j, piece in enumerate(slices(table, self.batches)):
            await self.write_handle.compare_and_append(piece, j, j + 1)
        self.as_of = self.batches - 1

    async def settle(self) -> bool:
        assert self.client is not None and self.write_handle is not None
        await self.client.maintain(self.write_handle.shard_id)
        return True

    async def prepare_read(self, hint: dict[str, Any]) -> None:
        return None

    async def read(self) -> pa.Table:
        assert self.read_handle is not None
        return await self.read_handle.snapshot_and_fetch(self.as_of)

    async def read_old(self) -> pa.Table | None:
        assert self.read_handle is not None
        if self.batches == 1:
            return None
        return await self.read_handle.snapshot_and_fetch(old_version(self.batches))

    async def close(self) -> dict[str, Any]:
        assert self.client is not None and self.write_handle is not None
        info = await self.client.inspect(self.write_handle.shard_id)
        await close_client(self.client)
        return {
            "parts": info["parts"],
            "batches": info["batches"],
            "disk_MB": dir_bytes(self.root / "blob") / 1e6,
        }


class ParquetBulk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.file = root / "write" / "table.parquet"
        self.file.parent.mkdir()
        self.dataset_dir = root / "dataset"
        self.table: pa.Table | None = None

    async def settle(self) -> bool:
        return False

    async def write(self, table: pa.Table) -> None:
        pq.write_table(table, self.file)
        fsync_file(self.file)
        fsync_dir(self.file.parent)
        self.table = table

    async def prepare_read(self, hint: dict[str, Any]) -> None:
        assert self.table is not None
        files = max(1, int(hint.get("files") or 0) or -(-self.table.num_rows // 1_000_000))
        self.dataset_dir.mkdir(exist_ok=True)
        n = self.table.num_rows
        step = -(-n // files)
        for j in range(files):
            pq.write_table(self.table.slice(j * step, step), self.dataset_dir / f"{j:05d}.parquet")
        self.files = files
        self.table = None

    async def read(self) -> pa.Table:
        return pads.dataset(self.dataset_dir, format="parquet").to_table()

    async def read_old(self) -> pa.Table | None:
        return None

    async def close(self) -> dict[str, Any]:
        out: dict[str, Any] = {"disk_MB": self.file.stat().st_size / 1e6}
        if self.dataset_dir.exists():
            out["files"] = len(os.listdir(self.dataset_dir))
        return out


def slices(table: pa.Table, batches: int) -> list[pa.Table]:
    """``table`` cut into ``batches`` slices, slice ``j`` at ``_time`` ``j``."""
    step = -(-table.num_rows // batches)
    return [with_time(table.slice(j * step, step), j) for j in range(batches)]


def old_version(batches: int) -> int:
    """The slice after which the time-travel read looks: half of the rows."""
    return max(0, batches // 2 - 1)


class ParquetFilesBulk:
    """One plain Parquet file per slice (+ fsync of file and directory): the limit of N
    appends."""

    def __init__(self, root: Path, batches: int) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True)
        self.batches = batches
        self.files: list[str] = []

    async def settle(self) -> bool:
        return False

    async def write(self, table: pa.Table) -> None:
        for j, piece in enumerate(slices(table, self.batches)):
            path = self.dir / f"{j:05d}.parquet"
            pq.write_table(piece, path)
            fsync_file(path)
            fsync_dir(self.dir)
            self.files.append(str(path))

    async def prepare_read(self, hint: dict[str, Any]) -> None:
        return None

    async def read(self) -> pa.Table:
        return pads.dataset(self.files, format="parquet").to_table()

    async def read_old(self) -> pa.Table | None:
        files = self.files[: old_version(self.batches) + 1]
        return pads.dataset(files, format="parquet").to_table()

    async def close(self) -> dict[str, Any]:
        return {"files": len(self.files), "disk_MB": dir_bytes(self.dir) / 1e6}


class PeerBulk:
    """A peer store (``benches.peers``) written slice by slice, one append each."""

    def __init__(self, store: Any, root: Path, batches: int) -> None:
        self.store = store
        self.root = root
        self.batches = batches

    async def settle(self) -> bool:
        return False

    async def write(self, table: pa.Table) -> None:
        for piece in slices(table, self.batches):
            self.store.append(piece)

    async def prepare_read(self, hint: dict[str, Any]) -> None:
        return None

    async def read(self) -> pa.Table:
        return self.store.read(None)

    async def read_old(self) -> pa.Table | None:
        return self.store.read(old_version(self.batches))

    async def close(self) -> dict[str, Any]:
        try:
            return {"files": self.store.files(), "disk_MB": dir_bytes(self.root) / 1e6}
        finally:
            self.store.close()


async def _parquet(ctx: Context, tag: str) -> BulkStore:
    return ParquetBulk(ctx.workdir / tag)


def _parquet_files(batches: int) -> Callable[[Context, str], Awaitable[BulkStore]]:
    async def make(ctx: Context, tag: str) -> BulkStore:
        return ParquetFilesBulk(ctx.workdir / tag, batches)

    return make


def _delta(batches: int) -> Callable[[Context, str], Awaitable[BulkStore]]:
    async def make(ctx: Context, tag: str) -> BulkStore:
        root = ctx.workdir / tag
        return PeerBulk(DeltaStore(root), root, batches)

    return make


def _iceberg(batches: int) -> Callable[[Context, str], Awaitable[BulkStore]]:
    async def make(ctx: Context, tag: str) -> BulkStore:
        root = ctx.workdir / tag
        return PeerBulk(IcebergStore(root), root, batches)

    return make


def systems(batches: int = 10) -> list[System]:
    """Everything this scenario measures. Peers are added here."""
    files = parquet_files_name(batches)
    return [
        System(
            PERSIST,
            SUBJECT,
            lambda ctx, tag: PersistBulk.open(ctx, tag),
            note="one compare_and_append",
            meta={"limit": PARQUET},
        ),
        System(
            multi_name(PERSIST, batches),
            SUBJECT,
            lambda ctx, tag: PersistBulk.open(ctx, tag, batches),
            note=f"{batches} compare_and_append of rows/{batches}",
            meta={"limit": files},
        ),
        System(
            multi_name(DELTA_NAME, batches),
            PEER,
            _delta(batches),
            meta={"limit": files},
            note=f"{batches} write_deltalake(mode=append)",
            requires=(DELTA,),
        ),
        System(
            multi_name(ICEBERG_NAME, batches),
            PEER,
            _iceberg(batches),
            meta={"limit": files},
            note=f"{batches} table.append",
            requires=(ICEBERG,),
        ),
        System(
            PARQUET,
            BASELINE,
            _parquet,
            note="write: write_table to 1 file + fsync; read: dataset().to_table()",
        ),
        System(
            files,
            BASELINE,
            _parquet_files(batches),
            note=f"write: {batches} write_table + fsync; read: dataset(files).to_table()",
        ),
    ]


def _tag(name: str, rep: int) -> str:
    return "".join(c if c.isalnum() else "-" for c in name) + f"-{rep}"


async def run(ctx: Context, only_systems: list[str] | None = None) -> dict[str, Any]:
    scale = ctx.scale
    n = scale.bulk_rows
    batches = scale.bulk_batches
    chosen, skipped = select_systems(systems(batches), only_systems)
    ctx.log(f"{NAME}: generating {n:,} rows")
    t0 = time.perf_counter()
    table = make_updates(n, time=0, seed=11)
    gen_s = time.perf_counter() - t0
    input_mb = table.nbytes / 1e6
    ctx.log(f"{NAME}: {input_mb:.0f} MB in memory (generated in {gen_s:.1f}s)")
    step = -(-n // batches)
    old_rows = min(n, step * (old_version(batches) + 1))

    write_s: dict[str, list[float]] = {s.name: [] for s in chosen}
    read_s: dict[str, list[float]] = {s.name: [] for s in chosen}
    old_s: dict[str, list[float]] = {}
    settle_s: dict[str, list[float]] = {}
    stores: dict[str, BulkStore] = {}
    extras: dict[str, dict[str, Any]] = {}
    budget = ctx.budget()
    try:
        # Writes: each repetition into a fresh location; the last one is kept for the reads.
        for rep in range(scale.bulk_write_repeats):
            if rep and not budget.left():
                break
            last = rep == scale.bulk_write_repeats - 1
            for s in chosen:
                store = await s.make(ctx, _tag(s.name, rep))
                gc.collect()
                t = time.perf_counter()
                await store.write(table)
                write_s[s.name].append(time.perf_counter() - t)
                t = time.perf_counter()
                if await store.settle():
                    settle_s.setdefault(s.name, []).append(time.perf_counter() - t)
                ctx.log(
                    f"{NAME}: write {rep + 1} {s.name}: {write_s[s.name][-1]:.2f}s"
                    + (f" (+ maintain {settle_s[s.name][-1]:.2f}s)" if s.name in settle_s else "")
                )
                if last or not budget.left():
                    stores[s.name] = store
                else:
                    await store.close()
                    _rm(ctx.workdir / _tag(s.name, rep))
            if len(stores) == len(chosen):
                break

        hint: dict[str, Any] = {}
        if PERSIST in stores:
            assert isinstance(stores[PERSIST], PersistBulk)
            p = stores[PERSIST]
            assert p.client is not None and p.write_handle is not None
            hint["files"] = (await p.client.inspect(p.write_handle.shard_id))["parts"]
        del table
        for s in chosen:
            await stores[s.name].prepare_read(hint)
            got = await stores[s.name].read()  # untimed: warms the page cache
            if got.num_rows != n:
                raise RuntimeError(f"{s.name} read {got.num_rows} rows, wrote {n}")
            del got
            old = await stores[s.name].read_old()
            if old is not None:
                if old.num_rows != old_rows:
                    raise RuntimeError(f"{s.name} time travel read {old.num_rows} of {old_rows}")
                old_s[s.name] = []
            del old
        read_budget = ctx.budget()
        for rep in range(scale.bulk_read_repeats):
            if rep and not read_budget.left():
                break
            for s in chosen:
                gc.collect()
                t = time.perf_counter()
                got = await stores[s.name].read()
                read_s[s.name].append(time.perf_counter() - t)
                rows = got.num_rows
                del got
                if rows != n:
                    raise RuntimeError(f"{s.name} read {rows} rows, wrote {n}")
                if s.name in old_s:
                    gc.collect()
                    t = time.perf_counter()
                    old = await stores[s.name].read_old()
                    old_s[s.name].append(time.perf_counter() - t)
                    del old
            ctx.log(
                f"{NAME}: read round {rep + 1}: "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in read_s.items())
            )
    finally:
        for name, store in stores.items():
            extras[name] = await store.close()

    by_name = {s.name: s for s in chosen}
    write_rows: dict[str, dict[str, Any]] = {}
    read_rows: dict[str, dict[str, Any]] = {}
    old_rows_table: dict[str, dict[str, Any]] = {}
    for name in write_s:
        w = float(np.median(write_s[name]))
        write_rows[name] = {
            "role": by_name[name].role,
            "write_s": w,
            "rows_per_s": n / w,
            "MB_per_s": input_mb / w,
            "repeats": len(write_s[name]),
            **({"maintain_s": float(np.median(settle_s[name]))} if name in settle_s else {}),
            **{k: v for k, v in extras.get(name, {}).items()},
        }
    for name in read_s:
        r = float(np.median(read_s[name]))
        read_rows[name] = {
            "role": by_name[name].role,
            "read_s": r,
            "rows_per_s": n / r,
            "MB_per_s": input_mb / r,
            "repeats": len(read_s[name]),
        }
    for name, xs in old_s.items():
        r = float(np.median(xs))
        old_rows_table[name] = {
            "role": by_name[name].role,
            "rows": old_rows,
            "read_s": r,
            "rows_per_s": old_rows / r,
            "MB_per_s": input_mb * old_rows / n / r,
            "repeats": len(xs),
        }

    ratios = []
    for s in chosen:
        if s.role == BASELINE:
            continue
        limit = s.meta.get("limit", PARQUET)
        target = TARGET if s.role == SUBJECT else None
        if limit in write_rows:
            ratios.append(
                ratio_entry(
                    f"{s.name} write rows/s vs {limit}",
                    ratio(write_rows[s.name]["rows_per_s"], write_rows[limit]["rows_per_s"]),
                    f"rows/s({s.name}) / rows/s({limit})",
                    at_least=target,
                )
            )
        if limit in read_rows:
            ratios.append(
                ratio_entry(
                    f"{s.name} read rows/s vs {limit} dataset read",
                    ratio(read_rows[s.name]["rows_per_s"], read_rows[limit]["rows_per_s"]),
                    f"rows/s(read({s.name})) / rows/s(dataset({limit}).to_table())",
                    at_least=target,
                )
            )
    multi = [s.name for s in chosen if s.name != PERSIST and s.role == SUBJECT]
    if PERSIST in read_rows:
        for name in multi:
            ratios.append(
                ratio_entry(
                    f"{name} read time vs 1 bulk append",
                    ratio(read_rows[name]["read_s"], read_rows[PERSIST]["read_s"]),
                    f"read_s({name}) / read_s({PERSIST})",
                )
            )

    comparisons = []
    peers = [s.name for s in chosen if s.role == PEER]
    for s in chosen:
        if s.role != SUBJECT:
            continue
        limit = s.meta.get("limit", PARQUET)
        for figure, rows_table in (
            ("bulk write rows/s", write_rows),
            ("bulk snapshot read rows/s", read_rows),
            ("bulk time-travel read rows/s", old_rows_table),
        ):
            if s.name not in rows_table:
                continue
            comparisons.append(
                comparison(
                    figure,
                    "rows/s",
                    "higher",
                    s.name,
                    rows_table[s.name]["rows_per_s"],
                    peers={p: rows_table[p]["rows_per_s"] for p in peers if p in rows_table},
                    limit=(limit, rows_table[limit]["rows_per_s"]) if limit in rows_table else None,
                    limit_at_least=TARGET if "time-travel" not in figure else None,
                    note="" if s.name != PERSIST else f"one append; peers: {batches} appends",
                )
            )

    return {
        "scenario": NAME,
        "params": {
            "rows": n,
            "input_MB": input_mb,
            "batches_variant": batches,
            "time_travel_rows": old_rows,
            "write_repeats": scale.bulk_write_repeats,
            "read_repeats": scale.bulk_read_repeats,
            "part_target_bytes": persist.PersistConfig().part_target_bytes,
            "io_concurrency": persist.PersistConfig().io_concurrency,
        },
        "tables": {
            "write": write_rows,
            "read (warm page cache)": read_rows,
            f"time-travel read of the version after {old_version(batches) + 1} of {batches} "
            "appends (warm page cache)": old_rows_table,
        },
        "ratios": ratios,
        "comparisons": comparisons,
        "skipped": skipped,
        "samples_s": {"write": write_s, "read": read_s, "time_travel": old_s},
        "notes": [
            f"{n:,} rows, {input_mb:.0f} MB in memory (MB/s is of that); keys ascending",
            "figures are medians over the repeats; write and read repeats interleave systems",
            "after each persist write, client.maintain (compaction, rollup, GC) runs to "
            "completion, timed apart (maintain_s, not in write_s), so persist's background work "
            "never overlaps another system's measurement; reads see the maintained shard",
            "reads are from a warm page cache for every system (just written, one untimed "
            "read first)",
            f"the {PARQUET} read baseline reads {hint.get('files', '?')} plain Parquet files "
            f"(= persist's part count); {parquet_files_name(batches)} reads its {batches} files",
            "persist stores a _diff column as well (8 bytes/row more than the parquet "
            "baselines); peers store the 3 data columns only (no _time, no _diff) and do not "
            "fsync",
        ],
        "machine": machine_info(ctx.scale.name, {"pid": os.getpid()}, ctx.workdir),
    }


def _rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
