"""Fault injection: wrappers around any Blob and Consensus that misbehave on purpose.

``Faults`` is the shared configuration and tally; ``FaultyBlob`` and ``FaultyConsensus`` wrap a
real location and consult it on every call::

    faults = Faults(seed=7, fail_before=0.1, fail_after=0.05, latency_s=(0.0, 0.002))
    client = persist.PersistClient(
        FaultyBlob(blob, faults), FaultyConsensus(consensus, faults), config
    )

A call is, in order: held while the faults are paused (``pause()`` / ``resume()``), delayed by
a latency drawn from ``latency_s``, then, with probability ``fail_before``, failed *before* it
reaches the location (a determinate ``ExternalError``: it certainly did not happen). Otherwise
it runs, and a call that changes the location (``Blob.set``/``delete``,
``Consensus.compare_and_set``/``truncate``) is, with probability ``fail_after``, failed *after*
it took effect: an indeterminate ``ExternalError`` (``determinate=False``), like a reply lost
on the way back. Reads have no effect to lose, so only ``fail_before`` applies to them.

With probability ``cancel``, a call made *by the task under test* (``target(task)``; never by
the tasks it spawns, such as heartbeats and maintenance) cancels that task for real, either
before the call runs or after it took effect, as a caller's ``task.cancel()`` (a timeout, a
shutdown) would land while persist awaits its location. ``lose_next_reply(op)`` makes the next
successful ``op`` of the target fail after taking effect, once (a scripted indeterminate error).

Every draw comes from one ``random.Random(seed)``, so a run that makes the same calls in the same
order gets the same faults. ``suspended()`` turns failures, cancellations and latency off for a
block (a checker that must read the truth); ``counts`` says what was injected. ``cancel_next(op)`` cancels the
target at its next ``op``, before it runs, once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from persist.errors import ExternalError
from persist.location import Blob, Consensus, Pushed, VersionedData

__all__ = ["BLOB_OPS", "CONSENSUS_OPS", "FaultCounts", "Faults", "FaultyBlob", "FaultyConsensus"]

T = TypeVar("T")

BLOB_OPS = frozenset({"blob.get", "blob.set", "blob.delete", "blob.list_keys"})
CONSENSUS_OPS = frozenset(
    {"consensus.head", "consensus.compare_and_set", "consensus.scan", "consensus.truncate"}
)
_MUTATING = frozenset(
    {"blob.set", "blob.delete", "consensus.compare_and_set", "consensus.truncate"}
)


@dataclass
class FaultCounts:
    """What a ``Faults`` did. ``by_op`` counts the injected failures of each operation."""

    calls: int = 0
    failed_before: int = 0
    failed_after: int = 0
    delayed: int = 0
    held: int = 0
    cancelled_before: int = 0
    cancelled_after: int = 0
    pushes_dropped: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def injected(self) -> int:
        return self.failed_before + self.failed_after

    @property
    def cancelled(self) -> int:
        return self.cancelled_before + self.cancelled_after

    def add(self, other: FaultCounts) -> None:
        self.calls += other.calls
        self.failed_before += other.failed_before
        self.failed_after += other.failed_after
        self.delayed += other.delayed
        self.held += other.held
        self.cancelled_before += other.cancelled_before
        self.cancelled_after += other.cancelled_after
        self.pushes_dropped += other.pushes_dropped
        for op, n in other.by_op.items():
            self.by_op[op] = self.by_op.get(op, 0) + n


def _fraction(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1], not {value!r}")
    return float(value)


class Faults:
    """The faults to inject into the wrapped locations, and a tally of those injected.

    ``ops`` limits failures (not latency or pauses) to the named operations, e.g.
    ``{"consensus.compare_and_set"}``; see ``BLOB_OPS`` and ``CONSENSUS_OPS``.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        fail_before: float = 0.0,
        fail_after: float = 0.0,
        cancel: float = 0.0,
        latency_s: tuple[float, float] = (0.0, 0.0),
        ops: Iterable[str] | None = None,
    ) -> None:
        self.fail_before = _fraction("fail_before", fail_before)
        self.fail_after = _fraction("fail_after", fail_after)
        if self.fail_before + self.fail_after > 1.0:
            raise ValueError("fail_before + fail_after must not exceed 1")
        self.cancel = _fraction("cancel", cancel)
        lo, hi = latency_s
        if not 0.0 <= lo <= hi:
            raise ValueError(
                f"latency_s must be (low, high) with 0 <= low <= high, not {latency_s}"
            )
        self.latency_s = (float(lo), float(hi))
        known = BLOB_OPS | CONSENSUS_OPS
        self.ops = known if ops is None else frozenset(ops)
        if not self.ops <= known:
            raise ValueError(
                f"unknown operations {sorted(self.ops - known)}; known: {sorted(known)}"
            )
        self.seed = seed
        self.rng = random.Random(seed)
        self.counts = FaultCounts()
        self._suspended = 0
        self._paused = False
        self._held: list[asyncio.Future[None]] = []
        self._target: asyncio.Task[Any] | None = None
        self._lose_reply: set[str] = set()
        self._cancel_next: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"Faults(seed={self.seed}, fail_before={self.fail_before}, "
            f"fail_after={self.fail_after}, cancel={self.cancel}, latency_s={self.latency_s})"
        )

    # --- the task under test -------------------------------------------------------------------

    @contextmanager
    def target(self, task: asyncio.Task[Any]) -> Iterator[None]:
        """Within the block, ``cancel`` and ``lose_next_reply`` apply to calls made by ``task``.

        Identity, not a contextvar: tasks the call spawns inherit its context, and cancelling
        a heartbeat or a compaction is not what a caller's cancellation does.
        """
        previous, self._target = self._target, task
        try:
            yield
        finally:
            self._target = previous
            self._lose_reply.clear()
            self._cancel_next.clear()

    def lose_next_reply(self, op: str) -> None:
        """The target's next ``op`` that takes effect fails after it, indeterminately (once)."""
        if op not in _MUTATING:
            raise ValueError(f"only a call that changes the location has a reply to lose: {op}")
        self._lose_reply.add(op)

    def cancel_next(self, op: str) -> None:
        """The target's next ``op`` cancels it before the call runs (once)."""
        if op not in BLOB_OPS | CONSENSUS_OPS:
            raise ValueError(f"unknown operation {op}")
        self._cancel_next.add(op)

    def _is_target(self) -> bool:
        task = self._target
        return task is not None and asyncio.current_task() is task and not task.done()

    @property
    def active(self) -> bool:
        """Whether calls may currently fail or be cancelled (a fraction is set, not suspended)."""
        return not self._suspended and (
            self.fail_before > 0 or self.fail_after > 0 or self.cancel > 0
        )

    # --- pausing -------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def waiting(self) -> int:
        """How many calls are held by the pause right now."""
        return sum(1 for f in self._held if not f.done())

    def pause(self) -> None:
        """Holds every call that starts from now on until ``resume()`` (calls in flight go on)."""
        self._paused = True

    def resume(self) -> None:
        """Lets the held calls go on. Safe to call from any thread."""
        self._paused = False
        held, self._held = self._held, []
        for fut in held:
            if not fut.done():
                fut.get_loop().call_soon_threadsafe(_release, fut)

    # --- suspending ----------------------------------------------------------------------------

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Within the block, calls neither fail nor wait for latency (pauses still hold)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # --- the call path -------------------------------------------------------------------------

    async def call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs ``fn`` (the real call of operation ``op``) with the faults applied."""
        if self._paused:
            self.counts.held += 1
            while self._paused:
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._held.append(fut)
                await fut
        self.counts.calls += 1
        if not self._suspended:
            lo, hi = self.latency_s
            if hi > 0:
                self.counts.delayed += 1
                await asyncio.sleep(self.rng.uniform(lo, hi))
        targeted = not self._suspended and self._is_target()
        cancel_before = cancel_after = False
        if targeted and op in self._cancel_next:
            self._cancel_next.discard(op)
            cancel_before = True
        elif targeted and self.cancel:
            x = self.rng.random()
            cancel_before = x < self.cancel / 2
            cancel_after = not cancel_before and x < self.cancel
        if cancel_before:
            self.counts.cancelled_before += 1
            await _cancel_self()
        fail_after = False
        if not self._suspended and op in self.ops and (self.fail_before or self.fail_after):
            x = self.rng.random()
            if x < self.fail_before:
                self._tally(op)
                self.counts.failed_before += 1
                raise ExternalError(f"injected fault: {op} failed before it ran", determinate=True)
            fail_after = op in _MUTATING and x < self.fail_before + self.fail_after
        result = await fn()
        if targeted and op in self._lose_reply and result is not False:
            self._lose_reply.discard(op)
            fail_after = True
        if cancel_after:
            self.counts.cancelled_after += 1
            await _cancel_self()
        if fail_after:
            self._tally(op)
            self.counts.failed_after += 1
            raise ExternalError(
                f"injected fault: {op} took effect, then its reply was lost", determinate=False
            )
        return result

    def _tally(self, op: str) -> None:
        self.counts.by_op[op] = self.counts.by_op.get(op, 0) + 1


async def _cancel_self() -> None:
    """Cancels the running task as ``task.cancel()`` from outside would (``cancelling()`` set),
    and lets the cancellation land at this await."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    await asyncio.sleep(0)
    raise AssertionError("the task went on after its cancellation was delivered")


