"""``connect`` and ``PersistClient``: the entry point to shards at one location."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.config import PersistConfig, is_seconds, read_clock
from persist.core.arrow import evolution as evo
from persist.core.arrow.predicates import check_predicate
from persist.core.arrow.updates import check_schema
from persist.core.shard import garbage
from persist.core.shard import lifecycle as life
from persist.errors import InvalidUsage
from persist.ids import ShardId
from persist.internal import report
from persist.internal.batch import Batch, delete_parts
from persist.internal.fetch import (
    Consolidate,
    MissingPart,
    Split,
    read_split,
    schema_from_bytes,
    stream_split,
)
from persist.internal.shards import Shards
from persist.location import Blob, Consensus, open_blob, open_consensus
from persist.plan import SPLIT_BYTES, SnapshotPlan, make_plan
from persist.read import ReadHandle, register_reader_handle
from persist.scan import ScanPlan, make_scan_plan
from persist.write import WriteHandle, register_writer_handle

__all__ = ["PersistClient", "connect", "default_locations"]

ENV_BLOB = "PERSIST_BLOB_URI"
ENV_CONSENSUS = "PERSIST_CONSENSUS_URI"


# A purpose is a label, copied into consensus with each heartbeat and write of its handle.
MAX_PURPOSE_BYTES = 64 * 1024


# A lease longer than this would be a registration nobody can count on going away.
_MAX_LEASE_S = 7 * 24 * 3600

# Ten years: longer is a typo, not a policy.
_MAX_RETENTION_S = 10 * 365 * 24 * 3600


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
    uri = None if isinstance(blob, Blob) else blob or default_blob
    return PersistClient(b, c, config or PersistConfig(), blob_uri=uri)


class PersistClient:
    """Opens handles on shards of one location; runs their background work.

    Use as ``async with client:`` or call ``await client.close()``: closing expires the handles
    the client registered (not those it resumed or ``detach``ed), stops heartbeats and
    background work and releases connections.

    Every call that takes a shard id takes a shard's name too (``create_shard``), looked up when
    the call is made; a handle holds the id, so a later rename doesn't move it. Opening with a
    schema creates a shard that doesn't exist yet: under a new name, the shard is created and
    named at once.
    """

    def __init__(
        self,
        blob: Blob,
        consensus: Consensus,
        config: PersistConfig,
        *,
        blob_uri: str | None = None,
    ) -> None:
        self.blob = blob
        self.consensus = consensus
        self.config = config
        # ``blob_uri``: where ``blob`` was opened, so that a merge worker can open it too.
        self._shards = Shards(blob, consensus, config, blob_uri)
        self._worker = self._shards.worker

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
        await self._shards.close()

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
        machine, stored, version = await self._shards.open(shard_id, schema)
        return await register_writer_handle(machine, stored, purpose, lease_ms, version)

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
        machine, _, version = await self._shards.open(shard_id, schema)
        shown = evo.shown_schema(machine.state, version)
        return await register_reader_handle(machine, shown, purpose, lease_ms, version)

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
        machine, writer_id = await self._shards.loaded_with(shard_id, writer_id, "writer")
        writer = machine.state.writers[writer_id]
        version = writer.schema_version
        schema = evo.schema_of(evo.versions(machine.state)[version])
        handle = WriteHandle(machine, writer_id, schema, writer.lease_duration_ms, version)
        await handle.heartbeat()
        return handle

    async def resume_reader(self, shard_id: str, reader_id: str) -> ReadHandle:
        """A handle on reader ``reader_id``, registered by any process: it heartbeats (at once,
        then in the background, by that reader's lease), reads at or after the reader's since,
        and expires it as the handle that opened it would. Every split any handle of this
        reader handed out stays fetchable while this handle holds the since at or below the
        split's ``as_of``. ``LeaseExpired`` if the reader is not registered."""
        machine, reader_id = await self._shards.loaded_with(shard_id, reader_id, "reader")
        reader = machine.state.readers[reader_id]
        schema = evo.shown_schema(machine.state, reader.schema_version)
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
            schema_version=reader.schema_version,
        )
        await handle.heartbeat()
        return handle

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
        move_since: bool = True,
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
          the wait ends, the since never passed what it was. ``move_since=False`` leaves it at
          its registration (at or below ``as_of``: the splits are held all the same), so that
          a one-off read (``persist export``) does not move the shard's since.
        - If this raises (or is cancelled), the reader it registered is expired in the
          background (``close`` waits for that), and the shard's since is where it was.
        The caller owns the reader: it heartbeats in the background, and expiring it (or its
        lease running out) ends the hold; the splits can't be fetched after that.
        """
        purpose = check_purpose(purpose)
        lease_ms = self._lease_ms(lease_duration_s)
        return await make_plan(
            self._shards,
            shard_id,
            as_of=as_of,
            splits=splits,
            split_bytes=split_bytes,
            parallelism=parallelism,
            drop_empty_splits=drop_empty_splits,
            wait=wait,
            empty_if_unwritten=empty_if_unwritten,
            move_since=move_since,
            purpose=purpose,
            lease_ms=lease_ms,
            clean_up=self._shards.clean_up,
        )

    # --- batches and splits --------------------------------------------------------------------

    async def fetch_split(self, split: Split) -> pa.Table:
        """The consolidated updates of one split (see ``ReadHandle.snapshot``)."""
        with self._fetching(split):
            return await read_split(self.blob, self.config, split, self._shards.recent)

    async def fetch_split_batches(
        self, split: Split, max_bytes: int = 64 << 20, *, consolidate: Consolidate = True
    ) -> AsyncIterator[pa.RecordBatch]:
        """The rows of ``fetch_split(split)`` (same schema, consolidated, in key order) as a
        stream of record batches, read piece by piece: memory holds about ``max_bytes`` of
        decoded parts at a time (plus a row group per part at the ends of each piece), never
        the whole split. Used as ``async for batch in client.fetch_split_batches(split)``.

        ``consolidate=False`` skips the merge where it can (a snapshot split's piece with no
        retraction): such a piece's rows come unordered and may repeat, each row's diffs
        summing to its multiplicity; a piece with a retraction is consolidated as usual. For
        readers of the contents as a multiset of rows, which need no merge for that.

        ``consolidate="never"`` (a snapshot's splits only): the updates as stored, for a reader
        that consolidates them itself: unmerged (a row may come several times, with negative
        diffs too; per row, the diffs sum to its multiplicity in ``fetch_split(split)``), at
        ``_time == split.as_of``, read part by part and row group by row group, about
        ``max_bytes`` at a time. Nothing is read twice and nothing waits for a merge, so the
        first batch comes early."""
        with self._fetching(split):
            if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
                raise InvalidUsage(f"max_bytes must be a positive int, not {max_bytes!r}")
            if not isinstance(consolidate, bool) and consolidate != "never":
                raise InvalidUsage(
                    f'consolidate must be True, False or "never", not {consolidate!r}'
                )
            async for table in stream_split(
                self.blob,
                self.config,
                split,
                max_bytes,
                self._shards.recent,
                consolidate=consolidate,
            ):
                for rb in table.to_batches():
                    yield rb

    @contextlib.contextmanager
    def _fetching(self, split: object) -> Iterator[None]:
        """What every fetch of a split checks first. A part gone is ``InvalidUsage``: the split's
        reader let its since pass ``as_of`` (or its lease ran out)."""
        self._shards.check_open()
        if not isinstance(split, Split):
            raise InvalidUsage(f"expected persist.Split, got {type(split).__name__}")
        try:
            yield
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
        machine = await self._shards.machine(batch.shard_id)
        state = await machine.load()
        return state is not None and bool(
            garbage.referenced_keys(state, inline=True).intersection(
                p.key for p in batch.hollow.parts
            )
        )

    # --- maintenance and inspection ------------------------------------------------------------

    async def frontiers(self, shard_id: str) -> tuple[int | None, int | None]:
        """The shard's ``(since, upper)`` now, with no handle (``InvalidUsage`` if it does not
        exist). Reads only what changed since this client last looked."""
        state = (await self._shards.loaded(shard_id)).state
        return state.since, state.upper

    async def shard_schema(self, shard_id: str) -> pa.Schema:
        """The schema of an existing shard (``InvalidUsage`` if it does not exist)."""
        return schema_from_bytes((await self._shards.loaded(shard_id)).state.schema)

    async def evolve_schema(
        self,
        shard: str,
        schema: pa.Schema,
        *,
        renames: dict[str, str] | None = None,
        expected_version: int | None = None,
    ) -> int:
        """Makes ``schema`` the shard's current schema in one consensus commit; returns its
        version (the first schema is version 0). Field by field, matched by name or through
        ``renames`` (``{"old": "new"}``), it may add a nullable field, drop one, rename one,
        widen a type losslessly, make a NOT NULL field nullable, or reorder fields; anything
        else raises ``InvalidUsage`` naming the field and why, and nothing changes.
        ``expected_version`` given and not the current one: ``SchemaChanged``. Evolving to
        the current schema is a no-op (its version is returned). Handles opened before keep
        their version: their rows are read in every later one (see ``docs/lifecycle.md``)."""
        checked = check_schema(schema)
        if renames is not None and not isinstance(renames, dict):
            raise InvalidUsage(f"renames must be a dict of old names to new ones, not {renames!r}")
        if expected_version is not None and (
            isinstance(expected_version, bool) or not isinstance(expected_version, int)
        ):
            raise InvalidUsage(f"expected_version must be an int or None, not {expected_version!r}")
        return await self._shards.evolve(shard, checked, renames, expected_version)

    async def schemas(self, shard: str) -> list[tuple[int, pa.Schema]]:
        """Every version of the shard's schema, oldest first: ``(version, schema)``."""
        state = (await self._shards.loaded(shard)).state
        return [(n, evo.schema_of(v)) for n, v in sorted(evo.versions(state).items())]

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
        machine = await self._shards.loaded(shard_id)
        return await self._shards.maintenance[machine.shard_id].maintain(progress)

    async def inspect(self, shard_id: str, *, storage: bool = False) -> dict[str, Any]:
        """The shard's state in numbers: seqno, since, upper, batches, parts, bytes (of live
        parts), rows, readers, writers, rollups, retired (blobs no state needs any more, not
        yet deleted), retention_s, finalized, schema_version, and ``streams``: per server that
        committed into it, ``{"resolved_lsn", "at"}`` (every LSN of that server's log below
        ``resolved_lsn`` is resolved; its latest group landed at time ``at``). From the state
        alone (no blob listing) unless
        ``storage``: then also ``storage``, every byte the shard holds (see ``storage()``; a
        listing of its blobs and a scan of its consensus entries)."""
        machine = await self._shards.loaded(shard_id)
        info = report.numbers(machine)
        if storage:
            info["storage"] = await report.storage(self.blob, self.consensus, machine)
        return info

    async def finalize(self, shard_id: str) -> None:
        """Deletes the data of a shard whose since and upper are both None, leaving a tombstone:
        opening it again raises ``InvalidUsage``."""
        machine = await self._shards.loaded(shard_id)
        await self._shards.finalize(machine, life.finalize)

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
        lease_ms = self._lease_ms(lease_duration_s)
        return await make_scan_plan(
            self._shards,
            shard_id,
            as_of=as_of,
            wait=wait,
            empty_if_unwritten=empty_if_unwritten,
            purpose=purpose,
            lease_ms=lease_ms,
            clean_up=self._shards.clean_up,
        )

    # --- a shard's life: names, retention, history, storage, purge, erase, drop -----------------

    async def create_shard(self, name: str, schema: pa.Schema) -> ShardId:
        """A new shard with ``schema``, named ``name`` (dotted words, e.g. ``"sales.orders"``).

        ``InvalidUsage`` if the name is taken: of two callers creating one name, exactly one
        gets the id, the other the error (its shard is dropped again). The name is given once
        the shard exists, so a name always leads to a shard."""
        return await self._shards.create(name, schema)

    async def shard_id(self, name: str) -> ShardId:
        """The id of the shard named ``name`` now (``InvalidUsage`` if none is). A shard id is
        returned as it is (whether or not that shard exists)."""
        self._shards.check_open()
        return await self._shards.resolve(name)

    async def list_shards(self, prefix: str = "") -> list[dict[str, Any]]:
        """The named shards whose name starts with ``prefix``, by name: each a dict with
        ``name``, ``shard_id``, ``named_at`` (UTC datetime), ``schema`` (text), ``since``,
        ``upper``, ``seqno``, ``bytes`` (of its live parts) and ``rows`` (stored updates); a
        shard whose state can't be read has ``error`` (the reason) instead of those, and
        ``other_blob_location: True`` too when its data is in another blob location than this
        client's (``WrongBlobLocation``). Unnamed shards are not listed."""
        return await self._shards.listed(prefix)

    async def rename_shard(self, old: str, new: str) -> None:
        """Names the shard ``old`` (a name or a shard id) ``new``; ``InvalidUsage`` if ``new``
        is taken or ``old`` names no shard. Handles opened by either name or id keep working:
        they hold the id."""
        await self._shards.rename(old, new)

    async def drop_shard(self, shard: str, *, force: bool = False) -> ShardId:
        """Seals, finalizes and unnames the shard ``shard`` (a name or a shard id) in one call:
        its data is deleted, a tombstone stays under its id (opening it raises
        ``InvalidUsage``), and its name is free again.

        Refused with ``InvalidUsage`` while a writer or reader of someone else holds a live
        lease on it, naming them, unless ``force=True``, which expires them (their next call
        raises ``LeaseExpired``). The caller's own handles (those this client registered and
        did not ``detach``) need no force: they are expired with the shard. A crash part way
        leaves it for another ``drop_shard`` to finish. Returns the id of the shard dropped."""
        return await self._shards.drop(shard, force)

    async def set_retention(self, shard_id: str, seconds: float | None) -> None:
        """Keeps the contents as of every time made readable within the last ``seconds``
        readable, whatever readers do; with no reader the since follows that window by itself
        (as commits and ``maintain`` come). None: readers alone hold history. A longer window
        keeps more from now on; it can't bring back times the since has passed."""
        if seconds is not None and not is_seconds(seconds, _MAX_RETENTION_S):
            raise InvalidUsage(
                f"retention must be None or a number of seconds in (0, {_MAX_RETENTION_S}], "
                f"not {seconds!r}"
            )
        ms = None if seconds is None else max(1, int(seconds * 1000))
        machine = await self._shards.loaded(shard_id)
        await machine.apply(lambda s, now: life.set_retention(s, ms, now))

    async def as_of_at(self, shard_id: str, when: datetime.datetime) -> int:
        """The newest time of ``shard_id`` that was readable at the instant ``when`` (an aware
        datetime, or naive in UTC): exact over the shard's last 256 commits, the newest time
        readable at most one granule (the retention / 1024, at least a second) earlier before
        them. ``InvalidUsage`` outside the retention, in the future, before the shard had
        anything written, or where the since has passed it."""
        if not isinstance(when, datetime.datetime):
            raise InvalidUsage(f"when must be a datetime, not {type(when).__name__}")
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        machine = await self._shards.loaded(shard_id)
        return report.as_of_at(machine, read_clock(self.config), when)

    async def history(self, shard_id: str) -> list[dict[str, Any]]:
        """The commits of ``shard_id`` within its retention (a week without one), oldest first:
        ``seqno``, ``at`` (UTC datetime the upper was reached), ``upper``, ``rows_added`` and
        ``rows_retracted`` (updates with a positive or negative diff), ``purpose`` (the
        writer's), and ``commits``: 1, or how many commits of one granule an entry stands for
        (beyond the newest 256 commits; it shows the newest of them)."""
        machine = await self._shards.loaded(shard_id)
        return report.history(machine, read_clock(self.config))

    async def storage(self, shard_id: str) -> dict[str, int]:
        """Every byte the shard holds, by where and why (``persist du``): ``live_parts_bytes``
        (parts in blob the state names), ``inline_bytes`` (parts kept in the state itself),
        ``rollup_bytes``, ``retired_bytes`` (blobs no state needs, not yet deleted: readers
        may still hold them), ``other_blob_bytes`` (parts of writes not committed yet,
        abandoned compactions and writers' leftovers, until garbage collection sweeps them),
        ``blob_bytes`` (all of the shard's blobs, from a listing), ``consensus_entries`` and
        ``consensus_bytes`` (its state diffs in consensus, inline parts included) and
        ``total_bytes`` (blob + consensus)."""
        machine = await self._shards.loaded(shard_id)
        return await report.storage(self.blob, self.consensus, machine)

    async def purge(self, shard_id: str) -> dict[str, Any]:
        """Rewrites what lies below the shard's since so that no blob of the shard holds an
        update whose row's multiplicity is zero as of the since: a retracted row is gone from
        storage once the since has passed its retraction (retention, readers). The replaced
        blobs, old rollups and consensus diffs are deleted unless a reader still holds the
        state versions that name them (``blobs_held``: then again once it lets go, by the
        next ``maintain``). Says what it did: ``since``, ``batches_rewritten``,
        ``parts_rewritten``, ``rows_before``/``rows_after`` and ``bytes_before``/``bytes_after``
        (of live parts), ``blobs_deleted``, ``blobs_held``."""
        machine = await self._shards.loaded(shard_id)
        return await self._shards.maintenance[machine.shard_id].purge()

    async def erase(self, shard_id: str, predicate: pc.Expression) -> dict[str, Any]:
        """Removes every stored update of the rows ``predicate`` matches (a
        ``pyarrow.compute.Expression`` over data columns; a null is no match), whatever its
        time, from every batch, inline part and rollup of the shard, in one commit: the one
        call that rewrites history. Snapshots at every time, the since included, read as if
        those rows had never been written; every other row keeps its updates. Writes committed
        after it are not touched (a write that brings the rows again puts them back).

        Then, as ``purge`` does, it writes a rollup and collects garbage: no blob or consensus
        entry of the shard holds those rows once every reader holding a state version from
        before the erase has renewed its hold (``held_by``: those readers' ids and purposes;
        then the next ``maintain`` deletes what they held). Returns ``since``, ``seqno`` (of
        the erase's commit; None when nothing matched), ``batches_rewritten``,
        ``parts_rewritten``, ``rows_erased`` (stored updates removed), ``rows_before``/
        ``rows_after`` and ``bytes_before``/``bytes_after`` (of live parts),
        ``blobs_deleted``, ``blobs_held`` and ``held_by``.

        ``InvalidUsage``, nothing changed, if the predicate names anything but data columns
        (``_time``, ``_diff``, a column the shard lacks: named) or can't be evaluated on the
        rows. ``ExternalError`` (determinate: nothing changed) if the shard's batches kept
        changing under it for many rounds."""
        machine = await self._shards.loaded(shard_id)
        check_predicate(predicate, schema_from_bytes(machine.state.schema))
        return await self._shards.maintenance[machine.shard_id].erase(predicate)


def _gone(exc: MissingPart, split: Split) -> InvalidUsage:
    return InvalidUsage(
        f"part {exc.key} of this split is gone: the reader {split.reader_id} that made "
        f"the split no longer holds its since at or below {split.as_of}"
    )
