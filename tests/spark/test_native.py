"""``persist.spark.read``: Spark's own Parquet reader over persist's parts, held from the driver.

Every answer is compared with the verified path (``spark.read.format("persist")``, which reads
through persist and checks each part's checksum) on shards with and without retractions, with
multiplicities, inline parts, time travel, and compaction and garbage collection running while
the DataFrame is in use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import persist
import persist.spark
from tests.spark.conftest import Location, times

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string()), ("u", pa.uint64())])
BLOB_PARTS = persist.PersistConfig(inline_writes_max_bytes=0)


def _updates(keys: list[int], t: int, diffs: list[int] | None = None) -> pa.Table:
    cols: dict[str, Any] = {
        "k": pa.array(keys, pa.int64()),
        "v": [f"v{k}" for k in keys],
        "u": pa.array([k * 7 for k in keys], pa.uint64()),
        "_time": times([t] * len(keys)),
    }
    if diffs is not None:
        cols["_diff"] = pa.array(diffs, pa.int64())
    return pa.table(cols)


def _fill(loc: Location, appends: list[pa.Table], config: persist.PersistConfig) -> str:
    shard = str(persist.ShardId.new())

    async def go() -> None:
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            write = await client.open_writer(shard, SCHEMA)
            for t, table in enumerate(appends):
                await write.compare_and_append(table, t, t + 1)
            await write.expire()

    asyncio.run(go())
    return shard


def _rows(df: Any) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r) for r in df.collect())


def _both(spark: Any, loc: Location, shard: str, **options: Any) -> tuple[Any, Any]:
    native = persist.spark.read(spark, **loc.options(shard, **options))
    verified = spark.read.format("persist").options(**loc.options(shard, **options)).load()
    return native, verified


N = 3000
SHARDS: dict[str, list[pa.Table]] = {
    # Inserts only: the parts' rows as they are.
    "inserts": [_updates(list(range(0, N, 2)), 0), _updates(list(range(1, N, 2)), 1)],
    # Retractions of earlier rows: a groupBy summing _diff.
    "retractions": [
        _updates(list(range(N)), 0),
        _updates(list(range(0, N, 3)), 1, [-1] * len(range(0, N, 3))),
        _updates(list(range(0, N, 5)), 2),
    ],
    # Multiplicities above one, no retraction: rows repeated by their diff.
    "multiplicities": [
        _updates(list(range(N)), 0, [1 + k % 3 for k in range(N)]),
        _updates(list(range(N, 2 * N)), 1),
    ],
    # Retractions of rows holding nulls: a null matches a null.
    "null_retractions": [
        _updates(list(range(N)), 0).set_column(1, "v", pa.array([None] * N, pa.string())),
        _updates(list(range(0, N, 4)), 1, [-1] * len(range(0, N, 4))).set_column(
            1, "v", pa.array([None] * len(range(0, N, 4)), pa.string())
        ),
    ],
    # The same row in several appends: multiplicities that only the sum shows.
    "repeats": [_updates(list(range(N)), t) for t in range(3)],
}


@pytest.mark.parametrize("kind", sorted(SHARDS))
@pytest.mark.parametrize("inline", [False, True], ids=["blob", "inline"])
def test_the_native_read_equals_the_verified_path(
    spark: Any, loc: Location, kind: str, inline: bool
) -> None:
    appends = SHARDS[kind]
    if inline:  # small appends stay in the state: both kinds of parts in one scan
        appends = [*appends, _updates([2 * N + 1, 2 * N + 2], len(appends))]
    config = persist.PersistConfig() if inline else BLOB_PARTS
    shard = _fill(loc, appends, config)
    upper = len(appends)
    for as_of in sorted({0, upper - 2, upper - 1}):
        for mode in ("contents", "updates"):
            native, verified = _both(spark, loc, shard, as_of=as_of, mode=mode)
            want = _rows(verified)
            assert _rows(native) == want and want, (kind, as_of, mode)
            assert native.columns == verified.columns
            assert [f.dataType for f in native.schema] == [f.dataType for f in verified.schema]
            persist.spark.release(native)


def test_a_negative_multiplicity_fails_the_action(spark: Any, loc: Location) -> None:
    shard = _fill(loc, [_updates([7, 8], 0, [-2, 1])], BLOB_PARTS)
    df = persist.spark.read(spark, **loc.options(shard))
    with pytest.raises(Exception, match=r"persist\.InvalidUsage: row .*\"k\":7.* negative"):
        df.collect()
    updates = persist.spark.read(spark, **loc.options(shard, mode="updates"))
    assert sorted((r.k, r._diff) for r in updates.collect()) == [(7, -2), (8, 1)]


def test_spark_prunes_columns_and_pushes_filters_into_the_parts(spark: Any, loc: Location) -> None:
    shard = _fill(loc, SHARDS["inserts"], BLOB_PARTS)
    df = persist.spark.read(spark, **loc.options(shard))
    picked = df.select("k").where("k < 10")
    plan = picked._jdf.queryExecution().executedPlan().toString()
    assert "FileScan parquet" in plan and "ReadSchema: struct<k:bigint>" in plan, plan
    assert "PushedFilters: [IsNotNull(k), LessThan(k,10)]" in plan, plan
    assert sorted(r.k for r in picked.collect()) == list(range(10))


def test_the_snapshot_is_fixed_at_read_and_held_while_compaction_runs(
    spark: Any, loc: Location
) -> None:
    # Filled with compaction off: the parts the read plans are the appends' own, and the
    # churn's maintenance replaces some of them for sure. (With it on, the filling client
    # could merge them all before it closed, and then no planned part might be replaced.)
    still = dataclasses.replace(BLOB_PARTS, compaction_enabled=False)
    shard = _fill(loc, [_updates(list(range(t * 100, t * 100 + 100)), t) for t in range(30)], still)
    df = persist.spark.read(spark, **loc.options(shard))
    want = Counter((k, f"v{k}", k * 7) for k in range(3000))
    planned = {p for p in loc.blob_keys() if "/w/" in p or "/c/" in p}
    stop = threading.Event()
    rounds: queue.Queue[int] = queue.Queue()  # the churn's append-and-maintain rounds, as done

    async def churn() -> None:
        async with await persist.connect(loc.blob, loc.consensus, config=BLOB_PARTS) as client:
            write = await client.open_writer(shard, SCHEMA)
            t = 30
            while not stop.is_set():
                await write.compare_and_append(_updates([10_000 + t], t), t, t + 1)
                await client.maintain(shard)
                t += 1
                rounds.put(t)
            await write.expire()

    background = threading.Thread(target=lambda: asyncio.run(churn()))
    background.start()
    try:
        # The same snapshot each time, whatever compaction did: each read after another round
        # of appends and maintenance (waited for, not slept for: a busy machine is slow).
        for _ in range(3):
            rounds.get(timeout=300)
            assert _rows(df) == want
    finally:
        stop.set()
        background.join()
    assert loc.run(lambda c: c.frontiers(shard))[1] > 32  # the churn ran
    assert planned - loc.blob_keys() == set()  # every part the plan named is still there
    # Released, the parts compaction replaced may go.
    persist.spark.release(df)

    async def collect(client: persist.PersistClient) -> None:
        # Until a replaced part is gone; the deadline only bounds a failing run.
        deadline = time.monotonic() + 300
        while not planned - loc.blob_keys() and time.monotonic() < deadline:
            await client.maintain(shard)
            await asyncio.sleep(0.1)

    loc.run(collect)
    assert planned - loc.blob_keys(), "no replaced part was deleted after the release"


def test_bad_native_reads_are_refused(spark: Any, loc: Location) -> None:
    shard = _fill(loc, SHARDS["inserts"], BLOB_PARTS)
    with pytest.raises(persist.InvalidUsage, match="unknown option"):
        persist.spark.read(spark, **loc.options(shard, splits=3))
    with pytest.raises(persist.InvalidUsage, match="lives in one process"):
        persist.spark.read(spark, shard=shard, blob="mem://x", consensus=loc.consensus)
    with pytest.raises(persist.InvalidUsage, match="not below the shard's upper"):
        persist.spark.read(spark, **loc.options(shard, as_of=2))
    assert loc.run(lambda c: c.inspect(shard))["readers"] == 0  # nothing left held
    verified = persist.spark.read(spark, **loc.options(shard, verify=True))
    assert verified.count() == N


_HOLDER = """
import json, sys, time
import persist, persist.spark
from pyspark.sql import SparkSession

