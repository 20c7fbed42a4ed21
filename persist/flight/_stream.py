"""Streaming writes (DoExchange): the thin shell around the ledger (``persist.core.stream.ledger``).

Every promise about a streamed write (its LSN, its acks, what a failed commit leaves pending,
the bytes it holds) is the ledger's, kept behind one lock. This module keeps the shards and the
calls and only carries out what the ledger asks:

- a call's gRPC thread checks each write at the edge (``core.arrow.shaping.EdgeCheck``: whatever a
  commit would refuse is refused here, before its ``MEMORY`` ack, ending only that call), then
  hands it to the ledger under the lock (``Streams.accept``);
- per shard, a flusher and a committer (``_commits.ShardWork``) move the writes on to the WAL
  (``LOCAL_DISK``), a blob part (``OBJECT_STORAGE``) and the shard (``COMMITTED``);
- a call's ack thread sends whatever acks the ledger queued for it (``take_acks``);
- at start, ``recover`` commits what a crashed run logged, whatever happened to the shards
  meanwhile: a shard that is gone gets its writes set aside, and the server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from persist.core.arrow.casts import differences
from persist.core.arrow.shaping import EdgeCheck, rows_schema
from persist.core.arrow.updates import DIFF, check_schema
from persist.core.stream.durability import TIER_NAMES, Over, Refuse, Settled, Tier, Wait, Write
from persist.core.stream.ledger import Ledger
from persist.errors import ExternalError, InvalidUsage, PersistError
from persist.flight._commits import CommitTurn, Hub, ShardWork, Writers, now_us
from persist.flight._protocol import write_seq
from persist.flight._wal import Recovery, Wal, version_tag
from persist.flight._wal_format import VERSION_KEY
from persist.ids import ShardId

if TYPE_CHECKING:
    from persist.client import PersistClient
    from persist.flight._metrics import Metrics
    from persist.write import WriteHandle

__all__ = ["CallInfo", "Streams", "version_for"]

log = logging.getLogger("persist")

# A gRPC thread that must wait (for room, an LSN reservation) looks this often whether its call
# was cancelled.
_POLL_S = 0.1

# Counted against the buffer per write besides its Arrow bytes (``accept``).
_WRITE_OVERHEAD = 1024

# Runs work in the background, kept referenced and awaited by the drain (the server's).
Spawn = Callable[[Coroutine[Any, Any, Any]], None]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a DoExchange's gRPC thread needs of its call."""

    id: int
    shard: str
    schema: pa.Schema  # the data columns of the version of the shard's schema it writes
    writer_id: str | None
    # The call's write counters (writes, bytes), labelled once, not per write.
    counters: tuple[Any, Any]
    check: EdgeCheck  # what a commit would refuse of a write of its version
    # Each write's schema metadata becomes this (its version's mark, ``version_tag``), when
    # ``retag``: writes of version 0 keep theirs unless the client sent a mark of its own.
    tag: pa.KeyValueMetadata | None = None
    retag: bool = False


