"""Streaming writes into one shard (DoExchange): LSNs, the WAL, group commits, acknowledgements.

Everything here runs on the server's event loop except what the gRPC threads of a call do
(``Call.offer``, ``Call.next_acks``, ``Room.wait``), which only touch thread-safe structures.

A write's life: a call's gRPC thread reads it and hands it over (``Call.offer``); the loop takes
every write waiting in the call at once as a **bunch** (``ShardStream._take``): each gets the next
LSN (its rows' shard time) and the ``MEMORY`` ack. The flusher appends every bunch not yet logged
to the WAL with one fsync (``LOCAL_DISK``). The committer cuts a group of logged bunches once the
oldest waited ``commit_interval_ms`` or the group holds ``commit_bytes``, writes it as one batch
to blob (``OBJECT_STORAGE``) and appends it with ``compare_and_append_batch`` from the upper to its
last LSN + 1, recording its writes' seqs in the same commit (``COMMITTED``). A watermark per tier
says that every LSN below it reached the tier; acks follow the watermarks, per call, in LSN order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist.core.streams import check_writer_id
from persist.core.updates import DIFF, TIME
from persist.errors import InvalidUsage, PersistError, UpperMismatch
from persist.flight._wal import Wal, WalRecord, decode_rows, encode_rows, frame

if TYPE_CHECKING:
    from persist.client import PersistClient
    from persist.flight._metrics import Metrics
    from persist.write import WriteHandle

__all__ = ["ACK_SCHEMA", "Call", "Room", "ShardStream", "Tier"]

ACK_SCHEMA = pa.schema(
    [
        pa.field("lsn", pa.uint64(), nullable=False),
        pa.field("durability_level", pa.utf8(), nullable=False),
        pa.field("is_durability_update", pa.bool_(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


class Tier(IntEnum):
    MEMORY = 0
    LOCAL_DISK = 1
    OBJECT_STORAGE = 2
    COMMITTED = 3


TIER_NAMES = [t.name for t in Tier]
# An ack: (lsn, tier, microseconds since the epoch when the tier was reached).
Ack = tuple[int, int, int]


def _now_us() -> int:
    return time.time_ns() // 1000


class Room:
    """The shard's buffer of uncommitted writes, in bytes, shared with the gRPC threads that
    read writes: a thread waits for room before it reads the next write (backpressure)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> None:
        with self._cond:
            self._held += nbytes

    def give(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            if self._held < self.limit:
                self._cond.notify_all()

    @property
    def held(self) -> int:
        return self._held

    def wait(self, stop: Callable[[], bool], timeout: float = 0.1) -> bool:
        """Waits until there is room (True) or ``stop()`` (False). Returns at once with room."""
        with self._cond:
            while self._held >= self.limit:
                if stop():
                    return False
                self._cond.wait(timeout)
        return True


class Call:
    """One DoExchange call's side of the stream: acks out (to its ack thread), what it still
    owes, and when it is done. Its counters are guarded by its stream's lock."""

    def __init__(self, stream: ShardStream, writer_id: str | None, levels: frozenset[Tier]) -> None:
        self.stream = stream
        self.writer_id = writer_id
        self.levels = levels
        self.top = max(levels | {Tier.MEMORY})
        self._acks: list[Ack] = []
        self._acks_ready = threading.Condition()
        self._send_lock = threading.Lock()
        self.ended = False  # the client finished writing
        self.finished = threading.Event()  # every ack the call owes was queued (or it failed)
        self.error: BaseException | None = None
        self.schema: pa.Schema | None = None
        # Per tier after MEMORY, this call's LSNs waiting for it, in order.
        self.waiting: dict[Tier, collections.deque[int]] = {
            t: collections.deque() for t in Tier if t in levels and t is not Tier.MEMORY
        }
        # LSNs of this call not yet at its top tier (the call ends once this is empty).
        self.open_lsns = 0

    def wait_acks(self, timeout: float) -> None:
        """Waits (at most ``timeout``) until an ack is queued or the call is finished."""
        with self._acks_ready:
            if not self._acks and not self.finished.is_set():
                self._acks_ready.wait(timeout)

    def send(self, acks: list[Ack]) -> None:
        if acks:
            with self._acks_ready:
                self._acks.extend(acks)
                self._acks_ready.notify()

    def flush(self, write: Callable[[list[Ack]], None]) -> bool:
        """Writes every ack queued, in order, with ``write`` (the call's ack thread does, one
        batch for all that queued up meanwhile). False once the call owes no more."""
        with self._send_lock:
            with self._acks_ready:
                acks, self._acks = self._acks, []
                done = not acks and self.finished.is_set()
            if acks:
                write(acks)
            return not done

    def finish(self, error: BaseException | None = None) -> None:
        with self._acks_ready:
            if self.finished.is_set():
                return
            if error is not None and self.error is None:
                self.error = error
            self.finished.set()
            self._acks_ready.notify()


@dataclass(eq=False)
class _Bunch:
    """Writes one call handed over together: ``table`` holds their rows (data columns and
    ``_diff``), write ``i`` being ``counts[i]`` rows at LSN ``lsns[i]``."""

    table: pa.Table
    lsns: list[int]
    counts: list[int]
    seqs: list[int]
    writer_id: str
    nbytes: int
    at: float  # monotonic time it was taken


class ShardStream:
    """The streaming writes of one shard on this server (see the module docstring)."""

    def __init__(
        self,
        shard: str,
        client: PersistClient,
        writer: WriteHandle,
        wal_dir: Path,
        *,
        commit_interval_s: float,
        commit_bytes: int,
        room: Room,
        metrics: Metrics,
    ) -> None:
        self.shard = shard
        self.client = client
        self.writer = writer
        self.schema = pa.schema([*writer.schema, pa.field(DIFF, pa.int64(), nullable=False)])
        self.wal = Wal(wal_dir / shard, self.schema)
        self.commit_interval_s = commit_interval_s
        self.commit_bytes = commit_bytes
        self.room = room
        self.metrics = metrics
        upper = writer.upper if writer.upper is not None else 0
        self.next_lsn = upper
        # Per tier: every LSN below it reached the tier.
        self.marks = [upper] * len(Tier)
        self.unlogged: list[_Bunch] = []
        self.logged: list[_Bunch] = []  # in the WAL, not yet committed
        self.pending: dict[tuple[str, int], int] = {}  # named uncommitted writes -> LSN
        self.calls: set[Call] = set()
        self.failed: BaseException | None = None
        self._logged_event = asyncio.Event()
        self._unlogged_event = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        # The WAL's file operations run in worker threads, one at a time.
        self._wal_lock = asyncio.Lock()
        self._tasks = [
            asyncio.ensure_future(self._flusher()),
            asyncio.ensure_future(self._committer()),
        ]
        for t in self._tasks:
            t.add_done_callback(self._task_died)
        self.uncommitted_bytes = 0
        self._flushing = False
        self._holds = 0
        # Guards what a call's gRPC thread touches: LSNs, marks, pending seqs, the calls' acks
        # owed, and the writes taken but not yet bunched (``_incoming``).
        self.lock = threading.Condition()
        self._incoming: list[tuple[Call, pa.RecordBatch, int, int, int]] = []
        self._loop = asyncio.get_running_loop()

    # --- accepting writes -----------------------------------------------------------------------

    def open_call(self, call: Call) -> None:
        with self.lock:
            if self.failed is not None:
                raise self.failed
            self.calls.add(call)

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """No write is taken (no LSN handed out) inside: another commit of this server's (a
        DoPut) moves the upper meanwhile. A call's thread with a write waits meanwhile."""
        with self.lock:
            self._holds += 1
        try:
            yield
        finally:
            with self.lock:
                self._holds -= 1
                self.lock.notify_all()

    def drop_call(self, call: Call) -> None:
        """The call's client went away: it is owed nothing more (its writes still progress)."""
        with self.lock:
            self.calls.discard(call)
        call.finish()

    # --- on a call's gRPC thread ---------------------------------------------------------------

    def accept(
        self, call: Call, batch: pa.RecordBatch, metadata: bytes | None, nbytes: int
    ) -> None:
        """Takes one write at once, on the thread that read it: its LSN and ``MEMORY`` ack do
        not wait for the loop (which logs and commits). A bad write ends the call."""
        try:
            if call.schema is None:
                call.schema = self._check_schema(batch.schema)
            elif batch.schema != call.schema:
                raise InvalidUsage("a write's schema differs from the call's first write")
            seq = _seq(metadata, call.writer_id)
        except PersistError as exc:
            self.room.give(nbytes)
            self.fail_call(call, exc)
            return
        writer_id = call.writer_id or ""
        now_us = _now_us()
        with self.lock:
            while self._holds and self.failed is None:
                self.lock.wait(0.1)
            if self.failed is not None:
                error = self.failed
            else:
                error = None
                if seq >= 0:
                    replayed = self._replayed(writer_id, seq)
                    if replayed is not None:
                        call.send(self._replay_acks(call, replayed, now_us))
                        self.room.give(nbytes)
                        self.metrics.acks.labels("MEMORY").inc()
                        return
                    self.pending[(writer_id, seq)] = self.next_lsn
                lsn = self.next_lsn
                self.next_lsn += 1
                self.marks[Tier.MEMORY] = self.next_lsn
                for q in call.waiting.values():
                    q.append(lsn)
                if call.top is not Tier.MEMORY:
                    call.open_lsns += 1
                call.send([(lsn, Tier.MEMORY, now_us)])
                wake = not self._incoming
                self._incoming.append((call, batch, lsn, seq, nbytes))
        if error is not None:
            self.room.give(nbytes)
            self.fail_call(call, error)
            return
        self.metrics.writes.labels("do_exchange").inc()
        self.metrics.write_bytes.labels("do_exchange").inc(nbytes)
        self.metrics.acks.labels("MEMORY").inc()
        if wake:
            self._loop.call_soon_threadsafe(self._drain)

    def end_call(self, call: Call) -> None:
        """The client finished writing: the call ends once it owes no more acks."""
        with self.lock:
            call.ended = True
            self._maybe_finish(call)

    # --- on the loop ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Writes taken since the last drain become bunches (one per writer id) for the WAL."""
        with self.lock:
            incoming, self._incoming = self._incoming, []
        if not incoming:
            return
        groups: dict[str, list[tuple[Call, pa.RecordBatch, int, int, int]]] = {}
        for item in incoming:
            groups.setdefault(item[0].writer_id or "", []).append(item)
        now = time.monotonic()
        for writer_id, items in groups.items():
            tables = [_normalized(item[1], self.schema) for item in items]
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            self.unlogged.append(
                _Bunch(
                    table,
                    [item[2] for item in items],
                    [item[1].num_rows for item in items],
                    [item[3] for item in items],
                    writer_id,
                    sum(item[4] for item in items),
                    now,
                )
            )
        self.uncommitted_bytes += sum(item[4] for item in incoming)
        self._unlogged_event.set()

    def _check_schema(self, schema: pa.Schema) -> pa.Schema:
        names = schema.names
        if TIME in names:
            raise InvalidUsage(
                f"a streaming write has no {TIME!r} column: the server gives each write its LSN "
                "as its time"
            )
        data = pa.schema([f for f in schema if f.name != DIFF])
        expected = self.writer.schema
        if [f.name for f in data] != expected.names or any(
            f.type != e.type for f, e in zip(data, expected, strict=True)
        ):
            raise InvalidUsage(
                f"a streaming write must have the shard's columns ({expected}) and optionally "
                f"{DIFF!r} (int64); it has {schema}"
            )
        if DIFF in names and schema.field(DIFF).type != pa.int64():
            raise InvalidUsage(f"{DIFF!r} must be int64, not {schema.field(DIFF).type}")
        return schema

    def _replayed(self, writer_id: str, seq: int) -> int | None:
        lsn = self.pending.get((writer_id, seq))
        if lsn is not None:
            return lsn
        return self.writer.streamed_lsn(writer_id, seq)

    def _replay_acks(self, call: Call, lsn: int, now_us: int) -> list[Ack]:
        acks: list[Ack] = [(lsn, Tier.MEMORY, now_us)]
        for tier in Tier:
            if tier is Tier.MEMORY or tier not in call.levels:
                continue
            if lsn < self.marks[tier]:
                acks.append((lsn, tier, now_us))
            else:
                _insort(call.waiting[tier], lsn)
        if call.top is not Tier.MEMORY and lsn >= self.marks[call.top]:
            call.open_lsns += 1
        return acks

    # --- tiers -----------------------------------------------------------------------------------

    def _advance(self, tier: Tier, mark: int) -> None:
        """Every LSN below ``mark`` reached ``tier``: ack it to the calls that asked."""
        now_us = _now_us()
        sent = 0
        with self.lock:
            if mark <= self.marks[tier]:
                return
            self.marks[tier] = mark
            for call in list(self.calls):
                q = call.waiting.get(tier)
                if not q:
                    continue
                acks: list[Ack] = []
                while q and q[0] < mark:
                    acks.append((q.popleft(), tier, now_us))
                if acks:
                    call.send(acks)
                    sent += len(acks)
                    if tier is call.top:
                        call.open_lsns -= len(acks)
                        self._maybe_finish(call)
        if sent:
            self.metrics.acks.labels(tier.name).inc(sent)

    def _maybe_finish(self, call: Call) -> None:
        # Under the lock.
        if call.ended and call.open_lsns <= 0:
            self.calls.discard(call)
            call.finish()

    def fail_call(self, call: Call, error: BaseException) -> None:
        with self.lock:
            self.calls.discard(call)
        call.finish(error)

    # --- the WAL and group commits ------------------------------------------------------------

    async def _flusher(self) -> None:
        while True:
            await self._unlogged_event.wait()
            self._unlogged_event.clear()
            bunches, self.unlogged = self.unlogged, []
            if not bunches:
                continue
            self._flushing = True
            try:
                # One write and one fsync for every bunch that arrived meanwhile; encoding
                # them too runs off the loop (the loop is what acks MEMORY).
                async with self._wal_lock:
                    await asyncio.to_thread(self._log, bunches)
            finally:
                self._flushing = False
            self.logged.extend(bunches)
            self._advance(Tier.LOCAL_DISK, max(max(b.lsns) for b in bunches) + 1)
            self._logged_event.set()

    def _log(self, bunches: list[_Bunch]) -> None:
        records = [
            WalRecord(b.lsns, b.writer_id, b.seqs, b.counts, encode_rows(b.table)) for b in bunches
        ]
        self.wal.append(records, frame(records))

    async def _committer(self) -> None:
        while True:
            await self._logged_event.wait()
            if not self.logged:
                self._logged_event.clear()
                continue
            # Cut the group when its oldest write waited the interval or it holds enough bytes.
            wait = self.logged[0].at + self.commit_interval_s - time.monotonic()
            size = sum(b.nbytes for b in self.logged)
            if wait > 0 and size < self.commit_bytes:
                self._logged_event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._logged_event.wait(), wait)
                self._logged_event.set()
                continue
            try:
                await self.commit_logged()
            except PersistError:
                return  # every call was told (_fail_all)

    async def commit_logged(self) -> None:
        """Commits every logged write now, as one group."""
        async with self._commit_lock:
            group, self.logged = self.logged, []
            if not group:
                return
            async with self._wal_lock:
                # The group's segments can go once it is committed.
                await asyncio.to_thread(self.wal.roll)
            try:
                await self._commit(group)
            except PersistError as exc:
                self._fail_all(exc)
                raise
            async with self._wal_lock:
                await asyncio.to_thread(self.wal.drop_committed, self.marks[Tier.COMMITTED])

    async def flush_and_commit(self) -> None:
        """Logs and commits every write taken so far (a DoPut into the shard goes after them)."""
        self._drain()
        while self.unlogged or self._flushing:
            self._unlogged_event.set()
            await asyncio.sleep(0.001)
        await self.commit_logged()
        if self.failed is not None:
            raise self.failed

    async def _commit(self, group: list[_Bunch]) -> None:
        table = pa.concat_tables([b.table for b in group])
        lsns = np.fromiter((x for b in group for x in b.lsns), dtype=np.uint64)
        counts = np.fromiter((c for b in group for c in b.counts), dtype=np.int64)
        times = pa.array(np.repeat(lsns, counts), pa.uint64())
        table = table.append_column(pa.field(TIME, pa.uint64(), nullable=False), times)
        expected = self.marks[Tier.COMMITTED]
        new_upper = int(lsns.max()) + 1
        batch = await self.writer.batch(table, expected, new_upper)
        self._advance(Tier.OBJECT_STORAGE, new_upper)
        seqs = [
            (b.writer_id, s, lsn)
            for b in group
            for s, lsn in zip(b.seqs, b.lsns, strict=True)
            if s >= 0
        ]
        try:
            with self.metrics.commit():
                await self.writer.append_streamed(batch, expected, new_upper, seqs)
        except UpperMismatch:
            # Another writer passed these LSNs: they can never be committed where they were
            # acked. Nothing of them is in the shard; their part goes.
            await self.client.delete_batch(batch)
            raise
        for b in group:
            with self.lock:
                for s in b.seqs:
                    if s >= 0:
                        self.pending.pop((b.writer_id, s), None)
        freed = sum(b.nbytes for b in group)
        self.uncommitted_bytes -= freed
        self.room.give(freed)
        self._advance(Tier.COMMITTED, new_upper)

    def note_upper(self, upper: int | None) -> None:
        """Another commit of this server (a DoPut) moved the upper: LSNs continue above it."""
        with self.lock:
            if upper is not None and upper > self.next_lsn:
                self.next_lsn = upper
                for tier in Tier:
                    self.marks[tier] = max(self.marks[tier], upper)

    def _fail_all(self, error: BaseException) -> None:
        """The stream can't go on (another writer passed an uncommitted LSN, or the commit
        failed): every open call ends with the error; nothing taken is committed twice."""
        with self.lock:
            self.failed = error
            calls = list(self.calls)
            self.calls.clear()
            incoming, self._incoming = self._incoming, []
            self.lock.notify_all()
        for call in calls:
            call.finish(error)
        freed = sum(b.nbytes for b in self.unlogged + self.logged) + sum(i[4] for i in incoming)
        self.room.give(freed)

    def _task_died(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            print(f"persist flight: stream of {self.shard} stopped: {exc!r}", file=sys.stderr)
            if self.failed is None:
                self._fail_all(exc)

    # --- what the server asks -------------------------------------------------------------------

    def durability(self) -> dict[str, int]:
        return {t.name: self.marks[t] for t in Tier}

    def lag(self) -> dict[str, tuple[int, float]]:
        """Per tier: (LSNs taken but not at it, seconds the oldest of them has waited)."""
        now = time.monotonic()
        taken = self.marks[Tier.MEMORY]
        oldest_unlogged = self.unlogged[0].at if self.unlogged else None
        oldest = self.logged[0].at if self.logged else oldest_unlogged
        out: dict[str, tuple[int, float]] = {"MEMORY": (0, 0.0)}
        for tier, first in (
            (Tier.LOCAL_DISK, oldest_unlogged),
            (Tier.OBJECT_STORAGE, oldest),
            (Tier.COMMITTED, oldest),
        ):
            out[tier.name] = (taken - self.marks[tier], 0.0 if first is None else now - first)
        return out

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        async with self._wal_lock:
            await asyncio.to_thread(self.wal.close)


def _seq(metadata: bytes | None, writer_id: str | None) -> int:
    if not metadata:
        return -1
    try:
        value = json.loads(metadata)
    except (UnicodeDecodeError, ValueError):
        raise InvalidUsage(f"a write's app_metadata is not JSON: {metadata[:100]!r}") from None
    if not isinstance(value, dict) or set(value) - {"seq"}:
        raise InvalidUsage('a write\'s app_metadata must be {"seq": n}')
    seq = value.get("seq")
    if seq is None:
        return -1
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 63:
        raise InvalidUsage(f"seq must be an int in [0, 2^63), not {seq!r}")
    if writer_id is None:
        raise InvalidUsage('a write with a "seq" needs the call\'s "writer_id"')
    return seq


def _normalized(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """A write's rows with ``_diff`` (1 when the write has none), in the stream's schema."""
    table = pa.Table.from_batches([batch])
    if DIFF not in table.column_names:
        table = table.append_column(
            pa.field(DIFF, pa.int64(), nullable=False),
            pa.array(np.ones(table.num_rows, dtype=np.int64)),
        )
    return table if table.schema == schema else table.cast(schema)


def _insort(q: collections.deque[int], lsn: int) -> None:
    if not q or q[-1] <= lsn:
        q.append(lsn)
        return
    items = sorted([*q, lsn])
    q.clear()
    q.extend(items)


def check_levels(levels: object) -> frozenset[Tier]:
    if levels is None:
        return frozenset(Tier)
    if not isinstance(levels, list) or not all(isinstance(x, str) for x in levels):
        raise InvalidUsage(f'"levels" must be a list of tier names {TIER_NAMES}, not {levels!r}')
    unknown = [x for x in levels if x not in TIER_NAMES]
    if unknown:
        raise InvalidUsage(f"unknown durability level(s) {unknown}; they are {TIER_NAMES}")
    return frozenset(Tier[x] for x in levels) | {Tier.MEMORY}


def writer_id_of(value: object) -> str | None:
    if value is None:
        return None
    problem = check_writer_id(value)
    if problem is not None:
        raise InvalidUsage(problem)
    assert isinstance(value, str)
    return value


def recovered_writes(
    directory: Path,
) -> tuple[pa.Schema | None, list[tuple[int, str, int, pa.Table]], list[Path]]:
    """Every write in a shard's WAL: ``(lsn, writer_id, seq, rows)`` in LSN order."""
    schema, records, paths = Wal.recover(directory)
    writes: list[tuple[int, str, int, pa.Table]] = []
    if schema is None:
        return None, [], paths
    for r in records:
        rows = pa.Table.from_batches([decode_rows(r.rows, schema)])
        at = 0
        for lsn, seq, count in zip(r.lsns, r.seqs, r.counts, strict=True):
            writes.append((lsn, r.writer_id, seq, rows.slice(at, count)))
            at += count
    writes.sort(key=lambda w: w[0])
    return schema, writes, paths
