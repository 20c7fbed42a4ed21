"""evolution: reading a shard whose parts were written in several schema versions.

The same rows go into two shards on one file blob + Postgres consensus (compaction off, so
every append's parts stay as written, each in its version), as ``BATCHES`` appends (batch ``j`` at ``_time`` ``j``,
ids ascending across batches; rows per scale in ``COUNTS``):

- ``one version`` (the baseline): created with the final schema ``V2`` (``id int64 NOT NULL,
  label string, amount int64, note string``), every batch written in it;
- ``three versions`` (the subject): created with ``V0`` (``id``, ``name``, ``amount int32``);
  batches 0-1 written in it, then ``evolve_schema`` adds the nullable ``note`` (``V1``),
  batches 2-3, then ``evolve_schema`` widens ``amount`` to int64 and renames ``name`` to
  ``label`` (``V2``), batches 4-5. Each batch is written by a writer opened at the version
  current then, so the shard holds parts of three versions, read through
  ``core.arrow.evolution.View``.

The first two batches have ``note`` null in both shards, so their contents are equal; the
scenario fails unless both reads of both shards return the same rows as written.

Reads, from a fresh client (nothing of the writes cached), interleaved (the order alternating
each round), one untimed read each first (warm page cache), then timed (wall time, and the
process's CPU time over all threads, which other work on a shared machine moves less) with the
garbage collector run before each:

- ``snapshot_and_fetch``: ``ReadHandle.snapshot_and_fetch(as_of)`` of a reader at the current
  version (consolidated, sorted);
- ``read_table``: the body of ``persist.read_table`` (``persist.plain.contents``: a planned
  read, ``plan_snapshot`` + ``fetch_split_batches(consolidate=False)``) on the same client, so
  the timing is the read and not ``persist.connect``.

Target (issue 32): each read of the three-version shard at most 1.2x the time of the same
read of the one-version shard.
"""

from __future__ import annotations

import collections
import functools
import gc
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import persist
from benches.fixtures import RECOVERIES, close_client, persist_append, resilient
from benches.harness import BASELINE, SUBJECT, Context, Run, System, own_target, ratio
from benches.harness import ratio_entry as entry
from benches.systems import PersistLocation
from persist.plain import contents

NAME = "evolution"
TITLE = "Reading parts of several schema versions"
ONE = "persist[file+postgres] one version"
THREE = "persist[file+postgres] three versions"
READS = ("snapshot_and_fetch", "read_table")
TARGET = 1.2
BATCHES = 6
# (rows in all, timed read rounds)
COUNTS = {"smoke": (6_000, 1), "quick": (1_000_000, 7), "full": (5_000_000, 5)}

V0 = pa.schema(
    [pa.field("id", pa.int64(), nullable=False), ("name", pa.string()), ("amount", pa.int32())]
)
V1 = pa.schema([*V0, pa.field("note", pa.string())])
V2 = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        ("label", pa.string()),
        ("amount", pa.int64()),
        ("note", pa.string()),
    ]
)
# The version batch j of the three-version shard is written in.
VERSION_OF = (0, 0, 1, 1, 2, 2)
_MIX = np.int64(-7046029254386353131)  # odd 64-bit constant: id -> pseudo-random digits


