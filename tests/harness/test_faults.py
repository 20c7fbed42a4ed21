"""Fault injection: the wrappers do what they claim, and persist keeps its promises under them.

The promises, checked on every kind of location with failures before and after calls took
effect: every acknowledged write is in every later snapshot; no write applies twice; an
indeterminate ``ExternalError`` is the only way a caller can be unsure, and a read resolves it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pyarrow as pa
import pytest

import persist
from persist.location import Blob, Consensus
from persist.location.mem import MemBlob, MemConsensus
from persist.testing import (
    Faults,
    FaultyBlob,
    FaultyConsensus,
    LocationFactory,
    ShardModel,
    contents_of,
    machine_config,
    scaled,
)
from persist.testing.faults import BLOB_OPS, CONSENSUS_OPS
from persist.testing.lag import LoopLag

from .conftest import LOCATIONS, Figures

SCHEMA = pa.schema([("writer", pa.string()), ("n", pa.int64())])


def row_table(writer: str, n: int, time: int) -> pa.Table:
    return pa.table(
        {
            "writer": pa.array([writer], pa.string()),
            "n": pa.array([n], pa.int64()),
            "_time": pa.array([time], pa.uint64()),
        }
    )


# --- the wrappers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fail_before": -0.1},
        {"fail_after": 1.5},
        {"fail_before": 0.6, "fail_after": 0.6},
        {"latency_s": (0.2, 0.1)},
        {"latency_s": (-1.0, 0.0)},
        {"ops": ["blob.get", "blob.teleport"]},
    ],
    ids=repr,
)
def test_faults_refuse_a_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Faults(**kwargs)  # type: ignore[arg-type]


async def test_fail_before_never_reaches_the_location() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    faults = Faults(fail_before=1.0)
    fb, fc = FaultyBlob(blob, faults), FaultyConsensus(consensus, faults)
    with pytest.raises(persist.ExternalError) as info:
        await fb.set("a/b", b"x")
    assert info.value.determinate
    with pytest.raises(persist.ExternalError) as info:
        await fc.compare_and_set("k", None, b"d")
    assert info.value.determinate
    assert await blob.get("a/b") is None and await consensus.head("k") is None
    assert faults.counts.failed_before == 2 and faults.counts.failed_after == 0


async def test_fail_after_takes_effect_then_is_indeterminate() -> None:
    blob, consensus = MemBlob(), MemConsensus()
    faults = Faults(fail_after=1.0)
    fb, fc = FaultyBlob(blob, faults), FaultyConsensus(consensus, faults)
    for call in (fb.set("a/b", b"x"), fc.compare_and_set("k", None, b"d")):
        with pytest.raises(persist.ExternalError) as info:
            await call
        assert info.value.determinate is False
    assert await blob.get("a/b") == b"x"
    head = await consensus.head("k")
    assert head is not None and head.data == b"d"
    # Reads have no effect to lose: fail_after never applies to them.
    assert await fb.get("a/b") == b"x" and await fb.list_keys("a/") == ["a/b"]
    assert (await fc.head("k")) == head and await fc.scan("k", 1, 10) == [head]
    assert faults.counts.failed_after == 2


async def test_fractions_ops_and_seeds() -> None:
    async def run(faults: Faults) -> list[bool]:
        fc = FaultyConsensus(MemConsensus(), faults)
        failed = []
        for _ in range(2000):
            try:
                await fc.head("k")
                failed.append(False)
            except persist.ExternalError:
                failed.append(True)
        return failed

    a = await run(Faults(seed=11, fail_before=0.25))
    b = await run(Faults(seed=11, fail_before=0.25))
    c = await run(Faults(seed=12, fail_before=0.25))
    assert a == b, "the same seed must inject the same faults"
    assert a != c
    # 2000 draws at p=0.25: mean 500, sd ~19; these bounds are ~8 sd wide.
    assert 350 < sum(a) < 650
    only_blob = Faults(fail_before=1.0, ops=BLOB_OPS)
    assert not any(await run(only_blob)), "ops limits failures to the operations named"
    assert CONSENSUS_OPS.isdisjoint(BLOB_OPS)


async def test_suspended_and_latency() -> None:
    faults = Faults(fail_before=1.0, latency_s=(0.0, 0.001))
    fb = FaultyBlob(MemBlob(), faults)
    with faults.suspended():
        assert not faults.active
        await fb.set("a/b", b"x")
        assert await fb.get("a/b") == b"x"
    assert faults.active
    with pytest.raises(persist.ExternalError):
        await fb.get("a/b")
    assert faults.counts.delayed == 1  # only the call outside the suspended block waited


async def test_pause_holds_calls_until_resume() -> None:
    faults = Faults()
    fb = FaultyBlob(MemBlob(), faults)
    faults.pause()
    task = asyncio.ensure_future(fb.set("a/b", b"x"))
    for _ in range(1000):
        if faults.waiting:
            break
        await asyncio.sleep(0.001)
    assert faults.waiting == 1 and not task.done()
    # resume() is safe from another thread (a test driver outside the loop).
    threading.Thread(target=faults.resume).start()
    await asyncio.wait_for(task, 30)
    assert await fb.get("a/b") == b"x" and faults.counts.held == 1 and not faults.paused


# --- persist's promises under faults ------------------------------------------------------------


async def _resolved_upper(client: persist.PersistClient, shard: str, attempts: int = 50) -> int:
    """The shard's upper, read through faulty ``client`` (reads retried: they are determinate)."""
    for _ in range(attempts):
        try:
            upper = (await client.inspect(shard))["upper"]
            assert isinstance(upper, int)
            return upper
        except persist.ExternalError as exc:
            assert exc.determinate, f"a read failed indeterminately: {exc}"
    raise AssertionError(f"no read of {shard} succeeded in {attempts} attempts")


