"""Erasing rows (``PersistClient.erase``): the one change of a shard that rewrites history.

Every other change keeps what the shard held: compaction rewrites updates only into equivalent
ones (times advanced to the since, equal rows' diffs summed), so the contents as of every
readable time stay what they were. An erase removes every stored update of the rows a predicate
matches, at whatever time, so the contents as of every time lose those rows.

The predicate may name data columns only (``core.arrow.predicates``): all the updates of a row (its
inserts and retractions, at any times) share its data columns, so such a predicate takes all
of them or none, and every row left keeps exactly its multiplicities. A predicate over
``_time`` or ``_diff`` would take some of a row's updates and leave the others, showing
multiplicities nobody wrote.

The edge (``persist.internal.erase``) reads the shard's parts and rewrites each one that holds
a matching update without them (``rewrite``), writing the rewrites of parts in blob; ``erase``
then replaces, in one commit, every batch of the state that holds such a part. Part keys are
written once, so what was read of a part holds for as long as the part is in the state, in
whatever batch: a batch appended, folded or merged meanwhile needs reading only if it has a
part in blob that nobody read. Inline parts are at hand in the state itself, so ``erase``
rewrites the ones appended since the read itself: a stream of small appends can't keep an
erase from landing.

Nor can another process's compaction. A merge output nobody read is known to hold no match
when its span of times, ``[lower, upper)``, lies below the upper of the last read and overlaps
no batch of that read that held one: batches tile the times below the upper, a merge takes
neighbours (its span is theirs), appends come at or above the upper, and merging only moves
times within the span and sums diffs. So every update of such an output comes from batches of
the read that it overlaps, and none of those held a match.

Pure, like ``core.shard.transitions``: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.evolution import View, current_view
from persist.core.arrow.keyrange import encode_keys, key_index
from persist.core.arrow.updates import (
    DIFF,
    TIME,
    checksum,
    decode_part,
    encode_part,
    part_row_group_rows,
)
from persist.core.frontier import Frontier, frontier_le
from persist.core.shard import keys
from persist.core.shard.clock import Clock, Now
from persist.core.shard.transitions import Break, Continue, Outcome, Txn, finalized_error
from persist.core.shard.types import HollowBatch, PartRef, State
from persist.errors import InvalidUsage

__all__ = ["Erased", "Read", "Rewrite", "erase", "rewrite", "unmatched"]


def unmatched(updates: pa.Table, predicate: pc.Expression) -> pa.Table:
    """The updates of ``updates`` whose rows ``predicate`` does not match; a row it evaluates
    to null for is no match. Their order is kept, so a sorted, consolidated part stays one.
    ``InvalidUsage`` if the predicate can't be evaluated on these rows."""
    keep = pc.invert(pc.coalesce(predicate, pc.scalar(False)))
    try:
        return updates.filter(keep)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise InvalidUsage(f"the predicate can't filter the shard's rows: {exc}") from None


def unmatched_as(updates: pa.Table, shown: pa.Table, predicate: pc.Expression) -> pa.Table:
    """``unmatched`` of ``updates`` judged on ``shown``: the same updates row for row, in the
    schema ``predicate`` names (a part of an earlier schema version in the current one)."""
    rows = pa.array(np.arange(shown.num_rows, dtype=np.int64))
    hit = unmatched(shown.append_column("__row", rows), predicate).column("__row")
    return updates.take(hit)


class Rewrite(NamedTuple):
    """A part without the updates a predicate matched: ``part`` (None when nothing of it is
    left), how many updates it lost (``rows``) and, for a part to be written to blob under
    ``part.key``, its bytes (``data``; empty for an inline part, which holds them itself)."""

    part: PartRef | None
    rows: int
    data: bytes = b""


def rewrite(
    data: bytes, part: PartRef, predicate: pc.Expression, view: View, key: str
) -> Rewrite | None:
    """``part`` (its bytes ``data``) without the updates ``predicate`` matches, under ``key``;
    None when it holds none. ``view``: the shard's current schema, in which ``predicate``
    is evaluated on the part's rows; the rewrite stays in the part's own schema version (its
    columns, order and key index are that version's). An inline part's rewrite is
    inline (it is no bigger) and keeps the small parts' encoding; a part in blob gets a key
    index of its own, since the rows sampled for the old one may be gone."""
    version = part.schema_version
    table = decode_part(data, part.checksum, part.key, schema=view.stored_schema(version))
    names = table.column_names[:-2]  # the version's data columns (then _time, _diff)
    if view.direct(version):
        kept = unmatched(table, predicate)
    else:
        kept = unmatched_as(table, view.project(table, version), predicate)
    erased = table.num_rows - kept.num_rows
    if erased == 0:
        return None
    if kept.num_rows == 0:
        return Rewrite(None, erased)
    kept = kept.combine_chunks()
    inline = bool(part.inline)
    encoded = encode_part(
        kept,
        dictionary=not inline,
        row_group_rows=part_row_group_rows(kept.num_rows, kept.nbytes),
        key_names=names,
    )
    times, diffs = pc.min_max(kept.column(TIME)), pc.min_max(kept.column(DIFF))
    retracted = pc.sum(pc.less(kept.column(DIFF), pa.scalar(0, pa.int64()))).as_py() or 0
    new = PartRef(
        key,
        kept.num_rows,
        len(encoded),
        checksum(encoded),
        times["min"].as_py(),
        times["max"].as_py(),
        kept.nbytes,
        encoded if inline else b"",
        b"" if inline else encode_keys(key_index(kept, names, kept.nbytes)),
        diffs["min"].as_py(),
        diffs["max"].as_py(),
        int(retracted),
        version,
    )
    return Rewrite(new, erased, b"" if inline else encoded)