opts = json.loads(sys.argv[1])


def session():
    return (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )


spark = session()
df = persist.spark.read(spark, **opts)
print("held", df.count(), flush=True)
spark.stop()
time.sleep(8)  # the holds of a stopped session go within a few seconds
print("stopped", flush=True)
sys.stdin.readline()
spark = session()
df = persist.spark.read(spark, **opts)
print("held again", df.count(), flush=True)
sys.stdin.readline()
"""


def test_holds_go_when_the_session_stops_and_when_the_process_exits(
    loc: Location, tmp_path: Path
) -> None:
    shard = _fill(loc, SHARDS["inserts"], BLOB_PARTS)
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    env = os.environ | {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(loc.options(shard))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:

        def expect(prefix: str) -> None:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith(prefix), line

        readers = lambda: loc.run(lambda c: c.inspect(shard))["readers"]  # noqa: E731
        expect(f"held {N}")
        assert readers() == 1
        expect("stopped")
        assert readers() == 0
        proc.stdin.write("\n")
        proc.stdin.flush()
        expect(f"held again {N}")
        assert readers() == 1
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
    assert readers() == 0  # expired at exit, not left to its lease


def test_many_touched_rows_are_summed_on_every_action_instead(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``_TOUCHED_ROWS`` rows touched by retractions, the read sums the whole snapshot on
    every action rather than keep the touched rows as local data: the same answer."""
    import persist.spark._native as native

    monkeypatch.setattr(native, "_TOUCHED_ROWS", 10)
    monkeypatch.setattr(native, "_LOCAL_ROWS", 0)  # not summed in the driver at read() either
    shard = _fill(loc, SHARDS["retractions"], BLOB_PARTS)
    df, verified = _both(spark, loc, shard)
    assert _rows(df) == _rows(verified)
    persist.spark.release(df)


