"""One shard's streaming writes on their way down: its WAL appends and its group commits.

Per shard, two tasks on the server's loop carry out what the ledger (``core.stream.ledger``) hands out
and report back what happened (``_stream`` keeps the shards, the calls and the one lock):

- the **flusher** appends what ``to_log`` hands out to the shard's WAL with one fsync, on a
  worker thread (``LOCAL_DISK``);
- the **committer** commits each group ``cut`` hands out: one blob part at the shard's upper
  (``OBJECT_STORAGE``), one ``commit_stream_group`` (``COMMITTED``), which decides in the
  transition itself whether the group landed, here or by an earlier try, and which of its named
  writes another server committed first (``core.stream.streams``). Another writer that moved the upper
  meanwhile costs a part written again at the new upper, nothing else. A commit that fails is
  retried with backoff until it lands; writes that can never land (a refused write, a shard
  that was dropped) are set aside in the WAL's ``quarantine/``, and only their calls end.

**Schema versions.** A call takes writes of the version of the shard's schema its stream's
columns are (the current one or an earlier one); each write keeps its version (``version_tag``)
in the ledger and in the WAL, and is checked, fingerprinted and logged in it. A group's writes
are committed through one writer, so in one version: the writer's, moved on to the shard's
current version when a group holds a write of a newer one; rows of earlier versions are shown
in it by field identity (``WriteHandle.view``), as a reader of that version would see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist.core.arrow.evolution import View
from persist.core.arrow.fingerprint import fingerprint, write_fingerprints
from persist.core.arrow.shaping import EdgeCheck, at_times, refused_writes, rows_schema, shape_rows
from persist.core.arrow.updates import TIME
from persist.core.stream.durability import (
    Gone,
    Group,
    Landed,
    Outcome,
    Refused,
    Retry,
    Settled,
    Write,
    sort_taken,
)
from persist.core.stream.ledger import Ledger
from persist.core.stream.streams import GroupLanded, Named, Recorded, ShardGone
from persist.errors import ExternalError, InvalidUsage, LeaseExpired, PersistError, UpperMismatch
from persist.flight._wal import Wal
from persist.flight._wal_format import version_of
from persist.internal.batch import Batch

if TYPE_CHECKING:
    from persist.client import PersistClient
    from persist.flight._metrics import Metrics
    from persist.write import WriteHandle

__all__ = ["Hub", "ShardWork", "now_us"]

log = logging.getLogger("persist")

# A failed commit is tried again after this long, doubling up to the cap.
_RETRY_FIRST_S = 0.05
_RETRY_CAP_S = 5.0
# How often one try of a commit writes its part again because other writers kept moving the
# upper past it before it is reported as a failed try (and backs off).
_MAX_REWRITES = 20
# How far ahead of the upper a part written again goes at most (see ``_time_for``).
_MAX_AHEAD = 1 << 16
# An idle committer looks this often whether its shard is gone.
_IDLE_S = 1.0

# The server's writer of a shard: (shard, schema for a new shard, a writer that lapsed) -> it.
Writers = Callable[[str, "pa.Schema | None", "WriteHandle | None"], Awaitable["WriteHandle"]]
# The server's commits into a shard (DoPuts and groups) take turns: they never race each other.
CommitTurn = Callable[[str], contextlib.AbstractAsyncContextManager[None]]


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(eq=False)
class Hub:
    """What every shard's work shares: the ledger and its one lock, the server's id, writers,
    commit turns, metrics, and how to wake calls and forget a shard (``_stream.Streams``)."""

    ledger: Ledger[pa.RecordBatch]
    cv: threading.Condition
    server: str
    client: PersistClient
    metrics: Metrics
    writers: Writers
    turn: CommitTurn
    wake: Callable[[Settled[pa.RecordBatch]], None]
    forget: Callable[[ShardWork], None]
    interval_us: int
    commit_bytes: int
    wal_failed: bool = False  # a WAL append failed in this run (it left a torn tail behind)


@dataclass(eq=False)
class _Staged:
    """The blob part of the group out for commit, as last written."""

    group: int
    lsns: tuple[int, ...]  # the writes it carries
    rows: pa.Table  # their rows, shaped (no time yet)
    time: int
    writer: WriteHandle
    batch: Batch


@dataclass(eq=False)
class ShardWork:
    """One shard's WAL, writer, tasks and staged part, and the work that moves its writes."""

    hub: Hub
    name: str
    schema: pa.Schema  # the data columns of the writer's version: what groups commit
    wal: Wal
    writer: WriteHandle  # the server's writer of the shard (renewed if its lease lapses)
    schemas: dict[int, pa.Schema]  # the data columns of each version a write may be of
    # Per version, what a commit would refuse of a write, found before its MEMORY ack.
    checks: dict[int, EdgeCheck] = field(default_factory=dict)
    log_wake: asyncio.Event = field(default_factory=asyncio.Event)
    commit_wake: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    wal_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    forcing: int = 0  # flush_and_commit calls waiting: cut groups at once
    log_asked: bool = False  # a wake of the flusher is on its way (under the ledger lock)
    staged: _Staged | None = None
    stale: list[Batch] = field(default_factory=list)  # parts that will never land
    viewed: tuple[WriteHandle, View] | None = None  # the writer's view of earlier versions

    def recorded(self, writer_id: str, seq: int) -> Recorded | None:
        """Where a named write landed, in the writer's latest known state: a commit records
        its seqs there before the ledger forgets them (``settle``), so a taken seq is always
        in one of the two."""
        return self.writer.streamed(writer_id, seq)

    def fingerprint(self, rows: pa.RecordBatch) -> int:
        """Of a write's rows as the shard stores them in their own version (a replay's, or its
        original's): the same whatever version the writer is at when they commit."""
        return fingerprint(shape_rows([rows], self.schemas[version_of(rows)]))

    def check_for(self, version: int) -> EdgeCheck:
        """The edge check of writes of ``version`` (its data columns known: ``schemas``)."""
        check = self.checks.get(version)
        if check is None:
            check = self.checks[version] = EdgeCheck(self.schemas[version])
        return check

    def _use(self, writer: WriteHandle) -> None:
        """Commits go through ``writer`` from now on (a renewed one, or one of a newer
        version): a part the last one staged won't land."""
        if writer is not self.writer:
            if writer.schema_version != self.writer.schema_version:
                log.info(
                    "persist flight: streamed writes into %s commit at schema version %d",
                    self.name, writer.schema_version,
                )  # fmt: skip
            self._unstage()
            self.writer = writer
            self.schema = writer.schema
            self.schemas.setdefault(writer.schema_version, writer.schema)

    def _view(self) -> View:
        if self.viewed is None or self.viewed[0] is not self.writer:
            self.viewed = (self.writer, self.writer.view())
        return self.viewed[1]

    # --- the WAL ----------------------------------------------------------------------------------

    def start(self) -> None:
        self.tasks = [
            asyncio.ensure_future(self._flusher()),
            asyncio.ensure_future(self._committer()),
        ]
        for t in self.tasks:
            t.add_done_callback(_task_died)

    async def _flusher(self) -> None:
        failures = 0
        while True:
            await self.log_wake.wait()
            self.log_wake.clear()
            with self.hub.cv:
                self.log_asked = False
                writes = self.hub.ledger.to_log(self.name)
            if not writes:
                continue
            try:
                # Encoding too runs off the loop: the loop is what moves every other tier.
                async with self.wal_lock:
                    await asyncio.to_thread(self.wal.append_writes, writes, self.schemas)
            except Exception as exc:
                with self.hub.cv:
                    self.hub.ledger.log_failed(self.name)
                failures += 1
                self.hub.metrics.wal_failures.inc()
                self.hub.wal_failed = True
                log.error(
                    "persist flight: the WAL append of %d write(s) of %s failed (try %d): %s",
                    len(writes), self.name, failures, exc,
                )  # fmt: skip
                await asyncio.sleep(_backoff(failures))
                self.log_wake.set()
                continue
            failures = 0
            with self.hub.cv:
                settled = self.hub.ledger.logged(self.name, writes, now_us())
            self.hub.wake(settled)
            # Writes taken during the append wait for the next one; the group may be due.
            self.log_wake.set()
            self.commit_wake.set()

    # --- group commits (on the loop) -------------------------------------------------------------

    async def _committer(self) -> None:
        failures = 0
        while True:
            try:
                if not await self._commit_next():
                    return  # the shard is gone
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Whatever went wrong around a commit (setting writes aside on a full disk,
                # say), the writes stay pending and the committer goes on.
                failures += 1
                log.error("persist flight: the committer of %s failed", self.name, exc_info=exc)
                await asyncio.sleep(_backoff(failures))

    async def _commit_next(self) -> bool:
        """Waits for the next group and commits it (one turn of the committer); False once the
        shard is gone."""
        with self.hub.cv:
            if self.hub.ledger.gone(self.name) is not None:
                return False
            group = self.hub.ledger.cut(
                self.name,
                now_us(),
                self.hub.interval_us,
                self.hub.commit_bytes,
                force=self.forcing > 0,
            )
            due = self.hub.ledger.next_cut_us(self.name, self.hub.interval_us)
        if group is None:
            if self.writer.upper is None:
                # Idle, and the shard is gone as the writer's state (kept fresh by its
                # heartbeats) knows it: its calls end now, not at their next write.
                await self._gone(f"shard {self.name} was dropped or finalized")
                return False
            self.commit_wake.clear()
            timeout = _IDLE_S if due is None else min(_IDLE_S, max(0, due - now_us()) / 1e6)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.commit_wake.wait(), timeout)
            return True
        try:
            async with self.wal_lock:
                # The group's writes are in the segments before this one: those can go once
                # it lands.
                await asyncio.to_thread(self.wal.roll)
            outcome = await self.commit(group)
        except Exception as exc:  # commit() turns errors into outcomes: this is a bug
            outcome = Retry(f"{type(exc).__name__}: {exc}")
        with self.hub.cv:
            settled = self.hub.ledger.settle(group, outcome, now_us())
        await self._after(group, outcome, settled)
        return not isinstance(outcome, Gone)

    async def commit(self, group: Group[pa.RecordBatch]) -> Outcome:
        """One try at committing ``group`` at the shard's upper: its part (kept for the next
        try if this one fails), then one ``commit_stream_group``, which decides in the
        transition whether the group landed (here or by an earlier try) and which of its named
        writes landed elsewhere. Every error becomes an outcome (``core.stream.ledger``)."""
        try:
            newest = max((version_of(w.payload) for w in group.fresh), default=0)
            if newest > self.writer.schema_version:
                # A write of a version newer than the writer's: the group goes in at the
                # shard's current version, every earlier version's rows shown in it.
                try:
                    self._use(await self.hub.writers(self.name, None, None))
                except InvalidUsage as exc:
                    return Gone(str(exc))  # dropped or finalized: no writer can be opened
            for _ in range(_MAX_REWRITES):
                fresh = group.fresh
                upper = self.writer.upper
                if upper is None:
                    return Gone(f"shard {self.name} is sealed")
                at = self._time_for(group, fresh, upper)
                batch = await self._stage(group, fresh, at)
                named = [
                    Named(w.writer_id, w.seq, w.lsn, i, w.fingerprint)
                    for i, w in enumerate(fresh)
                    if w.seq >= 0
                ]
                try:
                    async with self.hub.turn(self.name):
                        with self.hub.metrics.commit(self.name):
                            result = await self.writer.commit_stream_group(
                                batch, at, len(fresh), self.hub.server, group.lsn_end, named
                            )
                except UpperMismatch:
                    # Another writer moved the upper past the part; the writer's state is the
                    # latest now (a refusal is only given on it): write the part again, ahead.
                    group.rewrites += 1
                    self.hub.metrics.commit_rewrites.inc()
                    continue
                if isinstance(result, GroupLanded):
                    return Landed(result.at)
                if isinstance(result, ShardGone):
                    return Gone(result.why)
                same, differ = sort_taken(fresh, result.taken)
                if differ:
                    return Refused(differ)
                with self.hub.cv:
                    self.hub.ledger.elsewhere(group, same)
            return Retry(f"other writers moved the upper under {_MAX_REWRITES} tries in a row")
        except LeaseExpired:
            # The server's writer lapsed (the loop stalled past its lease, or a forced drop
            # expired it): a new one writes the part again, under its own prefix.
            self._unstage()
            try:
                self._use(await self.hub.writers(self.name, None, self.writer))
            except InvalidUsage as exc:
                return Gone(str(exc))  # the shard was dropped: no writer can be opened
            except PersistError as exc:
                return Retry(f"the server's writer lapsed, and a new one failed: {exc}")
            return Retry("the server's writer lapsed")
        except ExternalError as exc:
            # The next try finds out whether this one landed (``commit_group`` looks first).
            log.warning("persist flight: a commit of %s failed: %s", self.name, exc)
            return Retry(str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Not an outage: some write can't be committed (it passed the edge, so this is the
            # second line of defence), or a bug. Find the writes that fail on their own.
            upper = self.writer.upper or 0
            bad = await asyncio.to_thread(_refused, group.fresh, self.schemas, upper)
            if bad:
                return Refused(bad)
            log.error("persist flight: a commit of %s failed", self.name, exc_info=exc)
            return Retry(f"{type(exc).__name__}: {exc}")

    def _time_for(
        self, group: Group[pa.RecordBatch], fresh: list[Write[pa.RecordBatch]], upper: int
    ) -> int:
        """The time the group's rows go in at: its staged part's, while the upper has not
        passed it; else the upper, plus room that doubles with each part written again
        (another writer that commits while the part is written would pass it every time: a
        big group behind a busy writer never landed). The times skipped stay empty."""
        staged = self.staged
        if (
            staged is not None
            and staged.group == group.id
            and staged.lsns == tuple(w.lsn for w in fresh)
            and staged.writer is self.writer
            and staged.time >= upper
        ):
            return staged.time
        return upper + (min(1 << group.rewrites, _MAX_AHEAD) if group.rewrites else 0)

    async def _stage(
        self, group: Group[pa.RecordBatch], fresh: list[Write[pa.RecordBatch]], at: int
    ) -> Batch | None:
        """The group's part, its rows at times from ``at``: written now unless the last one
        written holds exactly these writes at this time, by the current writer."""
        staged = self.staged
        lsns = tuple(w.lsn for w in fresh)
        version = self.writer.schema_version
        if (
            staged is not None
            and staged.group == group.id
            and staged.lsns == lsns
            and staged.writer.schema_version == version
        ):
            if staged.time == at and staged.writer is self.writer:
                return staged.batch
            rows = staged.rows
        else:
            if not fresh:
                self._unstage()
                return None
            older = any(version_of(w.payload) != version for w in fresh)
            view = self._view() if older else None
            rows, fps = await asyncio.to_thread(_shaped, fresh, self.schemas, version, view)
            with self.hub.cv:
                for w, fp in zip(fresh, fps, strict=True):
                    w.fingerprint = fp
        first = staged is None or staged.group != group.id
        self._unstage()
        counts = [w.payload.num_rows for w in fresh]
        table = await asyncio.to_thread(at_times, rows, counts, at)
        batch = await self.writer.batch(table, at, at + len(fresh))
        self.staged = _Staged(group.id, lsns, rows, at, self.writer, batch)
        if first:
            with self.hub.cv:
                settled = self.hub.ledger.staged(group, now_us())
            self.hub.wake(settled)
        return batch

    def _unstage(self) -> None:
        """The staged part will not land: deleted once the group is settled."""
        if self.staged is not None:
            self.stale.append(self.staged.batch)
            self.staged = None

    async def _after(
        self,
        group: Group[pa.RecordBatch],
        outcome: Outcome,
        settled: Settled[pa.RecordBatch],
    ) -> None:
        if isinstance(outcome, Retry):
            self.hub.metrics.commit_retries.inc()
            log.warning(
                "persist flight: commit of LSN %d..%d of %s will be tried again (try %d): %s",
                group.writes[0].lsn, group.writes[-1].lsn, self.name, group.attempts, outcome.reason,
            )  # fmt: skip
            await asyncio.sleep(_backoff(group.attempts))
            return
        if isinstance(outcome, Landed):
            self.staged = None  # in the shard now
        else:
            self._unstage()
        if settled.quarantined:
            await self._set_aside(settled.quarantined)
        self.hub.wake(settled)
        if isinstance(outcome, Gone):
            await self._forget_shard(outcome.why)
        else:
            with self.hub.cv:
                resolved = self.hub.ledger.resolved_below(self.name)
            async with self.wal_lock:
                await asyncio.to_thread(self.wal.drop_below, resolved)
        if self.stale and not isinstance(outcome, Retry):
            stale, self.stale = self.stale, []
            for batch in stale:
                # A part of a try that can no longer land; ``delete_batch`` refuses one that
                # did land.
                with contextlib.suppress(PersistError):
                    await self.hub.client.delete_batch(batch)
        self.settled.set()

    async def _set_aside(self, writes: list[tuple[Write[pa.RecordBatch], str]]) -> None:
        """Writes that can never be committed: kept in the WAL's ``quarantine/`` (with why)
        before their segments may go, logged and counted."""
        for w, why in writes:
            async with self.wal_lock:
                path = await asyncio.to_thread(self.wal.quarantine, w, why)
            self.hub.metrics.quarantined.labels(self.hub.metrics.shard(self.name)).inc()
            log.error(
                "persist flight: the write at LSN %d of %s (writer %r, seq %d) can never be "
                "committed and was set aside in %s: %s",
                w.lsn, self.name, w.writer_id, w.seq, path, why,
            )  # fmt: skip

    async def _gone(self, why: str) -> None:
        """The shard is gone with no group out: what it holds is set aside, its calls end."""
        with self.hub.cv:
            settled = self.hub.ledger.shard_gone(self.name, why)
        if settled.quarantined:
            await self._set_aside(settled.quarantined)
        self.hub.wake(settled)
        self._unstage()
        await self._forget_shard(why)

    async def _forget_shard(self, why: str) -> None:
        """The shard is gone (its writes set aside, its calls ended): stop keeping it. Its WAL
        segments hold nothing that is not committed or in ``quarantine/`` now."""
        log.error("persist flight: %s; its streaming writes end", why)
        self.hub.forget(self)
        with self.hub.cv:
            self.hub.ledger.remove_shard(self.name)
            self.hub.cv.notify_all()
        async with self.wal_lock:
            await asyncio.to_thread(self.wal.drop_below, 1 << 63)
            await asyncio.to_thread(self.wal.close)
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()


# --- helpers ---------------------------------------------------------------------------------------


def _shaped(
    writes: list[Write[pa.RecordBatch]],
    schemas: dict[int, pa.Schema],
    version: int,
    view: View | None,
) -> tuple[pa.Table, list[int]]:
    """The writes' rows shaped together in ``version`` (each run of writes of one version
    shaped in its own, then shown in ``version`` through ``view``), and each one's fingerprint
    (of its rows in its own version)."""
    # One chunk, not one per write: encoding, fingerprinting and the recent-parts cache all
    # pay per chunk (a chunk per 1-row write made encoding 20-40 times slower, and the cache
    # hold ~1.5 KB per write that its byte count never saw).
    versions = [version_of(w.payload) for w in writes]
    tables: list[pa.Table] = []
    fps: list[int] = []
    start = 0
    for i in range(1, len(writes) + 1):
        if i < len(writes) and versions[i] == versions[start]:
            continue
        run, v = writes[start:i], versions[start]
        rows = shape_rows([w.payload for w in run], schemas[v]).combine_chunks()
        fps += write_fingerprints(rows, [w.payload.num_rows for w in run])
        if v != version:
            assert view is not None
            # ``View.project`` takes updates: a time for each row, dropped again.
            shown = view.project(at_times(rows, [rows.num_rows], 0), v)
            shown = shown.remove_column(shown.schema.get_field_index(TIME))
            rows = pa.Table.from_arrays(shown.columns, schema=rows_schema(schemas[version]))
        tables.append(rows)
        start = i
    if len(tables) == 1:
        return tables[0], fps
    return pa.concat_tables(tables).combine_chunks(), fps


def _refused(
    writes: list[Write[pa.RecordBatch]], schemas: dict[int, pa.Schema], time: int
) -> dict[int, str]:
    """``refused_writes``, each write judged in its own version."""
    bad: dict[int, str] = {}
    for i, w in enumerate(writes):
        bad.update(refused_writes([w], schemas[version_of(w.payload)], time + i))
    return bad


def _backoff(attempt: int) -> float:
    return float(min(_RETRY_CAP_S, _RETRY_FIRST_S * 2 ** max(0, attempt - 1)))


def _task_died(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persist flight: a streaming-write task stopped", exc_info=task.exception())
