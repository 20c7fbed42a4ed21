"""The conformance suites every Blob and Consensus implementation must pass.

Subclass them in a ``Test...`` class and supply fixtures only::

    class TestMyBlob(BlobConformance):
        @pytest.fixture
        async def blob(self) -> AsyncIterator[Blob]:
            b = MyBlob(...)
            yield b
            await b.close()

``BlobConformance`` subclasses may override ``leave_partial_write`` (leaves what a writer killed
mid-``set`` leaves behind, for backends that leave anything). ``ConsensusConformance`` subclasses
provide ``consensus`` and may override ``consensus_uri`` (a URI that another process can pass to
:func:`persist.location.open_consensus` to reach the same location, enabling the cross-process
race), ``consensus_factory`` (independent instances over the same location, so racers use
separate connections) and ``consensus_write_lock`` (holds, from another connection, the lock a
compare-and-set waits for, so a cancellation can catch one mid-call). Never stub a test out; skip
it with a reason.

Every test works in a fresh random namespace (key prefix or consensus key), so a backend may
share one location between tests.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist.errors import InvalidUsage
from persist.location import Blob, Consensus, VersionedData, open_consensus

__all__ = [
    "BlobConformance",
    "ConsensusConformance",
    "ConsensusFactory",
    "ConsensusWriteLock",
    "PartialWrite",
]

_T = TypeVar("_T")

ConsensusFactory = Callable[[], Consensus]
"""Returns a new, independent handle on the location under test."""

ConsensusWriteLock = Callable[[str], AbstractAsyncContextManager[None]]
"""``lock(key)``: holds, from outside the instance under test, what a write of ``key`` waits for."""

PartialWrite = Callable[[Blob, str, float], Callable[[], bool]]
"""``leave(blob, key, age_s)``: leaves what a writer killed mid-``set(key)`` leaves, last touched
``age_s`` seconds ago; returns whether that leftover still exists."""

# Timeouts that cancel a call before it starts, and at various points while it runs.
_CANCEL_AFTER_S = [0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05]


async def _assert_stays(read: Callable[[], Awaitable[_T]], expected: _T, for_s: float) -> None:
    """Polls ``read`` for ``for_s`` seconds: it must keep answering ``expected``."""
    deadline = time.monotonic() + for_s
    while True:
        got = await read()
        assert got == expected, f"changed after the cancellation returned: {got!r} != {expected!r}"
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


_HYPOTHESIS = settings(
    max_examples=30,
    deadline=None,
    # The fixture is set up once per test, not per example; every example uses fresh keys.
    # The same test method runs on every backend's subclass by design (differing executors).
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.differing_executors],
)


def _namespace() -> str:
    return f"t-{uuid.uuid4().hex}/"


def _shard_key() -> str:
    return f"test-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------
# Blob


INVALID_KEYS = [
    "",
    "/abs",
    "a/../b",
    "../x",
    "..",
    ".",
    "./a",
    "a/.",
    "a//b",
    "a/",
    "a\\b",
    "a\x00b",
    "a\nb",
    "caf\u00e9",
    ".tmp-x",
    "a/.tmp-y",
]

# All at depth two, so no key is a directory of another (FileBlob maps keys to paths), while
# still covering prefix cases like ``a/x`` vs ``a/xy`` and ``a/`` vs ``ab/``.
_MODEL_KEYS = ["a/x", "a/xy", "a/y", "ab/x", "b/x"]
_MODEL_PREFIXES = ["", "a", "a/", "a/x", "ab", "b/", "c", "a/xy"]

_blob_ops = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(_MODEL_KEYS), st.binary(max_size=32)),
    st.tuples(st.just("get"), st.sampled_from(_MODEL_KEYS)),
    st.tuples(st.just("delete"), st.sampled_from(_MODEL_KEYS)),
    st.tuples(st.just("list"), st.sampled_from(_MODEL_PREFIXES)),
)


class BlobConformance:
    """Tests for a :class:`Blob`; subclasses provide an async fixture ``blob``."""

    # Explicit, so the suite also runs under pytest-asyncio's strict mode.
    pytestmark = pytest.mark.asyncio

    @pytest.fixture
    def leave_partial_write(self) -> PartialWrite | None:
        """Leaves a killed ``set``'s leftovers, if this backend leaves any (default: it doesn't)."""
        return None

    async def test_get_missing(self, blob: Blob) -> None:
        assert await blob.get(_namespace() + "missing") is None

    @pytest.mark.parametrize("size", [0, 1, 5 * 1024 * 1024], ids=["empty", "1B", "5MB"])
    async def test_roundtrip(self, blob: Blob, size: int) -> None:
        key = _namespace() + "value"
        value = os.urandom(size)
        await blob.set(key, value)
        got = await blob.get(key)
        assert type(got) is bytes
        assert got == value

    async def test_overwrite(self, blob: Blob) -> None:
        key = _namespace() + "value"
        await blob.set(key, b"first")
        await blob.set(key, b"second")
        assert await blob.get(key) == b"second"

    async def test_overwrite_is_atomic(self, blob: Blob) -> None:
        key = _namespace() + "value"
        # Different lengths and contents, so a torn or partial read cannot equal any of them.
        values = [bytes([65 + i]) * (150_000 + 70_000 * i) for i in range(3)]
        await blob.set(key, values[0])
        writing = True
        reads = 0

        async def reader() -> None:
            nonlocal reads
            while writing:
                got = await blob.get(key)
                assert got in values, f"read a value of {None if got is None else len(got)} bytes"
                reads += 1
                await asyncio.sleep(0)

        async def writer() -> None:
            nonlocal writing
            try:
                for i in range(1, 31):
                    await blob.set(key, values[i % 3])
                    await asyncio.sleep(0)
            finally:
                writing = False

        await asyncio.gather(writer(), *(reader() for _ in range(4)))
        assert reads > 0
        assert await blob.get(key) == values[30 % 3]

    async def test_delete_is_idempotent(self, blob: Blob) -> None:
        ns = _namespace()
        await blob.delete(ns + "never-written")
        await blob.set(ns + "k", b"v")
        await blob.set(ns + "other", b"w")
        await blob.delete(ns + "k")
        assert await blob.get(ns + "k") is None
        await blob.delete(ns + "k")
        assert await blob.get(ns + "other") == b"w"
        assert await blob.list_keys(ns) == [ns + "other"]

    async def test_list_keys_prefix(self, blob: Blob) -> None:
        ns = _namespace()
        names = ["a/b/c", "a/bc", "a/c", "ab", "b/x", "b/y/z/w"]
        for name in reversed(names):
            await blob.set(ns + name, name.encode())

        async def listed(prefix: str) -> list[str]:
            keys = await blob.list_keys(ns + prefix)
            assert keys == sorted(keys)
            return [k.removeprefix(ns) for k in keys]

        assert await listed("") == names
        # A prefix is a string prefix, not a path: "a/b" matches "a/b/c" and "a/bc".
        assert await listed("a/b") == ["a/b/c", "a/bc"]
        assert await listed("a/b/") == ["a/b/c"]
        assert await listed("a/") == ["a/b/c", "a/bc", "a/c"]
        assert await listed("a") == ["a/b/c", "a/bc", "a/c", "ab"]
        assert await listed("ab") == ["ab"]
        assert await listed("b/y/z/w") == ["b/y/z/w"]
        assert await listed("b/y/z/w/") == []
        assert await listed("zz") == []
        everything = await blob.list_keys("")
        assert everything == sorted(everything)
        assert {ns + n for n in names} <= set(everything)

    async def test_list_keys_impossible_prefix(self, blob: Blob) -> None:
        ns = _namespace()
        await blob.set(ns + "a", b"v")
        for prefix in ["/", "../", "/" + ns, ns + "/", ns + "./", ns + "../", "\\", ".tmp-"]:
            assert await blob.list_keys(prefix) == [], prefix

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    async def test_invalid_key_rejected(self, blob: Blob, key: str) -> None:
        before = await blob.list_keys("")
        with pytest.raises(InvalidUsage):
            await blob.set(key, b"nope")
        with pytest.raises(InvalidUsage):
            await blob.get(key)
        with pytest.raises(InvalidUsage):
            await blob.delete(key)
        assert await blob.list_keys("") == before

    async def test_cancelled_set_is_settled(self, blob: Blob) -> None:
        # When a cancelled set returns, it has landed or never will: the key's presence is what
        # a read right after the cancellation says, for good.
        ns = _namespace()
        value = os.urandom(4 * 1024 * 1024)
        present_at_cancel: dict[str, bool] = {}
        for i, timeout in enumerate(_CANCEL_AFTER_S):
            key = f"{ns}k{i}"
            try:
                await asyncio.wait_for(blob.set(key, value), timeout)
            except TimeoutError:
                present_at_cancel[key] = key in await blob.list_keys(key)
        assert present_at_cancel, "no set was cancelled"

        async def present() -> dict[str, bool]:
            listed = set(await blob.list_keys(ns))
            return {k: k in listed for k in present_at_cancel}

        await _assert_stays(present, present_at_cancel, for_s=0.5)
        for key, there in present_at_cancel.items():
            if there:
                assert await blob.get(key) == value

    async def test_delete_partial_writes(
        self, blob: Blob, leave_partial_write: PartialWrite | None
    ) -> None:
        ns, other = _namespace(), _namespace()
        keys = [ns + "a/x", ns + "a/b/y", ns + "z", other + "k"]
        for key in keys:
            await blob.set(key, key.encode())
        if leave_partial_write is None:
            assert await blob.delete_partial_writes(ns, 0.0) == 0
        else:
            hour = 3600.0
            old_in_a = leave_partial_write(blob, ns + "a/x2", hour)
            old_in_ab = [leave_partial_write(blob, ns + k, hour) for k in ("a/b/y2", "a/b/c/d/e")]
            old_top = leave_partial_write(blob, ns + "top", hour)
            fresh = leave_partial_write(blob, ns + "a/b/fresh", 0.0)
            elsewhere = leave_partial_write(blob, other + "old", hour)
            # A prefix ending mid-segment: a leftover in ns/a/ may belong to a key outside it.
            assert await blob.delete_partial_writes(ns + "a/b", 600.0) == len(old_in_ab)
            assert not any(exists() for exists in old_in_ab)
            assert old_in_a() and old_top() and fresh()
            assert await blob.delete_partial_writes(ns, 600.0) == 2
            assert not old_in_a() and not old_top()
            assert fresh(), "a leftover younger than the age may be a live set's"
            assert elsewhere(), "outside the prefix"
            assert await blob.delete_partial_writes(ns, 600.0) == 0
        for key in keys:
            assert await blob.get(key) == key.encode()
        assert await blob.list_keys(ns) == sorted(k for k in keys if k.startswith(ns))
        assert await blob.delete_partial_writes("/impossible", 0.0) == 0

    @_HYPOTHESIS
    @given(ops=st.lists(_blob_ops, max_size=25))
    async def test_matches_dict_model(self, blob: Blob, ops: list[tuple[Any, ...]]) -> None:
        ns = _namespace()
        model: dict[str, bytes] = {}
        for op in ops:
            if op[0] == "set":
                await blob.set(ns + op[1], op[2])
                model[op[1]] = op[2]
            elif op[0] == "get":
                assert await blob.get(ns + op[1]) == model.get(op[1]), op
            elif op[0] == "delete":
                await blob.delete(ns + op[1])
                model.pop(op[1], None)
            else:
                got = await blob.list_keys(ns + op[1])
                assert got == sorted(ns + k for k in model if k.startswith(op[1])), op


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
        key = _shard_key()
        assert await consensus.head(key) is None
        assert await consensus.scan(key, 0, 10) == []

    async def test_first_cas(self, consensus: Consensus) -> None:
        key = _shard_key()
        assert await consensus.compare_and_set(key, None, b"one")
        head = await consensus.head(key)
        assert head == VersionedData(seqno=1, data=b"one")
        assert head is not None and type(head.data) is bytes

    async def test_wrong_expected_writes_nothing(self, consensus: Consensus) -> None:
        key = _shard_key()
        for expected in (0, 1, 2):
            assert not await consensus.compare_and_set(key, expected, b"bad")
        assert await consensus.head(key) is None
        assert await consensus.compare_and_set(key, None, b"one")
        for wrong in (None, 0, 2, 3):
            assert not await consensus.compare_and_set(key, wrong, b"bad")
        assert await consensus.scan(key, 0, 10) == [VersionedData(seqno=1, data=b"one")]

    async def test_cas_chain(self, consensus: Consensus) -> None:
        key = _shard_key()
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
        key = _shard_key()
        assert await consensus.compare_and_set(key, None, data)
        assert await consensus.head(key) == VersionedData(seqno=1, data=data)
        assert await consensus.scan(key, 1, 1) == [VersionedData(seqno=1, data=data)]

    async def test_scan(self, consensus: Consensus) -> None:
        key = _shard_key()
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
        key = _shard_key()
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
        a, b = _shard_key(), _shard_key()
        assert await consensus.compare_and_set(a, None, b"a1")
        assert await consensus.compare_and_set(a, 1, b"a2")
        assert await consensus.head(b) is None
        assert await consensus.compare_and_set(b, None, b"b1")
        assert await consensus.truncate(a, 2) == 1
        assert await consensus.scan(b, 0, 10) == [VersionedData(seqno=1, data=b"b1")]
        assert await consensus.head(a) == VersionedData(seqno=2, data=b"a2")

    @_HYPOTHESIS
    @given(ops=st.lists(_consensus_ops, max_size=25))
    async def test_matches_list_model(
        self, consensus: Consensus, ops: list[tuple[Any, ...]]
    ) -> None:
        key = _shard_key()
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
        key = _shard_key()
        assert await consensus.compare_and_set(key, None, b"0")
        cancelled = 0
        for i, timeout in enumerate(_CANCEL_AFTER_S):
            head = await observer.head(key)
            assert head is not None
            try:
                await asyncio.wait_for(
                    consensus.compare_and_set(key, head.seqno, b"%d" % (i + 1)), timeout
                )
            except TimeoutError:
                cancelled += 1
                await _assert_stays(lambda: observer.head(key), await observer.head(key), 0.1)
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
        key = _shard_key()
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
        await _assert_stays(lambda: observer.head(key), unchanged, for_s=0.5)
        started = time.monotonic()
        assert await consensus.compare_and_set(key, 1, b"2")
        assert time.monotonic() - started < 5.0, "the cancelled call still holds up the next"
        assert await consensus.head(key) == VersionedData(seqno=2, data=b"2")

    async def test_concurrent_cas_race(
        self, consensus: Consensus, consensus_factory: ConsensusFactory
    ) -> None:
        key = _shard_key()
        racers = [consensus_factory() for _ in range(8)]
        rounds = 6
        barrier = asyncio.Barrier(len(racers))
        wins: list[VersionedData] = []

        async def race(racer: int, c: Consensus) -> None:
            for i in range(rounds):
                await barrier.wait()
                head = await c.head(key)
                expected = None if head is None else head.seqno
                # Let every racer read the head before anyone writes, even on backends whose
                # methods never yield to the event loop.
                await asyncio.sleep(0)
                data = f"{racer}:{i}".encode()
                if await c.compare_and_set(key, expected, data):
                    wins.append(VersionedData(seqno=(expected or 0) + 1, data=data))

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
        key = _shard_key()
        racers = [consensus_factory() for _ in range(6)]
        truncator = consensus_factory()
        wins: list[VersionedData] = []
        racing = True

        async def race(racer: int, c: Consensus) -> None:
            for i in range(15):
                head = await c.head(key)
                expected = None if head is None else head.seqno
                await asyncio.sleep(0)
                data = f"{racer}:{i}".encode()
                if await c.compare_and_set(key, expected, data):
                    wins.append(VersionedData(seqno=(expected or 0) + 1, data=data))

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
        key = _shard_key()
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