class Streams:
    """The server's streaming writes. gRPC threads call ``accept``, ``end_call``, ``drop_call``,
    ``wait_room`` and ``take_acks``; everything else runs on the event loop."""

    def __init__(
        self,
        client: PersistClient,
        metrics: Metrics,
        writers: Writers,
        turn: CommitTurn,
        spawn: Spawn,
        wal_dir: Path,
        server: str,
        *,
        commit_interval_ms: float,
        commit_bytes: int,
        max_buffer_bytes: int,
    ) -> None:
        self._metrics = metrics
        self._writers = writers
        self._spawn = spawn
        self._wal_dir = wal_dir
        self.server = server
        self._loop = asyncio.get_running_loop()
        # The one lock: every ledger call is made under it. Waiters for room or for an LSN
        # reservation wait on it too.
        self._cv = threading.Condition()
        self.ledger: Ledger[pa.RecordBatch] = Ledger(server, max_buffer_bytes)
        self._hub = Hub(
            self.ledger,
            self._cv,
            server,
            client,
            metrics,
            writers,
            turn,
            self._wake,
            self._forget,
            int(commit_interval_ms * 1000),
            commit_bytes,
        )
        self._shards: dict[str, ShardWork] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._ack_ready: dict[int, threading.Event] = {}
        # Each tier's counter, labelled at its first ack (a label lookup per ack message was a
        # third of counting it; a series made before any ack would show acks that never were).
        self._ack_counters: list[Any] = [None] * len(Tier)
        self._closed = False

    # --- shards (on the loop) --------------------------------------------------------------------

    async def open_call(
        self,
        shard: str,
        writer_id: str | None,
        levels: frozenset[Tier],
        schema: pa.Schema | None,
        stream: pa.Schema | None = None,
    ) -> CallInfo:
        """A DoExchange call into ``shard``, taking writes of the stream's schema (``stream``;
        None: the current version's), of the version of the shard's schema whose columns they
        are (the current one or an earlier one: ``version_for``); a new shard is created with
        ``schema`` (the stream's columns, less ``_diff``)."""
        while True:
            s = await self._shard(shard, schema)
            version = s.writer.schema_version
            if stream is not None:
                known = await self._hub.client.schemas(shard)
                s.schemas.update(known)
                data = pa.schema([f for f in stream if f.name != DIFF])
                # None: no version takes them; checked as the writer's version's, the first
                # write is refused (as any bad write is), naming why.
                found = version_for(known, data)
                version = version if found is None else found
            with self._cv:
                # The shard may have gone (a drop) while this call awaited: it is then opened
                # anew, which refuses the call with the reason, never a call into a shard that
                # is no longer kept.
                if self._shards.get(shard) is s:
                    call_id = self.ledger.open_call(shard, writer_id, levels)
                    self._ack_ready[call_id] = threading.Event()
                    break
        tag = version_tag(version)
        retag = tag is not None or (stream is not None and VERSION_KEY in (stream.metadata or {}))
        label = self._metrics.shard(shard)
        counters = (
            self._metrics.writes.labels("do_exchange", label),
            self._metrics.write_bytes.labels("do_exchange", label),
        )
        return CallInfo(
            call_id,
            shard,
            s.schemas[version],
            writer_id,
            counters,
            s.check_for(version),
            tag,
            retag,
        )

    async def _shard(self, shard: str, schema: pa.Schema | None) -> ShardWork:
        s = self._shards.get(shard)
        if s is not None:
            return s
        async with self._opening.setdefault(shard, asyncio.Lock()):
            s = self._shards.get(shard)
            if s is None:
                s = await self.open_shard(shard, schema)
        return s

    async def open_shard(
        self, shard: str, schema: pa.Schema | None, recovered: Recovery | None = None
    ) -> ShardWork:
        """Starts streaming into ``shard`` (``InvalidUsage`` when it is gone), with the writes
        a crashed run logged (``recovered``) pending again."""
        if self._closed:
            raise InvalidUsage("the server is shutting down")
        writer = await self._writers(shard, schema, None)
        upper = await writer.fetch_recent_upper()  # the state, fresh: what this server resolved
        if upper is None:
            raise InvalidUsage(f"shard {shard} is sealed: it takes no more writes")
        # Every version's columns: recovered writes (and calls) may be of any of them.
        versions = dict(await self._hub.client.schemas(shard))
        versions[writer.schema_version] = writer.schema
        directory = self._wal_dir / shard
        floor = await asyncio.to_thread(Wal.read_floor, directory)
        set_aside = await asyncio.to_thread(Wal.list_quarantine, directory)
        wal = Wal(directory, _logged(writer), recovered.segments if recovered else [])
        s = ShardWork(self._hub, shard, writer.schema, wal, writer, versions)
        # Each recovered write is read under its segment's schema: it keeps its version.
        writes = [
            (lsn, r.writer_id, seq, rows.nbytes, rows)
            for r in (recovered.records if recovered else [])
            for lsn, seq, rows in wal.unpacked(r, recovered.schema_of(r) if recovered else None)
        ]
        with self._cv:
            self.ledger.add_shard(
                shard,
                writer.stream_resolved(self.server),
                floor,
                writes,
                [e["lsn"] for e in set_aside if e["lsn"] is not None],
                now_us(),
            )
        try:
            # No LSN is handed out before the first reservation is on disk.
            await self._reserve(s)
        except BaseException:
            with self._cv:
                self.ledger.remove_shard(shard)  # its recovered writes are still in the WAL
            raise
        self._shards[shard] = s
        s.start()
        return s

    async def recover(self, clean: bool) -> None:
        """Commits what an earlier run logged and did not commit, before the server takes
        calls: every write acked ``LOCAL_DISK`` exactly once, whatever other writers did to its
        shard meanwhile. A shard that is gone has those writes set aside (``quarantine/``);
        damage found in a WAL is reported and kept aside (``_wal``). ``clean``: the earlier run
        drained (so a WAL's cut-off tail is damage, not a write torn by a crash)."""
        wal_dir = self._wal_dir
        if not await asyncio.to_thread(wal_dir.is_dir):
            return
        dirs = await asyncio.to_thread(lambda: sorted(p for p in wal_dir.iterdir() if p.is_dir()))
        for directory in dirs:
            try:
                shard = str(ShardId(directory.name))
            except InvalidUsage:
                continue
            await self._recover_shard(shard, directory, clean)

    async def _recover_shard(self, shard: str, directory: Path, clean: bool) -> None:
        gone: str | None = None
        hint: pa.Schema | None = None
        try:
            hint = _logged(await self._writers(shard, None, None))
        except InvalidUsage as exc:
            gone = str(exc)  # dropped, finalized, or unknown: nothing of it can commit
        found = await asyncio.to_thread(Wal.recover, directory, hint, clean)
        for d in found.damage:
            self._metrics.wal_failures.inc()
            log.error(
                "persist flight: the WAL of %s is damaged: %s (bytes %d..%d of %s); the "
                "segment is kept in %s, the records that pass their checksums are recovered",
                shard, d.why, d.offset, d.offset + d.nbytes, d.path, d.quarantined_as,
            )  # fmt: skip
        for t in found.torn:
            log.warning(
                "persist flight: the WAL of %s ends in a write torn by a crash (bytes %d..%d "
                "of %s): it was never acknowledged LOCAL_DISK",
                shard, t.offset, t.offset + t.nbytes, t.path,
            )  # fmt: skip
        lsns = sorted({lsn for r in found.records for lsn in r.lsns})
        if lsns and gone is None:
            try:
                await self.open_shard(shard, None, found)
            except InvalidUsage as exc:
                gone = str(exc)  # sealed
            else:
                await self.flush_and_commit(shard)
                log.warning(
                    "persist flight: recovered %d logged write(s) of %s (LSN %d..%d)",
                    len(lsns), shard, lsns[0], lsns[-1],
                )  # fmt: skip
                return
        if lsns and gone is not None:
            await self._set_aside_backlog(shard, directory, found, gone)
        for seg in found.segments:
            await asyncio.to_thread(seg.path.unlink, missing_ok=True)

    async def _set_aside_backlog(
        self, shard: str, directory: Path, found: Recovery, why: str
    ) -> None:
        """Sets aside the logged writes of a shard that is gone, except those this server
        committed before it went (its state says so, tombstone included)."""
        try:
            info = await self._hub.client.inspect(shard)
            resolved = info["streams"].get(self.server, {}).get("resolved_lsn", 0)
        except PersistError:
            resolved = 0
        wal = Wal(directory, found.schema or pa.schema([]), [])
        seen: set[int] = set()
        for record in found.records:
            for lsn, seq, rows in wal.unpacked(record, found.schema_of(record)):
                if lsn < resolved or lsn in seen:
                    continue
                seen.add(lsn)
                w = Write(lsn, None, record.writer_id, seq, rows.nbytes, rows, now_us())
                path = await asyncio.to_thread(wal.quarantine, w, why)
                self._metrics.quarantined.labels(self._metrics.shard(shard)).inc()
                log.error(
                    "persist flight: the logged write at LSN %d of %s (writer %r, seq %d) can "
                    "never be committed and was set aside in %s: %s",
                    lsn, shard, record.writer_id, seq, path, why,
                )  # fmt: skip

    async def _reserve(self, s: ShardWork) -> None:
        """Makes the next LSN reservation durable, if one is due (raises if it can't)."""
        with self._cv:
            due = self.ledger.reservation_due(s.name)
        if due is not None and not await self._make_durable(s, due):
            raise ExternalError(
                f"the LSN reservation of {s.name} could not be written", determinate=True
            )

    async def _make_durable(self, s: ShardWork, ceiling: int) -> bool:
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
            if self.ledger.keeps(s.name):  # not gone meanwhile
                self.ledger.reserved(s.name, ceiling if ok else None)
            self._cv.notify_all()
        return ok

    # --- on a call's gRPC thread -----------------------------------------------------------------

    def wait_room(self, call: CallInfo, cancelled: Callable[[], bool]) -> bool:
        """Waits until the call's shard may take another write (True), or ``cancelled()``."""
        with self._cv:
            if self._has_room(call.shard):
                return True
            self._metrics.backpressure_waits.inc()
            while not self._has_room(call.shard):
                if cancelled():
                    return False
                self._cv.wait(_POLL_S)
        return True

    def _has_room(self, shard: str) -> bool:
        return shard not in self._shards or self.ledger.has_room(shard)

    def accept(
        self,
        call: CallInfo,
        batch: pa.RecordBatch,
        metadata: bytes | None,
        cancelled: Callable[[], bool],
    ) -> bool:
        """Takes one write of a call; False once the call takes no more (its write was bad, or
        it failed meanwhile: ``take_acks`` gives the error)."""
        s = self._shards.get(call.shard)
        if s is None:
            return False  # the shard went away: the call heard it
        try:
            seq = write_seq(metadata, call.writer_id)
            # Checked, not shaped: the flusher and the committer shape many writes at once.
            call.check(batch)
        except PersistError as exc:
            with self._cv:
                settled = self.ledger.fail_call(call.id, exc)
            self._wake(settled)
            return False
        # What a write holds until it commits: its Arrow bytes, and the objects around them
        # (a 1-row write's ~44 bytes of data cost ~1.5 KB in all). Its buffers' sizes, not
        # ``nbytes``: the IPC reader cuts a batch's buffers to its own data, and ``nbytes``
        # (which works out what slices reference) took 8-14 us of the GIL per write.
        size = batch.get_total_buffer_size()
        nbytes = size + _WRITE_OVERHEAD
        if call.retag:
            batch = batch.replace_schema_metadata(call.tag)  # the write's version goes with it
        with self._cv:
            while True:
                got = self.ledger.accept(
                    call.id, seq, nbytes, batch, now_us(), s.recorded, s.fingerprint
                )
                # The next reservation is made long before this one runs out; a failed one is
                # asked for again here while writers wait for it.
                due = None if isinstance(got, Over) else self.ledger.reservation_due(call.shard)
                if due is not None:
                    self._loop.call_soon_threadsafe(self._spawn, self._make_durable(s, due))
                if not isinstance(got, Wait):
                    break
                if cancelled():
                    return False
                self._cv.wait(_POLL_S)
            if isinstance(got, Over | Refuse):
                taken = False
            else:
                taken = True
                wake_flusher = not got.replay and not s.log_asked
                if wake_flusher:
                    s.log_asked = True
        if taken and wake_flusher:
            self._loop.call_soon_threadsafe(s.log_wake.set)
        event = self._ack_ready.get(call.id)  # gone if the call failed meanwhile
        if event is not None:
            event.set()
        if not taken:
            return False
        writes, written = call.counters
        writes.inc()
        written.inc(size)
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
        return acks, over, error

    def count_acks(self, tiers: np.ndarray[Any, Any]) -> None:
        """Counts the acks of one message, given their tiers."""
        counters = self._ack_counters
        for tier, n in enumerate(np.bincount(tiers, minlength=len(Tier))):
            if n:
                if counters[tier] is None:
                    counters[tier] = self._metrics.acks.labels(TIER_NAMES[tier])
                counters[tier].inc(int(n))

    def _forget(self, s: ShardWork) -> None:
        """``s`` is gone: calls into it open it anew (and hear that it is gone)."""
        if self._shards.get(s.name) is s:
            del self._shards[s.name]

    def _wake(self, settled: Settled[pa.RecordBatch]) -> None:
        for call_id in settled.calls:
            event = self._ack_ready.get(call_id)
            if event is not None:
                event.set()
        with self._cv:
            self._cv.notify_all()  # room freed, a shard's failing commit landed, a shard gone

    # --- what actions and the drain ask (on the loop) --------------------------------------------

    async def flush_and_commit(self, shard: str) -> None:
        """Logs and commits every write the shard took so far (retrying until it lands, or the
        shard is gone)."""
        s = self._shards.get(shard)
        if s is None:
            return
        s.forcing += 1
        try:
            while self._shards.get(shard) is s:
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
                self.ledger.close_shard(s.name)
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
            if self._shards.get(s.name) is not s:
                continue  # gone meanwhile: its WAL is closed
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

    @property
    def wal_failed(self) -> bool:
        """Whether a WAL append failed in this run (it left a torn tail behind it)."""
        return self._hub.wal_failed


def _logged(writer: WriteHandle) -> pa.Schema:
    """The schema of the rows of ``writer``'s version in the WAL (marked with the version)."""
    return rows_schema(writer.schema).with_metadata(version_tag(writer.schema_version))


def version_for(versions: list[tuple[int, pa.Schema]], schema: pa.Schema) -> int | None:
    """Of a shard's ``versions`` (oldest first), the one data of ``schema`` is written in, as
    ``open_writer`` chooses it: the newest whose schema ``schema`` is (names, order, types
    and nullability; views and dictionaries as their values), else the newest that takes its
    columns (in any order, each type widened losslessly, a nullable column for a NOT NULL
    field); None if none does."""
    try:
        wanted = check_schema(schema)
    except InvalidUsage:
        return None
    for number, known in reversed(versions):
        if len(known) == len(wanted) and all(
            a.name == b.name and a.type == b.type and a.nullable == b.nullable
            for a, b in zip(known, wanted, strict=True)
        ):
            return int(number)
    for number, known in reversed(versions):
        if not differences(wanted, known):
            return int(number)
    return None
