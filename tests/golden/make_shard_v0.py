"""Writes the golden shards of persist 0.1.0, the release before schema evolution.

    .venv/bin/python tests/golden/make_shard_v0.py OUTDIR

OUTDIR (new or empty) gets ``blob/`` (a file blob) and ``consensus.db`` (a SQLite consensus)
holding two named shards, written through the public API only:

- ``golden.orders`` (id ``s601de700-0000-4000-8000-000000000001``): schema ``id int64 NOT NULL,
  name string, amount int32, ts timestamp[ms, tz=UTC]``; updates at times 0, 1 and 2 (time 2
  retracts a row of time 0 and adds its new version; time 1 holds a null in each nullable
  column and a row of multiplicity 2), written as parts in blob, with a rollup of the state
  after time 2 (version 5); then ``maintain`` merges the batches of times 0 and 1 into one
  compacted part and collects the merged inputs and the diffs before the rollup; then a
  second client appends one more row at time 3, kept inline in the state. So the shard holds
  a compacted part, a part as a writer wrote it and an inline part, its upper is 4 and its
  since 0 (no retention: every time from 0 on stays readable).
- ``golden.empty`` (id ``s601de700-0000-4000-8000-000000000002``): the same schema, created
  and never written (upper 0).

Every value is fixed, the clock included (the commits' stamps and the names' ``named_at``
step from 2025-01-01T00:00:00Z); only the ids persist draws itself (writers, batches, parts,
rollups) differ from run to run. Every handle is expired and both clients closed, so no
registration is left and SQLite has folded its -wal file back into consensus.db.

``tests/api/test_golden_shard.py`` reads the copy of OUTDIR checked in as
``tests/golden/shard_v0``: never regenerate that fixture with later code. To run this against
another commit's code, put that commit's ``persist`` first on PYTHONPATH (for example
``git archive <commit> persist | tar -x -C /tmp/src`` and ``PYTHONPATH=/tmp/src``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

try:
    import persist
except ModuleNotFoundError:  # run from a checkout without an install: the repo's own package
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import persist

ORDERS = "golden.orders"
EMPTY = "golden.empty"
ORDERS_ID = persist.ShardId("s601de700-0000-4000-8000-000000000001")
EMPTY_ID = persist.ShardId("s601de700-0000-4000-8000-000000000002")

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("amount", pa.int32()),
        pa.field("ts", pa.timestamp("ms", tz="UTC")),
    ]
)

# 2025-01-01T00:00:00Z: the fixed clock's start, and the rows' timestamps' base.
EPOCH_MS = 1_735_689_600_000


class StepClock:
    """A clock that stands still until the script moves it: ``PersistConfig.now_ms``."""

    def __init__(self, start_ms: int) -> None:
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def step(self, seconds: int = 1) -> None:
        self.ms += seconds * 1000


def updates(
    rows: list[tuple[int, str | None, int | None, int]],
    time: int | None,
    diffs: list[int] | None = None,
) -> pa.Table:
    """The rows ``(id, name, amount, ts as ms after EPOCH_MS)`` as updates at ``time`` (no
    ``_time`` column when None: ``append_next`` picks it)."""
    columns: dict[str, pa.Array] = {
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "name": pa.array([r[1] for r in rows], pa.string()),
        "amount": pa.array([r[2] for r in rows], pa.int32()),
        "ts": pa.array([EPOCH_MS + r[3] for r in rows], pa.timestamp("ms", tz="UTC")),
    }
    if time is not None:
        columns["_time"] = pa.array([time] * len(rows), pa.uint64())
    if diffs is not None:
        columns["_diff"] = pa.array(diffs, pa.int64())
    return pa.Table.from_pydict(columns, schema=_with_columns(columns))


def _with_columns(columns: dict[str, pa.Array]) -> pa.Schema:
    fields = list(SCHEMA)
    if "_time" in columns:
        fields.append(pa.field("_time", pa.uint64()))
    if "_diff" in columns:
        fields.append(pa.field("_diff", pa.int64()))
    return pa.schema(fields)


def config(clock: StepClock, **overrides: Any) -> persist.PersistConfig:
    # No retention: readers alone hold history, and with none left the since stays at 0, so
    # the fixture reads the same at every time whenever it is opened. No background
    # compaction: what is merged is what maintain merges, the same on every run.
    settings: dict[str, Any] = {
        "retention_s": None,
        "compaction_enabled": False,
        "now_ms": clock,
    }
    settings.update(overrides)
    return persist.PersistConfig(**settings)


def locations(out: Path) -> tuple[str, str]:
    return (out / "blob").as_uri(), f"sqlite://{out / 'consensus.db'}"


async def write_phase_one(out: Path, clock: StepClock) -> None:
    """Creates both shards; writes times 0 to 2 of golden.orders as parts in blob; maintains."""
    blob, consensus = locations(out)
    cfg = config(
        clock,
        # Every part a writer writes goes to blob (the inline ones come in phase two).
        inline_writes_max_bytes=0,
        # Every due merge rewrites its inputs (none is only folded).
        compaction_min_parts=1,
        # A rollup is due every 4 commits: the one of the third append (state version 5)
        # writes it, and maintain then drops the consensus diffs before it.
        rollup_interval=4,
    )
    async with await persist.connect(blob, consensus, config=cfg) as client:
        empty = await client.open_writer(EMPTY_ID, SCHEMA, purpose="golden v0: create empty")
        await client.rename_shard(EMPTY_ID, EMPTY)
        await empty.expire()
        clock.step()

        write = await client.open_writer(ORDERS_ID, SCHEMA, purpose="golden v0: orders")
        await client.rename_shard(ORDERS_ID, ORDERS)
        clock.step()
        await write.compare_and_append(
            updates([(1, "ada", 100, 0), (2, "bob", 250, 1_000)], 0), 0, 1
        )
        clock.step()
        await write.compare_and_append(
            updates([(3, None, 75, 2_000), (4, "dee", None, 3_000)], 1, diffs=[1, 2]), 1, 2
        )
        clock.step()
        # bob's order changes: the row of time 0 is retracted, its new version added.
        await write.compare_and_append(
            updates([(2, "bob", 250, 1_000), (2, "bob", 300, 4_000)], 2, diffs=[-1, 1]), 2, 3
        )
        clock.step()
        print("maintain:", await client.maintain(ORDERS_ID))
        await write.expire()
        clock.step()


async def write_phase_two(out: Path, clock: StepClock) -> None:
    """Another client (parts inline, as by default) appends time 3 to golden.orders."""
    blob, consensus = locations(out)
    async with await persist.connect(blob, consensus, config=config(clock)) as client:
        write = await client.open_writer(ORDERS, None, purpose="golden v0: after maintain")
        clock.step()
        time = await write.append_next(updates([(5, "zoë", -40, 5_000)], None))
        assert time == 3, time
        await write.expire()
        clock.step()


async def report(out: Path) -> None:
    """Prints what the location holds, read back from a copy of it (a read registers a reader,
    a commit: the fixture itself must stay as the writes left it)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy"
        shutil.copytree(out, copy)
        blob, consensus = locations(copy)
        async with await persist.connect(blob, consensus) as client:
            for shard in await client.list_shards("golden."):
                print(f"{shard['name']}: {shard['shard_id']} named at {shard['named_at']}")
            for name in (ORDERS, EMPTY):
                info = await client.inspect(name, storage=True)
                assert info["readers"] == 0 and info["writers"] == 0, info
                print(f"{name}: {info}")
            for entry in await client.history(ORDERS):
                print(f"{ORDERS} history: {entry}")
            since, upper = await client.frontiers(ORDERS)
            assert (since, upper) == (0, 4), (since, upper)
            read = await client.open_leased_reader(ORDERS, None, purpose="golden v0: report")
            for as_of in range(upper):
                rows = (await read.snapshot_and_fetch(as_of)).to_pylist()
                for row in sorted(rows, key=lambda r: (r["id"], r["amount"] or 0)):
                    print(f"{ORDERS} as of {as_of}: {row}")
            await read.expire()


async def main(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: give a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    print(f"persist {persist.__version__} from {Path(persist.__file__).parent}")
    clock = StepClock(EPOCH_MS)
    await write_phase_one(out, clock)
    await write_phase_two(out, clock)
    print(f"clock stopped at {datetime.datetime.fromtimestamp(clock.ms / 1000, datetime.UTC)}")
    await report(out)
    leftovers = [p.name for p in out.iterdir() if p.name.startswith("consensus.db-")]
    if leftovers:
        raise SystemExit(f"SQLite left {leftovers} behind: a connection was not closed")
    total = 0
    for path in sorted(out.rglob("*")):
        if path.is_file():
            size = path.stat().st_size
            total += size
            print(f"{size:>8}  {path.relative_to(out)}")
    print(f"{total:>8}  bytes in all")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="a new or empty directory")
    asyncio.run(main(parser.parse_args().outdir.absolute()))
