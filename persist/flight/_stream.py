"""Streaming writes (DoExchange): the thin shell around the ledger (``persist.core.ledger``).

Every promise about a streamed write (its LSN, its acks, what a failed commit leaves pending,
the bytes it holds) is the ledger's, kept behind one lock. This module only carries out what
the ledger asks and reports back what happened:

- a call's gRPC thread checks each write at the edge (``core.shaping.EdgeCheck``: whatever a
  commit would refuse is refused here, before its ``MEMORY`` ack, ending only that call), then
  hands it to the ledger under the lock (``Streams.accept``);
- per shard, a **flusher** task appends what the ledger hands out (``to_log``) to the shard's WAL
  with one fsync, on a worker thread (``LOCAL_DISK``);
- per shard, a **committer** task commits each group the ledger cuts, through ``commit``: one
  blob part (``OBJECT_STORAGE``), one ``append_streamed`` (``COMMITTED``). It is the only commit
  path: recovery, DoPuts into a streamed shard and the drain all go through it. A commit that
  fails is retried with backoff until it lands (reported in the log and the metrics); writes
  that can never land are set aside in the WAL's ``quarantine/`` and only their calls end;
- a call's ack thread sends whatever acks the ledger queued for it (``take_acks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist.batch import Batch
from persist.core.durability import (
    Group,
    Landed,
    Outcome,
    Refused,
    Retry,
    Tier,
    Write,
    judge,
)
from persist.core.ledger import Ledger, Over, Settled, Wait
from persist.core.shaping import EdgeCheck, group_updates, refused_writes, rows_schema
from persist.errors import (
    ExternalError,
    InvalidUsage,
    LeaseExpired,
    PersistError,
    UpperMismatch,
)
from persist.flight._protocol import write_seq
from persist.flight._wal import Segment, Wal, WalRecord
from persist.ids import ShardId

if TYPE_CHECKING:
    from persist.client import PersistClient
    from persist.flight._metrics import Metrics
    from persist.write import WriteHandle

__all__ = ["CallInfo", "Streams"]

log = logging.getLogger("persist")

# Why a write that another writer's upper passed is set aside.
_PASSED = "another writer moved the shard's upper past it"
# A failed commit is tried again after this long, doubling up to the cap.
_RETRY_FIRST_S = 0.05
_RETRY_CAP_S = 5.0
# A gRPC thread that must wait (for room, a DoPut, an LSN reservation) looks this often whether
# its call was cancelled.
_POLL_S = 0.1

# Runs work in the background, kept referenced and awaited by the drain (the server's).
Spawn = Callable[[Coroutine[Any, Any, Any]], None]
# The server's writer of a shard: (shard, schema for a new shard, a writer that lapsed) -> it.
Writers = Callable[[str, "pa.Schema | None", "WriteHandle | None"], Awaitable["WriteHandle"]]


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(eq=False)
class _Shard:
    """What the shell keeps per shard: its WAL, its tasks, the batches it staged."""

    name: str
    schema: pa.Schema  # the shard's data columns
    wal: Wal
    writer: WriteHandle  # the server's writer of the shard (renewed if its lease lapses)
    check: EdgeCheck  # what a commit would refuse of a write, found before its MEMORY ack
    log_wake: asyncio.Event = field(default_factory=asyncio.Event)
    commit_wake: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    wal_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    forcing: int = 0  # flush_and_commit calls waiting: cut groups at once
    log_asked: bool = False  # a wake of the flusher is on its way (under the ledger lock)
    staged: dict[int, Batch] = field(default_factory=dict)  # group id -> its blob part
    stale: list[Batch] = field(default_factory=list)  # parts of groups that will never land

    def lookup(self, writer_id: str, seq: int) -> int | None:
        """The LSN a named write was committed at, in the writer's latest known state: a
        commit records its seqs there before the ledger forgets them (``settle``), so a taken
        seq is always in one of the two."""
        return self.writer.streamed_lsn(writer_id, seq)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a DoExchange's gRPC thread needs of its call."""

    id: int
    shard: str
    schema: pa.Schema  # the shard's data columns
    writer_id: str | None


