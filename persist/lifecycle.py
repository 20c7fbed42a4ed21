"""The part of ``PersistClient`` about a shard's life: names (the catalog), retention and
history, what a shard costs (``storage``), ``purge``, ``erase`` and ``drop_shard``. A mixin, so
that ``client.py`` keeps to opening, reading and writing; everything here goes through the same
machines and resolves names the same way."""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.catalog import change_catalog, read_catalog
from persist.config import PersistConfig, is_seconds, read_clock
from persist.core import catalog as cat
from persist.core.arrow.predicates import check_predicate
from persist.core.arrow.updates import check_schema
from persist.core.shard import history as hist
from persist.core.shard import keys
from persist.core.shard import lifecycle as life
from persist.core.shard.clock import Now
from persist.core.shard.transitions import Outcome
from persist.core.shard.types import HollowBatch, State
from persist.errors import ExternalError, InvalidUsage, WrongBlobLocation
from persist.fetch import schema_from_bytes
from persist.ids import ShardId
from persist.location import Blob, Consensus

if TYPE_CHECKING:
    from persist.internal.machine import Machine
    from persist.internal.maintenance import Maintenance

__all__ = ["ShardLifecycle"]

log = logging.getLogger("persist")

# A newest commit stamped further than this past this client's clock makes ``as_of_at`` warn:
# less is ordinary skew between committers (and costs at most that much staleness).
_STAMPS_AHEAD_WARN_MS = 1000

# Ten years: longer is a typo, not a policy.
_MAX_RETENTION_S = 10 * 365 * 24 * 3600


