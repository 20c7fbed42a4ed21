"""``SnapshotPlan``: what a front end hands out for one snapshot read (a reader holding ``as_of``
and the splits to fetch), planned in one place by ``PersistClient.plan_snapshot``."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import pyarrow as pa

from persist.core.arrow.evolution import current_version
from persist.core.frontier import check_frontier, check_since, frontier_le
from persist.core.read.queries import snapshot_as_of
from persist.errors import InvalidUsage
from persist.internal.fetch import Split, schema_from_bytes
from persist.internal.shards import Shards
from persist.read import ReadHandle, register_reader_handle

__all__ = ["MIN_SPLIT_BYTES", "SPLIT_BYTES", "Held", "SnapshotPlan", "check_flags", "plan_held"]

# The default split count of a plan: one split per this many bytes of the snapshot's parts...
SPLIT_BYTES = 128 << 20
# ... and at least one per core that fetches them, while each split still gets this many: below
# it, a split costs more to schedule than to read.
MIN_SPLIT_BYTES = 8 << 20

CleanUp = Callable[[Coroutine[Any, Any, Any], str], None]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SnapshotPlan:
    """One snapshot read, planned by ``PersistClient.plan_snapshot``.

    ``reader`` holds the shard's since at ``as_of`` (``reader.since == as_of`` as planned; at or
    below it without ``move_since``) for as long as it lives, so every split can be fetched
    (``PersistClient.fetch_split`` and friends, in any process) until the reader is expired or
    its lease runs out; the caller owns it. ``reader`` is None when the plan holds nothing: no
    split to fetch (the contents are empty).
    ``as_of`` is None only for a shard with nothing written (upper 0) planned as empty.
    """

    shard_id: str
    schema: pa.Schema  # the shard's data columns
    as_of: int | None
    reader: ReadHandle | None
    splits: tuple[Split, ...]

    @property
    def size(self) -> int:
        """Bytes of blob that fetching every split reads (a part shared by several splits
        counts once per split)."""
        return sum(s.size for s in self.splits)


async def make_plan(
    shards: Shards,
    shard_id: str,
    *,
    as_of: int | None,
    splits: int | None,
    split_bytes: int,
    parallelism: int,
    drop_empty_splits: bool,
    wait: bool,
    empty_if_unwritten: bool,
    move_since: bool,
    purpose: str,
    lease_ms: int,
    clean_up: CleanUp,
) -> SnapshotPlan:
    """``PersistClient.plan_snapshot`` (documented there); ``clean_up`` runs a coroutine in the
    background, where a cancelled caller does not wait for it."""
    _check_count("splits", splits, allow_none=True)
    _check_count("split_bytes", split_bytes)
    _check_count("parallelism", parallelism)
    check_flags(drop_empty_splits=drop_empty_splits)

    async def cut(reader: ReadHandle, t: int) -> tuple[list[Split], bool]:
        got = await _cut(reader, t, splits, split_bytes, parallelism)
        if drop_empty_splits:
            got = [s for s in got if s.parts]
        return got, bool(got)

    planned = await plan_held(
        shards,
        shard_id,
        cut,
        as_of=as_of,
        wait=wait,
        empty_if_unwritten=empty_if_unwritten,
        move_since=move_since,
        purpose=purpose,
        lease_ms=lease_ms,
        clean_up=clean_up,
    )
    return SnapshotPlan(
        planned.shard_id,
        planned.schema,
        planned.as_of,
        planned.reader,
        tuple(planned.made or ()),
    )


@dataclass(frozen=True, slots=True)
class Held(Generic[T]):
    """What ``plan_held`` planned: ``made`` by its ``make`` (None for an empty plan), and the
    reader holding it (None when it holds nothing)."""

    shard_id: str
    schema: pa.Schema
    as_of: int | None
    reader: ReadHandle | None
    made: T | None


async def plan_held(
    shards: Shards,
    shard_id: str,
    make: Callable[[ReadHandle, int], Awaitable[tuple[T, bool]]],
    *,
    as_of: int | None,
    wait: bool,
    empty_if_unwritten: bool,
    purpose: str,
    lease_ms: int,
    clean_up: CleanUp,
    move_since: bool = True,
) -> Held[T]:
    """The steps every planned read shares: ``as_of`` resolved and refused as
    ``PersistClient.plan_snapshot`` documents, a new leased reader registered, ``make(reader,
    as_of)`` run (it may wait for the upper; it says whether its result needs the reader to
    hold anything), and only then (with ``move_since``) the reader's since moved up to
    ``as_of``. A reader holding nothing, or one whose planning failed or was cancelled, is
    expired in the background."""
    t = check_frontier("as_of", as_of)
    check_flags(wait=wait, empty_if_unwritten=empty_if_unwritten, move_since=move_since)
    # InvalidUsage if there is no such shard. Everything refused from what this state says is
    # refused before a reader is registered.
    machine = await shards.loaded(shard_id)
    state = machine.state
    sid, schema = state.shard_id, schema_from_bytes(state.schema)
    t = snapshot_as_of(state, t, wait=wait, empty_if_unwritten=empty_if_unwritten)
    if t is None:
        return Held(sid, schema, None, None, None)

    # Planned reads show the current schema (rows of other versions shown in it).
    version = current_version(state)
    reader = await register_reader_handle(machine, schema, purpose, lease_ms, version)
    try:
        check_since(t, reader.since)  # the since may have moved since the state was read
        # Waits while t >= upper: the reader holds its registered since meanwhile, never t,
        # which may be past the upper (and a since never moves back).
        made, holds = await make(reader, t)
        if not holds:
            clean_up(reader.expire(), f"expire {reader.reader_id}")  # nothing to hold
            return Held(sid, schema, t, None, made)
        # Only now, past the wait, may the since move up to t: a cancelled or failed wait
        # leaves it where it was.
        if move_since and not frontier_le(t, reader.since):
            await reader.downgrade_since(t)
    except BaseException:
        # In the background, so that a cancelled caller returns at once.
        clean_up(reader.expire(), f"expire {reader.reader_id}")
        raise
    return Held(sid, schema, t, reader, made)


def check_flags(**flags: object) -> None:
    """``InvalidUsage`` naming the first of ``flags`` that is not a bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise InvalidUsage(f"{name} must be a bool, not {flag!r}")


async def _cut(
    reader: ReadHandle, as_of: int, n: int | None, split_bytes: int, parallelism: int
) -> list[Split]:
    if n is not None:
        return await reader.snapshot(as_of, n)
    whole = await reader.snapshot(as_of, 1)
    n = default_splits(whole[0].size, split_bytes, parallelism)
    return whole if n == 1 else await reader.snapshot(as_of, n)


def default_splits(size: int, split_bytes: int, parallelism: int) -> int:
    """How many splits a snapshot of ``size`` bytes of parts gets when none are asked for."""
    by_size = math.ceil(size / split_bytes)
    by_cores = min(parallelism, size // MIN_SPLIT_BYTES)
    return max(1, by_size, by_cores)


def _check_count(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidUsage(f"{name} must be a positive int, not {value!r}")