def _release(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FaultyBlob(Blob):
    """``inner`` with ``faults`` injected into every call (``close`` passes straight through)."""

    def __init__(self, inner: Blob, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    async def get(self, key: str) -> bytes | None:
        return await self.faults.call("blob.get", lambda: self.inner.get(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self.faults.call("blob.get", lambda: self.inner.get_range(key, start, end))

    async def set(self, key: str, value: bytes) -> None:
        await self.faults.call("blob.set", lambda: self.inner.set(key, value))

    async def set_new(self, key: str, value: bytes) -> None:
        await self.faults.call("blob.set", lambda: self.inner.set_new(key, value))

    async def delete(self, key: str) -> None:
        await self.faults.call("blob.delete", lambda: self.inner.delete(key))

    async def list_keys(self, prefix: str) -> list[str]:
        return await self.faults.call("blob.list_keys", lambda: self.inner.list_keys(prefix))

    async def list_sizes(self, prefix: str) -> dict[str, int]:
        return await self.faults.call("blob.list_keys", lambda: self.inner.list_sizes(prefix))

    async def delete_partial_writes(self, prefix: str, older_than_s: float) -> int:
        # Passed through, or the base class's no-op would hide the wrapped blob's sweep.
        return await self.faults.call(
            "blob.delete", lambda: self.inner.delete_partial_writes(prefix, older_than_s)
        )

    def uri(self, key: str) -> str | None:
        # Naming does no I/O: nothing to inject.
        return self.inner.uri(key)

    async def close(self) -> None:
        await self.inner.close()


class FaultyConsensus(Consensus):
    """``inner`` with ``faults`` injected into every call (``close`` passes straight through)."""

    def __init__(self, inner: Consensus, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    async def head(self, key: str) -> VersionedData | None:
        return await self.faults.call("consensus.head", lambda: self.inner.head(key))

    async def compare_and_set(self, key: str, expected_seqno: int | None, data: bytes) -> bool:
        return await self.faults.call(
            "consensus.compare_and_set",
            lambda: self.inner.compare_and_set(key, expected_seqno, data),
        )

    async def scan(self, key: str, from_seqno: int, limit: int) -> list[VersionedData]:
        return await self.faults.call(
            "consensus.scan", lambda: self.inner.scan(key, from_seqno, limit)
        )

    async def truncate(self, key: str, seqno: int) -> int:
        return await self.faults.call("consensus.truncate", lambda: self.inner.truncate(key, seqno))

    def watch(self, key: str, on_change: Pushed) -> Callable[[], None] | None:
        """The inner watch, dropping pushes as often as calls fail: whoever relies on pushes
        must still hear of every change (by its fallback poll)."""
        faults = self.faults

        def maybe_drop(seqno: int | None, data: bytes | None) -> None:
            if faults.active and faults.rng.random() < faults.fail_before + faults.fail_after:
                faults.counts.pushes_dropped += 1
                return
            on_change(seqno, data)

        return self.inner.watch(key, maybe_drop)

    async def close(self) -> None:
        await self.inner.close()
