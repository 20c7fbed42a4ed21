"""Questions asked of a shard's state by reads: which parts hold what a read needs.

Pure functions of the state (no I/O), so that the read paths (snapshots, splits, listens, and
the front ends' reads) ask them one way and they are tested without an event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from persist.core.arrow.keyrange import Key, cut_keys, decode_keys, rank
from persist.core.frontier import Frontier, check_below_upper, check_since, newest_readable
from persist.core.shard.types import PartRef, State
from persist.errors import InvalidUsage

__all__ = [
    "KeyRange",
    "inline_bytes",
    "key_ranges",
    "parts_as_of",
    "parts_between",
    "snapshot_as_of",
]


def snapshot_as_of(
    state: State, as_of: int | None, *, wait: bool, empty_if_unwritten: bool
) -> int | None:
    """The time a planned snapshot of ``state``'s shard reads (``PersistClient.plan_snapshot``):
    ``as_of``, or by default the newest readable time; None for an empty plan (nothing written,
    ``empty_if_unwritten``). ``InvalidUsage`` for whatever ``state`` already refuses: a dropped
    shard, no default to take (sealed, or nothing written), an ``as_of`` not below the upper
    without ``wait``, or below the since (a since never moves back: below it now is below it
    at any later registration too)."""
    sid = state.shard_id
    if state.finalized:
        # Its since and upper are None too, but "give as_of" would send the caller after a
        # time that no longer exists.
        raise InvalidUsage(
            f"shard {sid} was dropped (finalized): its data is deleted and nothing of it can "
            f"be read at any time"
        )
    upper = state.upper
    t = as_of
    if t is None:
        t = newest_readable(upper)
        if t is None:
            if upper is None:
                raise InvalidUsage(f"shard {sid} is finished (its upper is None): give as_of")
            if empty_if_unwritten:
                return None
            raise InvalidUsage(f"shard {sid} has nothing to read yet (its upper is 0): give as_of")
    elif not wait:
        check_below_upper(t, upper)
    check_since(t, state.since)
    return t


def inline_bytes(state: State) -> int:
    """How many bytes of part data the state holds inline."""
    return sum(len(p.inline) for b in state.batches.values() for p in b.parts)


def parts_as_of(state: State, as_of: int) -> list[PartRef]:
    """The parts that can hold updates at times ``<= as_of``: those of the batches whose lower
    is at or below it, less the parts whose updates all come later."""
    return [
        p
        for b in state.batches.values()
        if b.lower <= as_of
        for p in b.parts
        if p.min_time <= as_of
    ]


def parts_between(state: State, lower: int, upper: Frontier) -> list[PartRef]:
    """The parts that can hold updates at times in ``[lower, upper)`` (``upper`` None: no end):
    those of the batches that overlap it, less the parts whose times all lie outside it."""
    return [
        p
        for b in state.batches.values()
        if (b.upper is None or b.upper > lower) and (upper is None or b.lower < upper)
        for p in b.parts
        if p.max_time >= lower and (upper is None or p.min_time < upper)
    ]


class KeyRange(NamedTuple):
    """One share of a read cut by key: the keys in ``[lower, upper)`` (None: unbounded) and
    the parts that may hold some of them."""

    lower: Key | None
    upper: Key | None
    parts: list[PartRef]


def key_ranges(
    parts: Sequence[PartRef],
    schema: pa.Schema,
    n: int,
    lower: Key | None = None,
    upper: Key | None = None,
) -> list[KeyRange]:
    """``parts`` cut into ``n`` ranges of keys (``schema``: the data columns) of about equal
    bytes, from their key indexes alone (no I/O). Every key lies in exactly one range, so all
    updates of a row fall in one share, and the ranges, in order, cover every key (of
    ``[lower, upper)`` when given: a split cut into pieces).

    A part goes to each range its keys may reach; one without a key index (inline, or written
    before indexes) goes to every range, which then reads only its own keys of it.
    """
    indexed = [p for p in parts if p.key_index]

    def one_range() -> list[KeyRange]:
        # Every key is in the first range; the others are empty ones at its upper end.
        return [
            KeyRange(lower, upper, list(parts)) if i == 0 else KeyRange(upper, upper, [])
            for i in range(n)
        ]

    if n == 1 or not indexed:
        return one_range()
    indexes = [decode_keys(p.key_index, schema) for p in indexed]
    # Key i of an index of k + 1 starts a k-th of the part's rows: that k-th of its bytes.
    starts = pa.concat_tables([ix.slice(0, ix.num_rows - 1) for ix in indexes])
    weights = np.concatenate(
        [
            np.full(ix.num_rows - 1, p.size / (ix.num_rows - 1))
            for p, ix in zip(indexed, indexes, strict=True)
        ]
    )
    inside = np.ones(starts.num_rows, dtype=bool)
    if lower is not None:
        inside &= rank(lower, starts) >= 1  # lower <= key
    if upper is not None:
        inside &= rank(upper, starts) == 0  # key < upper
    if not inside.all():
        if not inside.any():
            return one_range()
        mask = pa.array(inside)
        starts, weights = starts.filter(mask), weights[inside]
    cuts = cut_keys(starts, weights, n)  # n - 1 of them
    table = pa.concat_tables(cuts)
    firsts = rank(table, pa.concat_tables([ix.slice(0, 1) for ix in indexes]))
    lasts = rank(table, pa.concat_tables([ix.slice(ix.num_rows - 1, 1) for ix in indexes]))
    shares = [[p for p in parts if not p.key_index] for _ in range(n)]
    for p, first, last in zip(indexed, firsts, lasts, strict=True):
        for i in range(int(first), int(last) + 1):
            shares[i].append(p)
    bounds: list[Key | None] = [lower, *cuts, upper]
    return [KeyRange(bounds[i], bounds[i + 1], shares[i]) for i in range(n)]
