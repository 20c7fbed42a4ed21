"""Garbage collection: deleting what no state version anyone can still use refers to.

It follows the seed's logical-then-physical pattern (epoch-based reclamation):

1. **Logical**: a transition that makes a blob redundant (a merge replacing batches, a newer
   rollup) records it in ``State.retired`` with the seqno X of that transition. States at or
   after X no longer refer to it; older ones still may.
2. **Physical**: once every reader's ``seqno_since`` is at or past X (readers only read through
   states at or after their ``seqno_since``, which holds back while they read a snapshot or
   have splits out), the blob is deleted, and only then dropped from ``retired`` by
   ``forget_retired``. A crash between the two just deletes it again later (deletes are
   idempotent).
3. **Orphans**: parts written by a writer that died (or was refused) before committing are
   under its prefix. When a writer expires the state records it in ``expired_writers``; this
   sweeps its prefix for keys the state does not refer to (an expired writer's batches can't be
   committed any more: ``compare_and_append`` refuses them). Compaction output that was never
   committed, and rollups that lost their race, are swept by age and seqno in
   ``sweep_orphans`` mode (``client.maintain``). The same sweeps take a retired blob whose
   delete a crash undid (a file blob does not sync its deletes).
4. **Consensus**: diffs before the latest rollup are never read again (a shard is loaded from
   its latest rollup; a client whose cache fell behind a truncation reloads from it), so they
   are truncated, last.

Every step re-reads what it needs from the state and may be run twice, concurrently, or
abandoned half way: the worst outcome is a delete repeated or deferred to the next run.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from persist.core.shard import garbage
from persist.core.shard import keys as blob_keys
from persist.location import Blob
from persist.metrics import on as metrics_on

if TYPE_CHECKING:
    from persist.internal.machine import Machine

__all__ = ["collect"]

_DELETE_CONCURRENCY = 16


async def _delete_all(blob: Blob, keys: list[str]) -> None:
    gate = asyncio.Semaphore(_DELETE_CONCURRENCY)

    async def one(key: str) -> None:
        async with gate:
            await blob.delete(key)

    await asyncio.gather(*(one(k) for k in keys))


log = logging.getLogger("persist")


async def collect(machine: Machine, *, sweep_orphans: bool) -> dict[str, int]:
    """Runs every due garbage-collection step for one shard; counts what it did."""
    m = machine
    done = {"blobs_deleted": 0, "writers_swept": 0, "orphans_deleted": 0, "diffs_truncated": 0}
    if m.state.finalized:
        return done

    keys = garbage.deletable(m.state)
    if keys:
        await _delete_all(m.blob, keys)
        await m.apply(lambda s, now: garbage.forget_retired(s, keys, now), housekeeping=True)
        done["blobs_deleted"] = len(keys)

    expired = sorted(m.state.expired_writers)
    if expired:
        referenced = garbage.referenced_keys(m.state)
        for writer_id in expired:
            listed = await m.blob.list_keys(blob_keys.writer_prefix(m.shard_id, writer_id))
            junk = [k for k in listed if k not in referenced]
            await _delete_all(m.blob, junk)
            done["orphans_deleted"] += len(junk)
        await m.apply(
            lambda s, now: garbage.forget_expired_writers(s, expired, now), housekeeping=True
        )
        done["writers_swept"] = len(expired)

    if sweep_orphans:
        done["orphans_deleted"] += await _sweep_orphans(m)

    latest = m.state.latest_rollup.seqno
    if latest > m.truncated_below:
        done["diffs_truncated"] = await m.consensus.truncate(m.shard_id, latest)
        m.truncated_below = latest
    if any(done.values()):
        log.debug("persist: shard %s: garbage collected %s", m.shard_id, done)
        if (counted := metrics_on()) is not None:
            counted.blobs_deleted.inc(done["blobs_deleted"] + done["orphans_deleted"])
    return done


async def _sweep_orphans(m: Machine) -> int:
    """Deletes abandoned compaction output, rollups that were never recorded and temp files of
    sets that died half way."""
    referenced = garbage.referenced_keys(m.state)
    # A merge can't commit after compaction_timeout_s; twice that leaves room for clock skew.
    cutoff = m.cfg.now_ms() - int(2 * m.cfg.compaction_timeout_s * 1000)
    junk = []
    for key in await m.blob.list_keys(blob_keys.compaction_prefix(m.shard_id)):
        started = blob_keys.compaction_started_ms(key)
        if key not in referenced and started is not None and started < cutoff:
            junk.append(key)
    # A rollup for a seqno below the latest recorded one can never be recorded any more.
    latest = m.state.latest_rollup.seqno
    for key in await m.blob.list_keys(blob_keys.rollup_prefix(m.shard_id)):
        seqno = blob_keys.rollup_seqno(key)
        if key not in referenced and seqno is not None and seqno < latest:
            junk.append(key)
    await _delete_all(m.blob, junk)
    # Temp files of a process killed mid-set. A live set keeps its temp file's mtime recent,
    # but one may stall (a slow disk, a paused process): the slack abandoned compaction output
    # gets, twice the longest a merge may take, is far beyond any set that is still alive.
    partial = await m.blob.delete_partial_writes(
        blob_keys.shard_prefix(m.shard_id), 2 * m.cfg.compaction_timeout_s
    )
    return len(junk) + partial
