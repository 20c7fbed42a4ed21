"""``connect`` and ``PersistClient``: the entry point to shards at one location."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa

from persist.batch import Batch, RecentParts, delete_parts
from persist.catalog import read_catalog
from persist.config import PersistConfig
from persist.core import catalog as cat
from persist.core.arrow.casts import differences
from persist.core.arrow.updates import check_schema
from persist.core.shard import garbage, keys
from persist.core.shard import lifecycle as life
from persist.core.shard.clock import Now
from persist.core.shard.transitions import Outcome, register_reader, register_writer
from persist.core.shard.types import HollowBatch, State
from persist.errors import InvalidUsage, LeaseExpired
from persist.fetch import (
    MissingPart,
    Split,
    read_split,
    schema_from_bytes,
    stream_raw,
    stream_split,
)
from persist.ids import ShardId, new_id
from persist.internal.machine import Machine
from persist.internal.maintenance import Maintenance
from persist.internal.tasks import Tasks
from persist.lifecycle import ShardLifecycle
from persist.location import Blob, Consensus, open_blob, open_consensus
from persist.plan import SPLIT_BYTES, SnapshotPlan, make_plan
from persist.read import ReadHandle
from persist.scan import ScanPlan, make_scan_plan
from persist.write import WriteHandle

__all__ = ["PersistClient", "connect", "default_locations"]

log = logging.getLogger("persist")

ENV_BLOB = "PERSIST_BLOB_URI"
ENV_CONSENSUS = "PERSIST_CONSENSUS_URI"


# A purpose is a label, copied into consensus with each heartbeat and write of its handle.
MAX_PURPOSE_BYTES = 64 * 1024


# A lease longer than this would be a registration nobody can count on going away.
_MAX_LEASE_S = 7 * 24 * 3600

# How long ``close`` waits for cleanup started by cancelled or failed calls (an expiry is one
# consensus write, retried) before it stops it.
_CLEANUP_GRACE_S = 10.0

# How long ``close`` tries to expire the handles the client registered (one consensus write
# per shard): a consensus that is down must not hold a script's exit for minutes, and what is
# left runs out with its lease anyway.
_EXPIRE_ON_CLOSE_S = 5.0


def check_purpose(purpose: object) -> str:
    """``purpose`` if it is text persist can store (UTF-8, at most 64 KiB); else InvalidUsage."""
    if not isinstance(purpose, str):
        raise InvalidUsage(f"purpose must be a str, not {type(purpose).__name__}")
    try:
        size = len(purpose.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidUsage(f"purpose is not valid UTF-8 text: {exc}") from None
    if size > MAX_PURPOSE_BYTES:
        raise InvalidUsage(f"purpose is {size} bytes; at most {MAX_PURPOSE_BYTES} are allowed")
    return purpose


def default_locations() -> tuple[str, str]:
    """The blob and consensus URIs ``connect()`` uses without arguments."""
    base = Path.cwd() / "persist-data"
    blob = os.environ.get(ENV_BLOB) or (base / "blob").as_uri()
    consensus = os.environ.get(ENV_CONSENSUS) or f"sqlite://{base / 'consensus.db'}"
    return blob, consensus


class _Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


async def connect(
    blob: str | Blob | None = None,
    consensus: str | Consensus | None = None,
    *,
    config: PersistConfig | None = None,
) -> PersistClient:
    """A client for the shards at one location.

    ``blob``: ``file:///abs/dir`` | ``s3://bucket/prefix?endpoint_url=..&region=..`` |
    ``mem://name`` (or a ``Blob``). ``consensus``: ``postgresql://...`` | ``sqlite:///abs/path.db``
    | ``mem://name`` (or a ``Consensus``). Without them: ``PERSIST_BLOB_URI`` /
    ``PERSIST_CONSENSUS_URI``, else a file blob and a SQLite consensus under ``./persist-data/``.
    """
    default_blob, default_consensus = default_locations()
    b = blob if isinstance(blob, Blob) else open_blob(blob or default_blob)
    c = (
        consensus
        if isinstance(consensus, Consensus)
        else open_consensus(consensus or default_consensus)
    )
    return PersistClient(b, c, config or PersistConfig())


class PersistClient(ShardLifecycle):
    """Opens handles on shards of one location; runs their background work.

    Use as ``async with client:`` or call ``await client.close()``: closing expires the handles
    the client registered (not those it resumed or ``detach``ed), stops heartbeats and
    background work and releases connections.

    Every call that takes a shard id takes a shard's name too (``create_shard``), looked up when
    the call is made; a handle holds the id, so a later rename doesn't move it. Opening with a
    schema creates a shard that doesn't exist yet: under a new name, the shard is created and
    named at once.
    """

    def __init__(self, blob: Blob, consensus: Consensus, config: PersistConfig) -> None:
        self.blob = blob
        self.consensus = consensus
        self.config = config
        self._tasks = Tasks(config.compaction_concurrency)
        self._machines: dict[str, Machine] = {}
        self._recent = RecentParts(config.recent_parts_bytes)
        self._maintenance: dict[str, Maintenance] = {}
        self._cleanups: set[asyncio.Task[Any]] = set()
        self._lifecycle = _Lifecycle.OPEN

    async def __aenter__(self) -> PersistClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Expires the writers and readers this client registered (``open_writer``,
        ``open_leased_reader``, ``open``, the plans' readers) and has not expired, stops
        background work and closes the location's connections. Idempotent.

        Left registered: handles resumed from another process (their registration is that
        process's) and handles ``detach``ed (handed to one); they stop heartbeating here and
        last until their leases run out unless another process heartbeats or expires them.
        Expiring is best effort within a few seconds, so that a consensus that is down can't
        hold the close: what could not be expired is logged (a warning naming the handles)
        and left to its leases."""
        if self._lifecycle is _Lifecycle.CLOSED:
            return
        self._lifecycle = _Lifecycle.CLOSED
        # From here handles refuse use as closed (a read woken by its reader's expiry too),
        # and nothing new starts in the background.
        self._tasks.closed = True
        if self._cleanups:
            # A handle whose call failed is let go for real, not left to its lease.
            await asyncio.wait(list(self._cleanups), timeout=_CLEANUP_GRACE_S)
        await self._expire_registered()
        for machine in self._machines.values():
            if machine.stop_watching is not None:
                machine.stop_watching()
        await self._tasks.close()
        await asyncio.gather(self.blob.close(), self.consensus.close(), return_exceptions=True)

    async def _expire_registered(self) -> None:
        """Expires every shard's ``registered`` handles, a commit per shard, all at once and
        for at most ``_EXPIRE_ON_CLOSE_S``; logs those left registered."""
        machines = [m for m in self._machines.values() if m.registered and m.loaded]
        if not machines:
            return

        async def expire(machine: Machine) -> None:
            ids = frozenset(machine.registered)
            # Housekeeping: nothing for maintenance to do about it as the client goes.
            await machine.apply(lambda s, now: life.expire_handles(s, ids, now), housekeeping=True)
            machine.registered.difference_update(ids)

        tries = [asyncio.ensure_future(expire(m)) for m in machines]
        for t in tries:
            # One that outlives its cancellation fails later, unawaited: its failure is logged
            # below (or was), not again by asyncio.
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        _, pending = await asyncio.wait(tries, timeout=_EXPIRE_ON_CLOSE_S)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for machine, t in zip(machines, tries, strict=True):
            if not machine.registered:
                continue
            failure = None if t in pending or t.cancelled() else t.exception()
            log.warning(
                "persist: close could not expire %s of shard %s (%s); they stay registered "
                "until their leases run out",
                ", ".join(sorted(machine.registered)),
                machine.shard_id,
                f"no answer within {_EXPIRE_ON_CLOSE_S:g} s"
                if failure is None
                else f"{type(failure).__name__}: {failure}",
            )

    def _check_open(self) -> None:
        if self._lifecycle is not _Lifecycle.OPEN:
            raise InvalidUsage("the persist client was closed")

    def _clean_up(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Runs ``coro`` in the background (a cancelled caller returns at once); ``close`` waits
        for it, a bounded time, before it stops background work."""
        task = self._tasks.spawn(coro, name)
        if task is not None:
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    # --- opening -------------------------------------------------------------------------------

    async def _resolve(self, shard: object) -> ShardId:
        """The id of ``shard``: a shard id as is, a name as the catalog has it now."""
        if isinstance(shard, ShardId):
            return shard
        if cat.is_name(shard):
            assert isinstance(shard, str)
            sid = await self._named(shard)
            if sid is None:
                raise InvalidUsage(f"no shard is named {shard!r}")
            return sid
        if isinstance(shard, str) and "-" in shard:
            return ShardId(shard)  # says what a shard id is
        shown = repr(shard) if len(repr(shard)) <= 80 else repr(shard)[:77] + "..."
        raise InvalidUsage(
            f"not a shard id or name: {shown} (an id is 's' followed by a UUID; a name is "
            f"dotted words, e.g. 'sales.orders')"
        )

    async def _named(self, name: str) -> ShardId | None:
        _, catalog = await read_catalog(self.consensus, self.config)
        entry = catalog.names.get(name)
        return None if entry is None else ShardId(entry.shard_id)

    async def _machine(self, shard_id: object) -> Machine:
        self._check_open()
        sid = await self._resolve(shard_id)
        machine = self._machines.get(sid)
        if machine is None:
            machine = Machine(
                sid, self.blob, self.consensus, self.config, self._tasks, self._recent
            )
            maintenance = Maintenance(machine)
            machine.on_commit = maintenance.kick
            self._machines[sid] = machine
            self._maintenance[sid] = maintenance
        return machine

    async def _open_shard(self, shard_id: object, schema: object) -> tuple[Machine, pa.Schema]:
        if schema is None:
            # Without a schema the shard must exist: its own is taken.
            # (A finalized shard is refused by the registration, as with a schema.)
            machine = await self._loaded(str(shard_id))
            return machine, schema_from_bytes(machine.state.schema)
        checked = check_schema(schema)
        if cat.is_name(shard_id) and await self._named(str(shard_id)) is None:
            # As an id that names no shard yet, a new name creates the shard (under it).
            with contextlib.suppress(InvalidUsage):  # taken meanwhile: open that shard
                await self.create_shard(str(shard_id), checked)
        machine = await self._machine(shard_id)
        state = await machine.load_or_create(checked.serialize().to_pybytes())
        stored = schema_from_bytes(state.schema)
        problems = differences(checked, stored)
        if problems:
            raise InvalidUsage(
                f"shard {machine.shard_id}'s schema is not the one given: " + "; ".join(problems)
            )
        return machine, stored

    def _lease_ms(self, lease_duration_s: object) -> int:
        if lease_duration_s is None:
            return self.config.lease_duration_ms
        if (
            isinstance(lease_duration_s, bool)
            or not isinstance(lease_duration_s, int | float)
            or not math.isfinite(lease_duration_s)
            or not 0.001 <= lease_duration_s <= _MAX_LEASE_S
        ):
            raise InvalidUsage(
                f"lease_duration_s must be a number of seconds in [0.001, {_MAX_LEASE_S}], "
                f"not {lease_duration_s!r}"
            )
        return int(lease_duration_s * 1000)

    async def open_writer(
        self,
        shard_id: str,
        schema: pa.Schema | None = None,
        purpose: str = "",
        *,
        lease_duration_s: float | None = None,
    ) -> WriteHandle:
        """A writer of ``shard_id`` (created with ``schema`` if new; else ``schema`` must match).
        Without ``schema`` the shard must exist (else ``InvalidUsage``) and its schema is used.

        ``purpose`` is a label for ``inspect`` and logs (text, at most 64 KiB).
        ``lease_duration_s`` (default: the client's) is how long the writer stays registered
        without a heartbeat."""
        purpose = check_purpose(purpose)
        lease_ms = self._lease_ms(lease_duration_s)
        machine, stored = await self._open_shard(shard_id, schema)
        writer_id = new_id("w")
        machine.own.add(writer_id)
        machine.registered.add(writer_id)
        await machine.apply(lambda s, now: register_writer(s, writer_id, purpose, lease_ms, now))
        log.debug(
            "persist: opened writer %s of shard %s (%r)", writer_id, machine.shard_id, purpose
        )
        return WriteHandle(machine, writer_id, stored, lease_ms)

    async def open_leased_reader(
        self,
        shard_id: str,
        schema: pa.Schema | None = None,
        purpose: str = "",
        *,
        lease_duration_s: float | None = None,
    ) -> ReadHandle:
        """A reader of ``shard_id`` holding the shard's current since (created if new).
        Without ``schema`` the shard must exist (else ``InvalidUsage``) and its schema is used.

        ``purpose`` is a label for ``inspect`` and logs (text, at most 64 KiB).
        ``lease_duration_s`` (default: the client's) is how long the reader holds the since
        without a heartbeat."""
        purpose = check_purpose(purpose)
        lease_ms = self._lease_ms(lease_duration_s)
        machine, stored = await self._open_shard(shard_id, schema)
        reader_id = new_id("r")
        machine.own.add(reader_id)
        machine.registered.add(reader_id)
        since = await machine.apply(
            lambda s, now: register_reader(s, reader_id, purpose, lease_ms, now)
        )
        log.debug(
            "persist: opened reader %s of shard %s at since %s (%r)",
            reader_id,
            machine.shard_id,
            since,
            purpose,
        )
        return ReadHandle(machine, reader_id, stored, since, lease_ms)

    async def open(
        self,
        shard_id: str,
        schema: pa.Schema | None = None,
        purpose: str = "",
        *,
        lease_duration_s: float | None = None,
    ) -> tuple[WriteHandle, ReadHandle]:
        """A writer and a leased reader of ``shard_id``."""
        write = await self.open_writer(shard_id, schema, purpose, lease_duration_s=lease_duration_s)
        read = await self.open_leased_reader(
            shard_id, schema, purpose, lease_duration_s=lease_duration_s
        )
        return write, read

    async def resume_writer(self, shard_id: str, writer_id: str) -> WriteHandle:
        """A handle on writer ``writer_id``, registered by any process: it heartbeats (at once,
        then in the background, by that writer's lease), writes, and expires it as the handle
        that opened it would. ``LeaseExpired`` if the writer is not registered."""
        machine, writer_id = await self._loaded_with(shard_id, writer_id, "writer")
        writer = machine.state.writers[writer_id]
        schema = schema_from_bytes(machine.state.schema)
        handle = WriteHandle(machine, writer_id, schema, writer.lease_duration_ms)
        await handle.heartbeat()
        return handle

    async def resume_reader(self, shard_id: str, reader_id: str) -> ReadHandle:
        """A handle on reader ``reader_id``, registered by any process: it heartbeats (at once,
        then in the background, by that reader's lease), reads at or after the reader's since,
        and expires it as the handle that opened it would. Every split any handle of this
        reader handed out stays fetchable while this handle holds the since at or below the
        split's ``as_of``. ``LeaseExpired`` if the reader is not registered."""
        machine, reader_id = await self._loaded_with(shard_id, reader_id, "reader")
        reader = machine.state.readers[reader_id]
        schema = schema_from_bytes(machine.state.schema)
        # Splits handed out by any handle of this reader name parts of state versions from
        # the reader's recorded seqno_since on: holding it (for times at or above the since)
        # keeps them from garbage collection while this handle heartbeats.
        holds = () if reader.since is None else ((reader.since, reader.seqno_since),)
        handle = ReadHandle(
            machine,
            reader_id,
            schema,
            reader.since,
            reader.lease_duration_ms,
            split_holds=holds,
        )
        await handle.heartbeat()
        return handle

    async def _loaded_with(
        self, shard_id: str, handle_id: object, kind: str
    ) -> tuple[Machine, str]:
        """The shard's machine, once its latest state has ``kind`` ``handle_id`` registered."""
        machine = await self._loaded(shard_id)
        hid = str(handle_id)
        state = machine.state
        if hid not in (state.writers if kind == "writer" else state.readers):
            raise LeaseExpired(f"{kind} {hid} is not registered (lease expired?)")
        machine.own.add(hid)  # this client heartbeats it from now on
        return machine, hid

    # --- planned reads --------------------------------------------------------------------------

    async def plan_snapshot(
        self,
        shard_id: str,
        *,
        as_of: int | None = None,
        splits: int | None = None,
        split_bytes: int = SPLIT_BYTES,
        parallelism: int = 1,
        drop_empty_splits: bool = False,
        wait: bool = True,
        empty_if_unwritten: bool = False,
        purpose: str = "",
        lease_duration_s: float | None = None,
    ) -> SnapshotPlan:
        """A snapshot read of ``shard_id`` planned for handing out: a new leased reader holding
        the since at ``as_of`` and the snapshot's key-range splits (see ``ReadHandle.snapshot``).

        - ``as_of`` defaults to the shard's upper - 1. A finished shard (upper None) has no
          default: ``InvalidUsage``. Nor has a shard with nothing written (upper 0):
          ``InvalidUsage``, or with ``empty_if_unwritten`` an empty plan (``as_of`` and
          ``reader`` None, no splits) that registers nothing.
        - ``as_of`` below the shard's since: ``InvalidUsage`` naming both.
        - ``as_of >= upper``: with ``wait`` (the default) waits until the upper passes it (cancel
          the call to give up); else ``InvalidUsage`` naming both, without waiting.
        - ``splits``: exactly that many splits; None: one per ``split_bytes`` of the snapshot's
          parts, and at least ``parallelism`` (the cores that will fetch them) as long as each
          gets ``MIN_SPLIT_BYTES`` (8 MiB) of parts; at least one. ``drop_empty_splits``
          leaves out those naming no part (their key range holds nothing); a plan left with
          none holds nothing (``reader`` None).
        - The reader (``purpose``, ``lease_duration_s`` as for ``open_leased_reader``) holds its
          since at ``as_of`` when this returns; it moves there only after the wait, so however
          the wait ends, the since never passed what it was.
        - If this raises (or is cancelled), the reader it registered is expired in the
          background (``close`` waits for that), and the shard's since is where it was.
        The caller owns the reader: it heartbeats in the background, and expiring it (or its
        lease running out) ends the hold; the splits can't be fetched after that.
        """
        purpose = check_purpose(purpose)
        self._lease_ms(lease_duration_s)
        return await make_plan(
            self,
            shard_id,
            as_of=as_of,
            splits=splits,
            split_bytes=split_bytes,
            parallelism=parallelism,
            drop_empty_splits=drop_empty_splits,
            wait=wait,
            empty_if_unwritten=empty_if_unwritten,
            purpose=purpose,
            lease_duration_s=lease_duration_s,
            clean_up=self._clean_up,
        )

    # --- batches and splits --------------------------------------------------------------------

    async def fetch_split(self, split: Split) -> pa.Table:
        """The consolidated updates of one split (see ``ReadHandle.snapshot``)."""
        self._check_open()
        if not isinstance(split, Split):
            raise InvalidUsage(f"expected persist.Split, got {type(split).__name__}")
        try:
            return await read_split(self.blob, self.config, split, self._recent)
        except MissingPart as exc:
            raise _gone(exc, split) from None

    async def fetch_split_batches(
        self, split: Split, max_bytes: int = 64 << 20, *, consolidate: bool = True
    ) -> AsyncIterator[pa.RecordBatch]:
        """The rows of ``fetch_split(split)`` (same schema, consolidated, in key order) as a
        stream of record batches, read piece by piece: memory holds about ``max_bytes`` of
        decoded parts at a time (plus a row group per part at the ends of each piece), never
        the whole split. Used as ``async for batch in client.fetch_split_batches(split)``.

        ``consolidate=False`` skips the merge where it can (a snapshot split's piece with no
        retraction): such a piece's rows come unordered and may repeat, each row's diffs
        summing to its multiplicity; a piece with a retraction is consolidated as usual. For
        readers of the contents as a multiset of rows, which need no merge for that."""
        self._check_open()
        if not isinstance(split, Split):
            raise InvalidUsage(f"expected persist.Split, got {type(split).__name__}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InvalidUsage(f"max_bytes must be a positive int, not {max_bytes!r}")
        try:
            async for table in stream_split(
                self.blob, self.config, split, max_bytes, self._recent, consolidate=consolidate
            ):
                for rb in table.to_batches():
                    yield rb
        except MissingPart as exc:
            raise _gone(exc, split) from None

    async def fetch_split_updates(
        self, split: Split, chunk_bytes: int = 8 << 20
    ) -> AsyncIterator[pa.RecordBatch]:
        """A snapshot split's updates as stored, for a reader that consolidates them itself:
        unmerged (a row may come several times, with negative diffs too; per row, the diffs sum
        to its multiplicity in ``fetch_split(split)``), at ``_time == split.as_of``, read part by
        part and row group by row group, about ``chunk_bytes`` at a time. Nothing is read twice
        and nothing waits for a merge, so the first batch comes early. Used as ``async for``."""
        self._check_open()
        if not isinstance(split, Split):
            raise InvalidUsage(f"expected persist.Split, got {type(split).__name__}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise InvalidUsage(f"chunk_bytes must be a positive int, not {chunk_bytes!r}")
        try:
            async for table in stream_raw(self.blob, self.config, split, chunk_bytes, self._recent):
                for rb in table.to_batches():
                    yield rb
        except MissingPart as exc:
            raise _gone(exc, split) from None

    async def delete_batch(self, batch: Batch) -> None:
        """Deletes the data of a batch that was not (and now can't be) appended."""
        if not isinstance(batch, Batch):
            raise InvalidUsage(f"expected persist.Batch, got {type(batch).__name__}")
        # Once appended, its parts belong to the shard (possibly as blobs retired by compaction
        # that readers still use) until garbage collection deletes them.
        if await self.batch_appended(batch):
            raise InvalidUsage(f"batch {batch.hollow.id} was appended; it can't be deleted")
        await delete_parts(self.blob, [batch.hollow])

    async def batch_appended(self, batch: Batch) -> bool:
        """Whether the shard's latest state holds a part of ``batch``. Asked right after
        ``compare_and_append_batch`` raised an ``ExternalError`` with ``determinate`` False, it
        says whether that append landed (it appends all its batches or none). Later, compaction
        and garbage collection may let an appended batch's parts go, and this turns False."""
        machine = await self._machine(batch.shard_id)
        state = await machine.load()
        return state is not None and bool(
            garbage.referenced_keys(state, inline=True).intersection(
                p.key for p in batch.hollow.parts
            )
        )

    # --- maintenance and inspection ------------------------------------------------------------

    async def _loaded(self, shard_id: str) -> Machine:
        """The shard's machine with its latest state (``InvalidUsage`` if there is no shard)."""
        machine = await self._machine(shard_id)
        if machine.loaded:
            await machine.refresh()  # only the diffs since the state it holds
        elif await machine.load() is None:
            raise InvalidUsage(f"shard {machine.shard_id} does not exist")
        return machine

    async def frontiers(self, shard_id: str) -> tuple[int | None, int | None]:
        """The shard's ``(since, upper)`` now, with no handle (``InvalidUsage`` if it does not
        exist). Reads only what changed since this client last looked."""
        state = (await self._loaded(shard_id)).state
        return state.since, state.upper

    async def shard_schema(self, shard_id: str) -> pa.Schema:
        """The schema of an existing shard (``InvalidUsage`` if it does not exist)."""
        return schema_from_bytes((await self._loaded(shard_id)).state.schema)

    async def maintain(
        self, shard_id: str, *, progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Runs every due maintenance step of the shard to completion; says what it did.

        Compaction until the spine has no merge due, a rollup if one is due, then garbage
        collection (retired blobs whose readers moved on, parts of expired writers, abandoned
        compaction output and rollups, consensus diffs before the latest rollup); first, the
        since moves as far as readers and the retention allow now. ``progress`` is called
        with what each round did (``persist maintain`` prints it).
        """
        machine = await self._loaded(shard_id)
        return await self._maintenance[machine.shard_id].maintain(progress)

    async def inspect(self, shard_id: str, *, storage: bool = False) -> dict[str, Any]:
        """The shard's state in numbers: seqno, since, upper, batches, parts, bytes (of live
        parts), rows, readers, writers, rollups, retired (blobs no state needs any more, not
        yet deleted), retention_s, finalized, and ``streams``: per streaming server that
        committed into it, ``{"resolved_lsn", "at"}`` (every LSN of that server's log below
        ``resolved_lsn`` is resolved; its latest group landed at time ``at``). From the state
        alone (no blob listing) unless
        ``storage``: then also ``storage``, every byte the shard holds (see ``storage()``; a
        listing of its blobs and a scan of its consensus entries)."""
        machine = await self._loaded(shard_id)
        s = machine.state
        info = {
            "shard_id": s.shard_id,
            "seqno": s.seqno,
            "since": s.since,
            "upper": s.upper,
            "batches": len(s.batches),
            "parts": sum(len(b.parts) for b in s.batches.values()),
            "bytes": sum(b.size for b in s.batches.values()),
            "rows": sum(b.rows for b in s.batches.values()),
            "readers": len(s.readers),
            "writers": len(s.writers),
            "rollups": len(s.rollups),
            "retention_s": None if s.retention_ms is None else s.retention_ms / 1000,
            "latest_rollup_seqno": s.latest_rollup.seqno,
            "finalized": s.finalized,
            "retired": len(s.retired),
            "schema": str(schema_from_bytes(s.schema)),
            "streams": {
                server: {"resolved_lsn": record.lsn_upper, "at": record.at}
                for server, record in s.stream_servers.items()
            },
        }
        if storage:
            info["storage"] = await self._storage(machine)
        return info

    async def finalize(self, shard_id: str) -> None:
        """Deletes the data of a shard whose since and upper are both None, leaving a tombstone:
        opening it again raises ``InvalidUsage``."""
        machine = await self._loaded(shard_id)
        await self._finalize(machine, life.finalize)

    async def _finalize(
        self, machine: Machine, transition: Callable[[State, Now], Outcome[list[HollowBatch]]]
    ) -> None:
        dropped = await machine.apply(transition)
        await delete_parts(self.blob, dropped)
        # The tombstone is the finalized state; a rollup of it lets older rollups go.
        if machine.state.latest_rollup.seqno < machine.state.seqno:
            await machine.write_rollup()
        keep = machine.state.latest_rollup.key
        prefix = keys.shard_prefix(machine.shard_id)
        stale = [k for k in await self.blob.list_keys(prefix) if k != keep]
        await asyncio.gather(*(self.blob.delete(k) for k in stale))
        head = await self.consensus.head(machine.shard_id)
        if head is not None:
            await self.consensus.truncate(machine.shard_id, head.seqno)

    async def plan_scan(
        self,
        shard_id: str,
        *,
        as_of: int | None = None,
        wait: bool = True,
        empty_if_unwritten: bool = False,
        purpose: str = "",
        lease_duration_s: float | None = None,
    ) -> ScanPlan:
        """A snapshot of ``shard_id`` for an engine that reads the parts' Parquet files with its
        own reader: the files, the inline parts, what to do with their rows, and a new leased
        reader that keeps the files in blob until ``plan.release()`` (see ``persist.scan``).
        ``as_of``, ``wait``, ``empty_if_unwritten``, ``purpose``, ``lease_duration_s`` and the
        refusals are as for ``plan_snapshot``; if this raises, its reader is expired."""
        purpose = check_purpose(purpose)
        self._lease_ms(lease_duration_s)
        return await make_scan_plan(
            self,
            shard_id,
            as_of=as_of,
            wait=wait,
            empty_if_unwritten=empty_if_unwritten,
            purpose=purpose,
            lease_duration_s=lease_duration_s,
            clean_up=self._clean_up,
        )


def _gone(exc: MissingPart, split: Split) -> InvalidUsage:
    return InvalidUsage(
        f"part {exc.key} of this split is gone: the reader {split.reader_id} that made "
        f"the split no longer holds its since at or below {split.as_of}"
    )
