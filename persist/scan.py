"""``ScanPlan``: a snapshot handed to a query engine that reads persist's Parquet parts with its
own reader, planned by ``PersistClient.plan_scan``: the part files (as URIs), the inline parts,
what the engine must do to their rows (``core.read.scan``), and a leased reader that keeps the files
in blob until the plan is released."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pyarrow as pa

from persist.core.arrow.evolution import Shapes, View, schema_of, shapes_for
from persist.core.arrow.updates import decode_part, full_schema
from persist.core.read.scan import Consolidation, Scan, ScanPart, plan_scan
from persist.errors import InvalidUsage
from persist.internal.shards import Shards
from persist.plan import CleanUp, plan_held
from persist.read import ReadHandle

__all__ = ["ScanPlan"]


@dataclass(frozen=True, slots=True)
class ScanPlan:
    """One snapshot of ``shard_id`` as of ``as_of``, planned for an engine's own Parquet reader.

    Read every file of ``files`` (Parquet: the data columns, ``_time`` uint64, ``_diff``
    int64) and the tables of ``inline`` (the same columns, decoded from the state), keep the
    rows with ``_time <= as_of`` when ``filter_time``, then consolidate as ``contents`` (or
    ``updates``) says: the rules are ``persist.core.read.scan``'s. ``consolidate`` is False when the
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
    # How the parts' schema versions show in ``schema`` (None: every part is in its version).
    shapes: Shapes | None = None

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
    def uniform(self) -> bool:
        """Whether every file holds the plan's ``schema`` (all written in the shard's current
        version). When False, the files of parts written in earlier versions hold those
        versions' columns: read each version's files with their own columns and show them in
        ``schema`` as ``columns_of`` says (or read the snapshot through persist); the contents
        are then ``SUM`` (rows of two versions may meet). ``inline`` is always shown in
        ``schema``."""
        return self.scan is None or self.scan.uniform

    def columns_of(self, version: int) -> list[tuple[str, str | None]]:
        """How a file of schema ``version`` (``ScanPart.schema_version``) shows in ``schema``:
        for each column of ``schema``, in order, the file's column holding the same field
        (matched by field id, never by name), or None where the file has none (a field added
        since, or one dropped since, whose values no reader is shown): null. A type that differs
        from the file's is cast to ``schema``'s (a lossless widening). ``InvalidUsage`` for a
        version no part of the plan was written in."""
        if self.scan is None:
            raise InvalidUsage(f"no part of this plan was written in schema version {version}")
        written = {p.schema_version for p in (*self.scan.parts, *self.scan.inline_parts)}
        if version not in written:
            raise InvalidUsage(f"no part of this plan was written in schema version {version}")
        if self.shapes is None:
            return [(n, n) for n in self.schema.names]
        stored = self.shapes.versions[version]
        by_id = dict(zip(stored.ids, schema_of(stored).names, strict=True))
        live = frozenset(self.shapes.live)
        mine = self.shapes.versions[self.shapes.reader].ids
        return [
            (name, by_id.get(fid) if fid in live else None)
            for name, fid in zip(self.schema.names, mine, strict=True)
        ]

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
    shards: Shards,
    shard_id: str,
    *,
    as_of: int | None,
    wait: bool,
    empty_if_unwritten: bool,
    purpose: str,
    lease_ms: int,
    clean_up: CleanUp,
) -> ScanPlan:
    """``PersistClient.plan_scan`` (documented there); ``clean_up`` runs a coroutine in the
    background, where a cancelled caller does not wait for it."""
    blob = shards.blob

    async def make(reader: ReadHandle, t: int) -> tuple[_Made, bool]:
        # As ``ReadHandle.snapshot`` does: wait while t >= upper, then hold the version read
        # (its parts) for as long as the reader holds a since at or below t.
        state, _ = await reader._held_version(t)
        # In a thread: proving rows distinct decodes every part's key index.
        scan = await asyncio.to_thread(plan_scan, state, t)
        uris = tuple(blob.uri(p.key) for p in scan.parts)
        shapes = shapes_for(
            state, reader.schema_version, [p.schema_version for p in scan.inline_parts]
        )
        inline = await _decoded(scan.inline_parts, reader.schema, shapes)
        every = (*scan.parts, *scan.inline_parts)
        shown = shapes_for(state, reader.schema_version, [p.schema_version for p in every])
        # Nothing to keep in blob without parts there: the inline parts came with the state.
        return _Made(scan, uris, inline, shown), bool(scan.parts)

    held = await plan_held(
        shards,
        shard_id,
        make,
        as_of=as_of,
        wait=wait,
        empty_if_unwritten=empty_if_unwritten,
        purpose=purpose,
        lease_ms=lease_ms,
        clean_up=clean_up,
    )
    made = held.made
    if made is None:
        return ScanPlan(held.shard_id, held.schema, None, None, None, (), ())
    return ScanPlan(
        held.shard_id,
        held.schema,
        held.as_of,
        held.reader,
        made.scan,
        made.uris,
        made.inline,
        made.shapes,
    )


@dataclass(frozen=True, slots=True)
class _Made:
    scan: Scan
    uris: tuple[str | None, ...]
    inline: tuple[pa.Table, ...]
    shapes: Shapes | None


async def _decoded(
    parts: tuple[ScanPart, ...], schema: pa.Schema, shapes: Shapes | None
) -> tuple[pa.Table, ...]:
    """The inline parts' tables (checksums verified), in the shard's full schema: parts of
    other versions shown in it (``core.arrow.evolution``)."""
    if not parts:
        return ()
    full = full_schema(schema)
    view = None if shapes is None else View(shapes, schema)

    def one(p: ScanPart) -> pa.Table:
        if view is None:
            return decode_part(p.inline, p.checksum, p.key, schema=full)
        return view.decoded(p.inline, p.checksum, p.key, p.schema_version)

    def decode() -> tuple[pa.Table, ...]:
        return tuple(one(p) for p in parts)

    # At most inline_writes_total_max_bytes (1 MiB) in all, but hundreds of small decodes.
    return await asyncio.to_thread(decode)
