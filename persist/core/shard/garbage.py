"""What of a shard's blobs is garbage, and the transitions that record its collection.

The state holds the blobs it refers to (live parts, rollups) and the ones it stopped referring
to (``State.retired``, with the seqno that retired each; ``State.expired_writers``, whose
prefixes may hold parts never committed). Garbage collection (``persist.internal.gc``) asks
here what it may delete, deletes it, and then commits that it did: these are its rules, kept
pure like every transition of ``core.shard.transitions``.
"""

from __future__ import annotations

from persist.core.shard.clock import Now
from persist.core.shard.transitions import Break, Continue, Outcome, Txn
from persist.core.shard.types import State

__all__ = ["deletable", "forget_expired_writers", "forget_retired", "referenced_keys"]


def referenced_keys(state: State, *, inline: bool = False) -> set[str]:
    """Every blob key the state needs: live parts, retired-but-not-deleted blobs, rollups.
    Inline parts' keys (nothing is stored under them) only ``inline``."""
    keys = {p.key for b in state.batches.values() for p in b.parts if inline or not p.inline}
    keys.update(state.retired)
    keys.update(r.key for r in state.rollups.values())
    return keys


def deletable(state: State) -> list[str]:
    """Retired blobs no reader can need.

    A blob retired at seqno X is referenced by no state at or after X; a reader only reads
    through states at or after its seqno_since. So once every reader's seqno_since is >= X
    (trivially so with no readers), nobody can reach it.
    """
    horizon = state.seqno_since
    return sorted(k for k, seqno in state.retired.items() if seqno <= horizon)


def forget_retired(state: State, keys: list[str], now_ms: Now) -> Outcome[None]:
    """Drops blobs that garbage collection has deleted from ``retired``."""
    gone = [k for k in keys if k in state.retired]
    if not gone:
        return Break(result=None)
    txn = Txn(state, now_ms)
    for k in gone:
        txn.retired.put(k, None)
    return Continue(txn.finish(), None)


def forget_expired_writers(state: State, writer_ids: list[str], now_ms: Now) -> Outcome[None]:
    """Drops writers whose prefix garbage collection has swept from ``expired_writers``."""
    gone = [w for w in writer_ids if w in state.expired_writers]
    if not gone:
        return Break(result=None)
    txn = Txn(state, now_ms)
    for w in gone:
        txn.expired_writers.put(w, None)
    return Continue(txn.finish(), None)
