"""Which batches to compact together: a size-tiered spine, after differential dataflow's.

A batch of about ``2**k`` updates has level ``k``. Walking the batches from oldest to newest, a
batch is merged with the one before it while that one's level is not above its own, so the
levels strictly decrease from the oldest batch to the newest, like the digits of a binary
counter. Hence:

- the number of batches is at most about ``log2(updates) + 1``;
- an update is rewritten only when its batch meets one at least as large, which at least
  doubles the batch it is in, so each update is rewritten ``O(log n)`` times (consolidation only
  makes batches smaller, which helps);
- only neighbours in time order merge, so a merged batch still covers one interval of times.

A merge of small batches is mostly fixed cost (reading each part, writing one, a commit, deleting
the inputs), so a group holding fewer than ``min_parts`` parts is *folded* instead: the merged
batch lists its inputs' parts as they are, and no data moves. Folding is a pure change of the
state, made in the commit of the append that makes it due (``fold_small``), so it costs no I/O
and no commit of its own. Only a group of at least ``min_parts`` parts is rewritten, which cuts
the rewrites of a stream of small appends by about ``min_parts`` times while a batch never holds
more than ``min_parts - 1`` unmerged parts from folding (about Materialize's compaction
heuristic, which skips compacting until enough inputs or parts gather).

An unsorted run (``PartRef.unsorted``: a big write's part, stored without sorting) is never
folded: a group holding one is rewritten, and a batch holding one that no merge is due for is
rewritten on its own (a group of one), so the sort a write skipped is done once, in the
background, rather than by every read.

Pure: in goes the list of batches, out come the groups to merge.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence

from persist.core.frontier import Frontier
from persist.core.shard.clock import Now
from persist.core.shard.transitions import Break, Continue, Outcome, Txn
from persist.core.shard.types import HollowBatch, State, batches_in_order


def level(rows: int) -> int:
    """The spine level of a batch of ``rows`` updates: ``floor(log2(rows))`` (0 when empty)."""
    return max(rows, 1).bit_length() - 1


def plan_merges(
    batches: Sequence[HollowBatch], busy: Collection[str] = ()
) -> list[list[HollowBatch]]:
    """The groups of neighbouring batches (oldest first) that should each become one batch.

    Batches in ``busy`` (being merged already) are left alone, and so are their neighbours'
    merges across them.
    """
    groups: list[list[HollowBatch]] = []
    stack: list[tuple[list[HollowBatch], int]] = []  # (members, rows)
    for batch in batches_in_order({b.id: b for b in batches}):
        if batch.id in busy:
            groups.extend(m for m, _ in stack if len(m) > 1)
            stack = []
            continue
        members, rows = [batch], batch.rows
        while stack and level(stack[-1][1]) <= level(rows):
            older, older_rows = stack.pop()
            members, rows = older + members, older_rows + rows
        stack.append((members, rows))
    groups.extend(m for m, _ in stack if len(m) > 1)
    grouped = {b.id for g in groups for b in g}
    groups.extend(
        [b] for b in batches if b.id not in grouped and b.id not in busy and has_unsorted([b])
    )
    return groups


def has_unsorted(group: Iterable[HollowBatch]) -> bool:
    """Whether a batch of ``group`` holds an unsorted run."""
    return any(p.unsorted for b in group for p in b.parts)


def span(group: Iterable[HollowBatch]) -> tuple[int, Frontier]:
    """The ``[lower, upper)`` a merge of neighbouring batches covers."""
    group = list(group)
    uppers = [b.upper for b in group]
    upper = None if None in uppers else max(u for u in uppers if u is not None)
    return min(b.lower for b in group), upper


def is_fold(group: Sequence[HollowBatch], min_parts: int) -> bool:
    """Whether merging ``group`` folds it (concatenates its parts) rather than rewriting it:
    it holds fewer than ``min_parts`` parts, none of them an unsorted run."""
    return sum(len(b.parts) for b in group) < min_parts and not has_unsorted(group)


def folded(group: Sequence[HollowBatch]) -> HollowBatch:
    """The batch that lists the parts of ``group`` as they are (each part a run of its own).

    Its id is derived from the inputs' ids, so every try of the same fold names it alike; a
    set of batches is folded at most once (they leave the state), so the id is never reused.
    """
    h = hashlib.blake2b("|".join(b.id for b in group).encode(), digest_size=16).hexdigest()
    lower, upper = span(group)
    since = max(b.since for b in group)
    parts = tuple(p for b in group for p in b.parts)
    fold_id = f"b{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"  # shaped like new_id's
    return HollowBatch(fold_id, lower, upper, since, parts)


def fold_small(txn: Txn, min_parts: int) -> int:
    """Folds, within ``txn``, every due merge of fewer than ``min_parts`` parts; how many.

    ``min_parts <= 1`` folds nothing (every merge is a rewrite).
    """
    if min_parts <= 1:
        return 0
    batches = [b for _, b in txn.batches.items()]
    n = 0
    for group in plan_merges(batches):
        if is_fold(group, min_parts):
            for b in group:
                txn.batches.put(b.id, None)
            out = folded(group)
            txn.batches.put(out.id, out)
            n += 1
    return n


def fold(state: State, min_parts: int, now_ms: Now) -> Outcome[int]:
    """The due folds as a transition of their own (when no append comes to make them)."""
    if state.finalized:
        return Break(result=0)
    txn = Txn(state, now_ms)
    n = fold_small(txn, min_parts)
    return Continue(txn.finish(), n) if n else Break(result=0)
