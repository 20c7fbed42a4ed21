"""Exactly-once bookkeeping of streaming writes, kept in the shard's state.

A streaming write may carry ``(writer_id, seq)``. The commit that makes a group of writes visible
also records, in the same state transition, each named write's LSN (kafka-delta-ingest keeps its
source offsets in the very transaction that adds the data): a replay after any crash, reconnect
or truncation of the server's log finds the write taken, at its LSN. A writer's seqs are kept in
blocks of ``SEQ_BLOCK`` (a commit's diff rewrites only the blocks it touched), as runs along which
seq and LSN both step by one (a writer streaming alone into a shard is one run per block); the
blocks older than the writer's latest ``KEEP_SEQS`` seqs are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from persist.core.state import SeqRuns, Txn

__all__ = ["KEEP_SEQS", "SEQ_BLOCK", "check_writer_id", "latest_seq", "lookup_seq", "record_seqs"]

SEQ_BLOCK = 1024
KEEP_SEQS = 100_000
_SEP = "\n"
MAX_WRITER_ID = 256


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


def lookup_seq(seqs: Mapping[str, SeqRuns], writer_id: str, seq: int) -> int | None:
    """The LSN ``(writer_id, seq)`` was committed at, if it is recorded."""
    runs = seqs.get(_key(writer_id, seq // SEQ_BLOCK))
    if runs is None:
        return None
    for first, lsn, count in runs.runs:
        if first <= seq < first + count:
            return lsn + (seq - first)
    return None


def latest_seq(seqs: Mapping[str, SeqRuns], writer_id: str) -> int | None:
    """The highest seq of ``writer_id`` recorded."""
    best: int | None = None
    for key, runs in seqs.items():
        w, _ = _writer_of(key)
        if w == writer_id and runs.runs:
            first, _, count = runs.runs[-1]
            top = first + count - 1
            best = top if best is None else max(best, top)
    return best


def record_seqs(txn: Txn, entries: Iterable[tuple[str, int, int]], keep: int = KEEP_SEQS) -> None:
    """Records ``(writer_id, seq, lsn)`` of committed writes in ``txn``, dropping each touched
    writer's blocks that lie wholly below its latest ``keep`` seqs. A seq already recorded is
    left as it is (a write is taken once)."""
    by_block: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for writer_id, seq, lsn in entries:
        by_block.setdefault((writer_id, seq // SEQ_BLOCK), []).append((seq, lsn))
    tops: dict[str, int] = {}
    for (writer_id, block), pairs in by_block.items():
        key = _key(writer_id, block)
        old = txn.stream_seqs.get(key)
        runs = _extended(old.runs if old else (), sorted(pairs))
        txn.stream_seqs.put(key, SeqRuns(runs))
        last_first, _, last_count = runs[-1]
        tops[writer_id] = max(tops.get(writer_id, -1), last_first + last_count - 1)
    for writer_id, top in tops.items():
        floor = (top - keep + 1) // SEQ_BLOCK  # blocks below this hold only seqs out of reach
        for key, _ in list(txn.stream_seqs.items()):
            w, block = _writer_of(key)
            if w == writer_id and block < floor:
                txn.stream_seqs.put(key, None)


def _extended(
    runs: tuple[tuple[int, int, int], ...], pairs: list[tuple[int, int]]
) -> tuple[tuple[int, int, int], ...]:
    """``runs`` with the sorted ``(seq, lsn)`` pairs added (a seq already there keeps its LSN).
    A writer streaming alone adds seqs and LSNs that both go on by one from its last run: that
    run just grows, without unpacking the block."""
    s0, l0 = pairs[0]
    n = len(pairs)
    if all(pairs[i] == (s0 + i, l0 + i) for i in range(1, n)):
        if not runs:
            return ((s0, l0, n),)
        first, lsn, count = runs[-1]
        if s0 == first + count and l0 == lsn + count:
            return (*runs[:-1], (first, lsn, count + n))
        if s0 > first + count:
            return (*runs, (s0, l0, n))
    known = {first + i: lsn + i for first, lsn, count in runs for i in range(count)}
    for seq, lsn in pairs:
        known.setdefault(seq, lsn)
    return _runs(known)


def _runs(lsns: Mapping[int, int]) -> tuple[tuple[int, int, int], ...]:
    runs: list[list[int]] = []
    for seq in sorted(lsns):
        lsn = lsns[seq]
        if runs and runs[-1][0] + runs[-1][2] == seq and runs[-1][1] + runs[-1][2] == lsn:
            runs[-1][2] += 1
        else:
            runs.append([seq, lsn, 1])
    return tuple((a, b, c) for a, b, c in runs)
