"""Streaming writes as the shard's state records them, and the one transition that commits them.

A streaming server (``persist.flight``) numbers the writes it takes by **LSN**: a position in
*its own* log of a shard, not a shard time. It commits them in groups, each at whatever time is
free when it commits (the upper then), and the shard's state records, in the very transition
that makes a group visible:

- per server (``State.stream_servers``, keyed by the server's id): every LSN of its log below
  ``lsn_upper`` is resolved, and its latest group landed at ``at``. Whether a try that failed
  without saying did land is read from here: nothing another writer does can move it, so any
  number of servers, DoPuts and Python or Spark writers may write the shard meanwhile;
- per named write ``(writer_id, seq)`` (``State.stream_named``): the server, LSN and time it
  landed at and a fingerprint of its rows (kafka-delta-ingest keeps its source offsets in the
  transaction that adds the data). A group whose named write is already recorded (a client
  resent it to another server, which committed first) does not land: ``commit_group`` says
  which are taken, and the server commits the rest without them. So a write is applied once
  whichever server commits it, and a resend with other rows is told apart from a replay.

A writer's seqs are kept in blocks of ``SEQ_BLOCK`` (a commit's diff rewrites only the blocks it
touched), as runs along which seq and LSN both step by one at one time and server (a writer
alone in a shard is one run per group), plus four bytes of fingerprint per seq; blocks wholly
older than the writer's latest ``KEEP_SEQS`` seqs are dropped. The previous release's records
(``stream_upper``, ``stream_seqs``: LSNs were shard times then) are still read: a seq found
there landed at its old LSN, by an unknown server, with no fingerprint.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from persist.core.shard.clock import Now
from persist.core.shard.streamed import SeqBlock, StreamServer
from persist.core.shard.transitions import Break, Continue, Outcome, Txn, compare_and_append
from persist.core.shard.types import HollowBatch, State
from persist.errors import IntegrityError, UpperMismatch

__all__ = [
    "KEEP_SEQS",
    "MAX_WRITER_ID",
    "SEQ_BLOCK",
    "GroupLanded",
    "Named",
    "Recorded",
    "SeqsTaken",
    "ShardGone",
    "check_writer_id",
    "commit_group",
    "lookup",
    "record_named",
    "resolved_below",
]

SEQ_BLOCK = 512
KEEP_SEQS = 100_000
MAX_WRITER_ID = 256
_SEP = "\n"
_FP = struct.Struct("<I")


def check_writer_id(writer_id: object) -> str | None:
    """The reason ``writer_id`` can't name a streaming writer, or None when it can."""
    if not isinstance(writer_id, str) or not writer_id:
        return "a writer_id must be a non-empty string"
    if len(writer_id) > MAX_WRITER_ID or not writer_id.isprintable():
        return f"a writer_id must be printable text of at most {MAX_WRITER_ID} characters"
    return None


def _key(writer_id: str, block: int) -> str:
    return f"{writer_id}{_SEP}{block}"


def _writer_of(key: str) -> tuple[str, int]:
    writer_id, _, block = key.rpartition(_SEP)
    return writer_id, int(block)


# --- what the state records ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Named:
    """A named write of a group: ``(writer_id, seq)`` at ``lsn`` of the committing server, its
    rows at the group's time + ``offset``, with their fingerprint (``core.arrow.fingerprint``; 0:
    unknown)."""

    writer_id: str
    seq: int
    lsn: int
    offset: int
    fingerprint: int


@dataclass(frozen=True, slots=True)
class Recorded:
    """Where a named write landed: at shard ``time``, as ``lsn`` of ``server`` (both None when
    the previous release recorded it), with its rows' ``fingerprint`` (0: unknown)."""

    time: int
    server: str | None
    lsn: int | None
    fingerprint: int


