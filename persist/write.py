"""``WriteHandle``: appending updates to a shard."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.builder import BatchBuilder
from persist.core.arrow import evolution as evo
from persist.core.arrow.evolution import Shapes, View, versions
from persist.core.arrow.predicates import check_predicate, matching_rows
from persist.core.arrow.shaping import at_times, prepare_updates, shape_updates
from persist.core.arrow.updates import DIFF, TIME, filter_times, full_schema
from persist.core.frontier import check_bounds, frontier_le, newest_readable
from persist.core.read.queries import inline_bytes
from persist.core.shard import garbage, keys
from persist.core.shard.clock import Now
from persist.core.shard.trace import fold_small
from persist.core.shard.transitions import (
    Committed,
    Outcome,
    Txn,
    compare_and_append,
    expire_writer,
    heartbeat_writer,
    register_writer,
)
from persist.core.shard.types import HollowBatch, State
from persist.core.stream.streams import (
    GroupResult,
    Named,
    Recorded,
    commit_group,
    lookup,
    resolved_below,
)
from persist.errors import ExternalError, InvalidUsage, LeaseExpired, PersistError, UpperMismatch
from persist.ids import new_id
from persist.internal.batch import Batch, PartWriter, delete_keys, delete_parts, stage_batch
from persist.internal.fetch import stream_split
from persist.internal.lease import LeasedHandle
from persist.internal.retry import Tries
from persist.internal.tasks import foreground
from persist.read import ReadHandle, register_reader_handle

if TYPE_CHECKING:
    from persist.internal.machine import Machine

log = logging.getLogger("persist")

__all__ = ["BatchBuilder", "WriteHandle", "register_writer_handle"]

# ``delete_where`` reads the contents in pieces of about this many bytes of parts.
_DELETE_PIECE_BYTES = 64 << 20

# Above this many rows, checking updates is worth a hop to a worker thread.
_INLINE_ROWS = 50_000


class WriteHandle(LeasedHandle):
    """A leased writer of one shard.

    Obtained from ``PersistClient.open_writer``. Its lease is renewed by every write and by a
    background heartbeat; a handle whose lease expired raises ``LeaseExpired``.
    """

    _kind = "writer"

    def __init__(
        self,
        machine: Machine,
        writer_id: str,
        schema: pa.Schema,
        lease_ms: int | None = None,
        schema_version: int = 0,
    ) -> None:
        self._writer_id = writer_id
        self._schema = schema
        self._schema_version = schema_version
        self._data_cols: list[str] = schema.names
        super().__init__(machine, writer_id, lease_ms)

    @property
    def writer_id(self) -> str:
        return self._writer_id

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def schema_version(self) -> int:
        """The version of the shard's schema this writer writes (``evolve_schema``)."""
        return self._schema_version

    @property
    def upper(self) -> int | None:
        """The latest shard upper this client knows of (no I/O)."""
        return self._machine.state.upper

    async def fetch_recent_upper(self) -> int | None:
        """The shard's current upper, read from consensus."""
        self._check_live()
        return (await self._machine.refresh()).upper

    async def compare_and_append(
        self, updates: pa.Table | pa.RecordBatch, expected_upper: int | None, new_upper: int | None
    ) -> None:
        """Atomically applies ``updates`` and moves the shard upper from ``expected_upper`` to
        ``new_upper``, iff the shard upper is ``expected_upper``; else raises ``UpperMismatch``
        and nothing is visible. Every ``_time`` must be in ``[expected_upper, new_upper)``.

        If an indeterminate error surfaces and the caller retries with the same arguments, the
        write is never applied twice: the retry either applies it or finds the upper moved on
        (``UpperMismatch`` with ``current == new_upper`` when the first try had landed).
        """
        self._check_live()
        lower, upper = check_bounds(
            expected_upper, new_upper, ("expected_upper", "new_upper"), lower_may_be_none=True
        )
        if lower is None:
            if getattr(updates, "num_rows", 0):
                raise InvalidUsage("nothing can be appended to a shard whose upper is None")
            await self._commit([], None, upper, owned=True)
            return
        table = await self._prepare(updates, lower, upper, ("expected_upper", "new_upper"))
        await self._append_prepared(table, lower, upper)

    async def _append_prepared(self, table: pa.Table, lower: int, upper: int | None) -> None:
        """``compare_and_append`` of updates ``prepare_updates`` shaped already."""
        if self._machine.state.upper != lower:
            # Don't write data for a write that is going to be refused.
            state = await self._machine.refresh()
            if self._writer_id not in state.writers:
                # Expired (a lease that ran out, a forced drop): that, not the upper, is news.
                raise LeaseExpired(f"writer {self._writer_id} is not registered (lease expired?)")
            if state.upper != lower:
                raise UpperMismatch(lower, state.upper)
        put = None
        if table.nbytes > self._machine.cfg.part_target_bytes:
            hollow = await self._write(table, lower, upper)
        else:
            # One part: its commit is planned while the part is written, and waits only for
            # the CAS once the part is durable.
            hollow, put = await self._stage(table, lower, upper)
        await self._commit([hollow] if hollow.parts else [], lower, upper, owned=True, ready=put)

    async def append_next(self, data: pa.Table | pa.RecordBatch) -> int:
        """Appends ``data`` (the shard's columns and, optionally, ``_diff``; no ``_time``) at
        the shard's current upper ``t``, moving it to ``t + 1``, and returns ``t``. A write
        that lands first (another writer) moves ``t``: this tries again at the new upper, so
        the rows go in exactly once, at the time it returns. For one writer, or several that
        don't care which time each write gets; ``compare_and_append`` is the exact form.

        Calls of this client's handles on one shard at once are committed together (one part,
        one commit; each call still at a time of its own, in the order they came): they don't
        race each other. A call cancelled before its group commits never lands; one cancelled
        during that commit may (as ``compare_and_append`` cancelled in its commit)."""
        self._check_live()
        if not isinstance(data, pa.Table | pa.RecordBatch):
            raise InvalidUsage(
                f"data must be a pyarrow Table or RecordBatch, not {type(data).__name__}"
            )
        if TIME in data.schema.names:
            raise InvalidUsage(
                f"append_next chooses the time itself: data must not have a {TIME!r} column"
            )
        # Shaped (and refused) here, by the caller's own handle: what the group commits is
        # only updates each of which its call would have written alone.
        rows = shape_updates(data, self._schema, time=0, keep_time=False)
        appends = self._machine.next_appends
        return await appends.append(self._schema_version, rows, self._commit_next, self._live)

    def _live(self) -> bool:
        try:
            self._check_live()
        except PersistError:
            return False
        return True

    async def _commit_next(self, writes: list[pa.Table]) -> int:
        """Commits ``writes`` (updates without ``_time``) at consecutive times from the shard's
        upper, one part and one commit for all; the first one's time."""
        self._check_live()
        rows = pa.concat_tables(writes)
        counts = [w.num_rows for w in writes]
        n, upper = len(writes), self.upper
        while True:
            if upper is None:
                raise InvalidUsage(
                    "the shard is sealed (its upper is None): nothing can be appended"
                )
            try:
                await self._append_prepared(at_times(rows, counts, upper), upper, upper + n)
            except UpperMismatch as exc:
                upper = exc.current
                continue
            return upper

    async def delete_where(self, predicate: pc.Expression) -> int:
        """Retracts, at the shard's next time, every row of the current contents matching
        ``predicate`` (a ``pyarrow.compute.Expression`` over data columns, e.g.
        ``pc.field("email") == "a@b.c"``): one ``compare_and_append`` from the upper ``u`` the
        contents were read at (as of ``u - 1``) to ``u + 1``. A write that lands in between
        makes it read again and retry, so no concurrent write is lost or missed. Returns how
        many rows it retracted (the sum of their multiplicities; 0 appends nothing).

        A predicate naming anything but a data column of this writer's schema (``_time``,
        ``_diff``, a column the shard lacks) raises ``InvalidUsage`` naming it, before
        anything is read: the contents are read consolidated, where ``_time`` is the read's
        time for every row. A writer at an earlier schema version judges the predicate on the
        rows in its own version's shape, and retracts them as they are in the current one
        (its own shape could not name the values of fields added since)."""
        self._check_live()
        check_predicate(predicate, self._schema)
        m = self._machine
        current = evo.current_version(m.state)
        schema = evo.schema_of(evo.versions(m.state)[current])
        reader = await register_reader_handle(
            m, schema, "delete_where", m.cfg.lease_duration_ms, current
        )
        try:
            while True:
                upper = await self.fetch_recent_upper()
                if upper is None:
                    raise InvalidUsage("the shard is sealed: nothing can be retracted")
                as_of = newest_readable(upper)
                if as_of is None:
                    return 0  # nothing written: nothing matches
                retract = await self._matching(reader, as_of, predicate)
                if retract.num_rows == 0:
                    return 0
                retract = retract.set_column(
                    retract.schema.get_field_index(TIME),
                    TIME,
                    pa.array(np.full(retract.num_rows, upper, np.uint64)),
                )
                diff_at = retract.schema.get_field_index(DIFF)
                retract = retract.set_column(diff_at, DIFF, pc.negate(retract.column(DIFF)))
                # As a prepared write is: the stored schema exactly (_time and _diff NOT NULL).
                retract = retract.cast(full_schema(reader.schema))
                try:
                    hollow = await self._write(retract, upper, upper + 1, reader)
                    await self._commit([hollow], upper, upper + 1, owned=True)
                except UpperMismatch:
                    continue  # another write landed first: read the contents again
                return -int(pc.sum(retract.column(DIFF)).as_py() or 0)
        finally:
            await reader.expire()

    async def _matching(self, reader: ReadHandle, as_of: int, predicate: pc.Expression) -> pa.Table:
        """The consolidated updates as of ``as_of`` (in ``reader``'s version) whose rows match
        ``predicate`` (judged in this writer's version)."""
        m = self._machine
        found: list[pa.Table] = []
        mine = None
        if reader.schema_version != self._schema_version:
            shapes = evo.shapes_for(m.state, self._schema_version, [reader.schema_version])
            mine = None if shapes is None else evo.View(shapes)
        for split in await reader.snapshot(as_of):
            async for piece in stream_split(m.blob, m.cfg, split, _DELETE_PIECE_BYTES, m.recent):
                if mine is not None:
                    shown = mine.project(piece, reader.schema_version)
                    found.append(piece.take(matching_rows(shown, predicate)))
                    continue
                try:
                    found.append(piece.filter(predicate))
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                    raise InvalidUsage(
                        f"the predicate can't filter the shard's rows: {exc}"
                    ) from None
        return pa.concat_tables(found) if found else full_schema(reader.schema).empty_table()

    async def append(
        self, updates: pa.Table | pa.RecordBatch, lower: int, upper: int | None
    ) -> None:
        """Applies ``updates`` (times in ``[lower, upper)``) for a writer that may be replicated.

        Several writers may append identical data for the same times: the shard ends up as if
        one of them wrote it. If the shard upper is already ``>= upper`` this returns at once; if
        it lies inside ``(lower, upper)`` only the updates at or above it are appended. A shard
        upper below ``lower`` (a gap) raises ``UpperMismatch``.
        """
        self._check_live()
        lo, hi = check_bounds(lower, upper, ("lower", "upper"))
        assert lo is not None  # checked: a lower is never None here
        table = await self._prepare(updates, lo, hi)
        current = self._machine.state.upper
        while True:
            if frontier_le(hi, current):
                return
            assert current is not None
            if current < lo:
                current = (await self._machine.refresh()).upper
                if current is not None and current < lo:
                    raise UpperMismatch(lo, current)
                continue
            part = table if current == lo else filter_times(table, current, hi)
            hollow = await self._write(part, current, hi)
            try:
                await self._commit([hollow] if hollow.parts else [], current, hi, owned=True)
                return
            except UpperMismatch as exc:
                current = exc.current

    async def batch(
        self, updates: pa.Table | pa.RecordBatch, lower: int, upper: int | None
    ) -> Batch:
        """Writes ``updates`` (times in ``[lower, upper)``) to blob without making them visible.

        Hand the batch to ``compare_and_append_batch`` (here or, through ``to_bytes``, in
        another process) or to ``PersistClient.delete_batch``.
        """
        self._check_live()
        lo, hi = check_bounds(lower, upper, ("lower", "upper"))
        assert lo is not None  # checked: a lower is never None here
        table = await self._prepare(updates, lo, hi)
        hollow = await self._write(table, lo, hi)
        return Batch(self.shard_id, self._writer_id, lo, hi, hollow)

    def batch_builder(self, lower: int, upper: int | None) -> BatchBuilder:
        """A batch written while its updates arrive, in parts of about ``part_target_bytes``:
        ``WriteHandle.batch`` of updates too many to hold at once (see ``BatchBuilder``)."""
        self._check_live()
        lo, hi = check_bounds(lower, upper, ("lower", "upper"))
        assert lo is not None  # checked: a lower is never None here
        m = self._machine
        batch_id = new_id("b")
        # No part is remembered in the client's recent parts: they would hold the memory the
        # builder exists to bound, and its batch is usually committed in another process.
        parts = PartWriter(
            m.blob,
            m.cfg,
            self.shard_id,
            self._writer_id,
            self._data_cols,
            batch_id,
            None,
            self._inline_max_bytes(),
            self._schema_version,
        )
        return BatchBuilder(
            (self.shard_id, self._writer_id),
            lo,
            hi,
            batch_id,
            parts,
            self._check_live,
            self._prepare,
            self._discard_unwritten,
            self._discard_in_background,
        )

    async def compare_and_append_batch(
        self, batches: Sequence[Batch], expected_upper: int | None, new_upper: int | None
    ) -> None:
        """Makes all ``batches`` visible and moves the upper from ``expected_upper`` to
        ``new_upper`` in one atomic step, iff the shard upper is ``expected_upper`` (else
        ``UpperMismatch``; the batches stay the caller's, to retry or delete). Every batch's
        ``[lower, upper)`` must lie within ``[expected_upper, new_upper)``."""
        self._check_live()
        lower, upper = check_bounds(
            expected_upper, new_upper, ("expected_upper", "new_upper"), lower_may_be_none=True
        )
        if isinstance(batches, Batch | str | bytes):
            raise InvalidUsage("batches must be a sequence of persist.Batch (a list)")
        try:
            batches = list(batches)
        except TypeError:
            raise InvalidUsage(
                f"batches must be a sequence of persist.Batch, not {type(batches).__name__}"
            ) from None
        hollows: list[HollowBatch] = []
        seen: set[str] = set()
        for b in batches:
            if not isinstance(b, Batch):
                raise InvalidUsage(f"expected persist.Batch, got {type(b).__name__}")
            if b.shard_id != self.shard_id:
                raise InvalidUsage(f"batch belongs to shard {b.shard_id}, not {self.shard_id}")
            if lower is None or b.lower < lower or not frontier_le(b.upper, upper):
                raise InvalidUsage(f"batch [{b.lower}, {b.upper}) is not within [{lower}, {upper})")
            # The batch came as bytes from anywhere: its parts must be its own writer's, for this
            # shard, inside its bounds (else GC of this shard could delete another's data).
            own = f"{self.shard_id}/w/{b.writer_id}/{b.hollow.id}-"
            inline_max = self._machine.cfg.inline_writes_max_bytes
            for p in b.hollow.parts:
                if (
                    not p.key.startswith(own)
                    or p.min_time < b.lower
                    or not frontier_le(p.max_time + 1, b.upper)
                ):
                    raise InvalidUsage(
                        f"batch {b.hollow.id} holds a part it did not write: {p.key}"
                    )
                if len(p.inline) > inline_max:
                    # It would swell every state version (and push) from now on.
                    raise InvalidUsage(
                        f"batch {b.hollow.id} holds an inline part of {len(p.inline)} bytes, "
                        f"over inline_writes_max_bytes ({inline_max})"
                    )
            if b.hollow.id in seen:
                raise InvalidUsage(f"batch {b.hollow.id} is given twice")
            seen.add(b.hollow.id)
            if b.hollow.parts:
                hollows.append(b.hollow)
        writers = frozenset(b.writer_id for b in batches)
        await self._commit(hollows, lower, upper, owned=False, batch_writers=writers)

    # --- the streaming writers' API ---------------------------------------------------------
    # For a server that streams writes into a shard (``persist.flight``): it numbers each write
    # by its position in its own log of the shard (LSN), names writes ``(writer_id, seq)`` for
    # exactly-once replays, and commits them in groups at whatever time is free. Ordinary
    # writers never need these.

    def streamed(self, writer_id: str, seq: int) -> Recorded | None:
        """Where the streamed write ``(writer_id, seq)`` landed (time, server, LSN, fingerprint
        of its rows), if this handle's latest known state records it (the latest 100,000 seqs
        of each writer id are kept); None otherwise. No I/O."""
        return lookup(self._machine.state, writer_id, seq)

    def view(self) -> View:
        """How rows of this writer's or an earlier version of the shard's schema are written in
        this writer's (``View.project``): each field by its identity (renamed, moved, widened:
        its values; added since: null; dropped since: left out). No I/O."""
        known = versions(self._machine.state)
        mine = self._schema_version
        earlier = {n: v for n, v in known.items() if n <= mine}
        return View(Shapes(mine, earlier, known[mine].ids))

    def stream_resolved(self, server: str) -> int:
        """Every LSN of ``server``'s log of this shard below this is committed or given up, as
        this handle's latest known state says. No I/O."""
        return resolved_below(self._machine.state, server)

    async def commit_stream_group(
        self,
        batch: Batch | None,
        expected_upper: int,
        times: int,
        server: str,
        lsn_end: int,
        named: Sequence[Named],
    ) -> GroupResult:
        """Commits one group of ``server``'s streamed writes in one state transition
        (``core.stream.streams.commit_group``): ``batch`` (times in ``[expected_upper, expected_upper
        + times)``) from ``expected_upper`` to ``expected_upper + times``, the server's log
        resolved below ``lsn_end``, and the ``named`` writes recorded. Answers
        ``GroupLanded`` (``already``: an earlier try had landed it), ``SeqsTaken`` or
        ``ShardGone`` (nothing landed); raises ``UpperMismatch`` (write the rows again at the
        upper now) and what any commit raises. The batch stays the caller's unless it landed."""
        self._check_live()
        hollows = [batch.hollow] if batch is not None and batch.hollow.parts else []
        token = new_id("t")
        min_parts = self._compaction_min_parts()

        def transition(s: State, now: Now) -> Outcome[GroupResult]:
            return commit_group(
                s,
                self._writer_id,
                server,
                lsn_end,
                named,
                hollows,
                expected_upper,
                times,
                token,
                now,
                lambda txn: fold_small(txn, min_parts),
            )

        try:
            result = await self._machine.apply(transition, tries=Tries())
        except PersistError as exc:
            if isinstance(exc, LeaseExpired) or isinstance(exc.__cause__, LeaseExpired):
                self._expired = str(exc)
            raise
        assert result is not None
        return result

    # --- internals -----------------------------------------------------------------------------

    def _expiry(self, state: State, now: Now) -> Outcome[None]:
        return expire_writer(state, self._writer_id, now)

    async def _heartbeat(self) -> None:
        await self._machine.apply(lambda s, now: heartbeat_writer(s, self._writer_id, now))

    async def _prepare(
        self,
        updates: object,
        lower: int,
        upper: int | None,
        names: tuple[str, str] = ("lower", "upper"),
    ) -> pa.Table:
        rows = getattr(updates, "num_rows", 0)
        if isinstance(rows, int) and rows > _INLINE_ROWS:
            return await asyncio.to_thread(
                prepare_updates, updates, self._schema, lower, upper, names
            )
        return prepare_updates(updates, self._schema, lower, upper, names)

    async def _write(
        self, table: pa.Table, lower: int, upper: int | None, shape: ReadHandle | None = None
    ) -> HollowBatch:
        """Writes ``table`` (prepared) as a batch in this writer's version, or in the version
        ``shape`` (a reader) reads (``delete_where``'s retractions of what it read)."""
        hollow, _ = await self._encode(table, lower, upper, shape, defer_puts=False)
        return hollow

    async def _stage(
        self, table: pa.Table, lower: int, upper: int | None
    ) -> tuple[HollowBatch, Callable[[], Awaitable[None]]]:
        """``_write`` in two steps: the batch, its parts encoded, and the call that writes them
        (give it to ``_commit`` as ``ready``, which deletes them if the commit fails)."""
        hollow, put = await self._encode(table, lower, upper, None, defer_puts=True)

        async def durable() -> None:
            try:
                with foreground():
                    await put()
            except PersistError:
                raise  # ``_commit`` deletes the parts
            except Exception:
                # Not persist's own (a blob of the caller's): nothing references the parts.
                await delete_parts(self._machine.blob, [hollow])
                raise

        return hollow, durable

    async def _encode(
        self,
        table: pa.Table,
        lower: int,
        upper: int | None,
        shape: ReadHandle | None,
        *,
        defer_puts: bool,
    ) -> tuple[HollowBatch, Callable[[], Awaitable[None]]]:
        m = self._machine
        batch_id = new_id("b")
        names, version = self._data_cols, self._schema_version
        if shape is not None:
            names, version = shape.schema.names, shape.schema_version
        # Merges step aside while it encodes and writes: a merge's decoding, encoding and fsync
        # running alongside would double a small append's time. A merge still gets its turn
        # (each of its steps waits a bounded time), and under a steady stream of appends it
        # merges more at once, which rewrites less in all.
        try:
            with foreground():
                return await stage_batch(
                    m.blob,
                    m.cfg,
                    self.shard_id,
                    self._writer_id,
                    table,
                    lower,
                    upper,
                    names,
                    batch_id,
                    m.recent,
                    self._inline_max_bytes(),
                    version,
                    defer_puts=defer_puts,
                )
        except asyncio.CancelledError:
            # Cancelled before any commit could name them: nothing references these parts.
            # In the background, so that the cancelled caller returns at once.
            m.tasks.spawn(self._discard_unwritten(batch_id), f"discard {batch_id}")
            raise
        except BaseException:
            await self._discard_unwritten(batch_id)
            raise

    def _compaction_min_parts(self) -> int:
        """How many parts a commit's fold of small batches leaves (0: compaction is off)."""
        cfg = self._machine.cfg
        return cfg.compaction_min_parts if cfg.compaction_enabled else 0

    def _inline_max_bytes(self) -> int:
        """How big a part this write may keep inline: none once the shard (as this client
        knows it) holds its total of inline bytes."""
        m = self._machine
        if inline_bytes(m.state) >= m.cfg.inline_writes_total_max_bytes:
            return 0
        return m.cfg.inline_writes_max_bytes

    async def _commit(
        self,
        hollows: list[HollowBatch],
        expected: int | None,
        new: int | None,
        *,
        owned: bool,
        batch_writers: frozenset[str] = frozenset(),
        also: Callable[[Txn], None] | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        token = new_id("t")
        min_parts = self._compaction_min_parts()

        def fold(txn: Txn) -> None:
            fold_small(txn, min_parts)
            if also is not None:
                also(txn)

        def transition(s: State, now: Now) -> Outcome[Committed]:
            return compare_and_append(
                s, self._writer_id, hollows, expected, new, token, now, batch_writers, fold
            )

        tries = Tries()
        try:
            await self._machine.apply(transition, tries=tries, ready=ready)
        except asyncio.CancelledError:
            if owned and any(h.parts for h in hollows):
                # In the background, so that the cancelled caller returns at once.
                self._machine.tasks.spawn(
                    self._discard_if_unreferenced(hollows, tries), f"settle {hollows[0].id}"
                )
            raise
        except PersistError as exc:
            if isinstance(exc, LeaseExpired) or isinstance(exc.__cause__, LeaseExpired):
                self._expired = str(exc)
            if owned and any(h.parts for h in hollows):
                if tries.maybe_committed:
                    # The write may be in the shard: never delete what it refers to here.
                    self._machine.tasks.spawn(
                        self._discard_if_unreferenced(hollows, tries), f"settle {hollows[0].id}"
                    )
                else:
                    await delete_parts(self._machine.blob, hollows)
            raise

    async def _discard_if_unreferenced(self, hollows: list[HollowBatch], tries: Tries) -> None:
        """Deletes the parts of a write that may have been committed, once the shard shows it
        was not and never will be; else they stay for garbage collection, which sweeps this
        writer's prefix once it expires."""
        m = self._machine
        if not tries.maybe_committed:
            await delete_parts(m.blob, hollows)
            return
        try:
            state = await m.refresh()
        except ExternalError as exc:
            log.info("persist: leaving the parts of batch %s to gc: %s", hollows[0].id, exc)
            return
        if not tries.settled_in(state):
            return  # a try could still land: garbage collection decides after this writer expires
        # A landed batch is in the state, or its parts are (retired by a merge until collected);
        # once collected they are gone, and deleting them again changes nothing.
        if {h.id for h in hollows} & state.batches.keys():
            return
        if garbage.referenced_keys(state).intersection(p.key for h in hollows for p in h.parts):
            return
        await delete_parts(m.blob, hollows)

    def _discard_in_background(self, batch_id: str) -> None:
        """``_discard_unwritten`` as a background task of the client (a cancelled caller
        returns at once)."""
        self._machine.tasks.spawn(self._discard_unwritten(batch_id), f"discard {batch_id}")

    async def _discard_unwritten(self, batch_id: str) -> None:
        # Every set of the write has settled (landed or never will) by the time it raised.
        m = self._machine
        prefix = keys.batch_prefix(self.shard_id, self._writer_id, batch_id)
        await delete_keys(m.blob, await m.blob.list_keys(prefix))


async def register_writer_handle(
    machine: Machine, schema: pa.Schema, purpose: str, lease_ms: int, schema_version: int = 0
) -> WriteHandle:
    """A new writer of ``machine``'s shard (writing ``schema``, its version ``schema_version``),
    heartbeated by this client and expired by its ``close``: every writer a client opens for
    itself (``open_writer``) is registered here, as readers are by
    ``read.register_reader_handle``."""
    writer_id = new_id("w")
    # Before the commit: a registration that lands while its open is cancelled, before the
    # handle exists, is still this client's to judge and to expire on close.
    machine.own.add(writer_id)
    machine.registered.add(writer_id)
    await machine.apply(
        lambda s, now: register_writer(s, writer_id, purpose, lease_ms, now, schema_version)
    )
    log.debug("persist: opened writer %s of shard %s (%r)", writer_id, machine.shard_id, purpose)
    return WriteHandle(machine, writer_id, schema, lease_ms, schema_version)
