"""What a client tells of one shard from its state, with no change to it: its numbers
(``inspect``), every byte it holds (``storage``), its commits (``history``) and the time that was
readable at an instant (``as_of_at``)."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from persist.core.arrow import evolution as evo
from persist.core.shard import history as hist
from persist.core.shard import keys
from persist.internal.fetch import schema_from_bytes
from persist.internal.machine import Machine
from persist.location import Blob, Consensus

log = logging.getLogger("persist")

# A newest commit stamped further than this past this client's clock makes ``as_of_at`` warn:
# less is ordinary skew between committers (and costs at most that much staleness).
_STAMPS_AHEAD_WARN_MS = 1000


def utc(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)


def numbers(machine: Machine) -> dict[str, Any]:
    """``PersistClient.inspect`` without ``storage`` (documented there)."""
    s = machine.state
    return {
        "shard_id": s.shard_id,
        "seqno": s.seqno,
        "since": s.since,
        "upper": s.upper,
        "batches": len(s.batches),
        "parts": sum(len(b.parts) for b in s.batches.values()),
        "bytes": sum(b.size for b in s.batches.values()),
        "rows": sum(b.rows for b in s.batches.values()),
        "readers": len(s.readers),
        "writers": len(s.writers),
        "rollups": len(s.rollups),
        "retention_s": None if s.retention_ms is None else s.retention_ms / 1000,
        "latest_rollup_seqno": s.latest_rollup.seqno,
        "finalized": s.finalized,
        "retired": len(s.retired),
        "schema": str(schema_from_bytes(s.schema)),
        "schema_version": evo.current_version(s),
        "streams": {
            server: {"resolved_lsn": record.lsn_upper, "at": record.at}
            for server, record in s.stream_servers.items()
        },
    }


async def storage(blob: Blob, consensus: Consensus, machine: Machine) -> dict[str, int]:
    """``PersistClient.storage`` (documented there): a listing of the shard's blobs and a scan
    of its consensus entries, against its state."""
    s = machine.state
    sizes = await blob.list_sizes(keys.shard_prefix(machine.shard_id))
    parts = {p.key for b in s.batches.values() for p in b.parts if not p.inline}
    rollups = {r.key for r in s.rollups.values()}
    live = sum(n for k, n in sizes.items() if k in parts)
    rolled = sum(n for k, n in sizes.items() if k in rollups)
    retired = sum(n for k, n in sizes.items() if k in s.retired)
    entries = await consensus.scan(machine.shard_id, 0, 1 << 30)
    blob_bytes = sum(sizes.values())
    consensus_bytes = sum(len(e.data) for e in entries)
    return {
        "live_parts_bytes": live,
        "inline_bytes": sum(len(p.inline) for b in s.batches.values() for p in b.parts),
        "rollup_bytes": rolled,
        "retired_bytes": retired,
        "other_blob_bytes": blob_bytes - live - rolled - retired,
        "blob_bytes": blob_bytes,
        "consensus_entries": len(entries),
        "consensus_bytes": consensus_bytes,
        "total_bytes": blob_bytes + consensus_bytes,
    }


def history(machine: Machine, now_ms: int) -> list[dict[str, Any]]:
    """``PersistClient.history`` (documented there)."""
    s = machine.state
    return [
        {
            "seqno": seqno,
            "at": utc(m.at_ms),
            "upper": m.upper,
            "rows_added": m.added,
            "rows_retracted": m.retracted,
            "purpose": m.purpose,
            "commits": m.commits,
        }
        for seqno, m in hist.within(s.history, s.retention_ms, now_ms)
    ]


def as_of_at(machine: Machine, now_ms: int, when: datetime.datetime) -> int:
    """``PersistClient.as_of_at`` (documented there), ``when`` aware."""
    s = machine.state
    as_of = hist.as_of_at(s.history, s.retention_ms, now_ms, s.since, int(when.timestamp() * 1000))
    newest = max((m.at_ms for m in s.history.values()), default=now_ms)
    if newest - now_ms > _STAMPS_AHEAD_WARN_MS:
        # Stamps never go backwards, so after this clock stepped back (or behind another
        # committer's) commits made "before when" by this clock may be stamped after it.
        log.warning(
            "persist: shard %s: its newest commit is stamped %s, %.1f s after this "
            "client's clock: the clock stepped back or runs behind a committer's, so "
            "as_of_at(%s) = %d may leave out commits made before that instant by this "
            "clock (see the clock skew rule in docs/lifecycle.md)",
            machine.shard_id,
            utc(newest).isoformat(),
            (newest - now_ms) / 1000,
            when.isoformat(),
            as_of,
        )
    return as_of