class Streams:
    """The server's streaming writes. gRPC threads call ``accept``, ``end_call``, ``drop_call``,
    ``wait_room`` and ``take_acks``; everything else runs on the event loop."""

    def __init__(
        self,
        client: PersistClient,
        metrics: Metrics,
        writers: Writers,
        spawn: Spawn,
        wal_dir: Path,
        *,
        commit_interval_ms: float,
        commit_bytes: int,
        max_buffer_bytes: int,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._writers = writers
        self._spawn = spawn
        self._wal_dir = wal_dir
        self._interval_us = int(commit_interval_ms * 1000)
        self._commit_bytes = commit_bytes
        self._loop = asyncio.get_running_loop()
        # The one lock: every ledger call is made under it. Waiters for room, for a DoPut's
        # hold or for an LSN reservation wait on it too.
        self._cv = threading.Condition()
        self.ledger: Ledger[pa.RecordBatch] = Ledger(max_buffer_bytes)
        self._shards: dict[str, _Shard] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._ack_ready: dict[int, threading.Event] = {}
        self._closed = False

    # --- shards (on the loop) --------------------------------------------------------------------

    async def open_call(
        self, shard: str, writer_id: str | None, levels: frozenset[Tier], schema: pa.Schema | None
    ) -> CallInfo:
        """A DoExchange call into ``shard``; a new shard is created with ``schema`` (the
        stream's columns, less ``_diff``)."""
        s = await self._shard(shard, schema)
        with self._cv:
            call_id = self.ledger.open_call(shard, writer_id, levels)
            self._ack_ready[call_id] = threading.Event()
        return CallInfo(call_id, shard, s.schema, writer_id)

    async def _shard(self, shard: str, schema: pa.Schema | None) -> _Shard:
        s = self._shards.get(shard)
        if s is not None:
            return s
        async with self._opening.setdefault(shard, asyncio.Lock()):
            s = self._shards.get(shard)
            if s is None:
                s = await self._open_shard(shard, schema)
        return s

    async def _open_shard(
        self,
        shard: str,
        schema: pa.Schema | None,
        recovered: tuple[list[WalRecord], list[Segment]] = ([], []),
    ) -> _Shard:
        if self._closed:
            raise InvalidUsage("the server is shutting down")
        writer = await self._writers(shard, schema, None)
        upper = await writer.fetch_recent_upper()
        if upper is None:
            raise InvalidUsage(f"shard {shard} is finished: it takes no more writes")
        directory = self._wal_dir / shard
        floor = await asyncio.to_thread(Wal.read_floor, directory)
        records, segments = recovered
        wal = Wal(directory, rows_schema(writer.schema), segments)
        s = _Shard(shard, writer.schema, wal, writer, EdgeCheck(writer.schema))
        writes = [
            (lsn, r.writer_id, seq, rows.nbytes, rows)
            for r in records
            for lsn, seq, rows in s.wal.unpacked(r)
        ]
        with self._cv:
            settled = self.ledger.add_shard(
                shard, upper, writer.stream_upper, floor, writes, now_us()
            )
        if settled.lost:
            await self._set_aside(s, [(w, _PASSED) for w in settled.lost])
        try:
            # No LSN is handed out before the first reservation is on disk.
            await self._reserve(s)
        except BaseException:
            with self._cv:
                self.ledger.remove_shard(shard)  # its recovered writes are still in the WAL
            raise
        self._shards[shard] = s
        s.tasks = [
            asyncio.ensure_future(self._flusher(s)),
            asyncio.ensure_future(self._committer(s)),
        ]
        for t in s.tasks:
            t.add_done_callback(_task_died)
        return s

    async def recover(self) -> None:
        """Commits, at their LSNs, the writes a crashed run logged but did not commit, before
        the server takes calls (through the one commit path)."""
        wal_dir = self._wal_dir
        if not await asyncio.to_thread(wal_dir.is_dir):
            return
        dirs = await asyncio.to_thread(lambda: sorted(p for p in wal_dir.iterdir() if p.is_dir()))
        for directory in dirs:
            try:
                shard = str(ShardId(directory.name))
            except InvalidUsage:
                continue
            _, records, segments = await asyncio.to_thread(Wal.recover, directory)
            if not records:  # every segment torn before its first record: nothing was acked
                for seg in segments:
                    await asyncio.to_thread(seg.path.unlink, missing_ok=True)
                continue
            await self._open_shard(shard, None, (records, segments))
            lsns = sorted(lsn for r in records for lsn in r.lsns)
            await self.flush_and_commit(shard)
            log.warning(
                "persist flight: recovered %d write(s) of %s from the WAL (LSN %d..%d)",
                len(lsns), shard, lsns[0], lsns[-1],
            )  # fmt: skip

    async def _reserve(self, s: _Shard) -> None:
        """Makes the next LSN reservation durable, if one is due (raises if it can't)."""
        with self._cv:
            due = self.ledger.reservation_due(s.name)
        if due is not None and not await self._make_durable(s, due):
            raise ExternalError(
                f"the LSN reservation of {s.name} could not be written", determinate=True
            )

    async def _make_durable(self, s: _Shard, ceiling: int) -> bool:
        """Writes the reservation ``ceiling`` (which ``reservation_due`` handed out) to disk and
        tells the ledger; writers waiting for it go on."""
        try:
            async with s.wal_lock:
                await asyncio.to_thread(s.wal.write_floor, ceiling)
            ok = True
        except ExternalError as exc:
            log.error("persist flight: the LSN reservation of %s failed: %s", s.name, exc)
            ok = False
        with self._cv:
            self.ledger.reserved(s.name, ceiling if ok else None)
            self._cv.notify_all()
        return ok

    # --- on a call's gRPC thread -----------------------------------------------------------------

    def wait_room(self, cancelled: Callable[[], bool]) -> bool:
        """Waits until the buffer has room for another write (True), or ``cancelled()``."""
        with self._cv:
            if self.ledger.has_room():
                return True
            self._metrics.backpressure_waits.inc()
            while not self.ledger.has_room():
                if cancelled():
                    return False
                self._cv.wait(_POLL_S)
        return True

    def accept(
        self,
        call: CallInfo,
        batch: pa.RecordBatch,
        metadata: bytes | None,
        cancelled: Callable[[], bool],
    ) -> bool:
        """Takes one write of a call; False once the call takes no more (its write was bad, or
        it failed meanwhile: ``take_acks`` gives the error)."""
        s = self._shards[call.shard]
        try:
            seq = write_seq(metadata, call.writer_id)
            # Checked, not shaped: the flusher and the committer shape many writes at once.
            s.check(batch)
        except PersistError as exc:
            with self._cv:
                settled = self.ledger.fail_call(call.id, exc)
            self._wake(settled)
            return False
        nbytes = batch.nbytes
        with self._cv:
            while True:
                got = self.ledger.accept(call.id, seq, nbytes, batch, now_us(), s.lookup)
                # The next reservation is made long before this one runs out; a failed one is
                # asked for again here while writers wait for it.
                due = self.ledger.reservation_due(call.shard)
                if due is not None:
                    self._loop.call_soon_threadsafe(self._spawn, self._make_durable(s, due))
                if not isinstance(got, Wait):
                    break
                if cancelled():
                    return False
                self._cv.wait(_POLL_S)
            if isinstance(got, Over):
                return False
            wake_flusher = not got.replay and not s.log_asked
            if wake_flusher:
                s.log_asked = True
        if wake_flusher:
            self._loop.call_soon_threadsafe(s.log_wake.set)
        event = self._ack_ready.get(call.id)  # gone if the call failed meanwhile
        if event is not None:
            event.set()
        shard = self._metrics.shard(call.shard)
        self._metrics.writes.labels("do_exchange", shard).inc()
        self._metrics.write_bytes.labels("do_exchange", shard).inc(nbytes)
        return True

    def end_call(self, call: CallInfo) -> None:
        """The client finished writing: the call ends once it owes no more acks."""
        with self._cv:
            settled = self.ledger.end_call(call.id)
        self._wake(settled)

    def drop_call(self, call: CallInfo) -> None:
        """The client went away: it is owed nothing more (its writes still progress)."""
        with self._cv:
            self.ledger.drop_call(call.id)
        event = self._ack_ready.pop(call.id, None)
        if event is not None:
            event.set()

    def take_acks(self, call: CallInfo, timeout: float) -> tuple[list[Any], bool, Any]:
        """The call's acks queued so far (waiting at most ``timeout`` for some), whether it is
        over and the error it ends with."""
        event = self._ack_ready.get(call.id)
        if event is None:
            return [], True, None
        event.wait(timeout)
        event.clear()
        with self._cv:
            acks, over, error = self.ledger.take_acks(call.id)
        if over:
            self._ack_ready.pop(call.id, None)
        if acks:
            self._count_acks(acks)
        return acks, over, error

    def _count_acks(self, acks: list[Any]) -> None:
        tiers = np.bincount(np.fromiter((a[1] for a in acks), dtype=np.int64), minlength=4)
        for tier, n in zip(Tier, tiers, strict=True):
            if n:
                self._metrics.acks.labels(tier.name).inc(int(n))

    def _wake(self, settled: Settled[pa.RecordBatch]) -> None:
        for call_id in settled.calls:
            event = self._ack_ready.get(call_id)
            if event is not None:
                event.set()
        if settled.freed:
            with self._cv:
                self._cv.notify_all()

    # --- the WAL (on the loop) -------------------------------------------------------------------

    async def _flusher(self, s: _Shard) -> None:
        failures = 0
        while True:
            await s.log_wake.wait()
            s.log_wake.clear()
            with self._cv:
                s.log_asked = False
                writes = self.ledger.to_log(s.name)
            if not writes:
                continue
            try:
                # Encoding too runs off the loop: the loop is what moves every other tier.
                async with s.wal_lock:
                    await asyncio.to_thread(s.wal.append_writes, writes, s.schema)
            except Exception as exc:
                with self._cv:
                    self.ledger.log_failed(s.name)
                failures += 1
                self._metrics.wal_failures.inc()
                log.error(
                    "persist flight: the WAL append of %d write(s) of %s failed (try %d): %s",
                    len(writes), s.name, failures, exc,
                )  # fmt: skip
                await asyncio.sleep(_backoff(failures))
                s.log_wake.set()
                continue
            failures = 0
            with self._cv:
                settled = self.ledger.logged(s.name, writes, now_us())
            self._wake(settled)
            # Writes taken during the append wait for the next one; the group may be due.
            s.log_wake.set()
            s.commit_wake.set()

    # --- group commits (on the loop) -------------------------------------------------------------

    async def _committer(self, s: _Shard) -> None:
        failures = 0
        while True:
            try:
                await self._commit_next(s)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Whatever went wrong around a commit (setting writes aside on a full disk,
                # say), the writes stay pending and the committer goes on.
                failures += 1
                log.error("persist flight: the committer of %s failed", s.name, exc_info=exc)
                await asyncio.sleep(_backoff(failures))

    async def _commit_next(self, s: _Shard) -> None:
        """Waits for the next group and commits it (one turn of the committer)."""
        with self._cv:
            group = self.ledger.cut(
                s.name, now_us(), self._interval_us, self._commit_bytes, force=s.forcing > 0
            )
            due = self.ledger.next_cut_us(s.name, self._interval_us)
        if group is None:
            s.commit_wake.clear()
            timeout = None if due is None else max(0, due - now_us()) / 1e6
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.commit_wake.wait(), timeout)
            return
        try:
            async with s.wal_lock:
                # The group's writes are in the segments before this one: those can go once
                # it lands.
                await asyncio.to_thread(s.wal.roll)
            outcome = await self.commit(s, group)
        except Exception as exc:  # commit() turns errors into outcomes: this is a bug
            outcome = Retry(f"{type(exc).__name__}: {exc}")
        with self._cv:
            settled = self.ledger.settle(group, outcome, now_us())
        await self._after(s, group, outcome, settled)

    async def commit(self, s: _Shard, group: Group[pa.RecordBatch]) -> Outcome:
        """One try at committing ``group``: one blob part (kept for the next try if this one
        fails), then one ``append_streamed`` that records the group's seqs with it. Every error
        becomes an outcome (``core.ledger``); none escapes."""
        try:
            batch = s.staged.get(group.id)
            if batch is None:
                table = await asyncio.to_thread(group_updates, group, s.schema)
                batch = await s.writer.batch(table, group.expected_upper, group.new_upper)
                s.staged[group.id] = batch
                with self._cv:
                    settled = self.ledger.staged(group, now_us())
                self._wake(settled)
            with self._metrics.commit(s.name):
                await s.writer.append_streamed(
                    batch, group.expected_upper, group.new_upper, group.seqs
                )
            return Landed()
        except UpperMismatch:
            return await self._judge(s, group)
        except LeaseExpired:
            # The server's writer lapsed (the loop stalled past its lease): a new one writes the
            # part again, under its own prefix (the old one's is swept).
            self._stale(s, group)
            try:
                s.writer = await self._writers(s.name, None, s.writer)
            except PersistError as exc:
                return Retry(f"the server's writer lapsed, and a new one failed: {exc}")
            return Retry("the server's writer lapsed")
        except ExternalError as exc:
            log.warning("persist flight: a commit of %s failed: %s", s.name, exc)
            return await self._judge(s, group)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Not an outage: some write can't be committed (it passed the edge, so this is the
            # second line of defence), or a bug. Find the writes that fail on their own.
            bad = await asyncio.to_thread(refused_writes, group, s.schema)
            if bad:
                return Refused(bad)
            log.error("persist flight: a commit of %s failed", s.name, exc_info=exc)
            return Retry(f"{type(exc).__name__}: {exc}")

    async def _judge(self, s: _Shard, group: Group[pa.RecordBatch]) -> Outcome:
        """What became of a try whose outcome is unknown, read from the shard's state."""
        try:
            upper = await s.writer.fetch_recent_upper()
        except PersistError as exc:
            return Retry(f"the shard's state could not be read: {exc}")
        return judge(group, upper, s.writer.stream_upper)

    async def _after(
        self,
        s: _Shard,
        group: Group[pa.RecordBatch],
        outcome: Outcome,
        settled: Settled[pa.RecordBatch],
    ) -> None:
        if isinstance(outcome, Retry):
            self._metrics.commit_retries.inc()
            log.warning(
                "persist flight: commit of LSN %d..%d of %s will be tried again (try %d): %s",
                group.writes[0].lsn, group.writes[-1].lsn, s.name, group.attempts, outcome.reason,
            )  # fmt: skip
            await asyncio.sleep(_backoff(group.attempts))
            return
        if not isinstance(outcome, Landed):
            self._stale(s, group)
        s.staged.pop(group.id, None)
        given_up = [*settled.quarantined, *((w, _PASSED) for w in settled.lost)]
        if given_up:
            await self._set_aside(s, given_up)
        self._wake(settled)
        with self._cv:
            resolved = self.ledger.resolved_below(s.name)
        async with s.wal_lock:
            await asyncio.to_thread(s.wal.drop_below, resolved)
        if isinstance(outcome, Landed) and s.stale:
            stale, s.stale = s.stale, []
            for batch in stale:
                # A part of a try that can no longer land (the upper moved past its expected
                # upper); ``delete_batch`` refuses one that did land.
                with contextlib.suppress(PersistError):
                    await self._client.delete_batch(batch)
        s.settled.set()

    def _stale(self, s: _Shard, group: Group[pa.RecordBatch]) -> None:
        batch = s.staged.pop(group.id, None)
        if batch is not None:
            s.stale.append(batch)

    async def _set_aside(self, s: _Shard, writes: list[tuple[Write[pa.RecordBatch], str]]) -> None:
        """Writes that can never be committed where they were acked: kept in the WAL's
        ``quarantine/`` (with why) before their segments may go, logged and counted."""
        for w, why in writes:
            async with s.wal_lock:
                path = await asyncio.to_thread(s.wal.quarantine, w, why)
            self._metrics.quarantined.labels(self._metrics.shard(s.name)).inc()
            log.error(
                "persist flight: the write at LSN %d of %s (writer %r, seq %d) can never be "
                "committed and was set aside in %s: %s",
                w.lsn, s.name, w.writer_id, w.seq, path, why,
            )  # fmt: skip

    # --- what DoPuts, actions and the drain ask (on the loop) ------------------------------------

    async def flush_and_commit(self, shard: str) -> None:
        """Logs and commits every write the shard took so far (retrying until it lands)."""
        s = self._shards.get(shard)
        if s is None:
            return
        s.forcing += 1
        try:
            while True:
                with self._cv:
                    if self.ledger.pending(shard) == 0:
                        return
                s.settled.clear()
                s.log_wake.set()
                s.commit_wake.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(s.settled.wait(), 0.5)
        finally:
            s.forcing -= 1

    @contextlib.asynccontextmanager
    async def holding(self, shard: str) -> Any:
        """No write of ``shard`` is taken inside (a DoPut commits meanwhile); writers wait."""
        s = self._shards.get(shard)
        if s is None:
            yield
            return
        with self._cv:
            self.ledger.hold(shard)
        try:
            yield
        finally:
            with self._cv:
                self.ledger.release(shard)
                self._cv.notify_all()

    def note_upper(self, shard: str, upper: int | None) -> None:
        """A DoPut moved the shard's upper: LSNs go on above it."""
        if shard in self._shards:
            with self._cv:
                settled = self.ledger.note_upper(shard, upper, now_us())
            self._wake(settled)

    def streams(self, shard: str) -> bool:
        return shard in self._shards

    def marks(self, shard: str) -> dict[str, int] | None:
        if shard not in self._shards:
            return None
        with self._cv:
            return self.ledger.marks(shard)

    def lag(self) -> dict[str, tuple[int, float]]:
        total: dict[str, tuple[int, float]] = {}
        now = now_us()
        with self._cv:
            per_shard = [self.ledger.lag(shard, now) for shard in self._shards]
        for lag in per_shard:
            for tier, (n, secs) in lag.items():
                m, w = total.get(tier, (0, 0.0))
                total[tier] = (m + n, max(w, secs))
        return total

    async def close(self, timeout_s: float) -> None:
        """The drain: commits what every shard took (for at most ``timeout_s``: what is left
        stays in the WAL, for the next start to recover), then stops the tasks."""
        self._closed = True
        shards = list(self._shards.values())
        with self._cv:
            for s in shards:
                # No LSN is handed out from here on (a call the drain could not end waits).
                self.ledger.hold(s.name)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self.flush_and_commit(s.name) for s in shards)), timeout_s
            )
        except TimeoutError:
            log.error(
                "persist flight: pending streamed writes were not committed within %.0f s of the "
                "drain; they stay in the WAL and the next start commits them",
                timeout_s,
            )
        for s in shards:
            for t in s.tasks:
                t.cancel()
            await asyncio.gather(*s.tasks, return_exceptions=True)
            with self._cv:
                done = self.ledger.pending(s.name) == 0 and not self.ledger.reserving(s.name)
                next_lsn = self.ledger.marks(s.name)["MEMORY"]
            async with s.wal_lock:
                if done:
                    # Everything handed out is committed: the next start may go on right
                    # above it, not above the whole reservation (only a crash skips LSNs).
                    with contextlib.suppress(ExternalError):
                        await asyncio.to_thread(s.wal.write_floor, next_lsn)
                await asyncio.to_thread(s.wal.close)


# --- helpers ---------------------------------------------------------------------------------------


def _backoff(attempt: int) -> float:
    return float(min(_RETRY_CAP_S, _RETRY_FIRST_S * 2 ** max(0, attempt - 1)))


def _task_died(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persist flight: a streaming-write task stopped", exc_info=task.exception())
