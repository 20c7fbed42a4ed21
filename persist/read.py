"""``ReadHandle``: snapshots, splits and listens of a shard, under a leased since."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import pyarrow as pa
import pyarrow.dataset as ds

from persist.core.arrow.evolution import Shapes, View, dropped, shapes_for, shown_schema
from persist.core.arrow.keyrange import Key, decode_keys, encode_keys
from persist.core.arrow.updates import as_rows
from persist.core.frontier import check_frontier, frontier_le
from persist.core.read.queries import key_ranges, parts_as_of, parts_between
from persist.core.read.rowbounds import RowBounds, parts_in_key_range
from persist.core.read.scan import plan_scan
from persist.core.shard.clock import Now
from persist.core.shard.transitions import (
    Outcome,
    downgrade_since,
    expire_reader,
    register_reader,
)
from persist.core.shard.types import PartRef, State
from persist.errors import IntegrityError, InvalidUsage, LeaseExpired
from persist.ids import new_id
from persist.internal.fetch import MissingPart, Split, read_split, read_updates
from persist.internal.lease import LeasedHandle
from persist.metrics import on as metrics_on

if TYPE_CHECKING:
    from persist.internal.machine import Machine

__all__ = ["ListenEvent", "ReadHandle", "register_reader_handle"]


log = logging.getLogger("persist")


@dataclass(frozen=True, slots=True)
class ListenEvent:
    """Updates with ``_time < upper`` not delivered before; after it, everything below ``upper``
    has been delivered. ``upper`` None means the shard is finished: no event follows."""

    updates: pa.Table
    upper: int | None


ListenEvent.__module__ = "persist"


class ReadHandle(LeasedHandle):
    """A leased reader of one shard, holding back the shard's since at its own.

    Obtained from ``PersistClient.open_leased_reader``. Its lease is renewed by
    ``downgrade_since`` and by a background heartbeat; a handle whose lease expired raises
    ``LeaseExpired`` and no longer holds anything.
    """

    _kind = "reader"

    def __init__(
        self,
        machine: Machine,
        reader_id: str,
        schema: pa.Schema,
        since: int | None,
        lease_ms: int | None = None,
        *,
        split_holds: Sequence[tuple[int, int]] = (),
        schema_version: int = 0,
    ) -> None:
        self._reader_id = reader_id
        self._schema = schema
        self._schema_bytes = schema.serialize().to_pybytes()
        self._schema_version = schema_version
        self._since = since
        # (as_of, seqno) of splits handed out: their parts are referenced by the state at
        # seqno, so the reader must not release state versions at or after it while it still
        # holds a since at or below as_of.
        self._split_holds: list[tuple[int, int]] = list(split_holds)
        self._reads_in_flight: dict[int, int] = {}
        super().__init__(machine, reader_id, lease_ms)

    @property
    def reader_id(self) -> str:
        return self._reader_id

    @property
    def schema(self) -> pa.Schema:
        """The schema this reader shows rows in: its version's, with a field made nullable
        once a later version makes it nullable or drops it."""
        return self._schema

    @property
    def schema_version(self) -> int:
        """The version of the shard's schema this reader reads every row in."""
        return self._schema_version

    @property
    def since(self) -> int | None:
        """This handle's since: it can read as of any time at or after it."""
        return self._since

    async def downgrade_since(self, new_since: int | None) -> None:
        """Moves this handle's since forward to ``new_since`` (None gives up reading for good)
        and renews its lease. Moving it backwards raises ``InvalidUsage``."""
        self._check_live()
        new = check_frontier("new_since", new_since)
        if not frontier_le(self._since, new):
            raise InvalidUsage(f"since can't move backwards: from {self._since} to {new}")
        await self._apply_since(new)

    async def snapshot(
        self,
        as_of: int,
        num_splits: int = 1,
        *,
        lower_key: bytes = b"",
        upper_key: bytes = b"",
        timeout: float | None = None,
    ) -> list[Split]:
        """The contents as of ``as_of`` cut into exactly ``num_splits`` splits by key range,
        balanced by bytes as far as the parts' key indexes tell.

        Every update of a row is in exactly one split, so each fetched split is exact on its
        own; their union is the contents. Waits while ``as_of >= upper``: for at most
        ``timeout`` seconds if given, then ``TimeoutError``. ``as_of < since`` raises
        ``InvalidUsage``.

        ``lower_key`` / ``upper_key`` (a key as ``core.arrow.keyrange.encode_keys`` encodes it, such as
        a ``Split``'s bounds or a ``RowBounds.key_within`` cut; empty: unbounded) take only the
        rows whose key lies in ``[lower_key, upper_key)``. Keys are values, not positions in
        parts: the same range reads the same rows whatever compaction did in between.
        """
        _check_num_splits(num_splits)
        lower, upper = self._key_range(lower_key, upper_key)
        state, as_of = await self._held_version(as_of, timeout)
        shaped, shapes = self._shaped(state, parts_as_of(state, as_of))
        parts = parts_in_key_range(shaped, self._schema, lower, upper)
        return self._splits(parts, shapes, as_of, num_splits, None, lower, upper)

    async def splits_between(
        self,
        lower: int,
        upper: int,
        num_splits: int = 1,
        *,
        lower_key: bytes = b"",
        upper_key: bytes = b"",
    ) -> list[Split]:
        """The updates with ``lower <= _time < upper``, at their own times, cut into exactly
        ``num_splits`` splits by key range (as ``snapshot``'s are): what a micro-batch of a
        stream reads, each split fetched anywhere by ``PersistClient.fetch_split``.
        ``lower_key`` / ``upper_key`` take only the keys in ``[lower_key, upper_key)``, as
        ``snapshot``'s do.

        Waits while ``upper`` is past the shard's upper. ``lower`` must be at or above this
        reader's since (below it, compaction may have moved times), and the reader must keep
        its since at or below ``lower`` until the splits are fetched.
        """
        _check_num_splits(num_splits)
        key_lo, key_hi = self._key_range(lower_key, upper_key)
        lo = check_frontier("lower", lower, allow_none=False)
        hi = check_frontier("upper", upper, allow_none=False)
        assert lo is not None and hi is not None
        if hi <= lo:
            raise InvalidUsage(f"upper ({hi}) must be above lower ({lo})")
        if not frontier_le(self._since, lo):
            raise InvalidUsage(f"lower {lo} is below this reader's since {self._since}")
        state, _ = await self._readable(hi - 1)
        if not frontier_le(self._learn_since(state), lo):
            raise InvalidUsage(f"lower {lo} is below this reader's since {self._since}")
        self._split_holds.append((lo, state.seqno))
        shaped, shapes = self._shaped(state, parts_between(state, lo, hi))
        parts = parts_in_key_range(shaped, self._schema, key_lo, key_hi)
        return self._splits(parts, shapes, hi - 1, num_splits, lo, key_lo, key_hi)

    async def row_bounds(self, lower: int, upper: int) -> RowBounds:
        """What the parts' row counts, times and key indexes tell of how the updates at times
        in ``[lower, upper)`` (and the contents as of ``upper - 1`` when ``lower`` is 0) spread
        over times and keys, read from the state alone (no blob read): what a reader taking
        about N rows at a time cuts its ranges by (``RowBounds.frontier_within``,
        ``key_within``).

        Waits while ``upper`` is past the shard's upper; ``upper - 1`` below this reader's
        since raises ``InvalidUsage``. It hands out no split: nothing is held for it.
        """
        lo = check_frontier("lower", lower, allow_none=False)
        hi = check_frontier("upper", upper, allow_none=False)
        assert lo is not None and hi is not None
        if hi <= lo:
            raise InvalidUsage(f"upper ({hi}) must be above lower ({lo})")
        state, _ = await self._readable(hi - 1)
        parts, _ = self._shaped(state, parts_between(state, lo, hi))
        return RowBounds(parts, self._schema, lo, hi)

    async def snapshot_and_fetch(self, as_of: int, *, timeout: float | None = None) -> pa.Table:
        """The contents as of ``as_of``, fully consolidated: each distinct row once, with
        ``_time == as_of`` and ``_diff`` its summed multiplicity (never zero). Waits while
        ``as_of >= upper``: for at most ``timeout`` seconds if given, then ``TimeoutError``."""
        state, as_of = await self._readable(as_of, timeout)
        split = self._split(state, as_of, parts_as_of(state, as_of))
        with self._reading(state.seqno), _missing_is_lost():
            return await read_split(
                self._machine.blob, self._machine.cfg, split, self._machine.recent
            )

    async def dataset(self, as_of: int, *, timeout: float | None = None) -> ds.Dataset:
        """The contents as of ``as_of`` (data columns, each row repeated by its multiplicity)
        as a ``pyarrow.dataset.Dataset`` that DuckDB, Polars and pyarrow scan lazily, with
        their own projection and filter pushdown.

        Where the snapshot needs no consolidation (every update +1, none after ``as_of``:
        ``core.read.scan.plan_scan``'s ``plain``) the dataset is the part files themselves,
        scanned in place (file and S3 blobs), and the parts kept in the state, in memory;
        otherwise the contents, consolidated now, in memory. The part files stay readable
        while this reader holds its since at or below ``as_of`` (as a snapshot's splits do).
        Waits while ``as_of >= upper`` (at most ``timeout`` seconds if given, then
        ``TimeoutError``); ``as_of`` below the since raises ``InvalidUsage``."""
        state, as_of = await self._held_version(as_of, timeout)
        parts = parts_as_of(state, as_of)  # the parts ``plan_scan`` names, as state holds them
        where = self._machine.blob.arrow_location()
        if where is None:  # no other reader can open the part files
            return ds.dataset(await self._rows(state, as_of, parts))
        # The one rule of when an engine may take the part files as they are, in a thread as
        # ``PersistClient.plan_scan`` runs it: proving rows distinct decodes key indexes.
        scan = await asyncio.to_thread(plan_scan, state, as_of)
        self._learn_schema(state)
        versions = [p.schema_version for p in parts]
        if not scan.plain or shapes_for(state, self._schema_version, versions) is not None:
            # Parts of other versions are shown in this reader's by persist, not the engine.
            return ds.dataset(await self._rows(state, as_of, parts))
        fs, path = where
        children: list[ds.Dataset] = []
        if scan.parts:
            # Scanned in place, the files skip the parts' checksums: a damaged page must fail
            # the scan rather than answer other rows (older parts of one row group carry none
            # and read unchecked).
            verify = ds.ParquetFragmentScanOptions(page_checksum_verification=True)
            fmt = ds.ParquetFileFormat(default_fragment_scan_options=verify)
            files = [path(p.key) for p in scan.parts]
            children.append(ds.dataset(files, schema=self._schema, format=fmt, filesystem=fs))
        if scan.inline_parts:
            inline = [p for p in parts if p.inline]
            children.append(ds.dataset(await self._rows(state, as_of, inline)))
        if len(children) == 1:
            return children[0]
        return ds.dataset(children or [ds.dataset(self._schema.empty_table())])

    async def listen(self, as_of: int) -> AsyncIterator[ListenEvent]:
        """The updates at times after ``as_of``, as they become final, in frontier order.

        Used as ``async for event in read.listen(as_of)``. Snapshot at ``t`` plus listen from
        ``t`` reproduce the collection exactly. This handle's since must stay at or below the
        last time delivered (``event.upper - 1``) for it to keep reading; ``as_of < since``
        raises ``InvalidUsage``, and so does a drop of one of this reader's fields while it
        listens (a drop hides the field's values in what was delivered too).
        """
        first, start = await self._check_as_of(as_of)
        progress = start + 1
        machine = self._machine
        redacted = dropped(first, self._schema_version)
        while True:
            state = await machine.wait_for(functools.partial(self._moved_past, progress))
            self._check_live()
            if self._reader_id not in state.readers:
                raise LeaseExpired(f"reader {self._reader_id}'s lease expired")
            if (gone := dropped(state, self._schema_version)) != redacted:
                # A drop hides the field's values in what was delivered too: what follows
                # would no longer add up with it.
                raise InvalidUsage(
                    f"field(s) {', '.join(map(repr, gone))} of this reader's schema were dropped "
                    f"while it listened (at {progress - 1} delivered): their values are gone "
                    "from every read; snapshot and listen again"
                )
            if not frontier_le(self._learn_since(state), progress - 1):
                # Compaction may have moved updates already delivered up to the since: past
                # progress - 1 they could no longer be told from new ones.
                raise InvalidUsage(
                    f"this reader's since ({self._since}) passed the listen's progress "
                    f"({progress - 1} delivered): keep since at or below what was delivered"
                )
            upper = state.upper
            parts, shapes = self._shaped(state, parts_between(state, progress, upper))
            view = None if shapes is None else View(shapes, self._schema)
            with self._reading(state.seqno), _missing_is_lost():
                updates = await read_updates(
                    machine.blob, machine.cfg, self._schema, parts, progress, upper, machine.recent,
                    view=view,
                )  # fmt: skip
            if (counted := metrics_on()) is not None:
                counted.listen_events.inc()
            yield ListenEvent(updates, upper)
            if upper is None:
                return
            progress = upper

    # --- internals -----------------------------------------------------------------------------

    def _shaped(self, state: State, parts: list[PartRef]) -> tuple[list[PartRef], Shapes | None]:
        """``parts`` as this reader reads them, and how they are shown in its schema version
        (None: all in its version, as stored). A part of another version carries its key
        index in this reader's columns where showing it keeps its order (``View.key_index``),
        else none (it is then read whole by every range that may hold its keys)."""
        self._learn_schema(state)
        shapes = shapes_for(state, self._schema_version, [p.schema_version for p in parts])
        if shapes is None:
            return parts, None
        view = View(shapes, self._schema)
        return [
            p
            if view.direct(p.schema_version)
            else msgspec.structs.replace(p, key_index=view.key_index(p.key_index, p.schema_version))
            for p in parts
        ], shapes

    def _learn_schema(self, state: State) -> None:
        """Adopts the schema ``state`` shows this reader's version in (``shown_schema``)."""
        shown = shown_schema(state, self._schema_version)
        if not shown.equals(self._schema):
            # A later version made one of its fields nullable, or dropped it: its rows may
            # hold nulls there now, and its schema says so from now on.
            self._schema = shown
            self._schema_bytes = shown.serialize().to_pybytes()

    def _split(self, state: State, as_of: int, parts: list[PartRef]) -> Split:
        """One split of all of ``parts`` (as of ``as_of``, read from ``state``)."""
        shaped, shapes = self._shaped(state, parts)
        return Split(
            self.shard_id, self._reader_id, as_of, self._schema_bytes, tuple(shaped),
            shapes=shapes,
        )  # fmt: skip

    def _splits(
        self,
        parts: list[PartRef],
        shapes: Shapes | None,
        as_of: int,
        n: int,
        updates_from: int | None,
        lower: Key | None = None,
        upper: Key | None = None,
    ) -> list[Split]:
        """``parts`` cut into ``n`` splits by key range (of ``[lower, upper)``)."""
        return [
            Split(
                self.shard_id,
                self._reader_id,
                as_of,
                self._schema_bytes,
                tuple(r.parts),
                b"" if r.lower is None else encode_keys(r.lower),
                b"" if r.upper is None else encode_keys(r.upper),
                updates_from,
                shapes,
            )
            for r in key_ranges(parts, self._schema, n, lower, upper)
        ]

    async def _rows(self, state: State, as_of: int, parts: list[PartRef]) -> pa.Table:
        """The contents of ``parts`` as of ``as_of`` (read from ``state``), consolidated: the
        data columns, each row repeated by its multiplicity."""
        split = self._split(state, as_of, parts)
        m = self._machine
        with self._reading(state.seqno), _missing_is_lost():
            table = await read_split(m.blob, m.cfg, split, m.recent)
        return as_rows(table).cast(self._schema)

    def _key_range(self, lower: bytes, upper: bytes) -> tuple[Key | None, Key | None]:
        """The decoded bounds of a key range given as ``encode_keys`` bytes (empty: none)."""
        return self._key("lower_key", lower), self._key("upper_key", upper)

    def _key(self, name: str, data: bytes) -> Key | None:
        if not isinstance(data, bytes):
            raise InvalidUsage(f"{name} must be bytes (encode_keys of one key), not {data!r}")
        if not data:
            return None
        try:
            key = decode_keys(data, self._schema)
        except IntegrityError:
            key = None
        if key is None or key.num_rows != 1:
            raise InvalidUsage(f"{name} is not one key of this shard's columns")
        return key

    def _expiry(self, state: State, now: Now) -> Outcome[None]:
        return expire_reader(state, self._reader_id, now)

    async def _heartbeat(self) -> None:
        await self._apply_since(self._since, heartbeat=True)

    async def _check_as_of(self, as_of: object) -> tuple[State, int]:
        self._check_live()
        t = check_frontier("as_of", as_of, allow_none=False)
        assert t is not None
        if not frontier_le(self._since, t):
            raise InvalidUsage(f"as_of {t} is below this reader's since {self._since}")
        return self._machine.state, t

    async def _readable(self, as_of: object, timeout: float | None = None) -> tuple[State, int]:
        """Waits until ``as_of`` is readable, for at most ``timeout`` seconds (None: as long
        as it takes); the state to read it from."""
        wait = _check_timeout(timeout)
        _, t = await self._check_as_of(as_of)
        upper = self._machine.state.upper
        if upper is not None and t >= upper:
            # Not an error (the contents as of t will be final once the upper passes it), but
            # a read that waits must not wait without a word.
            log.info(
                "persist: reader %s waits for shard %s's upper (%d) to pass as_of %d%s",
                self._reader_id,
                self.shard_id,
                upper,
                t,
                f", for at most {wait} s" if wait is not None else " (pass timeout= to bound it)",
            )
        try:
            async with asyncio.timeout(wait):
                state = await self._machine.wait_for(
                    lambda s: s.upper is None or t < s.upper or self._reader_id not in s.readers
                )
        except TimeoutError:
            raise TimeoutError(
                f"as_of {t} of shard {self.shard_id} is not readable after {wait} s: its upper "
                f"is still {self._machine.state.upper} (nothing was written at or past {t})"
            ) from None
        # A closing client expires its readers: a wait that ends for that says so.
        self._check_live()
        if self._reader_id not in state.readers:
            self._expired = "its lease expired"
            raise LeaseExpired(f"reader {self._reader_id}'s lease expired")
        since = self._learn_since(state)
        if not frontier_le(since, t):
            raise InvalidUsage(
                f"as_of {t} is below this reader's since {since} (a downgrade_since that "
                "failed indeterminately had landed)"
            )
        return state, t

    def _learn_since(self, state: State) -> int | None:
        """This reader's since as ``state`` records it, which this handle adopts.

        A ``downgrade_since`` that failed indeterminately may have landed, and compaction may
        then have moved the times below it: reads must go by the shard's record, not ours.
        """
        reader = state.readers.get(self._reader_id)
        if reader is not None and not frontier_le(reader.since, self._since):
            self._since = reader.since
        return self._since

    def _moved_past(self, progress: int, state: State) -> bool:
        """Whether ``state`` has news for a listen at ``progress`` (or this reader is gone)."""
        upper = state.upper
        return upper is None or upper > progress or self._reader_id not in state.readers

    async def _held_version(self, as_of: object, timeout: float | None = None) -> tuple[State, int]:
        """Waits until ``as_of`` is readable; the state to read it from and ``as_of``, checked.
        That state (its parts) stays held for as long as this reader's since stays at or below
        ``as_of``: what a snapshot's splits, or any plan naming the state's parts, need."""
        state, t = await self._readable(as_of, timeout)
        self._split_holds.append((t, state.seqno))
        return state, t

    def _split_holds_at(self, since: int | None) -> list[tuple[int, int]]:
        """The split holds still needed once this reader's since is ``since``."""
        return [(a, seqno) for a, seqno in self._split_holds if frontier_le(since, a)]

    def _seqno_hold(self, since: int | None) -> int:
        """The oldest state version this reader still reads through, holding ``since``."""
        held = [seqno for _, seqno in self._split_holds_at(since)] + list(self._reads_in_flight)
        return min(held, default=self._machine.state.seqno)

    def _reading(self, seqno: int) -> _ReadHold:
        return _ReadHold(self._reads_in_flight, seqno)

    async def _apply_since(self, new: int | None, *, heartbeat: bool = False) -> None:
        # Splits at times below the new since are released by this very downgrade.
        hold = self._seqno_hold(new)
        target = new

        def transition(s: State, now: Now) -> Outcome[int | None]:
            nonlocal target
            target = new
            reader = s.readers.get(self._reader_id)
            if heartbeat and reader is not None and frontier_le(new, reader.since):
                # Keep what an indeterminate downgrade may have landed; never move it back.
                target = reader.since
            return downgrade_since(s, self._reader_id, target, hold, now)

        try:
            await self._machine.apply(transition)
        except LeaseExpired as exc:
            self._expired = str(exc)
            raise
        # Only now may the holds go: a downgrade that was cancelled or failed left the since
        # (and so the splits' promise) where it was.
        self._since = target
        self._split_holds = self._split_holds_at(target)


