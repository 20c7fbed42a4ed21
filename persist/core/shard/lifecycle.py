"""Transitions of a shard's life beyond reads and writes: its retention, a client letting go of
its handles (``expire_handles``), and its end (``finalize``, ``drop``). Pure, like
``core.shard.transitions``, whose ``Txn`` they use."""

from __future__ import annotations

from collections.abc import Iterable

from persist.core.shard.clock import Now
from persist.core.shard.transitions import Break, Continue, Outcome, Txn, finalized_error
from persist.core.shard.types import HollowBatch, State
from persist.errors import InvalidUsage

__all__ = ["advance_since", "drop", "expire_handles", "finalize", "set_retention"]


def set_retention(state: State, retention_ms: int | None, now_ms: Now) -> Outcome[None]:
    """Sets how long contents stay readable by wall clock (None: readers alone hold history).
    A longer window keeps what is still readable from now on; it can't bring back times the
    since has passed."""
    if state.finalized:
        return Break(error=finalized_error(state))
    if state.retention_ms == retention_ms:
        return Break(result=None)
    txn = Txn(state, now_ms)
    txn.retention_ms = retention_ms
    txn.recompute_since()
    return Continue(txn.finish(), None)


def advance_since(state: State, now_ms: Now) -> Outcome[int | None]:
    """Moves the since as far as readers and retention allow now (the retention's window
    moves with the clock); the result is the since. Commits nothing when it stays."""
    if state.finalized:
        return Break(result=state.since)
    txn = Txn(state, now_ms)
    if txn.since == state.since and not txn.readers.diff() and not txn.writers.diff():
        return Break(result=state.since)
    return Continue(txn.finish(), txn.since)


def drop(
    state: State, force: bool, now_ms: Now, own: frozenset[str] = frozenset()
) -> Outcome[list[HollowBatch]]:
    """Seals the shard (upper and since None) and finalizes it in one commit; the result is
    the dropped batches, as ``finalize``'s.

    A writer or reader whose lease is still live refuses it (``InvalidUsage`` naming them)
    unless ``force`` or it is one of ``own`` (the caller's): then they are expired with it,
    and their next call fails with ``LeaseExpired``. A finalized shard is done already (an
    empty result).
    """
    if state.finalized:
        return Break(result=[])
    txn = Txn(state, now_ms)
    live = [f"writer {w} ({s.purpose!r})" for w, s in txn.writers.items() if w not in own]
    live += [f"reader {r} ({s.purpose!r})" for r, s in txn.readers.items() if r not in own]
    if live and not force:
        shown = ", ".join(live[:5]) + (f" and {len(live) - 5} more" if len(live) > 5 else "")
        return Break(
            error=InvalidUsage(
                f"shard {state.shard_id} has live handles: {shown}; expire them, wait for "
                f"their leases to run out, or drop with force=True"
            )
        )
    # Sealed and finalized at once: the handles go with the batches (_finalize_txn).
    txn.since, txn.upper = None, None
    return _finalize_txn(txn)


def expire_handles(state: State, handle_ids: Iterable[str], now_ms: Now) -> Outcome[None]:
    """Expires, in one commit, those of the writers and readers ``handle_ids`` names that are
    still registered (a client letting go of all it registered); the others are left alone."""
    ids = set(handle_ids)
    if ids.isdisjoint(state.writers) and ids.isdisjoint(state.readers):
        return Break(result=None)
    txn = Txn(state, now_ms)
    for hid in ids:
        # Those the transaction found stale are expired already.
        if txn.writers.get(hid) is not None:
            txn.expire_writer(hid)
        elif txn.readers.get(hid) is not None:
            txn.readers.put(hid, None)
    txn.recompute_since()
    return Continue(txn.finish(), None)


def finalize(state: State, now_ms: Now) -> Outcome[list[HollowBatch]]:
    """Marks a shard whose since and upper are both empty as finalized and drops its batches.

    The result is the dropped batches, whose blobs the caller then deletes: nobody can read
    them again, since no time is readable.
    """
    if state.finalized:
        return Break(result=[])
    if state.since is not None or state.upper is not None:
        return Break(
            error=InvalidUsage(
                f"only a shard with since and upper both None can be finalized "
                f"(since={state.since}, upper={state.upper})"
            )
        )
    return _finalize_txn(Txn(state, now_ms))


def _finalize_txn(txn: Txn) -> Outcome[list[HollowBatch]]:
    dropped = [b for _, b in txn.batches.items()]
    for b in dropped:
        txn.batches.put(b.id, None)
    for wid, _ in list(txn.writers.items()):
        txn.writers.put(wid, None)
    for rid, _ in list(txn.readers.items()):
        txn.readers.put(rid, None)
    # Finalizing deletes everything under the shard but the tombstone, so nothing is left
    # for garbage collection to track.
    for key, _ in list(txn.retired.items()):
        txn.retired.put(key, None)
    for wid, _ in list(txn.expired_writers.items()):
        txn.expired_writers.put(wid, None)
    txn.finalized = True
    return Continue(txn.finish(), dropped)
