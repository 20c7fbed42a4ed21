"""The shard state machine: plain data and pure transitions, no I/O.

A shard's state is a value (:class:`State`). Every change to it is a transition: a pure function
of the state, its inputs and the time (``now_ms``, passed in) that returns either
:class:`Continue` (a :class:`StateDiff` to commit, and the caller's result) or :class:`Break`
(commit nothing: a refusal, or an answer that needs no change). A diff holds only what changed,
so what goes to consensus is proportional to the change, not to the state.
``apply_diff(state, diff)`` is the only way a new state is made, for the writer that commits a
diff and for every reader that later replays it. What of it is garbage, and the transitions
that record its collection, are in ``core.garbage``.

Invariants (checked by the tests in ``tests/core``):

- ``upper`` never regresses; it moves only through ``compare_and_append``.
- ``since`` never regresses. It is the minimum of the readers' sinces and, with a retention,
  of the bound the retention sets (``core.history``); with no readers and no retention it stays.
- Every time of every update in ``batches`` is in ``[batch.lower, batch.upper)`` and below ``upper``.
- ``rollups`` holds at least one rollup, and every diff names the latest one
  (``StateDiff.latest_rollup``), so the state is rebuilt from one rollup plus the diffs after it.
- A writer or reader whose lease ran out (``last_heartbeat_ms + lease_duration_ms < now_ms``) is
  removed by the next transition that commits (unless the committer's clock can't be trusted
  to say so: see ``Clock``); its id is never readmitted.

This module must not import asyncio, time, uuid, random or ``persist.location``: time and ids
come in as arguments (a test enforces this).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from persist.core import history as hist
from persist.core.clock import Clock, Now, held_back, stale
from persist.core.frontier import frontier_le, frontier_max, frontier_min
from persist.core.history import Mark
from persist.core.overlay import Overlay
from persist.core.stream_records import SeqBlock, SeqRuns, StreamServer
from persist.errors import InvalidUsage, LeaseExpired, PersistError, UpperMismatch

R = TypeVar("R")
K = TypeVar("K")
V = TypeVar("V")

# The state structs are gc=False: they never form reference cycles, and a big shard's state holds
# tens of thousands of them, which the cyclic collector would otherwise keep rescanning.


class PartRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One Parquet part of a batch in blob: where it is and what it holds."""

    key: str
    rows: int
    size: int
    checksum: str
    min_time: int
    max_time: int
    # The part's size decoded, in memory (0: unknown, written before this was recorded). A
    # well-compressed part decodes to many times its size in blob: this, not ``size``, says
    # whether decoding it is quick enough for the event loop.
    nbytes: int = 0
    # The part's Parquet bytes when it is small enough to live in the state itself (an inline
    # write: nothing is stored at ``key``, which only names it); empty for a part in blob.
    inline: bytes = b""
    # The part's key index (``core.keyrange``): the first key of each row group, then its last
    # key. Empty for inline parts and parts written before it was recorded: a key range must
    # then read the part to know which of its rows it takes.
    key_index: bytes = b""
    # The smallest and largest ``_diff`` among the part's updates (a part holds no zero diff);
    # None: unknown, a part written before they were recorded. A scan whose parts all hold
    # only +1 diffs needs no consolidation (``core.scan``). Readers that predate these fields
    # ignore them (msgspec skips trailing array items).
    min_diff: int | None = None
    max_diff: int | None = None
    # How many of its updates have a negative diff (None: not recorded), for ``history``.
    retracted: int | None = None


class HollowBatch(msgspec.Struct, frozen=True, gc=False):
    """A batch of updates, by reference.

    Every update was written at a time in ``[lower, upper)``; compaction may since have advanced
    it, to at most ``since`` (a stored time lies between the original and
    ``max(original, since)``). Each part is sorted by (data columns, time) and consolidated;
    with ``sorted_run`` the parts, in order, are one sorted run (a compaction's output), else
    each part is a run of its own (an append's parts, or a fold of batches: see ``trace``).
    """

    id: str
    lower: int
    upper: int | None
    since: int
    parts: tuple[PartRef, ...]
    sorted_run: bool = False

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