class ShardLifecycle:
    """Names, retention, history, storage, purge, erase and drop (see ``docs/lifecycle.md``)."""

    if TYPE_CHECKING:
        blob: Blob
        consensus: Consensus
        config: PersistConfig
        _maintenance: dict[str, Maintenance]

        def _check_open(self) -> None: ...
        async def _resolve(self, shard: object) -> ShardId: ...
        async def _machine(self, shard_id: object) -> Machine: ...
        async def _loaded(self, shard_id: str) -> Machine: ...
        async def _finalize(
            self,
            machine: Machine,
            transition: Callable[[State, Now], Outcome[list[HollowBatch]]],
        ) -> None: ...

    async def storage(self, shard_id: str) -> dict[str, int]:
        """Every byte the shard holds, by where and why (``persist du``): ``live_parts_bytes``
        (parts in blob the state names), ``inline_bytes`` (parts kept in the state itself),
        ``rollup_bytes``, ``retired_bytes`` (blobs no state needs, not yet deleted: readers
        may still hold them), ``other_blob_bytes`` (parts of writes not committed yet,
        abandoned compactions and writers' leftovers, until garbage collection sweeps them),
        ``blob_bytes`` (all of the shard's blobs, from a listing), ``consensus_entries`` and
        ``consensus_bytes`` (its state diffs in consensus, inline parts included) and
        ``total_bytes`` (blob + consensus)."""
        return await self._storage(await self._loaded(shard_id))

    async def _storage(self, machine: Machine) -> dict[str, int]:
        s = machine.state
        sizes = await self.blob.list_sizes(keys.shard_prefix(machine.shard_id))
        parts = {p.key for b in s.batches.values() for p in b.parts if not p.inline}
        rollups = {r.key for r in s.rollups.values()}
        live = sum(n for k, n in sizes.items() if k in parts)
        rolled = sum(n for k, n in sizes.items() if k in rollups)
        retired = sum(n for k, n in sizes.items() if k in s.retired)
        entries = await self.consensus.scan(machine.shard_id, 0, 1 << 30)
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

    async def purge(self, shard_id: str) -> dict[str, Any]:
        """Rewrites what lies below the shard's since so that no blob of the shard holds an
        update whose row's multiplicity is zero as of the since: a retracted row is gone from
        storage once the since has passed its retraction (retention, readers). The replaced
        blobs, old rollups and consensus diffs are deleted unless a reader still holds the
        state versions that name them (``blobs_held``: then again once it lets go, by the
        next ``maintain``). Says what it did: ``since``, ``batches_rewritten``,
        ``parts_rewritten``, ``rows_before``/``rows_after`` and ``bytes_before``/``bytes_after``
        (of live parts), ``blobs_deleted``, ``blobs_held``."""
        machine = await self._loaded(shard_id)
        return await self._maintenance[machine.shard_id].purge()

    async def erase(self, shard_id: str, predicate: pc.Expression) -> dict[str, Any]:
        """Removes every stored update of the rows ``predicate`` matches (a
        ``pyarrow.compute.Expression`` over data columns; a null is no match), whatever its
        time, from every batch, inline part and rollup of the shard, in one commit: the one
        call that rewrites history. Snapshots at every time, the since included, read as if
        those rows had never been written; every other row keeps its updates. Writes committed
        after it are not touched (a write that brings the rows again puts them back).

        Then, as ``purge`` does, it writes a rollup and collects garbage: no blob or consensus
        entry of the shard holds those rows once every reader holding a state version from
        before the erase has renewed its hold (``held_by``: those readers' ids and purposes;
        then the next ``maintain`` deletes what they held). Returns ``since``, ``seqno`` (of
        the erase's commit; None when nothing matched), ``batches_rewritten``,
        ``parts_rewritten``, ``rows_erased`` (stored updates removed), ``rows_before``/
        ``rows_after`` and ``bytes_before``/``bytes_after`` (of live parts),
        ``blobs_deleted``, ``blobs_held`` and ``held_by``.

        ``InvalidUsage``, nothing changed, if the predicate names anything but data columns
        (``_time``, ``_diff``, a column the shard lacks: named) or can't be evaluated on the
        rows. ``ExternalError`` (determinate: nothing changed) if the shard's batches kept
        changing under it for many rounds."""
        machine = await self._loaded(shard_id)
        check_predicate(predicate, schema_from_bytes(machine.state.schema))
        return await self._maintenance[machine.shard_id].erase(predicate)

    # --- retention and history ---------------------------------------------------------------

    async def set_retention(self, shard_id: str, seconds: float | None) -> None:
        """Keeps the contents as of every time made readable within the last ``seconds``
        readable, whatever readers do; with no reader the since follows that window by itself
        (as commits and ``maintain`` come). None: readers alone hold history. A longer window
        keeps more from now on; it can't bring back times the since has passed."""
        if seconds is not None and not is_seconds(seconds, _MAX_RETENTION_S):
            raise InvalidUsage(
                f"retention must be None or a number of seconds in (0, {_MAX_RETENTION_S}], "
                f"not {seconds!r}"
            )
        ms = None if seconds is None else max(1, int(seconds * 1000))
        machine = await self._loaded(shard_id)
        await machine.apply(lambda s, now: life.set_retention(s, ms, now))

    async def as_of_at(self, shard_id: str, when: datetime.datetime) -> int:
        """The newest time of ``shard_id`` that was readable at the instant ``when`` (an aware
        datetime, or naive in UTC): exact over the shard's last 256 commits, the newest time
        readable at most one granule (the retention / 1024, at least a second) earlier before
        them. ``InvalidUsage`` outside the retention, in the future, before the shard had
        anything written, or where the since has passed it."""
        if not isinstance(when, datetime.datetime):
            raise InvalidUsage(f"when must be a datetime, not {type(when).__name__}")
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        machine = await self._loaded(shard_id)
        s = machine.state
        now = read_clock(self.config)
        as_of = hist.as_of_at(s.history, s.retention_ms, now, s.since, _ms(when))
        newest = max((m.at_ms for m in s.history.values()), default=now)
        if newest - now > _STAMPS_AHEAD_WARN_MS:
            # Stamps never go backwards, so after this clock stepped back (or behind another
            # committer's) commits made "before when" by this clock may be stamped after it.
            log.warning(
                "persist: shard %s: its newest commit is stamped %s, %.1f s after this "
                "client's clock: the clock stepped back or runs behind a committer's, so "
                "as_of_at(%s) = %d may leave out commits made before that instant by this "
                "clock (see the clock skew rule in docs/lifecycle.md)",
                machine.shard_id,
                _utc(newest).isoformat(),
                (newest - now) / 1000,
                when.isoformat(),
                as_of,
            )
        return as_of

    async def history(self, shard_id: str) -> list[dict[str, Any]]:
        """The commits of ``shard_id`` within its retention (a week without one), oldest first:
        ``seqno``, ``at`` (UTC datetime the upper was reached), ``upper``, ``rows_added`` and
        ``rows_retracted`` (updates with a positive or negative diff), ``purpose`` (the
        writer's), and ``commits``: 1, or how many commits of one granule an entry stands for
        (beyond the newest 256 commits; it shows the newest of them)."""
        machine = await self._loaded(shard_id)
        s = machine.state
        return [
            {
                "seqno": seqno,
                "at": _utc(m.at_ms),
                "upper": m.upper,
                "rows_added": m.added,
                "rows_retracted": m.retracted,
                "purpose": m.purpose,
                "commits": m.commits,
            }
            for seqno, m in hist.within(s.history, s.retention_ms, read_clock(self.config))
        ]

    # --- names ---------------------------------------------------------------------------------

    async def create_shard(self, name: str, schema: pa.Schema) -> ShardId:
        """A new shard with ``schema``, named ``name`` (dotted words, e.g. ``"sales.orders"``).

        ``InvalidUsage`` if the name is taken: of two callers creating one name, exactly one
        gets the id, the other the error (its shard is dropped again). The name is given once
        the shard exists, so a name always leads to a shard."""
        self._check_open()
        cat.check_name(name)
        checked = check_schema(schema)
        _, catalog = await read_catalog(self.consensus, self.config)
        if name in catalog.names:
            cat.add(catalog, name, "", 0)  # raises: taken
        sid = ShardId.new()
        machine = await self._machine(sid)
        await machine.load_or_create(checked.serialize().to_pybytes())
        try:
            await change_catalog(
                self.consensus, self.config, lambda c, now: cat.add(c, name, sid, now)
            )
        except InvalidUsage:
            await self._finalize(machine, lambda s, now: life.drop(s, True, now))
            raise
        return sid

    async def shard_id(self, name: str) -> ShardId:
        """The id of the shard named ``name`` now (``InvalidUsage`` if none is). A shard id is
        returned as it is (whether or not that shard exists)."""
        self._check_open()
        return await self._resolve(name)

    async def list_shards(self, prefix: str = "") -> list[dict[str, Any]]:
        """The named shards whose name starts with ``prefix``, by name: each a dict with
        ``name``, ``shard_id``, ``named_at`` (UTC datetime), ``schema`` (text), ``since``,
        ``upper``, ``seqno``, ``bytes`` (of its live parts) and ``rows`` (stored updates); a
        shard whose state can't be read has ``error`` (the reason) instead of those, and
        ``other_blob_location: True`` too when its data is in another blob location than this
        client's (``WrongBlobLocation``). Unnamed shards are not listed."""
        self._check_open()
        if not isinstance(prefix, str):
            raise InvalidUsage(f"prefix must be a str, not {type(prefix).__name__}")
        _, catalog = await read_catalog(self.consensus, self.config)
        named = sorted((n, e) for n, e in catalog.names.items() if n.startswith(prefix))
        gate = asyncio.Semaphore(self.config.io_concurrency)

        async def one(name: str, entry: cat.Entry) -> dict[str, Any]:
            listed: dict[str, Any] = {
                "name": name,
                "shard_id": entry.shard_id,
                "named_at": _utc(entry.named_ms),
            }
            try:
                async with gate:
                    machine = await self._machine(ShardId(entry.shard_id))
                    if machine.loaded:
                        await machine.refresh()
                        state: State | None = machine.state
                    else:
                        state = await machine.load()
            except WrongBlobLocation as exc:
                return {
                    **listed,
                    "error": f"{type(exc).__name__}: {exc}",
                    "other_blob_location": True,
                }
            except ExternalError as exc:
                # One shard that can't be read (its rollup lost) must not hide the rest of
                # the catalog.
                return {**listed, "error": f"{type(exc).__name__}: {exc}"}
            if state is None:
                return {**listed, "error": "the shard does not exist"}
            return {
                **listed,
                "schema": str(schema_from_bytes(state.schema)),
                "since": state.since,
                "upper": state.upper,
                "seqno": state.seqno,
                "bytes": sum(b.size for b in state.batches.values()),
                "rows": sum(b.rows for b in state.batches.values()),
            }

        return list(await asyncio.gather(*(one(n, e) for n, e in named)))

    async def rename_shard(self, old: str, new: str) -> None:
        """Names the shard ``old`` (a name or a shard id) ``new``; ``InvalidUsage`` if ``new``
        is taken or ``old`` names no shard. Handles opened by either name or id keep working:
        they hold the id."""
        self._check_open()
        cat.check_name(new)
        sid = await self._resolve(old)
        _, catalog = await read_catalog(self.consensus, self.config)
        current = cat.name_of(catalog, sid)
        if current is None:
            # An unnamed shard gets its first name (it must exist).
            await self._loaded(sid)
            await change_catalog(
                self.consensus, self.config, lambda c, now: cat.add(c, new, sid, now)
            )
            return
        await change_catalog(
            self.consensus, self.config, lambda c, _now: cat.rename(c, current, new, sid)
        )

    async def drop_shard(self, shard: str, *, force: bool = False) -> ShardId:
        """Seals, finalizes and unnames the shard ``shard`` (a name or a shard id) in one call:
        its data is deleted, a tombstone stays under its id (opening it raises
        ``InvalidUsage``), and its name is free again.

        Refused with ``InvalidUsage`` while a writer or reader of someone else holds a live
        lease on it, naming them, unless ``force=True``, which expires them (their next call
        raises ``LeaseExpired``). The caller's own handles (those this client registered and
        did not ``detach``) need no force: they are expired with the shard. A crash part way
        leaves it for another ``drop_shard`` to finish. Returns the id of the shard dropped."""
        machine = await self._loaded(shard)
        sid = machine.shard_id
        own = frozenset(machine.registered)
        await self._finalize(machine, lambda s, now: life.drop(s, force, now, own))
        machine.registered.difference_update(own)
        await change_catalog(self.consensus, self.config, lambda c, _now: cat.remove(c, sid))
        return ShardId(sid)


def _ms(when: datetime.datetime) -> int:
    return int(when.timestamp() * 1000)


def _utc(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
