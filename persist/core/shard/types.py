"""A shard's state as plain data: the value every transition (``core.shard.transitions``) reads
and every diff (``core.shard.diff``) changes.

Invariants (checked by the tests in ``tests/core``):

- ``upper`` never regresses; it moves only through ``compare_and_append``.
- ``since`` never regresses. It is the minimum of the readers' sinces and, with a retention,
  of the bound the retention sets (``core.shard.history``); with no readers and no retention it
  stays.
- Every time of every update in ``batches`` is in ``[batch.lower, batch.upper)`` and below ``upper``.
- ``rollups`` holds at least one rollup, and every diff names the latest one
  (``StateDiff.latest_rollup``), so the state is rebuilt from one rollup plus the diffs after it.
- A writer or reader whose lease ran out (``last_heartbeat_ms + lease_duration_ms < now_ms``) is
  removed by the next transition that commits (unless the committer's clock can't be trusted
  to say so: see ``core.shard.clock``); its id is never readmitted.

Nothing in ``core`` imports asyncio, time, uuid, random or ``persist.location``: time and ids
come in as arguments (a test enforces this).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from persist.core.shard.history import Mark
from persist.core.shard.streamed import SeqBlock, SeqRuns, StreamServer

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
    # The part's key index (``core.arrow.keyrange``): the first key of each row group, then its last
    # key. Empty for inline parts and parts written before it was recorded: a key range must
    # then read the part to know which of its rows it takes.
    key_index: bytes = b""
    # The smallest and largest ``_diff`` among the part's updates (a part holds no zero diff);
    # None: unknown, a part written before they were recorded. A scan whose parts all hold
    # only +1 diffs needs no consolidation (``core.read.scan``). Readers that predate these fields
    # ignore them (msgspec skips trailing array items).
    min_diff: int | None = None
    max_diff: int | None = None
    # How many of its updates have a negative diff (None: not recorded), for ``history``.
    retracted: int | None = None
    # The version of the shard's schema the part was written in (``State.schemas``): its
    # columns are that version's, and so is the sort order of its rows and its key index.
    schema_version: int = 0
    # An unsorted run: rows in the order written, not consolidated (a row and time may appear
    # more than once; still no zero diff), no key index (``core.arrow.updates``). A big write
    # stores its parts so, to cost one encode; decoding sorts them, and compaction rewrites
    # them as sorted runs. ``rows``, ``min_diff`` and ``max_diff`` describe its updates as
    # stored (what an engine reading the file sees). Never inline.
    unsorted: bool = False
    # The merge that wrote it (its output batch's id); "" for a write's part or a rewrite's.
    # The parts of one merge stay together: a merge rewrites whole batches, a fold keeps them.
    origin: str = ""
    # Each of its rows has exactly one update, a +1, among all the parts of its ``origin``:
    # no other part of that merge holds one of its rows, whatever their key ranges
    # (``core.read.scan.untouched``). A merge writes such rows apart, as a run of their own.
    alone: bool = False


class HollowBatch(msgspec.Struct, frozen=True, gc=False):
    """A batch of updates, by reference.

    Every update was written at a time in ``[lower, upper)``; compaction may since have advanced
    it, to at most ``since`` (a stored time lies between the original and
    ``max(original, since)``). Each part is a sorted run, sorted by (data columns, time) and
    consolidated, or an unsorted run (``PartRef.unsorted``) that decodes as one; with
    ``sorted_run`` the parts, in order, are sorted runs (a compaction's output; never with an
    unsorted part): its alone parts (``PartRef.alone``) are one, its others another; else each
    part is a run of its own (an append's parts, or a fold of batches: see ``trace``).
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

    def runs(self) -> list[tuple[PartRef, ...]]:
        """The batch's sorted runs, each its parts in order (see above)."""
        if not self.sorted_run:
            return [(p,) for p in self.parts]
        alone = tuple(p for p in self.parts if p.alone)
        others = tuple(p for p in self.parts if not p.alone)
        return [run for run in (alone, others) if run]

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
    # The schema version the writer was opened at (a resumed handle writes it too).
    schema_version: int = 0


class ReaderState(msgspec.Struct, frozen=True, gc=False):
    purpose: str
    since: int | None
    # The oldest state version this reader may still read from (its snapshots' blobs live there).
    seqno_since: int
    lease_duration_ms: int
    last_heartbeat_ms: int
    # The schema version the reader was opened at: what it reads every row in.
    schema_version: int = 0


class SchemaVersion(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One version of a shard's schema: the data columns (pyarrow IPC bytes) and, for each
    column in order, its field id. A field keeps its id through renames, widenings and moves;
    a dropped field's id is never given again, so values stored under it never reappear
    under a new field of the same name (``core.arrow.evolution``)."""

    schema: bytes
    ids: tuple[int, ...]
    # When the version was made (the committer's clock; 0 for the first).
    at_ms: int = 0
    # The evolve_schema call that made it: a retry of that call (its reply lost) finds it.
    token: str = ""


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
    # once every reader's seqno_since is past it (see ``core.shard.garbage``).
    retired: dict[str, int] = {}
    # Writers expired at a seqno, whose prefix garbage collection has yet to sweep for parts
    # they wrote but never committed.
    expired_writers: dict[str, int] = {}
    # Streaming writes (the Flight server's DoExchange), recorded in the commit that makes
    # them visible (``core.stream.streams``): per server, how far its log of the shard is resolved;
    # per writer id, where its recent named writes landed. ``stream_upper`` and
    # ``stream_seqs`` are the previous release's (LSNs were shard times then): read, never
    # written.
    stream_upper: int = 0
    stream_seqs: dict[str, SeqRuns] = {}
    # How long contents stay readable by wall clock, in ms (None: readers alone hold history;
    # the default of shards created before retention existed) and when each upper was reached
    # (seqno -> mark): see ``core.shard.history``.
    retention_ms: int | None = None
    history: dict[int, Mark] = {}
    stream_servers: dict[str, StreamServer] = {}
    stream_named: dict[str, SeqBlock] = {}
    # Every version of the schema, by number (``core.shard.schemas``); empty until the first
    # evolution: ``schema`` is then version 0, its fields ids 0, 1, ...; else ``schema`` is the
    # newest version's.
    schemas: dict[int, SchemaVersion] = {}

    @property
    def latest_rollup(self) -> RollupRef:
        return self.rollups[max(self.rollups)]

    @property
    def seqno_since(self) -> int:
        """The oldest seqno anyone may still read state at (for garbage collection)."""
        return min((r.seqno_since for r in self.readers.values()), default=self.seqno)


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


def batches_in_order(batches: Mapping[str, HollowBatch]) -> list[HollowBatch]:
    """The batches by lower, then upper, then id (a stable, deterministic order)."""
    return sorted(
        batches.values(),
        key=lambda b: (b.lower, b.upper is None, b.upper or 0, b.id),
    )
