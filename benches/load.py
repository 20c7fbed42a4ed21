"""load: TPC-H loaded through persist's Python API, against the same chunks written as plain
Parquet files with fsync.

The data is TPC-H at ``load_scale_factor``, made by ``tpchgen-cli parquet`` as ``tpch`` makes it.
Each table is read into memory (untimed) in its shard schema (``tpch.shard_schema``) and cut into
appends of ``load_chunk_rows`` rows (the last one shorter; a smaller table is one append); append
``i`` carries ``_time = i``. Every system loads every table, lineitem (16 columns, the widest
and biggest) first:

- ``persist[file+postgres]`` (compaction on, the default config: as a user has it): per table
  a new shard (``open_writer``), then ``compare_and_append(chunk, i, i + 1)`` per chunk;
- ``persist[file+postgres] compaction off``: the same client with ``compaction_enabled=False``;
- ``parquet+fsync`` (the baseline): per table a new directory, then per chunk
  ``pq.write_table`` (default options) of the same table to a new file, fsync of the file and
  of the directory.

A load is timed from the shard's (directory's) creation to the return of its last append. After
a persist load with compaction on, ``client.maintain`` of the shard runs to completion, timed
apart (``maintain_s``): what the load left for later, which then never overlaps another
system's load.

Up to ``load_repeats`` rounds (after the first, a round starts only within ``load_budget_s``);
in each, table by table, every system loads the table in turn, in an order that rotates with the
round and the table, so noise on the shared machine hits them alike. Each system gets a fresh
client (and Postgres table) or directory per round. Figures: rows/s of the lineitem load and of
all 8 tables (their rows over the sum of the table loads' times), from the median over the
rounds; the ratio persist / parquet+fsync of those, with the range of the per-round ratios.
Target (issue 33): >= 0.8 with compaction on.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import persist
from benches.fixtures import close_client, persist_append, resilient
from benches.harness import BASELINE, SUBJECT, Context, Run, System, column, timed, versus
from benches.systems import PARQUET_FSYNC, PERSIST_PG, ParquetFiles, PersistLocation
from benches.tpch import GENERATOR, TABLES, generate_or_skip, shard_schema

NAME = "load"
TITLE = "Load: TPC-H through the Python API vs Parquet + fsync of the same chunks"
ON = PERSIST_PG
OFF = f"{PERSIST_PG} compaction off"
TARGET = 0.8
LINEITEM = "lineitem"
ALL = f"all {len(TABLES)} tables"


@dataclass(frozen=True)
class Chunked:
    """One table as its appends, in its shard schema, each stamped with its ``_time``."""

    name: str
    schema: pa.Schema
    chunks: list[pa.Table]

    @property
    def rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def _chunked(name: str, path: Path, rows: int) -> Chunked:
    """The table at ``path`` cut into appends of ``rows`` rows. Each is its own contiguous
    copy, as a loader's chunk would be, so neither system pays for slicing the other's way."""
    table = pq.read_table(path)
    schema = shard_schema(table.schema)
    table = table.cast(schema)
    chunks = []
    for i, start in enumerate(range(0, max(table.num_rows, 1), rows)):
        piece = table.slice(start, rows).combine_chunks()
        stamp = pa.array(np.full(piece.num_rows, i, np.uint64))
        chunks.append(piece.append_column("_time", stamp))
    return Chunked(name, schema, chunks)


class PersistLoader:
    """One client (file blob + a Postgres table of its own) into which each ``load`` writes one
    table as a new shard."""

    def __init__(self, loc: PersistLocation, client: Any, compaction: bool) -> None:
        self.loc, self.client, self.compaction = loc, client, compaction
        self.write: persist.WriteHandle | None = None
        self.expected = (0, 0)  # rows and upper after the current load

    @classmethod
    async def make(cls, ctx: Context, tag: str, compaction: bool) -> PersistLoader:
        loc = PersistLocation(ctx, ctx.workdir / tag, "postgres")
        config = persist.PersistConfig(compaction_enabled=compaction)
        return cls(loc, await loc.connect(config), compaction)

    async def load(self, data: Chunked) -> None:
        client = self.client
        write: persist.WriteHandle = await resilient(
            lambda: client.open_writer(
                persist.ShardId.new(), data.schema, f"bench load {data.name}"
            ),
            "open_writer",
        )
        self.write, self.expected = write, (data.rows, len(data.chunks))
        for i, chunk in enumerate(data.chunks):
            await persist_append(write, chunk, i, i + 1)

    async def settle(self) -> dict[str, float]:
        """Untimed, after a load: the shard's parts as the load left them (a shard short of
        rows fails the scenario: a fast load of less is no figure); with compaction on, the
        maintenance due, run to completion (its seconds: ``maintain_s``)."""
        write, self.write = self.write, None
        if write is None:
            return {}
        shard = write.shard_id
        info = await resilient(lambda: self.client.inspect(shard), "inspect")
        if (info["rows"], info["upper"]) != self.expected:
            raise RuntimeError(
                f"shard {shard} holds {info['rows']} rows at upper {info['upper']}, "
                f"not {self.expected[0]} at {self.expected[1]}"
            )
        out = {"parts": float(info["parts"])}
        if self.compaction:
            out["maintain_s"] = (await timed(self.client.maintain(shard)))[0]
        await write.expire()
        return out

    async def close(self) -> dict[str, Any]:
        try:
            await close_client(self.client)
        finally:
            await self.loc.drop()
            shutil.rmtree(self.loc.root, ignore_errors=True)
        return {}


class ParquetLoader:
    """Each ``load`` writes one table's chunks as plain Parquet files (``ParquetFiles``: one
    durable ``write_table`` each) into a new directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.loads = 0
        self.files: ParquetFiles | None = None

    async def load(self, data: Chunked) -> None:
        self.files = files = ParquetFiles(self.root / f"{self.loads:02d}-{data.name}")
        self.loads += 1
        for chunk in data.chunks:
            files.append(chunk)

    async def settle(self) -> dict[str, float]:
        files, self.files = self.files, None
        return {"parts": float(files.files())} if files else {}

    async def close(self) -> dict[str, Any]:
        shutil.rmtree(self.root, ignore_errors=True)
        return {}