class WriterState(msgspec.Struct, frozen=True, gc=False):
    purpose: str
    lease_duration_ms: int
    last_heartbeat_ms: int
    # The token and new upper of this writer's latest committed compare_and_append: a retry of
    # that same write (after an indeterminate error) is recognised as already done.
    last_write_token: str = ""
    last_write_upper: int | None = None


class ReaderState(msgspec.Struct, frozen=True, gc=False):
    purpose: str
    since: int | None
    # The oldest state version this reader may still read from (its snapshots' blobs live there).
    seqno_since: int
    lease_duration_ms: int
    last_heartbeat_ms: int


class RollupRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A full copy of the state at ``seqno``, stored in blob at ``key``."""

    seqno: int
    key: str


class State(msgspec.Struct, frozen=True, gc=False):
    shard_id: str
    seqno: int
    # The Arrow schema of the data columns, as serialized by pyarrow (IPC).
    schema: bytes
    since: int | None
    upper: int | None
    writers: dict[str, WriterState]
    readers: dict[str, ReaderState]
    batches: dict[str, HollowBatch]
    rollups: dict[int, RollupRef]
    finalized: bool = False
    # Blobs no longer referenced as of a seqno (replaced batches' parts, old rollups): deleted
    # once every reader's seqno_since is past it (see ``core.garbage``).
    retired: dict[str, int] = {}
    # Writers expired at a seqno, whose prefix garbage collection has yet to sweep for parts
    # they wrote but never committed.
    expired_writers: dict[str, int] = {}
    # Streaming writes (the Flight server's DoExchange), recorded in the commit that makes
    # them visible (``core.streams``): per server, how far its log of the shard is resolved;
    # per writer id, where its recent named writes landed. ``stream_upper`` and
    # ``stream_seqs`` are the previous release's (LSNs were shard times then): read, never
    # written.
    stream_upper: int = 0
    stream_seqs: dict[str, SeqRuns] = {}
    # How long contents stay readable by wall clock, in ms (None: readers alone hold history;
    # the default of shards created before retention existed) and when each upper was reached
    # (seqno -> mark): see ``core.history``.
    retention_ms: int | None = None
    history: dict[int, Mark] = {}
    stream_servers: dict[str, StreamServer] = {}
    stream_named: dict[str, SeqBlock] = {}

    @property
    def latest_rollup(self) -> RollupRef:
        return self.rollups[max(self.rollups)]

    @property
    def seqno_since(self) -> int:
        """The oldest seqno anyone may still read state at (for garbage collection)."""
        return min((r.seqno_since for r in self.readers.values()), default=self.seqno)


class StateDiff(msgspec.Struct, frozen=True, gc=False):
    """The change from the state at ``seqno_from`` to the state at ``seqno_to``.

    Scalar fields hold ``[]`` when unchanged and ``[new value]`` when changed; map fields hold
    ``(key, new value)`` pairs, with None for a removed key.
    """

    shard_id: str
    seqno_from: int
    seqno_to: int
    latest_rollup: RollupRef
    schema: list[bytes] = []
    since: list[int | None] = []
    upper: list[int | None] = []
    writers: list[tuple[str, WriterState | None]] = []
    readers: list[tuple[str, ReaderState | None]] = []
    batches: list[tuple[str, HollowBatch | None]] = []
    rollups: list[tuple[int, RollupRef | None]] = []
    finalized: list[bool] = []
    retired: list[tuple[str, int | None]] = []
    expired_writers: list[tuple[str, int | None]] = []
    stream_upper: list[int] = []
    stream_seqs: list[tuple[str, SeqRuns | None]] = []
    retention_ms: list[int | None] = []
    history: list[tuple[int, Mark | None]] = []
    stream_servers: list[tuple[str, StreamServer | None]] = []
    stream_named: list[tuple[str, SeqBlock | None]] = []


# Every State field except the diff's own bookkeeping is carried by StateDiff; tests hold this.
DIFFED_FIELDS = frozenset(
    {
        "schema",
        "since",
        "upper",
        "writers",
        "readers",
        "batches",
        "rollups",
        "finalized",
        "retired",
        "expired_writers",
        "stream_upper",
        "stream_seqs",
        "retention_ms",
        "history",
        "stream_servers",
        "stream_named",
    }
)


def empty_state(shard_id: str) -> State:
    """The state before a shard exists (seqno 0); the first diff creates the shard."""
    return State(
        shard_id=shard_id,
        seqno=0,
        schema=b"",
        since=0,
        upper=0,
        writers={},
        readers={},
        batches={},
        rollups={},
    )


def _apply_map(base: dict[K, V], ops: list[tuple[K, V | None]]) -> dict[K, V]:
    if not ops:
        return base
    out = dict(base)
    for key, value in ops:
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def apply_diff(state: State, diff: StateDiff) -> State:
    """The state after ``diff``. Raises ``ValueError`` if the diff does not follow ``state``."""
    return apply_diffs(state, [diff])


def apply_diffs(state: State, diffs: list[StateDiff]) -> State:
    """The state after ``diffs``, in order, copying each changed map once for the whole run.

    Raises ``ValueError`` if a diff does not follow the state before it.
    """
    seqno = state.seqno
    for diff in diffs:
        if diff.seqno_from != seqno or diff.shard_id != state.shard_id:
            raise ValueError(
                f"diff {diff.shard_id}@{diff.seqno_from}->{diff.seqno_to} does not apply to "
                f"{state.shard_id}@{seqno}"
            )
        seqno = diff.seqno_to
    if not diffs:
        return state
    scalars: dict[str, object] = {}
    for diff in diffs:
        for name in ("schema", "since", "upper", "finalized", "stream_upper", "retention_ms"):
            change = getattr(diff, name)
            if change:
                scalars[name] = change[-1]
    return msgspec.structs.replace(
        state,
        seqno=seqno,
        writers=_apply_map(state.writers, [op for d in diffs for op in d.writers]),
        readers=_apply_map(state.readers, [op for d in diffs for op in d.readers]),
        batches=_apply_map(state.batches, [op for d in diffs for op in d.batches]),
        rollups=_apply_map(state.rollups, [op for d in diffs for op in d.rollups]),
        retired=_apply_map(state.retired, [op for d in diffs for op in d.retired]),
        expired_writers=_apply_map(
            state.expired_writers, [op for d in diffs for op in d.expired_writers]
        ),
        stream_seqs=_apply_map(state.stream_seqs, [op for d in diffs for op in d.stream_seqs]),
        history=_apply_map(state.history, [op for d in diffs for op in d.history]),
        stream_servers=_apply_map(
            state.stream_servers, [op for d in diffs for op in d.stream_servers]
        ),
        stream_named=_apply_map(state.stream_named, [op for d in diffs for op in d.stream_named]),
        **scalars,
    )


# --- transitions -------------------------------------------------------------------------------


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
        """Records that this commit moved the upper to ``self.upper`` (``core.history``)."""
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
    state: State, writer_id: str, purpose: str, lease_duration_ms: int, now_ms: Now
) -> Outcome[int | None]:
    """Adds a writer; the result is the shard's upper."""
    if state.finalized:
        return Break(error=finalized_error(state))
    txn = Txn(state, now_ms)
    txn.writers.put(writer_id, WriterState(purpose, lease_duration_ms, txn.now_ms))
    return Continue(txn.finish(), txn.upper)


def register_reader(
    state: State, reader_id: str, purpose: str, lease_duration_ms: int, now_ms: Now
) -> Outcome[int | None]:
    """Adds a reader holding the shard's since; the result is that since."""
    if state.finalized:
        return Break(error=finalized_error(state))
    txn = Txn(state, now_ms)
    txn.readers.put(
        reader_id,
        ReaderState(purpose, txn.since, state.seqno + 1, lease_duration_ms, txn.now_ms),
    )
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


def batches_in_order(batches: Mapping[str, HollowBatch]) -> list[HollowBatch]:
    """The batches by lower, then upper, then id (a stable, deterministic order)."""
    return sorted(
        batches.values(),
        key=lambda b: (b.lower, b.upper is None, b.upper or 0, b.id),
    )


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