def _faulty(location: LocationFactory, faults: Faults) -> persist.PersistClient:
    blob, consensus = location()
    return persist.PersistClient(
        FaultyBlob(blob, faults), FaultyConsensus(consensus, faults), machine_config()
    )


@pytest.mark.parametrize("kind", LOCATIONS)
async def test_acknowledged_writes_survive_faults(
    kind: str,
    location_factory: Callable[[str], LocationFactory],
    figures: Figures,
    loop_lag: LoopLag,
) -> None:
    """A writer and a reader, each with its own faulty connection, for a run of writes.

    Every outcome is classified: acknowledged, refused, failed determinately (then the upper
    must not have moved), failed indeterminately (then one read of the upper says whether it
    landed). After every acknowledgement a snapshot through the reader's client holds every
    acknowledged write exactly once; at the end a clean client agrees.
    """
    location = location_factory(kind)
    write_faults = Faults(seed=1, fail_before=0.15, fail_after=0.15, latency_s=(0.0, 0.001))
    read_faults = Faults(seed=2, fail_before=0.15, fail_after=0.15)
    writes = scaled(30)
    model = ShardModel()
    shard = persist.ShardId.new()
    outcomes = {"ok": 0, "determinate": 0, "indeterminate": 0, "landed": 0, "reads": 0}
    async with _faulty(location, write_faults) as wc, _faulty(location, read_faults) as rc:
        with write_faults.suspended(), read_faults.suspended():
            write = await wc.open_writer(shard, SCHEMA)
            read = await rc.open_leased_reader(shard, SCHEMA)
        n = 0
        while n < writes:
            e = model.upper
            assert e is not None
            table = row_table("w", n, e)
            try:
                await write.compare_and_append(table, e, e + 1)
                outcomes["ok"] += 1
                landed = True
            except persist.ExternalError as exc:
                actual = await _resolved_upper(rc, shard)
                if exc.determinate:
                    outcomes["determinate"] += 1
                    assert actual == e, "a determinate failure had moved the upper"
                    landed = False
                else:
                    outcomes["indeterminate"] += 1
                    assert actual in (e, e + 1)
                    landed = actual == e + 1
                    outcomes["landed"] += landed
            if not landed:
                continue  # the same write again: it must end up applied exactly once
            model.compare_and_append([(("w", n), e, 1)], e, e + 1, label=f"w{n}")
            n += 1
            for _ in range(50):
                try:
                    got = contents_of(await read.snapshot_and_fetch(e), SCHEMA.names, e)
                    break
                except persist.ExternalError as exc:
                    assert exc.determinate, f"a read failed indeterminately: {exc}"
            else:
                raise AssertionError("no snapshot succeeded in 50 attempts")
            outcomes["reads"] += 1
            assert got == model.contents_as_of(e), f"after write {n}: {got}"
    blob, consensus = location()
    async with persist.PersistClient(blob, consensus, machine_config()) as clean:
        reader = await clean.open_leased_reader(shard, SCHEMA)
        got = contents_of(await reader.snapshot_and_fetch(writes - 1), SCHEMA.names)
        listened: dict[tuple[tuple[object, ...], int], int] = {}
        async for event in reader.listen(0):
            for r in event.updates.to_pylist():
                key = ((r["writer"], r["n"]), r["_time"])
                listened[key] = listened.get(key, 0) + r["_diff"]
            if event.upper == writes:
                break
    audit = model.audit(listened, 0)
    assert got == model.contents_as_of(writes - 1)
    assert all(d == 1 for d in got.values()) and len(got) == writes
    assert audit.ok and audit.checked == writes - 1, audit.problems
    ops = sum(outcomes[k] for k in ("ok", "determinate", "indeterminate", "reads"))
    figures.operations_with_faults += ops
    figures.add_faults(write_faults.counts)
    figures.add_faults(read_faults.counts)
    figures.acknowledged_writes += writes
    figures.indeterminate_resolved += outcomes["indeterminate"]
    figures.note(f"acknowledged writes under faults on {kind}", **outcomes)
    assert write_faults.counts.injected > 0 and read_faults.counts.injected > 0


