"""The conformance suite every Consensus implementation must pass."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from persist.errors import InvalidUsage
from persist.location import Consensus, VersionedData, open_consensus
from persist.location.testing._common import (
    CANCEL_AFTER_S,
    HYPOTHESIS,
    ConsensusFactory,
    ConsensusWriteLock,
    assert_stays,
    shard_key,
)

# --------------------------------------------------------------------------------------------
# Consensus

_consensus_ops = st.one_of(
    st.tuples(st.just("cas"), st.binary(max_size=16)),
    st.tuples(st.just("cas_wrong"), st.sampled_from([-2, -1, 1, 2, 0])),
    st.tuples(st.just("scan"), st.integers(0, 12), st.integers(0, 5)),
    st.tuples(st.just("truncate"), st.integers(-1, 3)),
    st.tuples(st.just("head")),
)


class ConsensusConformance:
    """Tests for a :class:`Consensus`; subclasses provide an async fixture ``consensus``."""

    pytestmark = pytest.mark.asyncio

    # Whether the backend under test pushes changes (``Consensus.watch``): then it must.
    pushes_changes = False

    @pytest.fixture
    def consensus_uri(self) -> str | None:
        """A URI reaching the location of ``consensus`` from another process, if there is one."""
        return None

    @pytest_asyncio.fixture
    async def consensus_factory(
        self, consensus: Consensus, consensus_uri: str | None
    ) -> AsyncIterator[ConsensusFactory]:
        """Independent handles on the location of ``consensus`` (default: opened from the URI)."""
        if consensus_uri is None:
            yield lambda: consensus
            return
        uri = consensus_uri
        made: list[Consensus] = []

        def make() -> Consensus:
            c = open_consensus(uri)
            made.append(c)
            return c

        try:
            yield make
        finally:
            for c in made:
                await c.close()

    @pytest.fixture
    def consensus_write_lock(self) -> ConsensusWriteLock | None:
        """Holds what a compare-and-set waits for, from another connection (None: no such lock)."""
        return None

    async def test_head_of_empty_key(self, consensus: Consensus) -> None:
        key = shard_key()
        assert await consensus.head(key) is None
        assert await consensus.scan(key, 0, 10) == []

    async def test_first_cas(self, consensus: Consensus) -> None:
        key = shard_key()
        assert await consensus.compare_and_set(key, None, b"one")
        head = await consensus.head(key)
        assert head == VersionedData(seqno=1, data=b"one")
        assert head is not None and type(head.data) is bytes

    async def test_wrong_expected_writes_nothing(self, consensus: Consensus) -> None:
        key = shard_key()
        for expected in (0, 1, 2):
            assert not await consensus.compare_and_set(key, expected, b"bad")
        assert await consensus.head(key) is None
        assert await consensus.compare_and_set(key, None, b"one")
        for wrong in (None, 0, 2, 3):
            assert not await consensus.compare_and_set(key, wrong, b"bad")
        assert await consensus.scan(key, 0, 10) == [VersionedData(seqno=1, data=b"one")]

    async def test_cas_chain(self, consensus: Consensus) -> None:
        key = shard_key()
        expected: int | None = None
        for i in range(10):
            assert await consensus.compare_and_set(key, expected, b"v%d" % i)
            expected = i + 1
        assert await consensus.head(key) == VersionedData(seqno=10, data=b"v9")
        assert await consensus.scan(key, 1, 100) == [
            VersionedData(seqno=i + 1, data=b"v%d" % i) for i in range(10)
        ]

    @pytest.mark.parametrize(
        "data",
        [b"", bytes(range(256)), b"\x00" * 7, os.urandom(1024 * 1024)],
        ids=["empty", "all-bytes", "nuls", "1MB"],
    )
    async def test_data_roundtrip(self, consensus: Consensus, data: bytes) -> None:
        key = shard_key()
        assert await consensus.compare_and_set(key, None, data)
        assert await consensus.head(key) == VersionedData(seqno=1, data=data)
        assert await consensus.scan(key, 1, 1) == [VersionedData(seqno=1, data=data)]

    async def test_scan(self, consensus: Consensus) -> None:
        key = shard_key()
        entries = [VersionedData(seqno=i, data=b"%d" % i) for i in range(1, 6)]
        for e in entries:
            assert await consensus.compare_and_set(key, e.seqno - 1 or None, e.data)
        assert await consensus.scan(key, 1, 0) == []
        assert await consensus.scan(key, 1, 2) == entries[:2]
        assert await consensus.scan(key, 3, 10) == entries[2:]
        assert await consensus.scan(key, 5, 10) == entries[4:]
        assert await consensus.scan(key, 6, 10) == []
        assert await consensus.scan(key, 0, 100) == entries
        assert await consensus.scan(key, -5, 100) == entries
        with pytest.raises(InvalidUsage):
            await consensus.scan(key, 1, -1)

    async def test_truncate(self, consensus: Consensus) -> None:
        key = shard_key()
        with pytest.raises(InvalidUsage):
            await consensus.truncate(key, 1)
        for i in range(1, 6):
            assert await consensus.compare_and_set(key, i - 1 or None, b"%d" % i)
        assert await consensus.truncate(key, 1) == 0
        assert await consensus.truncate(key, 3) == 2
        assert [e.seqno for e in await consensus.scan(key, 0, 10)] == [3, 4, 5]
        assert await consensus.truncate(key, 3) == 0
        assert await consensus.truncate(key, 2) == 0
        with pytest.raises(InvalidUsage):
            await consensus.truncate(key, 6)
        assert [e.seqno for e in await consensus.scan(key, 0, 10)] == [3, 4, 5]
        # Truncating up to the head keeps the head.
        assert await consensus.truncate(key, 5) == 2
        assert await consensus.scan(key, 0, 10) == [VersionedData(seqno=5, data=b"5")]
        assert await consensus.head(key) == VersionedData(seqno=5, data=b"5")
        # The log continues from the head, and None still means "no entry ever".
        assert not await consensus.compare_and_set(key, None, b"again")
        assert await consensus.compare_and_set(key, 5, b"6")
        assert await consensus.head(key) == VersionedData(seqno=6, data=b"6")

    async def test_keys_are_independent(self, consensus: Consensus) -> None:
        a, b = shard_key(), shard_key()
        assert await consensus.compare_and_set(a, None, b"a1")
        assert await consensus.compare_and_set(a, 1, b"a2")
        assert await consensus.head(b) is None
        assert await consensus.compare_and_set(b, None, b"b1")
        assert await consensus.truncate(a, 2) == 1
        assert await consensus.scan(b, 0, 10) == [VersionedData(seqno=1, data=b"b1")]
        assert await consensus.head(a) == VersionedData(seqno=2, data=b"a2")

    @HYPOTHESIS
    @given(ops=st.lists(_consensus_ops, max_size=25))
    async def test_matches_list_model(
        self, consensus: Consensus, ops: list[tuple[Any, ...]]
    ) -> None:
        key = shard_key()
        model: list[VersionedData] = []  # never empties once written: the head is kept
        for op in ops:
            current = model[-1].seqno if model else None
            if op[0] == "cas":
                assert await consensus.compare_and_set(key, current, op[1]), op
                model.append(VersionedData(seqno=(current or 0) + 1, data=op[1]))
            elif op[0] == "cas_wrong":
                if op[1] == 0:
                    wrong = None if current is not None else 1
                else:
                    wrong = (current or 0) + op[1]
                assert not await consensus.compare_and_set(key, wrong, b"wrong"), op
            elif op[0] == "scan":
                _, from_seqno, limit = op
                expected = [e for e in model if e.seqno >= from_seqno][:limit]
                assert await consensus.scan(key, from_seqno, limit) == expected, op
            elif op[0] == "truncate":
                seqno = (current or 0) - op[1]
                if current is None or seqno > current:
                    with pytest.raises(InvalidUsage):
                        await consensus.truncate(key, seqno)
                else:
                    kept = [e for e in model if e.seqno >= seqno]
                    assert await consensus.truncate(key, seqno) == len(model) - len(kept), op
                    model = kept
            else:
                assert await consensus.head(key) == (model[-1] if model else None), op
        assert await consensus.scan(key, 0, 1000) == model

    async def test_cancelled_cas_is_settled(
        self, consensus: Consensus, consensus_factory: ConsensusFactory
    ) -> None:
        # When a cancelled CAS returns, it has landed or never will: the head is what a read
        # right after the cancellation says, for good. Read through another handle, so the
        # reads can't queue behind whatever the cancelled call left running.
        observer = consensus_factory()
        key = shard_key()
        assert await consensus.compare_and_set(key, None, b"0")
        cancelled = 0
        for i, timeout in enumerate(CANCEL_AFTER_S):
            head = await observer.head(key)
            assert head is not None
            try:
                await asyncio.wait_for(
                    consensus.compare_and_set(key, head.seqno, b"%d" % (i + 1)), timeout
                )
            except TimeoutError:
                cancelled += 1
                await assert_stays(lambda: observer.head(key), await observer.head(key), 0.1)
        assert cancelled, "no compare-and-set was cancelled"
        head = await consensus.head(key)
        assert head is not None
        assert await consensus.compare_and_set(key, head.seqno, b"still usable")

    @pytest.mark.parametrize("cancels", [1, 2], ids=["once", "twice"])
    async def test_cancelled_cas_waiting_for_the_lock_never_lands(
        self,
        consensus: Consensus,
        consensus_factory: ConsensusFactory,
        consensus_write_lock: ConsensusWriteLock | None,
        cancels: int,
    ) -> None:
        if consensus_write_lock is None:
            pytest.skip("this backend has no lock another connection can hold")
        observer = consensus_factory()
        key = shard_key()
        first = VersionedData(seqno=1, data=b"1")
        assert await consensus.compare_and_set(key, None, first.data)
        async with consensus_write_lock(key):
            cas = asyncio.create_task(consensus.compare_and_set(key, 1, b"late"))
            await asyncio.sleep(0.5)
            assert not cas.done(), "the compare-and-set did not wait for the lock"
            started = time.monotonic()
            for _ in range(cancels):
                cas.cancel()
                # A second cancellation lands while the first one is being settled.
                await asyncio.sleep(0)
            with pytest.raises(asyncio.CancelledError):
                await cas
            assert time.monotonic() - started < 5.0, "the cancellation waited out the lock"
            assert await observer.head(key) == first
        # The lock is gone: a call still pending anywhere would land now.
        unchanged: VersionedData | None = first
        await assert_stays(lambda: observer.head(key), unchanged, for_s=0.5)
        started = time.monotonic()
        assert await consensus.compare_and_set(key, 1, b"2")
        assert time.monotonic() - started < 5.0, "the cancelled call still holds up the next"
        assert await consensus.head(key) == VersionedData(seqno=2, data=b"2")

    # --- pushed changes (Consensus.watch) ------------------------------------------------------

    async def test_watch_pushes_changes_made_through_another_instance(
        self, consensus: Consensus, consensus_factory: ConsensusFactory
    ) -> None:
        key, other_key = shard_key(), shard_key()
        pushes = _Pushes()
        stop = consensus.watch(key, pushes)
        if stop is None:
            assert not self.pushes_changes, "watch returned None: this backend pushes nothing"
            pytest.skip("this backend does not push changes")
        try:
            other = consensus_factory()
            data = {1: b"one", 2: b"two", 3: b"three"}
            assert await other.compare_and_set(key, None, data[1])
            # A backend may have missed this one while its watch was being set up, and then
            # says so with a (None, None) push.
            await pushes.wait(lambda seen: bool(seen))
            pushes.seen.clear()
            assert await other.compare_and_set(other_key, None, b"elsewhere")
            assert await other.compare_and_set(key, 1, data[2])
            assert await other.compare_and_set(key, 2, data[3])
            await pushes.wait(lambda seen: any(seqno == 3 for seqno, _ in seen))
            for seqno, pushed in pushes.seen:
                assert seqno is None or seqno in data, pushes.seen
                assert pushed is None or (seqno is not None and pushed == data[seqno]), (
                    "a push carries the data of the entry it names, and only this key's"
                )
        finally:
            stop()

    async def test_a_stopped_watch_hears_nothing(self, consensus: Consensus) -> None:
        key = shard_key()
        pushes = _Pushes()
        stop = consensus.watch(key, pushes)
        if stop is None:
            assert not self.pushes_changes, "watch returned None: this backend pushes nothing"
            pytest.skip("this backend does not push changes")
        assert await consensus.compare_and_set(key, None, b"a")
        await pushes.wait(lambda seen: bool(seen))
        stop()
        await asyncio.sleep(0.2)  # pushes already on their way may still land
        pushes.seen.clear()
        assert await consensus.compare_and_set(key, 1, b"b")
        await asyncio.sleep(0.5)
        assert pushes.seen == []

    async def test_concurrent_cas_race(
        self, consensus: Consensus, consensus_factory: ConsensusFactory
    ) -> None:
        key = shard_key()
        racers = [consensus_factory() for _ in range(8)]
        rounds = 6
        barrier = asyncio.Barrier(len(racers))
        wins: list[VersionedData] = []

        async def race(racer: int, c: Consensus) -> None:
            for i in range(rounds):
                await barrier.wait()
                if won := await _cas_on_head(c, key, f"{racer}:{i}".encode()):
                    wins.append(won)

        await asyncio.gather(*(race(r, c) for r, c in enumerate(racers)))
        seqnos = [w.seqno for w in wins]
        assert len(seqnos) == len(set(seqnos)), "two writers won the same seqno"
        log = await consensus.scan(key, 0, 10_000)
        assert log == sorted(wins, key=lambda w: w.seqno)
        assert [e.seqno for e in log] == list(range(1, len(log) + 1))
        # Each round starts on a settled head, so its first writer wins.
        assert len(log) >= rounds

    async def test_concurrent_cas_with_truncate(
        self, consensus: Consensus, consensus_factory: ConsensusFactory
    ) -> None:
        key = shard_key()
        racers = [consensus_factory() for _ in range(6)]
        truncator = consensus_factory()
        wins: list[VersionedData] = []
        racing = True

        async def race(racer: int, c: Consensus) -> None:
            for i in range(15):
                if won := await _cas_on_head(c, key, f"{racer}:{i}".encode()):
                    wins.append(won)

        async def truncate() -> None:
            while racing:
                head = await truncator.head(key)
                if head is not None:
                    await truncator.truncate(key, head.seqno)
                await asyncio.sleep(0)

        truncating = asyncio.create_task(truncate())
        try:
            await asyncio.gather(*(race(r, c) for r, c in enumerate(racers)))
        finally:
            racing = False
            await truncating
        wins.sort(key=lambda w: w.seqno)
        assert [w.seqno for w in wins] == list(range(1, len(wins) + 1)), (
            "winners' seqnos must be distinct and gapless"
        )
        log = await consensus.scan(key, 0, 10_000)
        assert log, "the head is never truncated"
        assert log == wins[len(wins) - len(log) :]

    async def test_cross_process_cas_race(
        self, consensus: Consensus, consensus_uri: str | None
    ) -> None:
        if consensus_uri is None:
            pytest.skip("this backend has no location another process can open")
        key = shard_key()
        processes, rounds = 4, 25
        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(processes)
        results: Any = ctx.Queue()
        procs = [
            ctx.Process(
                target=_race_in_process,
                args=(consensus_uri, key, racer, rounds, barrier, results),
                daemon=True,
            )
            for racer in range(processes)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = await asyncio.to_thread(_collect, results, procs, 300.0)
        finally:
            for p in procs:
                await asyncio.to_thread(p.join, 30)
                if p.is_alive():
                    p.kill()
        failures = [f"racer {r}: {err}" for r, _, err in outcomes if err is not None]
        assert not failures, failures
        log = await consensus.scan(key, 0, 100_000)
        assert [e.seqno for e in log] == list(range(1, len(log) + 1))
        assert len(log) >= rounds
        total = 0
        for racer, claimed, _ in outcomes:
            assert claimed is not None
            mine = [e.seqno for e in log if e.data.split(b":")[0] == str(racer).encode()]
            assert sorted(claimed) == mine, f"racer {racer}"
            total += len(claimed)
        assert total == len(log)


def _collect(
    results: Any, procs: list[Any], timeout: float
) -> list[tuple[int, list[int] | None, str | None]]:
    """One result per process; fails fast when a process died without reporting one."""
    outcomes: list[tuple[int, list[int] | None, str | None]] = []
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(procs):
        try:
            outcomes.append(results.get(timeout=0.5))
        except queue.Empty:
            crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not crashed, f"racer processes crashed with exit codes {crashed}"
            assert time.monotonic() < deadline, "racer processes did not finish in time"
    return outcomes


def _race_in_process(
    uri: str, key: str, racer: int, rounds: int, barrier: Any, results: Any
) -> None:
    """Process entry point of the cross-process race: reports ``(racer, won seqnos, error)``."""
    try:
        barrier.wait(timeout=120)
        won = asyncio.run(_race(uri, key, racer, rounds))
    except BaseException as exc:
        results.put((racer, None, repr(exc)))
    else:
        results.put((racer, won, None))


async def _race(uri: str, key: str, racer: int, rounds: int) -> list[int]:
    consensus = open_consensus(uri)
    won: list[int] = []
    try:
        for i in range(rounds):
            head = await consensus.head(key)
            expected = None if head is None else head.seqno
            if await consensus.compare_and_set(key, expected, f"{racer}:{i}".encode()):
                won.append((expected or 0) + 1)
    finally:
        await consensus.close()
    return won


async def _cas_on_head(c: Consensus, key: str, data: bytes) -> VersionedData | None:
    """Reads the head and appends ``data`` after it; the entry written, or None if it lost."""
    head = await c.head(key)
    expected = None if head is None else head.seqno
    # Let every racer read the head before anyone writes, even on backends whose methods never
    # yield to the event loop.
    await asyncio.sleep(0)
    if await c.compare_and_set(key, expected, data):
        return VersionedData(seqno=(expected or 0) + 1, data=data)
    return None


class _Pushes:
    """A watch callback that records what it was told and lets a test wait for it."""

    def __init__(self) -> None:
        self.seen: list[tuple[int | None, bytes | None]] = []
        self._event = asyncio.Event()

    def __call__(self, seqno: int | None, data: bytes | None) -> None:
        self.seen.append((seqno, data))
        self._event.set()

    async def wait(
        self, done: Callable[[list[tuple[int | None, bytes | None]]], bool], timeout_s: float = 10
    ) -> None:
        async with asyncio.timeout(timeout_s):
            while not done(self.seen):
                self._event.clear()
                await self._event.wait()