def lookup(state: State, writer_id: str, seq: int) -> Recorded | None:
    """Where ``(writer_id, seq)`` landed, if the state still records it."""
    block = state.stream_named.get(_key(writer_id, seq // SEQ_BLOCK))
    if block is not None:
        for first, count, num, lsn, time in block.runs:
            if first <= seq < first + count:
                at = (seq % SEQ_BLOCK) * 4
                fps = block.fingerprints
                fp = _FP.unpack_from(fps, at)[0] if at + 4 <= len(fps) else 0
                step = seq - first
                return Recorded(time + step, _server_named(state, num), lsn + step, fp)
    return _legacy(state, writer_id, seq)


def _legacy(state: State, writer_id: str, seq: int) -> Recorded | None:
    runs = state.stream_seqs.get(f"{writer_id}{_SEP}{seq // _LEGACY_BLOCK}")
    if runs is None:
        return None
    for first, lsn, count in runs.runs:
        if first <= seq < first + count:
            return Recorded(lsn + (seq - first), None, None, 0)
    return None


# The previous release's block size (its keys are ``writer_id\nseq // 1024``).
_LEGACY_BLOCK = 1024


def _server_named(state: State, num: int) -> str | None:
    for server, record in state.stream_servers.items():
        if record.num == num:
            return server
    return None


def resolved_below(state: State, server: str) -> int:
    """Every LSN of ``server``'s log of the shard below this is resolved. The previous
    release's ``stream_upper`` counts for every server: its LSNs start at or above it."""
    record = state.stream_servers.get(server)
    return max(record.lsn_upper if record is not None else 0, state.stream_upper)


def record_named(
    txn: Txn, num: int, time: int, entries: Iterable[Named], keep: int = KEEP_SEQS
) -> None:
    """Records in ``txn`` that ``entries`` landed at ``time`` (+ each one's offset), by the
    server numbered ``num``,
    dropping each touched writer's blocks wholly below its latest ``keep`` seqs. A seq already
    recorded keeps its record (a write lands once: ``commit_group`` checks before)."""
    by_block: dict[tuple[str, int], list[Named]] = {}
    for n in entries:
        by_block.setdefault((n.writer_id, n.seq // SEQ_BLOCK), []).append(n)
    tops: dict[str, int] = {}
    for (writer_id, block), named in by_block.items():
        key = _key(writer_id, block)
        old = txn.stream_named.get(key)
        new = _extended(old, sorted(named, key=lambda n: n.seq), num, time)
        txn.stream_named.put(key, new)
        first, count, *_ = new.runs[-1]
        tops[writer_id] = max(tops.get(writer_id, -1), first + count - 1)
    for writer_id, top in tops.items():
        floor = (top - keep + 1) // SEQ_BLOCK  # blocks below this hold only seqs out of reach
        if floor <= 0:
            continue
        for key, _ in list(txn.stream_named.items()):
            w, block = _writer_of(key)
            if w == writer_id and block < floor:
                txn.stream_named.put(key, None)


def _extended(old: SeqBlock | None, named: list[Named], num: int, time: int) -> SeqBlock:
    runs = list(old.runs) if old is not None else []
    # Seqs usually come after every recorded one: then none is known, and no set is built.
    end = max((first + count for first, count, *_ in runs), default=0)
    known = (
        set()
        if named[0].seq >= end
        else {s for first, count, *_ in runs for s in range(first, first + count)}
    )
    fps = bytearray(old.fingerprints if old is not None else b"")
    added = False
    for n in named:
        if n.seq in known:
            continue
        known.add(n.seq)
        added = True
        at = (n.seq % SEQ_BLOCK) * 4
        if len(fps) < at + 4:
            fps.extend(bytes(at + 4 - len(fps)))
        _FP.pack_into(fps, at, n.fingerprint & 0xFFFFFFFF)
        if runs:
            first, count, r_num, r_lsn, r_time = runs[-1]
            if (
                n.seq == first + count
                and n.lsn == r_lsn + count
                and r_time + count == time + n.offset
                and r_num == num
            ):
                runs[-1] = (first, count + 1, r_num, r_lsn, r_time)
                continue
        runs.append((n.seq, 1, num, n.lsn, time + n.offset))
    if not added and old is not None:
        return old
    runs.sort()
    return SeqBlock(tuple(runs), bytes(fps))


# --- the transition ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupLanded:
    """The group is in the shard at time ``at`` (``already``: an earlier try had landed it)."""

    at: int
    already: bool = False


@dataclass(frozen=True, slots=True)
class SeqsTaken:
    """Nothing landed: these named writes of the group are recorded already (another server
    committed them, or this one under another LSN), so the group must go without them."""

    taken: dict[tuple[str, int], Recorded]


@dataclass(frozen=True, slots=True)
class ShardGone:
    """Nothing landed, and nothing ever will: the shard was finalized or sealed."""

    why: str


GroupResult = GroupLanded | SeqsTaken | ShardGone


def commit_group(
    state: State,
    writer_id: str,
    server: str,
    lsn_end: int,
    named: Sequence[Named],
    batches: list[HollowBatch],
    at: int,
    times: int,
    token: str,
    now: Now,
    fold: Callable[[Txn], object] | None = None,
) -> Outcome[GroupResult]:
    """Commits a streaming server's group in one transition: ``batches`` (its rows, at times in
    ``[at, at + times)``: one per write that carries rows), ``server``'s log resolved below
    ``lsn_end`` and ``named`` recorded. It lands while the upper is at most ``at``, moving it to
    ``at + times`` (times between the upper and ``at`` stay empty); with ``times`` 0 (every
    write of it landed elsewhere) it only resolves the LSNs.

    In order: a group ``server`` already resolved is ``GroupLanded(already=True)`` at the time
    recorded then (a try that failed without saying had landed); a finalized or sealed shard
    is ``ShardGone``; a named write already recorded is ``SeqsTaken``; an upper past ``at`` is
    ``UpperMismatch`` (the caller writes the rows again, later).
    """
    record = state.stream_servers.get(server)
    if record is not None and record.lsn_upper >= lsn_end:
        return Break(result=GroupLanded(record.at, already=True))
    if state.finalized or state.upper is None:
        why = "was dropped or finalized" if state.finalized else "is sealed (its upper is None)"
        return Break(result=ShardGone(f"shard {state.shard_id} {why}"))
    if named and min(n.lsn for n in named) < resolved_below(state, server):
        # The caller cuts groups from LSNs it has not resolved: a bug, not a race.
        return Break(error=IntegrityError(f"a group of server {server} below its resolved LSNs"))
    taken = {
        (n.writer_id, n.seq): found
        for n in named
        if (found := lookup(state, n.writer_id, n.seq)) is not None
    }
    if taken:
        return Break(result=SeqsTaken(taken))
    num = (
        record.num
        if record is not None
        else 1 + max((r.num for r in state.stream_servers.values()), default=0)
    )

    def recorded(txn: Txn, time: int) -> None:
        txn.stream_servers.put(server, StreamServer(num, lsn_end, time))
        record_named(txn, num, time, named)

    if times == 0:
        txn = Txn(state, now)
        at = record.at if record is not None else 0
        recorded(txn, at)
        return Continue(txn.finish(), GroupLanded(at))

    upper = state.upper
    if upper > at:
        return Break(error=UpperMismatch(at, upper))

    def then(txn: Txn) -> None:
        if fold is not None:
            fold(txn)
        recorded(txn, at)

    # From the upper as it is: the rows are at ``at`` or later, so they lie past it.
    out = compare_and_append(state, writer_id, batches, upper, at + times, token, now, then=then)
    if isinstance(out, Break):
        committed = out.result
        if committed is not None and committed.already:
            return Break(result=GroupLanded(at, already=True))
        return Break(error=out.error)
    return Continue(out.diff, GroupLanded(at), out.error)