def make_batches(rows: int) -> list[pa.Table]:
    """``BATCHES`` tables of ``V2`` (with ``_time``) of ``rows`` rows in all, ids ascending;
    ``note`` null in the batches written before it existed, else set on every other row."""
    step = -(-rows // BATCHES)
    out = []
    for j in range(BATCHES):
        ids = np.arange(j * step, min(rows, (j + 1) * step), dtype=np.int64)
        with np.errstate(over="ignore"):
            mixed = (ids * _MIX) & np.int64((1 << 53) - 1)
        label = pc.utf8_lpad(pc.cast(pa.array(mixed), pa.string()), 16, "0")
        amount = np.random.default_rng(j).integers(0, 1 << 31, size=len(ids), dtype=np.int64)
        if VERSION_OF[j] == 0:
            note = pa.nulls(len(ids), pa.string())
        else:
            text = pc.binary_join_element_wise(
                "note-", pc.cast(pa.array(ids % 997), pa.string()), ""
            )
            note = pc.if_else(pa.array(ids % 2 == 0), text, pa.scalar(None, pa.string()))
        times = pa.array(np.full(len(ids), j, dtype=np.uint64))
        out.append(
            pa.Table.from_arrays(
                [pa.array(ids), label, pa.array(amount), note, times],
                schema=pa.schema([*V2, pa.field("_time", pa.uint64())]),
            )
        )
    return out


def in_version(batch: pa.Table, version: int) -> pa.Table:
    """A ``V2`` batch as a writer at ``version`` writes it."""
    if version == 2:
        return batch
    columns = [
        batch.column("id"),
        batch.column("label"),
        batch.column("amount").cast(pa.int32()),
        *([batch.column("note")] if version == 1 else []),
        batch.column("_time"),
    ]
    schema = V0 if version == 0 else V1
    return pa.Table.from_arrays(
        columns, schema=pa.schema([*schema, pa.field("_time", pa.uint64())])
    )


class EvolvedShard:
    """One shard of the scenario: ``build`` writes the batches (evolving between them when
    ``evolve``), ``attach`` opens a reader on the reading client, ``read(kind)`` reads."""

    def __init__(self, ctx: Context, evolve: bool) -> None:
        self.ctx, self.evolve = ctx, evolve
        self.shard = persist.ShardId.new()
        self.client: persist.PersistClient | None = None
        self.reader: persist.ReadHandle | None = None
        self.as_of = BATCHES - 1
        self.info: dict[str, Any] = {}

    async def build(self, client: persist.PersistClient, batches: list[pa.Table]) -> float:
        """Writes ``batches``; the seconds it took (evolutions included)."""
        t0 = time.perf_counter()
        version = -1
        write: persist.WriteHandle | None = None
        for j, batch in enumerate(batches):
            want = VERSION_OF[j] if self.evolve else 2
            if want != version:
                if write is not None:
                    await write.expire()
                if self.evolve and want > 0:
                    schema, renames = (V1, None) if want == 1 else (V2, {"name": "label"})
                    evolve = functools.partial(
                        client.evolve_schema, self.shard, schema, renames=renames
                    )
                    got = await resilient(evolve, "evolve_schema")
                    if got != want:
                        raise RuntimeError(f"evolve_schema gave version {got}, not {want}")
                # The first writer creates the shard; later ones open it at its current version.
                first = (V0 if self.evolve else V2) if version < 0 else None
                opener = functools.partial(client.open_writer, self.shard, first, purpose="bench")
                write = await resilient(opener, "open_writer")
                # The one-version shard never evolves: its V2 schema is its version 0.
                expect = want if self.evolve else 0
                if write.schema_version != expect:
                    raise RuntimeError(f"writer at version {write.schema_version}, not {expect}")
                version = want
            assert write is not None
            await persist_append(write, in_version(batch, version), j, j + 1)
        if write is not None:
            await write.expire()
        return time.perf_counter() - t0

    async def attach(self, client: persist.PersistClient) -> None:
        """A reader at the current version on ``client``, and what the shard's parts are."""
        self.client = client
        self.reader = await client.open_leased_reader(self.shard, purpose="bench")
        splits = await self.reader.snapshot(self.as_of)
        by_version = collections.Counter(p.schema_version for s in splits for p in s.parts)
        info = await client.inspect(self.shard)
        self.info = {
            "parts": sum(by_version.values()),
            "parts_by_version": {str(v): n for v, n in sorted(by_version.items())},
            "schema_version": info["schema_version"],
        }

    async def read(self, kind: str) -> pa.Table:
        assert self.client is not None and self.reader is not None
        if kind == "snapshot_and_fetch":
            return await self.reader.snapshot_and_fetch(self.as_of)
        return await contents(self.client, str(self.shard), self.as_of)

    async def close(self) -> dict[str, Any]:
        if self.reader is not None:
            await self.reader.expire()
            self.reader = None
        return self.info


def systems() -> list[System]:
    return [
        System(ONE, BASELINE, lambda ctx: EvolvedShard(ctx, evolve=False)),
        System(THREE, SUBJECT, lambda ctx: EvolvedShard(ctx, evolve=True)),
    ]


def _check(kind: str, got: dict[str, pa.Table], expected: pa.Table) -> None:
    """Both shards' reads of ``kind`` hold the rows written, and equal each other."""
    tables = {}
    for name, table in got.items():
        if kind == "snapshot_and_fetch":
            if pc.any(pc.not_equal(table.column("_diff"), 1)).as_py():
                raise RuntimeError(f"{name} {kind}: a row's multiplicity is not 1")
            table = table.select(V2.names)
        else:
            table = table.sort_by("id")  # read_table's rows come in no particular order
        if not table.equals(expected):
            raise RuntimeError(
                f"{name} {kind} read {table.num_rows} rows that are not the "
                f"{expected.num_rows} written"
            )
        tables[name] = table
    first, *rest = tables.values()
    if any(not first.equals(t) for t in rest):
        raise RuntimeError(f"{kind}: the shards' reads differ")


async def _timed_read(shard: EvolvedShard, kind: str, rows: int) -> tuple[float, float, bool]:
    """One read's wall and CPU seconds (every thread of the process: less moved than wall
    time by other work on a shared machine), and whether it is a clean sample (no lost
    database connection was recovered meanwhile). The garbage collector runs first, untimed."""
    gc.collect()
    mark = RECOVERIES.count
    cpu0, t0 = time.process_time(), time.perf_counter()
    got = await resilient(lambda: shard.read(kind), kind)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if got.num_rows != rows:
        raise RuntimeError(f"{kind} read {got.num_rows} rows of {rows}")
    return wall, cpu, RECOVERIES.count == mark


async def run(ctx: Context) -> dict[str, Any]:
    rows, repeats = COUNTS[ctx.scale.name]
    config = persist.PersistConfig(compaction_enabled=False)
    loc = PersistLocation(ctx, ctx.workdir / "evolution", "postgres")
    wall: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    dropped: collections.Counter[str] = collections.Counter()
    build_s: dict[str, float] = {}
    try:
        async with Run(ctx, NAME, systems()) as run:
            await run.open()
            shards: dict[str, EvolvedShard] = run.adapters
            run.log(f"writing {rows:,} rows as {BATCHES} appends into each shard")
            batches = make_batches(rows)
            client = await loc.connect(config)
            try:
                for name, shard in shards.items():
                    build_s[name] = await shard.build(client, batches)
                    run.log(f"{name}: written in {build_s[name]:.2f}s")
            finally:
                await close_client(client)
            expected = pa.concat_tables(batches).select(V2.names).cast(V2)
            del batches
            reading = await loc.connect(config)
            try:
                for shard in shards.values():
                    await resilient(functools.partial(shard.attach, reading), "attach")
                # Untimed: the page cache warmed, and every read checked.
                for kind in READS:
                    got = {
                        name: await resilient(functools.partial(s.read, kind), kind)
                        for name, s in shards.items()
                    }
                    _check(kind, got, expected)
                    del got
                del expected
                wall = {name: {kind: [] for kind in READS} for name in shards}
                cpu = {name: {kind: [] for kind in READS} for name in shards}

                async def round_(rep: int) -> None:
                    order = list(shards.items())
                    for name, shard in order if rep % 2 == 0 else order[::-1]:
                        for kind in READS:
                            w, c, clean = await _timed_read(shard, kind, rows)
                            if not clean:  # it timed a database outage
                                dropped[name] += 1
                                continue
                            wall[name][kind].append(w)
                            cpu[name][kind].append(c)
                    run.log(
                        f"read round {rep + 1}: "
                        + ", ".join(
                            f"{n} " + " ".join(f"{k} {v[-1]:.3f}s" for k, v in ks.items() if v)
                            for n, ks in wall.items()
                        )
                    )

                await run.repeat(repeats, round_)
                await run.close()  # the readers expire while their client is open
            finally:
                await close_client(reading)
    finally:
        await loc.drop()

    def median(xs: list[float]) -> float | None:
        return float(np.median(xs)) if xs else None

    table: dict[str, dict[str, Any]] = {}
    for name in wall:
        figures: dict[str, Any] = {"rows": rows, "build_s": build_s[name]}
        for kind in READS:
            med = median(wall[name][kind])
            figures |= {
                f"{kind}_s": med,
                f"{kind}_rows_per_s": None if not med else rows / med,
                f"{kind}_cpu_s": median(cpu[name][kind]),
            }
        figures["repeats"] = min(len(xs) for xs in wall[name].values())
        figures |= {"dropped_samples": dropped[name]} if dropped[name] else {}
        table[name] = run.row(name, **figures)

    ratios = []
    for kind in READS:
        ratios.append(
            own_target(
                entry(
                    f"{THREE} {kind} time vs {ONE}",
                    ratio(table[THREE][f"{kind}_s"], table[ONE][f"{kind}_s"]),
                    f"median {kind}_s({THREE}) / median {kind}_s({ONE})",
                    at_most=TARGET,
                )
            )
        )
        ratios.append(
            entry(
                f"{THREE} {kind} CPU time vs {ONE}",
                ratio(table[THREE][f"{kind}_cpu_s"], table[ONE][f"{kind}_cpu_s"]),
                f"median {kind}_cpu_s({THREE}) / median {kind}_cpu_s({ONE}) (process CPU time, "
                "all threads)",
            )
        )
    return await run.result(
        params={"rows": rows, "batches": BATCHES, "read_repeats": repeats},
        tables={"read (warm page cache)": table},
        ratios=ratios,
        samples_s={"wall": wall, "cpu": cpu},
        notes=[
            f"{rows:,} rows as {BATCHES} appends (compaction off) into each shard; three "
            "versions: batches 0-1 at V0 (id, name, amount int32), 2-3 at V1 (+ note), 4-5 at "
            "V2 (amount int64, name renamed label); one version: all at V2",
            "both shards' reads return the same rows as written (checked, untimed, before the "
            "timed reads)",
            "reads from a fresh client, interleaved, order alternating per round; figures are "
            "medians; *_cpu_s is the process's CPU time (all threads) over the read, less moved "
            "than wall time by other work on a shared machine; build_s (writes and "
            "evolutions) is context only",
            "read_table = persist.plain.contents (read_table's body) on the open client: "
            "plan_snapshot (registers a reader) + fetch_split_batches(consolidate=False)",
        ],
    )