async def register_reader_handle(
    machine: Machine, schema: pa.Schema, purpose: str, lease_ms: int, schema_version: int = 0
) -> ReadHandle:
    """A new reader of ``machine``'s shard, registered holding the shard's since, heartbeated
    by this client and expired by its ``close``: every reader a client opens for itself
    (``open_leased_reader``, and so every plan's; ``delete_where``'s) is registered here."""
    reader_id = new_id("r")
    # Before the commit: a registration that lands while its open is cancelled, before the
    # handle exists, is still this client's to judge and to expire on close.
    machine.own.add(reader_id)
    machine.registered.add(reader_id)
    since = await machine.apply(
        lambda s, now: register_reader(s, reader_id, purpose, lease_ms, now, schema_version)
    )
    log.debug(
        "persist: opened reader %s of shard %s at since %s (%r)",
        reader_id,
        machine.shard_id,
        since,
        purpose,
    )
    return ReadHandle(machine, reader_id, schema, since, lease_ms, schema_version=schema_version)


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise InvalidUsage(f"timeout is a non-negative number of seconds or None, not {timeout!r}")
    return float(timeout)


def _check_num_splits(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidUsage(f"num_splits must be a positive int, not {n!r}")


@contextlib.contextmanager
def _missing_is_lost() -> Iterator[None]:
    # This handle holds the state version it reads from: a part missing then was lost.
    try:
        yield
    except MissingPart as exc:
        raise IntegrityError(f"part {exc.key} is missing from blob") from None


class _ReadHold:
    """Holds a state version while a read from it is in flight."""

    def __init__(self, counts: dict[int, int], seqno: int) -> None:
        self._counts = counts
        self._seqno = seqno

    def __enter__(self) -> None:
        self._counts[self._seqno] = self._counts.get(self._seqno, 0) + 1

    def __exit__(self, *exc: object) -> None:
        left = self._counts[self._seqno] - 1
        if left:
            self._counts[self._seqno] = left
        else:
            del self._counts[self._seqno]
