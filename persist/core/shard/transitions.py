"""The shard state machine's transitions: pure functions, no I/O.

Every change to a shard's state (``core.shard.types``) is a transition: a pure function of the
state, its inputs and the time (``now_ms``, passed in) that returns either :class:`Continue` (a
diff to commit, and the caller's result) or :class:`Break` (commit nothing: a refusal, or an
answer that needs no change). A transition collects its changes in a :class:`Txn`, which turns
them into a ``StateDiff`` (``core.shard.diff``). What of the state is garbage, and the
transitions that record its collection, are in ``core.shard.garbage``; a shard's retention and
end in ``core.shard.lifecycle``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from persist.core.frontier import frontier_le, frontier_max, frontier_min
from persist.core.shard import history as hist
from persist.core.shard.clock import Clock, Now, held_back, stale
from persist.core.shard.diff import StateDiff
from persist.core.shard.history import Mark
from persist.core.shard.overlay import Overlay
from persist.core.shard.streamed import SeqBlock, SeqRuns, StreamServer
from persist.core.shard.types import (
    HollowBatch,
    ReaderState,
    RollupRef,
    SchemaVersion,
    State,
    WriterState,
)
from persist.errors import (
    InvalidUsage,
    LeaseExpired,
    PersistError,
    SchemaChanged,
    UpperMismatch,
)

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Continue(Generic[R]):
    """Commit ``diff``; once committed, the caller gets ``result``, or ``error`` raised if set
    (a change that must land even though the call fails: the expiry of the caller's own
    handle, whose lease this very transition found run out)."""

    diff: StateDiff
    result: R
    error: PersistError | None = None


@dataclass(frozen=True, slots=True)
class Break(Generic[R]):
    """Commit nothing. ``error`` is raised to the caller if set, else ``result`` is returned."""

    result: R | None = None
    error: PersistError | None = None


Outcome = Continue[R] | Break[R]


class Txn:
    """Collects one transition's changes against a base state and turns them into a diff."""

    def __init__(self, state: State, now: Now) -> None:
        self.state = state
        clock = Clock.of(now)
        self.now_ms = clock.now_ms
        self._kept = frozenset(held_back(state, clock))
        self.writers: Overlay[str, WriterState] = Overlay(state.writers)
        self.readers: Overlay[str, ReaderState] = Overlay(state.readers)
        self.batches: Overlay[str, HollowBatch] = Overlay(state.batches)
        self.rollups: Overlay[int, RollupRef] = Overlay(state.rollups)
        self.retired: Overlay[str, int] = Overlay(state.retired)
        self.expired_writers: Overlay[str, int] = Overlay(state.expired_writers)
        self.stream_seqs: Overlay[str, SeqRuns] = Overlay(state.stream_seqs)
        self.history: Overlay[int, Mark] = Overlay(state.history)
        self.stream_servers: Overlay[str, StreamServer] = Overlay(state.stream_servers)
        self.stream_named: Overlay[str, SeqBlock] = Overlay(state.stream_named)
        self.schemas: Overlay[int, SchemaVersion] = Overlay(state.schemas)
        self.retention_ms = state.retention_ms
        self.stream_upper = state.stream_upper
        self.schema = state.schema
        self.since = state.since
        self.upper = state.upper
        self.finalized = state.finalized
        self._expirestale()

    @property
    def seqno(self) -> int:
        """The seqno this transition's diff will be committed at."""
        return self.state.seqno + 1

    def expire_writer(self, writer_id: str) -> None:
        self.writers.put(writer_id, None)
        self.expired_writers.put(writer_id, self.seqno)

    def retire(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.retired.put(key, self.seqno)

    def _expirestale(self) -> None:
        for wid, w in list(self.writers.items()):
            if stale(w, self.now_ms) and wid not in self._kept:
                self.expire_writer(wid)
        for rid, r in list(self.readers.items()):
            if stale(r, self.now_ms) and rid not in self._kept:
                self.readers.put(rid, None)
        self.recompute_since()

    def recompute_since(self) -> None:
        sinces = [r.since for _, r in self.readers.items()]
        if self.retention_ms is not None:
            sinces.append(hist.bound(self._marks(), self.retention_ms, self.now_ms, self.since))
        if sinces:
            # Readers never hold a since below the shard's; the retention's bound may lag it
            # (a window made longer): the since never regresses.
            self.since = frontier_max(self.since, frontier_min(sinces))

    def _marks(self) -> Mapping[int, Mark]:
        # Most transitions change no mark before reading them: the base, uncopied.
        return dict(self.history.items()) if self.history.ops else self.history.base

    def record_upper(self, added: int, retracted: int, purpose: str) -> None:
        """Records that this commit moved the upper to ``self.upper`` (``core.shard.history``)."""
        marks = self._marks()
        at = hist.stamp(marks, self.now_ms)
        mark = Mark(at, self.upper, added, retracted, purpose)
        for seqno, change in hist.record(marks, self.seqno, mark, self.retention_ms, at).items():
            self.history.put(seqno, change)

    def latest_rollup(self) -> RollupRef:
        return max((r for _, r in self.rollups.items()), key=lambda r: r.seqno)

    def finish(self) -> StateDiff:
        s = self.state
        return StateDiff(
            shard_id=s.shard_id,
            seqno_from=s.seqno,
            seqno_to=s.seqno + 1,
            latest_rollup=self.latest_rollup(),
            schema=[self.schema] if self.schema != s.schema else [],
            since=[self.since] if self.since != s.since else [],
            upper=[self.upper] if self.upper != s.upper else [],
            writers=self.writers.diff(),
            readers=self.readers.diff(),
            batches=self.batches.diff(),
            rollups=self.rollups.diff(),
            finalized=[self.finalized] if self.finalized != s.finalized else [],
            retired=self.retired.diff(),
            expired_writers=self.expired_writers.diff(),
            stream_upper=[self.stream_upper] if self.stream_upper != s.stream_upper else [],
            stream_seqs=self.stream_seqs.diff(),
            retention_ms=[self.retention_ms] if self.retention_ms != s.retention_ms else [],
            history=self.history.diff(),
            stream_servers=self.stream_servers.diff(),
            stream_named=self.stream_named.diff(),
            schemas=self.schemas.diff(),
        )


def _not_registered(state: State, txn: Txn, kind: str, handle_id: str) -> Outcome[Any]:
    """The outcome for a handle that ``txn`` doesn't hold: ``LeaseExpired``. When its lease ran
    out just now (``txn`` expired it), the expiry is committed with the error, so that what it
    held (a reader's since) is released now, not whenever another client next commits."""
    error = LeaseExpired(f"{kind} {handle_id} is not registered (lease expired?)")
    if handle_id in (state.writers if kind == "writer" else state.readers):
        return Continue(txn.finish(), None, error)
    return Break(error=error)


def finalized_error(state: State) -> InvalidUsage:
    return InvalidUsage(f"shard {state.shard_id} was finalized; it can't be opened or written")


def create_shard(
    state: State,
    schema: bytes,
    rollup: RollupRef,
    now_ms: Now,
    retention_ms: int | None = None,
) -> Outcome[None]:
    """Makes the shard exist, with ``schema``, since = upper = 0, ``retention_ms`` and its
    first rollup.

    ``rollup.seqno`` must be 1: the rollup holds the state this diff makes.
    """
    if state.seqno != 0:
        return Break(result=None)
    if rollup.seqno != 1:
        raise ValueError("the first rollup is the state at seqno 1")
    txn = Txn(state, now_ms)
    txn.schema = schema
    txn.since = 0
    txn.upper = 0
    txn.retention_ms = retention_ms
    txn.record_upper(0, 0, "")
    txn.rollups.put(rollup.seqno, rollup)
    return Continue(txn.finish(), None)


def register_writer(
    state: State,
    writer_id: str,
    purpose: str,
    lease_duration_ms: int,
    now_ms: Now,
    schema_version: int = 0,
) -> Outcome[int | None]:
    """Adds a writer (writing schema version ``schema_version``); the result is the shard's
    upper."""
    if state.finalized:
        return Break(error=finalized_error(state))
    txn = Txn(state, now_ms)
    writer = WriterState(purpose, lease_duration_ms, txn.now_ms, schema_version=schema_version)
    txn.writers.put(writer_id, writer)
    return Continue(txn.finish(), txn.upper)


def register_reader(
    state: State,
    reader_id: str,
    purpose: str,
    lease_duration_ms: int,
    now_ms: Now,
    schema_version: int = 0,
) -> Outcome[int | None]:
    """Adds a reader holding the shard's since (reading schema version ``schema_version``);
    the result is that since."""
    if state.finalized:
        return Break(error=finalized_error(state))
    txn = Txn(state, now_ms)
    reader = ReaderState(
        purpose, txn.since, state.seqno + 1, lease_duration_ms, txn.now_ms, schema_version
    )
    txn.readers.put(reader_id, reader)
    return Continue(txn.finish(), txn.since)


class Committed(msgspec.Struct, frozen=True):
    """What a compare_and_append did: ``already`` is True when an earlier try had committed it."""

    upper: int | None
    already: bool = False


def compare_and_append(
    state: State,
    writer_id: str,
    batches: list[HollowBatch],
    expected_upper: int | None,
    new_upper: int | None,
    token: str,
    now_ms: Now,
    batch_writers: frozenset[str] = frozenset(),
    then: Callable[[Txn], object] | None = None,
) -> Outcome[Committed]:
    """Adds ``batches`` and moves upper from ``expected_upper`` to ``new_upper``.

    The caller has checked the batches' times against ``[expected_upper, new_upper)``.
    ``token`` identifies this write: if the shard's upper moved on because this very write was
    committed by an earlier try, the answer is success (``already``), not a mismatch.
    ``batch_writers``: the writers that wrote the batches, when not ``writer_id`` (a coordinated
    commit). Each must still hold its lease: garbage collection sweeps an expired writer's
    uncommitted parts, so its batches can't be committed any more. ``then`` makes further
    changes in the same commit (a writer folds the spine's small merges this way).
    """
    if state.finalized:
        return Break(error=finalized_error(state))
    if not frontier_le(expected_upper, new_upper):
        return Break(error=InvalidUsage(f"new upper {new_upper} is below {expected_upper}"))
    if expected_upper is None and batches:
        return Break(error=InvalidUsage("nothing can be appended after the empty upper"))
    txn = Txn(state, now_ms)
    writer = txn.writers.get(writer_id)
    if writer is None:
        return _not_registered(state, txn, "writer", writer_id)
    if state.upper != expected_upper:
        if writer.last_write_token == token and writer.last_write_upper == new_upper:
            return Break(result=Committed(state.upper, already=True))
        return Break(error=UpperMismatch(expected_upper, state.upper))
    for other in sorted(batch_writers - {writer_id}):
        if txn.writers.get(other) is None:
            return Break(
                error=InvalidUsage(
                    f"a batch was written by writer {other}, whose lease expired: its data may "
                    f"already be garbage collected, so it can't be appended"
                )
            )
    for b in batches:
        if txn.batches.get(b.id) is not None:
            return Break(error=InvalidUsage(f"batch {b.id} was already appended"))
        txn.batches.put(b.id, b)
    txn.upper = new_upper
    if new_upper != expected_upper:
        retracted = sum(p.retracted or 0 for b in batches for p in b.parts)
        added = sum(b.rows for b in batches) - retracted
        txn.record_upper(added, retracted, writer.purpose)
        # Retention measures from when times became readable: this may let the since move.
        txn.recompute_since()
    txn.writers.put(
        writer_id,
        msgspec.structs.replace(
            writer,
            last_heartbeat_ms=txn.now_ms,
            last_write_token=token,
            last_write_upper=new_upper,
        ),
    )
    if then is not None:
        then(txn)
    return Continue(txn.finish(), Committed(new_upper))


def heartbeat_writer(state: State, writer_id: str, now_ms: Now) -> Outcome[int | None]:
    """Extends a writer's lease; the result is the shard's upper."""
    txn = Txn(state, now_ms)
    writer = txn.writers.get(writer_id)
    if writer is None:
        return _not_registered(state, txn, "writer", writer_id)
    txn.writers.put(writer_id, msgspec.structs.replace(writer, last_heartbeat_ms=txn.now_ms))
    return Continue(txn.finish(), txn.upper)


def downgrade_since(
    state: State, reader_id: str, new_since: int | None, seqno_since: int, now_ms: Now
) -> Outcome[int | None]:
    """Moves a reader's since to ``new_since`` (and extends its lease); the result is the
    shard's since afterwards. With ``new_since`` equal to the reader's since it is a heartbeat.

    ``seqno_since`` is the oldest state version the reader may still read from; it never moves
    backwards either.
    """
    txn = Txn(state, now_ms)
    reader = txn.readers.get(reader_id)
    if reader is None:
        return _not_registered(state, txn, "reader", reader_id)
    if not frontier_le(reader.since, new_since):
        return Break(
            error=InvalidUsage(f"since can't move backwards: from {reader.since} to {new_since}")
        )
    txn.readers.put(
        reader_id,
        msgspec.structs.replace(
            reader,
            since=new_since,
            seqno_since=max(reader.seqno_since, seqno_since),
            last_heartbeat_ms=txn.now_ms,
        ),
    )
    txn.recompute_since()
    return Continue(txn.finish(), txn.since)


def expire_writer(state: State, writer_id: str, now_ms: Now) -> Outcome[None]:
    if writer_id not in state.writers:
        return Break(result=None)
    txn = Txn(state, now_ms)
    txn.expire_writer(writer_id)
    return Continue(txn.finish(), None)


def expire_reader(state: State, reader_id: str, now_ms: Now) -> Outcome[None]:
    if reader_id not in state.readers:
        return Break(result=None)
    txn = Txn(state, now_ms)
    txn.readers.put(reader_id, None)
    txn.recompute_since()
    return Continue(txn.finish(), None)


def add_rollup(state: State, rollup: RollupRef, now_ms: Now) -> Outcome[bool]:
    """Records a rollup of the state at ``rollup.seqno``; False (no change) when a rollup as new
    or newer is already recorded, in which case the caller's rollup blob is unreferenced.

    True without a change when this very rollup is recorded: a retry after an indeterminate
    failure must not take its own landed commit for a lost race (and delete a live blob).
    """
    if state.rollups.get(rollup.seqno) == rollup:
        return Break(result=True)
    if state.rollups and max(state.rollups) >= rollup.seqno:
        return Break(result=False)
    if rollup.seqno > state.seqno:
        raise ValueError(f"a rollup at {rollup.seqno} is newer than the state ({state.seqno})")
    txn = Txn(state, now_ms)
    # Older rollups are redundant now; their blobs go once no reader can need them.
    for seqno, old in list(txn.rollups.items()):
        txn.rollups.put(seqno, None)
        txn.retire([old.key])
    txn.rollups.put(rollup.seqno, rollup)
    return Continue(txn.finish(), True)


def apply_merge(
    state: State,
    inputs: list[str],
    output: HollowBatch | None,
    started_ms: int,
    timeout_ms: int,
    now_ms: Now,
) -> Outcome[bool]:
    """Replaces the batches ``inputs`` by their compacted ``output`` (None: they cancelled out).

    True when applied. False (no change) when an input is gone (another compaction won, or the
    shard was finalized) or the compaction took longer than ``timeout_ms`` since
    ``started_ms`` (garbage collection may already be sweeping its output): the caller then
    deletes the output's blobs. Writers never wait for this: it is checked against whatever
    the state is now. True without a change when ``output`` is already in the state (a retry
    after an indeterminate failure found its own commit landed).
    """
    if output is not None and state.batches.get(output.id) == output:
        return Break(result=True)
    if Clock.of(now_ms).now_ms - started_ms > timeout_ms or state.finalized:
        return Break(result=False)
    if any(i not in state.batches for i in inputs):
        return Break(result=False)
    txn = Txn(state, now_ms)
    for i in inputs:
        old = txn.batches.get(i)
        assert old is not None  # checked above; expiry never removes batches
        txn.batches.put(i, None)
        txn.retire(p.key for p in old.parts if not p.inline)
    if output is not None and output.parts:
        txn.batches.put(output.id, output)
    return Continue(txn.finish(), True)


def evolve_schema(
    state: State,
    seed: SchemaVersion,
    new: SchemaVersion | None,
    expected_version: int | None,
    now_ms: Now,
    token: str = "",
) -> Outcome[int]:
    """Makes ``new`` the shard's current schema, as the next version; the result is its
    number. ``seed`` is version 0 as the state implies it, recorded with the first evolution.
    ``new`` None (the current schema again) changes nothing. ``expected_version`` given and
    not the current version: ``SchemaChanged``, nothing changes. Which changes are allowed
    is ``core.arrow.evolution.plan_evolution``'s to say, before this runs. ``token``
    identifies the call: its version is recorded with it (see ``landed_evolution``)."""
    if state.finalized:
        return Break(error=finalized_error(state))
    current = max(state.schemas, default=0)
    if expected_version is not None and expected_version != current:
        return Break(error=SchemaChanged(expected_version, current))
    if new is None:
        return Break(result=current)
    txn = Txn(state, now_ms)
    if not state.schemas:
        txn.schemas.put(0, seed)
    version = current + 1
    txn.schemas.put(version, msgspec.structs.replace(new, at_ms=txn.now_ms, token=token))
    txn.schema = new.schema
    txn.record_upper(0, 0, "evolve schema")
    return Continue(txn.finish(), version)


def landed_evolution(state: State, token: str) -> int | None:
    """The version the ``evolve_schema`` call ``token`` made, if it is in ``state`` (a try
    whose reply was lost had landed); None if not."""
    if not token:
        return None
    return next((n for n, v in state.schemas.items() if v.token == token), None)