def systems() -> list[System]:
    def persist_loader(compaction: bool) -> Any:
        return lambda ctx, tag: PersistLoader.make(ctx, tag, compaction)

    return [
        System(ON, SUBJECT, persist_loader(True)),
        System(OFF, SUBJECT, persist_loader(False)),
        System(PARQUET_FSYNC, BASELINE, lambda ctx, tag: ParquetLoader(ctx.workdir / tag)),
    ]


async def _rounds(
    run: Run, data: list[Chunked]
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[dict[str, float]]]]]:
    """The load seconds and what each load left, by system, table and round."""
    ctx = run.ctx
    names = run.names()
    seconds: dict[str, dict[str, list[float]]] = {s: {d.name: [] for d in data} for s in names}
    settled: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {d.name: [] for d in data} for s in names
    }
    deadline = ctx.deadline(ctx.scale.load_budget_s)
    for rep in range(ctx.scale.load_repeats):
        if rep and time.monotonic() >= deadline:
            run.log(f"budget of {ctx.scale.load_budget_s:g} s spent after {rep} round(s)")
            break
        adapters: dict[str, Any] = {}
        try:
            for s in names:
                tag = "".join(c if c.isalnum() else "-" for c in s) + f"-{rep}"
                adapters[s] = await run.make(s, tag)
            for k, d in enumerate(data):
                j = (rep + k) % len(names)
                for s in names[j:] + names[:j]:
                    dt, _ = await timed(adapters[s].load(d), collect=True)
                    seconds[s][d.name].append(dt)
                    settled[s][d.name].append(await adapters[s].settle())
            run.log(
                f"round {rep + 1}: "
                + ", ".join(
                    f"{s} {seconds[s][LINEITEM][-1]:.2f}s lineitem, "
                    f"{sum(xs[-1] for xs in seconds[s].values()):.2f}s all"
                    for s in names
                )
            )
        finally:
            for adapter in adapters.values():
                await adapter.close()
    return seconds, settled


