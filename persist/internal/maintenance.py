"""A shard's maintenance: when to compact, collect garbage and roll up, in the background.

The commit seam (``Machine``) only reports that something was committed; this module decides
what is due and runs it: merges (``compact.merge_batches``; the background loop's in the
client's merge worker process, ``worker.py``, where it has one), garbage collection
(``gc.collect``) and, in ``maintain``, due rollups. A client runs at most
``compaction_concurrency`` merges at once, and a shard's requests coalesce into one background
loop, so a burst of writes never queues a burst of merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pyarrow.compute as pc

from persist.core.arrow.evolution import current_view
from persist.core.arrow.updates import DiffOverflow
from persist.core.shard import lifecycle as life
from persist.core.shard.trace import fold, is_fold, plan_merges
from persist.core.shard.transitions import apply_merge
from persist.core.shard.types import HollowBatch, State, batches_in_order
from persist.errors import ExternalError, PersistError
from persist.internal.batch import delete_parts
from persist.internal.compact import merge_batches
from persist.internal.erase import erase_rows
from persist.internal.gc import collect
from persist.internal.machine import Machine
from persist.internal.retry import Tries
from persist.internal.tasks import being_cancelled
from persist.internal.worker import MergeWorker
from persist.metrics import on as metrics_on

log = logging.getLogger("persist")

__all__ = ["Maintenance"]

_MAINTAIN_ROUNDS = 8


class Maintenance:
    """A shard's background compaction and garbage collection: one loop, kicked by commits.

    Kicks coalesce (an event, not a queue), so work is bounded however fast writes come; the
    loop may die or be cancelled at any point without harming correctness (every step is
    idempotent and re-planned from the state). ``maintain()`` does all due work now.
    """

    def __init__(self, machine: Machine, worker: MergeWorker | None = None) -> None:
        self.machine = machine
        # The client's merge worker process, if its background merges run in one.
        self._worker = worker
        self._kicked = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.Task[None] | None = None
        self._busy: set[str] = set()

    def kick(self) -> None:
        m = self.machine
        if not m.cfg.compaction_enabled:
            return
        self._kicked.set()
        self._idle.clear()
        if self._loop is None or self._loop.done():
            self._loop = m.tasks.spawn(self._background(), f"maintenance {m.shard_id}")

    async def settle(self) -> None:
        """Waits for the shard's background work: a rollup in flight, the loop's work in hand."""
        while True:
            await self.machine.rollup_settled()
            loop = self._loop
            while not self._idle.is_set() and loop is not None and not loop.done():
                idle = asyncio.ensure_future(self._idle.wait())
                await asyncio.wait([idle, loop], return_when=asyncio.FIRST_COMPLETED)
                idle.cancel()
            if not self.machine.rolling_up():
                return

    async def maintain(
        self, progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Runs every due step to completion (``PersistClient.maintain``); says what it did,
        and after each round, to ``progress``, what that round did."""
        m = self.machine
        totals: dict[str, Any] = {"folds": 0, "merges": 0, "rollups": 0}
        # The retention's window moves with the clock: with no commit since, the since moves
        # here (then compaction can consolidate what fell out of the window).
        totals["since"] = await m.apply(life.advance_since)
        # Each step's commits can make another step due (a merge retires blobs, commits make a
        # rollup due, a rollup retires the one before): repeat until a round finds nothing.
        for _ in range(_MAINTAIN_ROUNDS):
            await self.settle()
            round_: dict[str, int] = {
                "folds": await self.fold(),
                "merges": await self.compact_all(),
            }
            round_["rollups"] = int(m.rollup_due() and await m.write_rollup())
            round_.update(await collect(m, sweep_orphans=True))
            for key, value in round_.items():
                totals[key] = totals.get(key, 0) + value
            if progress is not None:
                progress(dict(round_))
            # A rollup written after the merges settled ends it: with a small rollup interval,
            # the commits of collecting the one before would make yet another due.
            if (
                not round_["merges"]
                and not round_["folds"]
                and (round_["rollups"] or not any(round_.values()))
            ):
                break
        await self.settle()
        return totals

    async def purge(self) -> dict[str, Any]:
        """Rewrites every batch that may hold times at or below the since into one, at the
        since, then rolls up and collects garbage (``PersistClient.purge``): afterwards no blob
        the state reaches holds an update whose row's multiplicity is zero as of the since,
        and the replaced blobs are deleted once no reader still holds them."""
        m = self.machine
        await m.refresh()
        await self.settle()
        before = m.state
        report: dict[str, Any] = {
            "since": before.since,
            "batches_rewritten": 0,
            "parts_rewritten": 0,
            **_live(before, "before"),
        }
        for _ in range(_MAINTAIN_ROUNDS):
            state = m.state
            since = state.since
            if since is None or state.finalized:
                break
            group = [b for b in batches_in_order(state.batches) if b.lower <= since]
            if not group:
                break
            if await self.compact(group):
                report["batches_rewritten"] += len(group)
                report["parts_rewritten"] += sum(len(b.parts) for b in group)
                break
            await m.refresh()  # another merge won the inputs: plan again from the state
        else:
            raise ExternalError(
                "purge: the batches below the since kept changing", determinate=True
            )
        report.update(await self._rollup_and_collect())
        return report

    async def erase(self, predicate: pc.Expression) -> dict[str, Any]:
        """Removes every stored update of the rows ``predicate`` (a checked row predicate)
        matches in one commit (``erase_rows``), then rolls up and collects garbage
        (``PersistClient.erase``)."""
        m = self.machine
        await m.refresh()
        await self.settle()
        before = _live(m.state, "before")
        erased = await erase_rows(m, predicate, self._busy)
        report: dict[str, Any] = {
            "since": m.state.since,
            "seqno": erased.seqno,
            "batches_rewritten": erased.batches,
            "parts_rewritten": erased.parts,
            "rows_erased": erased.rows,
            **before,
        }
        report.update(await self._rollup_and_collect())
        after = m.state
        # A reader whose recorded state version is older than a retirement still reaches what
        # was retired: those blobs stay until it renews its hold.
        newest = max(after.retired.values(), default=0)
        report["held_by"] = {
            rid: r.purpose for rid, r in sorted(after.readers.items()) if r.seqno_since < newest
        }
        return report

    async def _rollup_and_collect(self) -> dict[str, Any]:
        """After a rewrite: the rollups before it still list the old parts (and hold inline
        ones), so a new rollup retires them, and collection deletes what no reader holds any
        more (and the consensus diffs before the rollup). What it did, for the reports."""
        m = self.machine
        await m.write_rollup()
        collected: dict[str, int] = {}
        for _ in range(2):  # the second round takes what the first one's commits released
            for key, value in (await collect(m, sweep_orphans=True)).items():
                collected[key] = collected.get(key, 0) + value
        return {
            **_live(m.state, "after"),
            "blobs_deleted": collected.get("blobs_deleted", 0)
            + collected.get("orphans_deleted", 0),
            "blobs_held": len(m.state.retired),
        }

    async def _background(self) -> None:
        try:
            while True:
                if not self._kicked.is_set():
                    self._idle.set()
                if being_cancelled():
                    raise asyncio.CancelledError()
                await self._kicked.wait()
                self._kicked.clear()
                try:
                    # One round of merges, then collection: while appends keep merges stepping
                    # aside, rounds keep coming, and what they retired must not pile up (nor
                    # swell every rollup) until they stop.
                    if await self.compact_all(max_rounds=1, background=True):
                        self._kicked.set()
                    await collect(self.machine, sweep_orphans=False)
                except PersistError as exc:
                    if being_cancelled():
                        raise asyncio.CancelledError() from exc
                    log.info("persist maintenance of %s deferred: %s", self.machine.shard_id, exc)
        finally:
            self._idle.set()

    async def compact_all(self, max_rounds: int | None = None, *, background: bool = False) -> int:
        """Runs merges until the spine has none due (or for ``max_rounds`` rounds of planning);
        the number applied. ``background``: the client's merge worker makes them, if it has
        one."""
        applied = 0
        rounds = 0
        while max_rounds is None or rounds < max_rounds:
            rounds += 1
            state = self.machine.state
            if state.since is None or state.finalized:
                return applied
            min_parts = self.machine.cfg.compaction_min_parts
            groups = [
                g
                for g in plan_merges(list(state.batches.values()), self._busy)
                if not is_fold(g, min_parts)
            ]
            if not groups:
                return applied
            progress = False
            for group in groups:
                if await self.compact(group, background=background):
                    applied += 1
                    progress = True
            # A merge that can't be done now (a part unreadable, the blob store failing) would
            # be planned again at once: leave it to the next kick instead of spinning on it.
            if not progress:
                return applied
        return applied

    async def fold(self) -> int:
        """Makes the due folds that no append made (writes fold them as they commit)."""
        m = self.machine
        min_parts = m.cfg.compaction_min_parts
        folded: int = await m.apply(lambda s, now: fold(s, min_parts, now))
        return folded

    async def compact(self, group: list[HollowBatch], *, background: bool = False) -> bool:
        m = self.machine
        ids = [b.id for b in group]
        if self._busy.intersection(ids):
            return False
        self._busy.update(ids)
        try:
            async with m.tasks.compaction_gate:
                since = m.state.since
                if since is None:
                    return False
                started = m.cfg.now_ms()
                view = current_view(m.state)
                # Background merges go to the worker process; a caller waiting on ``maintain``
                # gets its merges made here, at full priority (a niced worker is starved while
                # other processes keep the CPU busy).
                worker = self._worker if background else None
                if worker is not None and not worker.usable:
                    worker = None
                try:
                    if worker is not None:
                        output = await worker.merge(m.shard_id, view, group, since, started)
                    else:
                        output = await merge_batches(
                            m.blob, m.cfg, m.shard_id, view, group, since, started, m.recent
                        )
                except (ExternalError, DiffOverflow) as exc:
                    # DiffOverflow: at the since, some row's diffs sum outside int64. Left
                    # unmerged the shard stays exact (reads at such times raise it themselves).
                    log.info("persist compaction of %s abandoned: %s", m.shard_id, exc)
                    # Most often the inputs were merged and collected by another process:
                    # plan the next round from the state as it is now.
                    with contextlib.suppress(ExternalError):
                        await m.refresh()
                    return False
                timeout = int(m.cfg.compaction_timeout_s * 1000)
                tries = Tries()
                applied = await m.apply(
                    lambda s, now: apply_merge(s, ids, output, started, timeout, now),
                    tries=tries,
                )
                if applied and (counted := metrics_on()) is not None:
                    counted.merges.inc()
                    counted.merged_bytes.inc(sum(b.size for b in group))
                log.info(
                    "persist: shard %s: %s %d batches (%d parts, %d bytes) into %s in %.2f s%s",
                    m.shard_id,
                    "merged" if applied else "discarded a merge of",
                    len(group),
                    sum(len(b.parts) for b in group),
                    sum(b.size for b in group),
                    "nothing" if output is None else f"{len(output.parts)} part(s)",
                    (m.cfg.now_ms() - started) / 1000,
                    "" if worker is None else f" (in merge worker {worker.pid})",
                )
                # A try that may have landed may since have been merged on and its parts
                # retired while readers use them: the orphan sweep takes them in time.
                if not applied and output is not None and not tries.maybe_committed:
                    await delete_parts(m.blob, [output])
                return applied
        finally:
            self._busy.difference_update(ids)


def _live(state: State, when: str) -> dict[str, int]:
    """The rows and bytes of ``state``'s live parts, as a rewrite's report names them."""
    return {
        f"rows_{when}": sum(b.rows for b in state.batches.values()),
        f"bytes_{when}": sum(b.size for b in state.batches.values()),
    }
