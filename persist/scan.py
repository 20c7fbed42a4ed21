"""``ScanPlan``: a snapshot handed to a query engine that reads persist's Parquet parts with its
own reader, planned by ``PersistClient.plan_scan``: the part files (as URIs), the inline parts,
what the engine must do to their rows (``core.scan``), and a leased reader that keeps the files
in blob until the plan is released."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist.core.frontier import check_frontier, frontier_le
from persist.core.scan import Consolidation, Scan, ScanPart, plan_scan
from persist.core.updates import decode_part, full_schema
from persist.errors import InvalidUsage
from persist.fetch import schema_from_bytes
from persist.read import ReadHandle

if TYPE_CHECKING:
    from persist.client import PersistClient

__all__ = ["ScanPlan"]

CleanUp = Callable[[Coroutine[Any, Any, Any], str], None]


@dataclass(frozen=True, slots=True)
class ScanPlan:
    """One snapshot of ``shard_id`` as of ``as_of``, planned for an engine's own Parquet reader.

    Read every file of ``files`` (Parquet: the data columns, ``_time`` uint64, ``_diff``
    int64) and the tables of ``inline`` (the same columns, decoded from the state), keep the
    rows with ``_time <= as_of`` when ``filter_time``, then consolidate as ``contents`` (or
    ``updates``) says: the rules are ``persist.core.scan``'s. ``consolidate`` is False when the
    contents are the rows as they are.

    ``reader`` holds the shard's since at ``as_of`` and the state version whose parts the plan
    names (``scan.seqno``): compaction may replace those parts meanwhile, but garbage
    collection leaves them in blob until ``release()`` (or the reader's lease running out:
    it heartbeats in the background while its client is open). None when the plan holds
    nothing (no part in blob). ``as_of`` and ``scan`` are None only for a shard with nothing
    written planned as empty.

    ``files`` names the parts as the blob names them (``Blob.uri``: ``file:///...``,
    ``s3://...``; percent-encoded, as URIs are). ``engine_readable`` is False when the blob
    can't name them for another program (``mem://``): ``files`` then raises ``InvalidUsage``
    rather than leave parts out.
    """

    shard_id: str
    schema: pa.Schema  # the shard's data columns
    as_of: int | None
    reader: ReadHandle | None
    scan: Scan | None
    uris: tuple[str | None, ...]  # per ``scan.parts``
    inline: tuple[pa.Table, ...]

    @property
    def engine_readable(self) -> bool:
        """Whether every part in blob has a URI another program can open."""
        return None not in self.uris

    @property
    def files(self) -> tuple[str, ...]:
        """The URIs of the parts in blob, in the order of ``scan.parts``."""
        if not self.engine_readable:
            raise InvalidUsage(
                f"the parts of shard {self.shard_id} are in a blob no other program can read "
                "(mem://): read the snapshot through persist instead"
            )
        return tuple(u for u in self.uris if u is not None)

    @property
    def filter_time(self) -> bool:
        """Whether some row read may have ``_time > as_of`` (to drop)."""
        return self.scan is not None and self.scan.filter_time

    @property
    def contents(self) -> Consolidation:
        return Consolidation.NONE if self.scan is None else self.scan.contents

    @property
    def updates(self) -> Consolidation:
        return Consolidation.NONE if self.scan is None else self.scan.updates

    @property
    def consolidate(self) -> bool:
        """Whether the contents need more than the rows as they are (``contents`` is not
        ``NONE``)."""
        return self.contents is not Consolidation.NONE

    @property
    def size(self) -> int:
        """Bytes of the files."""
        return 0 if self.scan is None else self.scan.size

    async def release(self) -> None:
        """Lets the plan's parts go (expires its reader): garbage collection may then delete
        files compaction replaced. Idempotent."""
        if self.reader is not None:
            await self.reader.expire()


async def make_scan_plan(
    client: PersistClient,
    shard_id: str,
    *,
    as_of: int | None,
    wait: bool,
    empty_if_unwritten: bool,
    purpose: str,
    lease_duration_s: float | None,
    clean_up: CleanUp,
) -> ScanPlan:
    """``PersistClient.plan_scan`` (documented there); ``clean_up`` runs a coroutine in the
    background, where a cancelled caller does not wait for it."""
    t = check_frontier("as_of", as_of)
    for name, flag in (("wait", wait), ("empty_if_unwritten", empty_if_unwritten)):
        if not isinstance(flag, bool):
            raise InvalidUsage(f"{name} must be a bool, not {flag!r}")
    # Everything refused from what this state says is refused before a reader is registered.
    state = (await client._loaded(shard_id)).state
    sid = state.shard_id
    schema = schema_from_bytes(state.schema)
    upper = state.upper
    if t is None:
        if upper is None:
            raise InvalidUsage(f"shard {sid} is finished (its upper is None): give as_of")
        if upper == 0:
            if empty_if_unwritten:
                return ScanPlan(sid, schema, None, None, None, (), ())
            raise InvalidUsage(f"shard {sid} has nothing to read yet (its upper is 0): give as_of")
        t = upper - 1
    elif not wait and upper is not None and t >= upper:
        raise InvalidUsage(f"as_of {t} is not below the shard's upper {upper}")
    _check_since(t, state.since)

    reader = await client.open_leased_reader(
        sid, purpose=purpose, lease_duration_s=lease_duration_s
    )
    try:
        _check_since(t, reader.since)  # the since may have moved since the state was read
        # As ``ReadHandle.snapshot`` does: wait while t >= upper, then hold the version read
        # (its parts) for as long as the reader holds a since at or below t.
        state, t = await reader._readable(t)
        reader._split_holds.append((t, state.seqno))
        # In a thread: proving rows distinct decodes every part's key index.
        scan = await asyncio.to_thread(plan_scan, state, t)
        blob = client.blob
        uris = tuple(blob.uri(p.key) for p in scan.parts)
        inline = await _decoded(scan.inline_parts, schema)
        if not scan.parts:
            # Nothing to keep in blob: the inline parts' bytes came with the state.
            clean_up(reader.expire(), f"expire {reader.reader_id}")
            return ScanPlan(sid, schema, t, None, scan, uris, inline)
        # Only now, past the wait, may the since move up to t (never past the upper).
        if not frontier_le(t, reader.since):
            await reader.downgrade_since(t)
    except BaseException:
        clean_up(reader.expire(), f"expire {reader.reader_id}")
        raise
    return ScanPlan(sid, schema, t, reader, scan, uris, inline)


async def _decoded(parts: tuple[ScanPart, ...], schema: pa.Schema) -> tuple[pa.Table, ...]:
    """The inline parts' tables (checksums verified), in the shard's full schema."""
    if not parts:
        return ()
    full = full_schema(schema)

    def decode() -> tuple[pa.Table, ...]:
        return tuple(decode_part(p.inline, p.checksum, p.key, schema=full) for p in parts)

    # At most inline_writes_total_max_bytes (1 MiB) in all, but hundreds of small decodes.
    return await asyncio.to_thread(decode)


def _check_since(as_of: int, since: int | None) -> None:
    if not frontier_le(since, as_of):
        raise InvalidUsage(f"as_of {as_of} is below the shard's since {since}")