class Erased(msgspec.Struct, frozen=True):
    """What ``erase`` committed: at ``seqno`` (None: nothing matched, nothing committed), how
    many batches and parts it rewrote, how many updates it removed, and the keys of the
    rewrites in blob that the state now names (``in_blob``)."""

    seqno: int | None = None
    batches: int = 0
    parts: int = 0
    rows: int = 0
    in_blob: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Read:
    """What the edge read of the shard: ``parts``, by key, each one's ``rewrite`` (None: it
    held no matching update); and, of the state it read last, the ``upper`` and the spans
    (``[lower, upper)``) of the batches that held a match (``dirty``)."""

    parts: Mapping[str, Rewrite | None]
    upper: Frontier
    dirty: tuple[tuple[int, Frontier], ...]

    def clean(self, batch: HollowBatch) -> bool:
        """Whether ``batch``, made since the read, is known to hold no match without reading
        it (see the module's docstring)."""
        return frontier_le(batch.upper, self.upper) and not any(
            _overlap(batch.lower, batch.upper, lower, upper) for lower, upper in self.dirty
        )


def _overlap(lo1: int, hi1: Frontier, lo2: int, hi2: Frontier) -> bool:
    """Whether ``[lo1, hi1)`` and ``[lo2, hi2)`` share a time (None: no end)."""
    return (hi2 is None or lo1 < hi2) and (hi1 is None or lo2 < hi1)


def erase(
    state: State,
    predicate: pc.Expression,
    read: Read,
    started_ms: int | None,
    timeout_ms: int,
    now_ms: Now,
) -> Outcome[Erased | None]:
    """Replaces, in one commit, every batch of the state that holds a part with updates
    ``predicate`` matches by the batch without them, under a new id (a merge planned from the
    old batch is then refused, as ``apply_merge`` checks its inputs by id, instead of
    committing the rows back), and retires the blobs of the parts replaced.

    An inline part the caller did not ``read`` is rewritten here. None (no change) if a part
    in blob that it did not read is in the state and may hold a match (committed since: the
    caller reads it and tries again), or if the rewrites in blob were started
    (``started_ms``) more than ``timeout_ms`` ago, since garbage collection may then be
    sweeping them as abandoned compaction output (as ``apply_merge`` refuses). ``Erased()``
    (no change) when no part holds a matching update."""
    if state.finalized:
        return Break(error=finalized_error(state))
    now = Clock.of(now_ms).now_ms
    if started_ms is not None and now - started_ms > timeout_ms:
        return Break(result=None)
    txn = Txn(state, now_ms)
    view = current_view(state)
    batches = rows = parts_rewritten = 0
    in_blob: set[str] = set()
    for batch in state.batches.values():
        parts: list[PartRef] = []
        changed = False
        unread = [p for p in batch.parts if p.key not in read.parts and not p.inline]
        if unread and not read.clean(batch):
            return Break(result=None)
        for part in batch.parts:
            if part.key in read.parts:
                done = read.parts[part.key]
            elif part.inline:
                key = keys.compaction_part_key(
                    state.shard_id, now, _derived(part.key, txn.seqno), 0
                )
                try:
                    done = rewrite(part.inline, part, predicate, view, key)
                except InvalidUsage as exc:
                    return Break(error=exc)
            else:
                done = None  # known to hold no match: see Read.clean
            if done is None:
                parts.append(part)
                continue
            changed = True
            parts_rewritten += 1
            rows += done.rows
            if done.part is not None:
                parts.append(done.part)
                if not done.part.inline:
                    in_blob.add(done.part.key)
            if not part.inline:
                txn.retire([part.key])
        if changed:
            batches += 1
            txn.batches.put(batch.id, None)
            if parts:
                new_id = _derived(batch.id, txn.seqno)
                txn.batches.put(
                    new_id, msgspec.structs.replace(batch, id=new_id, parts=tuple(parts))
                )
    if not batches:
        return Break(result=Erased())
    return Continue(
        txn.finish(), Erased(txn.seqno, batches, parts_rewritten, rows, frozenset(in_blob))
    )


def _derived(of: str, seqno: int) -> str:
    """An id for what replaces ``of`` at ``seqno``, shaped like ``ids.new_id``'s: every try of
    the commit names it alike, and ``of`` is replaced at most once."""
    h = hashlib.blake2b(f"{of}@{seqno}".encode(), digest_size=16).hexdigest()
    return f"b{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
