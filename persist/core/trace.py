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

Pure: in goes the list of batches, out come the groups to merge.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from persist.core.state import HollowBatch, batches_in_order


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
    return groups