@pytest.mark.parametrize("kind", ["retractions", "null_retractions"])
def test_rows_sharing_a_touched_rows_digest_are_summed_with_it(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Untouched rows are told from touched ones by a digest of the row; an untouched row that
    shares a touched row's digest (forced here: every row has one of two digests) goes into
    the group-by with the touched rows, which matches on every column: the same answer."""
    import pyspark.sql.functions as F

    import persist.spark._native as native

    monkeypatch.setattr(native, "_digest", lambda data: F.coalesce(F.length(data[1]), F.lit(0)) % 2)
    monkeypatch.setattr(native, "_LOCAL_ROWS", 0)  # the digest's path, not the driver's sums
    shard = _fill(loc, SHARDS[kind], BLOB_PARTS)
    df, verified = _both(spark, loc, shard)
    want = _rows(verified)
    assert _rows(df) == want and want
    persist.spark.release(df)
    # With the real digest, the same shard is read through it.
    monkeypatch.undo()
    monkeypatch.setattr(native, "_LOCAL_ROWS", 0)
    df = persist.spark.read(spark, **loc.options(shard))
    assert _matches_by_digest(df) and _rows(df) == want
    persist.spark.release(df)


def _matches_by_digest(df: Any) -> bool:
    """Whether each action tells untouched rows by their digest (the local data holds none)."""
    return "_persist_digest" in df._jdf.queryExecution().analyzed().toString()


def _keys(start: int, stop: int, step: int = 1, *, shuffled: bool = False) -> list[int]:
    keys = list(range(start, stop, step))
    # Out of key order: stored as an unsorted run when parts may be (sorted_part_max_bytes=0).
    return keys[1::2] + keys[::2] if shuffled else keys


RETRACTED: dict[str, list[pa.Table]] = {
    # Retractions within one part's key range; the other part is untouched.
    "one_part": [
        _updates(_keys(0, 1000), 0),
        _updates(_keys(2000, 3000), 1),
        _updates(_keys(0, 100, 3), 2, [-1] * len(range(0, 100, 3))),
    ],
    # Retractions spanning two parts' key ranges, a third part apart.
    "spanning": [
        _updates(_keys(0, 1000), 0),
        _updates(_keys(1000, 2000), 1),
        _updates(_keys(3000, 4000), 2),
        _updates(_keys(990, 1010), 3, [-1] * 20),
    ],
    # A row twice, retracted once (one copy left) or twice (none), beside an untouched part.
    "twice": [
        _updates(_keys(0, 1000), 0),
        _updates(_keys(500, 600), 1),
        _updates(_keys(550, 565), 2, [-1] * 15),
        _updates(_keys(560, 565), 3, [-1] * 5),
        _updates(_keys(5000, 5100), 4),
    ],
    # Unsorted runs (no key range): every part is summed, none read as it is.
    "unsorted": [
        _updates(_keys(0, 1000, shuffled=True), 0),
        _updates(_keys(2000, 3000, shuffled=True), 1),
        _updates(_keys(0, 100, 3, shuffled=True), 2, [-1] * len(range(0, 100, 3))),
    ],
}


@pytest.mark.parametrize("local_rows", [0, 1_000_000], ids=["digests", "all-summed"])
@pytest.mark.parametrize("kind", sorted(RETRACTED))
def test_a_shard_with_retractions_reads_exactly_the_consolidated_rows(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch, kind: str, local_rows: int
) -> None:
    """The native read equals persist's own consolidated snapshot, where retractions meet
    rows in one part, across parts, rows written twice, and unsorted runs; parts no
    retraction's key range reaches are read as they are. The other parts' updates are summed
    in the driver at ``read()`` (all of them, where few) or found by digest on each action."""
    import persist.spark._native as native

    monkeypatch.setattr(native, "_LOCAL_ROWS", local_rows)
    config = dataclasses.replace(
        BLOB_PARTS,
        compaction_enabled=False,  # the parts as the appends wrote them
        sorted_part_max_bytes=0 if kind == "unsorted" else BLOB_PARTS.sorted_part_max_bytes,
    )
    appends = RETRACTED[kind]
    shard = _fill(loc, appends, config)
    as_of = len(appends) - 1

    async def truth(client: persist.PersistClient) -> tuple[pa.Table, list[bool]]:
        reader = await client.open_leased_reader(shard)
        try:
            table = await reader.snapshot_and_fetch(as_of)
        finally:
            await reader.expire()
        plan = await client.plan_scan(shard, as_of=as_of)
        await plan.release()
        assert plan.scan is not None and plan.contents.value == "sum"
        return table, [p.untouched for p in plan.scan.parts]

    table, untouched = loc.run(truth)
    # Each kind but the unsorted one has a part read as it is; unsorted runs have no range.
    assert any(untouched) == (kind != "unsorted"), untouched
    rows = table.to_pylist()
    want: Counter[tuple[Any, ...]] = Counter()
    for r in rows:
        want[(r["k"], r["v"], r["u"])] += r["_diff"]
    assert want and all(m > 0 for m in want.values())
    native = persist.spark.read(spark, **loc.options(shard, as_of=as_of))
    assert _rows(native) == want
    persist.spark.release(native)
    updates = persist.spark.read(spark, **loc.options(shard, as_of=as_of, mode="updates"))
    assert _rows(updates) == Counter((r["k"], r["v"], r["u"], as_of, r["_diff"]) for r in rows)
    persist.spark.release(updates)


@pytest.mark.parametrize("local_rows", [0, 1_000_000], ids=["digests", "all-summed"])
def test_a_merged_shard_reads_its_untouched_rows_as_they_are(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch, local_rows: int
) -> None:
    """Inserts over every key, then appends retracting some of them beside new inserts, merged:
    the rows never retracted are parts of their own, which the read takes as they are though
    every part's key range meets a part with retractions (of their own merge), and the rows
    the retractions touch come out summed (in the driver at ``read()``, or by digest on each
    action). Equal to persist's own snapshot. Actors: one writer, then maintenance to the end
    (merges, folds, garbage collection)."""
    import persist.spark._native as native

    monkeypatch.setattr(native, "_LOCAL_ROWS", local_rows)
    config = dataclasses.replace(BLOB_PARTS, compaction_min_parts=1)
    appends = [_updates(list(range(0, 3000, 3)), 0)]
    for t in (1, 2, 3):  # four appends of a size: the spine merges them into one batch
        gone = list(range(3 * t, 3000, 30))
        new = list(range(t, 3000, 3))[: 1000 - len(gone)]
        appends.append(_updates(gone + new, t, [-1] * len(gone) + [1] * len(new)))
    shard = _fill(loc, appends, config)

    async def truth(_: persist.PersistClient) -> tuple[pa.Table, list[bool]]:
        # Merged, not folded: a fold keeps the appends' parts as they are.
        async with await persist.connect(loc.blob, loc.consensus, config=config) as client:
            await client.maintain(shard)
            return await planned(client)

    async def planned(client: persist.PersistClient) -> tuple[pa.Table, list[bool]]:
        reader = await client.open_leased_reader(shard)
        try:
            table = await reader.snapshot_and_fetch(3)
        finally:
            await reader.expire()
        plan = await client.plan_scan(shard, as_of=3)
        await plan.release()
        assert plan.scan is not None and plan.contents.value == "sum"
        return table, [p.untouched for p in plan.scan.parts]

    table, untouched = loc.run(truth)
    assert any(untouched) and not all(untouched), untouched
    want = Counter((r["k"], r["v"], r["u"]) for r in table.to_pylist() for _ in range(r["_diff"]))
    native = persist.spark.read(spark, **loc.options(shard, as_of=3))
    assert _rows(native) == want and want
    assert _matches_by_digest(native) == (local_rows == 0)
    persist.spark.release(native)


@pytest.mark.parametrize("local_rows", [0, 1_000_000], ids=["digests", "all-summed"])
def test_touched_floats_are_summed_as_persist_compares_them(
    spark: Any, loc: Location, monkeypatch: pytest.MonkeyPatch, local_rows: int
) -> None:
    """-0.0 retracts 0.0 and a NaN retracts a NaN of another bit pattern (persist's equality,
    and Spark's group-by): the touched rows, summed in the driver (found by digest, or every
    update outside the untouched parts), come out as persist's snapshot does; an untouched row
    beside them stays."""
    import numpy as np

    import persist.spark._native as native

    monkeypatch.setattr(native, "_LOCAL_ROWS", local_rows)

    schema = pa.schema([("k", pa.int64()), ("x", pa.float64())])
    other_nan = np.array([0x7FF8000000000123], np.uint64).view(np.float64)[0]

    def rows(xs: list[float], t: int, diff: int) -> pa.Table:
        n = len(xs)
        return pa.table(
            {
                "k": pa.array([1] * n, pa.int64()),
                "x": pa.array(np.array(xs, np.float64)),
                "_time": times([t] * n),
                "_diff": pa.array([diff] * n, pa.int64()),
            }
        )

    shard = str(persist.ShardId.new())

    async def go(client: persist.PersistClient) -> None:
        write = await client.open_writer(shard, schema)
        await write.compare_and_append(rows([0.0, float("nan"), 2.0, 3.0], 0, 1), 0, 1)
        await write.compare_and_append(rows([-0.0, other_nan, 2.0], 1, -1), 1, 2)
        await write.expire()

    loc.run(go)
    native = persist.spark.read(spark, **loc.options(shard, as_of=1))
    assert _rows(native) == Counter({(1, 3.0): 1})
    persist.spark.release(native)
