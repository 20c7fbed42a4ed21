"""``BatchBuilder``: a batch written while its updates arrive, in bounded memory."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pyarrow as pa
import pyarrow.compute as pc

from persist.core.arrow.updates import TIME
from persist.core.frontier import check_bounds, frontier_le
from persist.errors import ExternalError, InvalidUsage
from persist.internal.batch import Batch, PartWriter
from persist.internal.tasks import foreground

__all__ = ["BatchBuilder"]

log = logging.getLogger("persist")


Prepare = Callable[[pa.Table | pa.RecordBatch, int, int | None], Awaitable[pa.Table]]


class BatchBuilder:
    """A batch written while its updates arrive (``WriteHandle.batch_builder(lower, upper)``).

    ``add`` checks updates as ``WriteHandle.batch`` does (times in ``[lower, upper)``) and holds
    them until they make a part of about ``part_target_bytes``, which it writes to blob then:
    the builder holds about one part's worth, however many updates it is given. ``finish``
    writes the rest and returns the ``Batch``: the updates ``WriteHandle.batch`` of all of them
    would have held, in parts cut where they came. Until then nothing is
    visible and nothing is the caller's to delete: if ``add`` or ``finish`` raises, or on
    ``discard``, the builder deletes what it wrote and can't be used again.
    """

    def __init__(
        self,
        ids: tuple[str, str],
        lower: int,
        upper: int | None,
        batch_id: str,
        parts: PartWriter,
        check_live: Callable[[], None],
        prepare: Prepare,
        discard: Callable[[str], Awaitable[None]],
        discard_in_background: Callable[[str], None],
    ) -> None:
        # The writer's: (shard id, writer id), its checks of updates, its deletion of a
        # batch's parts (now, or as a background task of its client).
        self._ids = ids
        self._prepare = prepare
        self._discard = discard
        self._discard_in_background = discard_in_background
        self._check_live = check_live
        self._lower = lower
        self._upper = upper
        self._batch_id = batch_id
        self._parts = parts
        self._max_time: int | None = None
        self._done = False

    async def add(self, updates: pa.Table | pa.RecordBatch) -> None:
        """Adds ``updates`` to the batch (any number of times)."""
        self._check_open()
        try:
            self._check_live()
            table = await self._prepare(updates, self._lower, self._upper)
            if table.num_rows:
                top = pc.max(table.column(TIME)).as_py()
                self._max_time = top if self._max_time is None else max(self._max_time, top)
            with foreground():
                await self._parts.add(table)
        except BaseException as exc:
            await self._failed(exc)
            raise

    async def finish(self, upper: int | None) -> Batch:
        """The batch of every update added, ``[lower, upper)``: ``upper`` must be above each of
        their times and at most the builder's upper (``InvalidUsage``)."""
        self._check_open()
        try:
            self._check_live()
            _, hi = check_bounds(self._lower, upper, ("lower", "upper"))
            if not frontier_le(hi, self._upper) or (
                self._max_time is not None and not frontier_le(self._max_time + 1, hi)
            ):
                top = "none" if self._max_time is None else self._max_time
                raise InvalidUsage(
                    f"upper {hi} must be at most the builder's ({self._upper}) and above "
                    f"every time added (the greatest is {top})"
                )
            with foreground():
                hollow = await self._parts.finish(self._lower, hi)
        except BaseException as exc:
            await self._failed(exc)
            raise
        self._done = True
        shard_id, writer_id = self._ids
        return Batch(shard_id, writer_id, self._lower, hi, hollow)

    async def discard(self) -> None:
        """Deletes what the builder wrote (best effort: what is left, garbage collection takes
        once the writer is gone); it can't be used again. Nothing once ``finish`` returned:
        the batch is the caller's then."""
        if self._done:
            return
        self._done = True
        try:
            await self._discard(self._batch_id)
        except ExternalError as exc:
            log.info("persist: leaving the parts of batch %s to gc: %s", self._batch_id, exc)

    def _check_open(self) -> None:
        if self._done:
            raise InvalidUsage(f"batch builder {self._batch_id} was finished or discarded")

    async def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            # In the background, so that the cancelled caller returns at once.
            self._done = True
            self._discard_in_background(self._batch_id)
            return
        await self.discard()