def _rows(
    run: Run,
    which: list[Chunked],
    seconds: dict[str, dict[str, list[float]]],
    settled: dict[str, dict[str, list[dict[str, float]]]],
) -> dict[str, dict[str, Any]]:
    """A table's rows, one per system, for the loads of the tables ``which``: per round the sum
    of their times; the median of those; rows/s and MB/s (of the chunks in memory) from it; the
    range of the rounds' ratios vs the baseline; the median maintenance after them."""
    rows = sum(d.rows for d in which)
    mb = sum(d.nbytes for d in which) / 1e6
    appends = sum(len(d.chunks) for d in which)
    per_round = {
        s: [sum(r) for r in zip(*(by[d.name] for d in which), strict=True)]
        for s, by in seconds.items()
    }
    base = per_round[PARQUET_FSYNC]
    out: dict[str, dict[str, Any]] = {}
    for s, xs in per_round.items():
        med = float(np.median(xs))
        figures: dict[str, Any] = {
            "load_s": med,
            "rows_per_s": rows / med,
            "MB_per_s": mb / med,
            "rows": rows,
            "appends": appends,
            "rounds": len(xs),
        }
        if s != PARQUET_FSYNC:
            # Per round, the two loads ran back to back: their ratio shares that round's noise.
            rs = [b / x for b, x in zip(base, xs, strict=True)]
            figures |= {"vs_parquet_min": min(rs), "vs_parquet_max": max(rs)}
        after = settled[s]
        left = [sum(after[d.name][r].get("maintain_s", 0.0) for d in which) for r in range(len(xs))]
        if any(left):
            figures["maintain_s"] = float(np.median(left))
        if len(which) == 1:
            figures["parts"] = settled[s][which[0].name][-1].get("parts")
        out[s] = run.row(s, **figures)
    return out


async def run(ctx: Context) -> dict[str, Any]:
    scale = ctx.scale
    sf, per = scale.load_scale_factor, scale.load_chunk_rows
    params: dict[str, Any] = {
        "scale_factor": sf,
        "rows_per_append": per,
        "rounds": scale.load_repeats,
        "rounds_budget_s": scale.load_budget_s,
        "part_target_bytes": persist.PersistConfig().part_target_bytes,
    }
    async with Run(ctx, NAME, systems()) as run:
        generated = await generate_or_skip(run, sf, ctx.workdir / "tpch")
        if generated is None:
            return await run.result(params=params, tables={}, ratios=[])
        files, generated_s = generated
        order = [LINEITEM, *(t for t in TABLES if t != LINEITEM)]
        data = [await asyncio.to_thread(_chunked, t, files[t], per) for t in order]
        shutil.rmtree(ctx.workdir / "tpch", ignore_errors=True)
        params |= {
            "generate_s": generated_s,
            "tables": {d.name: {"rows": d.rows, "appends": len(d.chunks)} for d in data},
        }
        run.log(
            f"{sum(d.rows for d in data):,} rows in {sum(len(d.chunks) for d in data)} appends, "
            f"{sum(d.nbytes for d in data) / 1e6:.0f} MB in memory"
        )
        seconds, settled = await _rounds(run, data)
    lineitem = data[0]
    lineitem_rows = _rows(run, [lineitem], seconds, settled)
    all_rows = _rows(run, data, seconds, settled)
    tables = {
        f"{LINEITEM} ({len(lineitem.schema)} columns, {lineitem.rows:,} rows in "
        f"{len(lineitem.chunks)} appends)": lineitem_rows,
        f"{ALL} ({all_rows[PARQUET_FSYNC]['rows']:,} rows)": all_rows,
    }
    ratios: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    for s in run.names(SUBJECT):
        goal = TARGET if s == ON else None
        for what, rows in ((LINEITEM, lineitem_rows), (ALL, all_rows)):
            name = f"{s} load of {what} vs {PARQUET_FSYNC}, rows/s"
            ratios.append(
                versus(rows, "rows_per_s", s, PARQUET_FSYNC, "rows/s", name, at_least=goal)
            )
            comparisons.append(
                run.compare(
                    f"TPC-H {what} load rows/s",
                    "rows/s",
                    s,
                    column(rows, "rows_per_s"),
                    PARQUET_FSYNC,
                    ("limit", ">=", TARGET) if goal else None,
                    f"SF {sf:g}, appends of {per:,} rows",
                )
            )
    return await run.result(
        params=params,
        tables=tables,
        ratios=ratios,
        comparisons=comparisons,
        samples_s=seconds,
        settled=settled,
        notes=[
            f"TPC-H SF {sf:g} by {GENERATOR}, each table in appends of {per:,} rows (one "
            "contiguous Arrow table each, with _time), the same tables for every system",
            "a load: the shard's (directory's) creation and every append of one table; rows/s "
            "from the median over the rounds, vs_parquet_min/max the range of the rounds' "
            "ratios (the systems load a table back to back in each round, in rotating order)",
            "persist and parquet+fsync both fsync every file and its directory; persist also "
            "commits each append to Postgres and stores a _diff column",
            "maintain_s: after each load with compaction on, client.maintain of the shard run "
            "to completion, timed apart (not in load_s): the work the load left, which so "
            "never overlaps another system's load; parts: as the load left them (last round)",
        ],
    )