def _stacked(
    blob: Blob, consensus: Consensus
) -> tuple[FaultyBlob, FaultyConsensus, Faults, Faults]:
    """Commits land but their replies are lost (``after``), and reads fail (``reads``)."""
    after = Faults(fail_after=1.0, ops={"consensus.compare_and_set"})
    reads = Faults(fail_before=1.0, ops={"consensus.head", "consensus.scan"})
    return (
        FaultyBlob(blob, after),
        FaultyConsensus(FaultyConsensus(consensus, after), reads),
        after,
        reads,
    )


@pytest.mark.parametrize("kind", ["mem", "file+sqlite", "file+postgres"])
@pytest.mark.parametrize("api", ["compare_and_append", "append", "compare_and_append_batch"])
async def test_retrying_after_an_indeterminate_error_applies_once(
    kind: str,
    api: str,
    location_factory: Callable[[str], LocationFactory],
    figures: Figures,
    loop_lag: LoopLag,
) -> None:
    """Persist can't learn the outcome (every commit's reply is lost, every read fails): the
    caller is told it is indeterminate; retrying the same call once the location is healthy
    applies the write exactly once, whichever way it had gone."""
    location = location_factory(kind)
    blob, consensus = location()
    fb, fc, after, reads = _stacked(blob, consensus)
    shard = persist.ShardId.new()
    async with persist.PersistClient(fb, fc, machine_config()) as client:
        with after.suspended(), reads.suspended():
            write, read = await client.open(shard, SCHEMA)
            batch = await write.batch(row_table("b", 0, 0), 0, 1)

        async def call() -> None:
            if api == "compare_and_append":
                await write.compare_and_append(row_table("b", 0, 0), 0, 1)
            elif api == "append":
                await write.append(row_table("b", 0, 0), 0, 1)
            else:
                await write.compare_and_append_batch([batch], 0, 1)

        with pytest.raises(persist.ExternalError) as info:
            await call()
        assert info.value.determinate is False
        with after.suspended(), reads.suspended():
            if api == "append":
                await call()  # idempotent: returns at once, the upper being past it
            else:
                with pytest.raises(persist.UpperMismatch) as mismatch:
                    await call()
                assert mismatch.value.current == 1  # the first try had landed
            got = contents_of(await read.snapshot_and_fetch(0), SCHEMA.names, 0)
    assert got == {("b", 0): 1}
    figures.operations_with_faults += 1
    figures.add_faults(after.counts)
    figures.add_faults(reads.counts)
    figures.indeterminate_resolved += 1


# --- cancellation of the call under test ----------------------------------------------------------


async def test_cancel_hits_only_the_target_task_before_or_after_the_call() -> None:
    from persist.testing.cancel import CallCancelled, under_test

    blob = MemBlob()
    faults = Faults(seed=3, cancel=1.0)
    fb = FaultyBlob(blob, faults)
    spawned: list[asyncio.Task[None]] = []

    async def call() -> None:
        # A task the call spawns (as a heartbeat would) is not the target: never cancelled.
        spawned.append(asyncio.ensure_future(fb.set("bg/x", b"1")))
        await fb.set("a/b", b"x")

    outcomes = []
    for _ in range(20):
        try:
            await under_test(call(), faults)
            outcomes.append("ok")
        except CallCancelled:
            outcomes.append("cancelled")
    await asyncio.gather(*spawned)
    assert outcomes == ["cancelled"] * 20
    assert faults.counts.cancelled_before > 0 and faults.counts.cancelled_after > 0
    # Cancelled after it took effect: the key is there.
    assert await blob.get("a/b") == b"x" and await blob.get("bg/x") == b"1"
    # Without a target, nothing is cancelled.
    await fb.set("c/d", b"y")


async def test_cancel_after_k_iterations_and_one_shot_faults() -> None:
    from persist.testing.cancel import CallCancelled, under_test

    async def slow() -> int:
        for _ in range(100):
            await asyncio.sleep(0)
        return 1

    with pytest.raises(CallCancelled):
        await under_test(slow(), cancel_after=5)
    assert await under_test(slow(), cancel_after=1000) == 1
    consensus = MemConsensus()
    faults = Faults()
    fc = FaultyConsensus(consensus, faults)
    with pytest.raises(persist.ExternalError) as info:
        await under_test(
            fc.compare_and_set("k", None, b"d"), faults, lose_reply="consensus.compare_and_set"
        )
    assert info.value.determinate is False and await consensus.head("k") is not None
    with pytest.raises(CallCancelled):
        await under_test(
            fc.compare_and_set("k", 1, b"e"), faults, cancel_at="consensus.compare_and_set"
        )
    head = await consensus.head("k")
    assert head is not None and head.seqno == 1  # cancelled before it ran


async def test_loop_lag_sees_a_blocked_loop() -> None:
    import time

    async with LoopLag() as lag:
        await asyncio.sleep(0.005)
        time.sleep(0.02)  # blocks the loop: the next tick is late
        await asyncio.sleep(0.005)
    assert lag.ticks > 0 and lag.worst_ms > 0
