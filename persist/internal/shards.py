"""The shards one client has open: per shard its machine and maintenance, the client's background
work, and every step a public call takes before the data path: a name looked up, a shard loaded,
opened, created, named, listed, finalized or dropped, and the client's close.

``PersistClient`` is the public face of one ``Shards``: it checks a caller's arguments and hands
the rest here, and the planners (``plan.py``, ``scan.py``) load shards through it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pyarrow as pa

from persist.config import PersistConfig
from persist.core import catalog as cat
from persist.core.arrow import evolution as evo
from persist.core.arrow.casts import differences
from persist.core.arrow.updates import check_schema
from persist.core.shard import keys
from persist.core.shard import lifecycle as life
from persist.core.shard.clock import Now
from persist.core.shard.transitions import Break, Outcome, evolve_schema, landed_evolution
from persist.core.shard.types import HollowBatch, State
from persist.errors import (
    ExternalError,
    InvalidUsage,
    LeaseExpired,
    SchemaChanged,
    WrongBlobLocation,
)
from persist.ids import ShardId, new_id
from persist.internal.batch import RecentParts, delete_parts
from persist.internal.catalog import change_catalog, read_catalog
from persist.internal.fetch import schema_from_bytes
from persist.internal.machine import Machine
from persist.internal.maintenance import Maintenance
from persist.internal.report import utc
from persist.internal.tasks import Tasks
from persist.internal.worker import worker_for
from persist.location import Blob, Consensus

__all__ = ["Shards"]

log = logging.getLogger("persist")

# How long ``close`` waits for cleanup started by cancelled or failed calls (an expiry is one
# consensus write, retried) before it stops it.
_CLEANUP_GRACE_S = 10.0

# How long ``close`` tries to expire the handles the client registered (one consensus write
# per shard): a consensus that is down must not hold a script's exit for minutes, and what is
# left runs out with its lease anyway.
_EXPIRE_ON_CLOSE_S = 5.0


class Shards:
    """The machines (one per shard, made on first use and kept for the client's life), their
    maintenance, and the background work of one client at one location."""

    def __init__(
        self,
        blob: Blob,
        consensus: Consensus,
        config: PersistConfig,
        blob_uri: str | None = None,
    ) -> None:
        self.blob = blob
        self.consensus = consensus
        self.config = config
        self.tasks = Tasks(config.compaction_concurrency)
        # ``blob_uri``: where ``blob`` was opened, so that a merge worker can open it too.
        self.worker = worker_for(blob, blob_uri, config)
        self.recent = RecentParts(config.recent_parts_bytes)
        self.machines: dict[str, Machine] = {}
        self.maintenance: dict[str, Maintenance] = {}
        self.closed = False
        self._cleanups: set[asyncio.Task[Any]] = set()

    def check_open(self) -> None:
        if self.closed:
            raise InvalidUsage("the persist client was closed")

    def clean_up(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """Runs ``coro`` in the background (a cancelled caller returns at once); ``close`` waits
        for it, a bounded time, before it stops background work."""
        task = self.tasks.spawn(coro, name)
        if task is not None:
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

    # --- finding a shard ---------------------------------------------------------------------

    async def resolve(self, shard: object) -> ShardId:
        """The id of ``shard``: a shard id as is, a name as the catalog has it now."""
        if isinstance(shard, ShardId):
            return shard
        if cat.is_name(shard):
            assert isinstance(shard, str)
            sid = await self.named(shard)
            if sid is None:
                raise InvalidUsage(f"no shard is named {shard!r}")
            return sid
        if isinstance(shard, str) and "-" in shard:
            return ShardId(shard)  # says what a shard id is
        shown = repr(shard) if len(repr(shard)) <= 80 else repr(shard)[:77] + "..."
        raise InvalidUsage(
            f"not a shard id or name: {shown} (an id is 's' followed by a UUID; a name is "
            f"dotted words, e.g. 'sales.orders')"
        )

    async def named(self, name: str) -> ShardId | None:
        _, catalog = await read_catalog(self.consensus, self.config)
        entry = catalog.names.get(name)
        return None if entry is None else ShardId(entry.shard_id)

    async def machine(self, shard: object) -> Machine:
        """The shard's machine (its state not loaded yet if this is its first use)."""
        self.check_open()
        sid = await self.resolve(shard)
        machine = self.machines.get(sid)
        if machine is None:
            machine = Machine(sid, self.blob, self.consensus, self.config, self.tasks, self.recent)
            maintenance = Maintenance(machine, self.worker)
            machine.on_commit = maintenance.kick
            self.machines[sid] = machine
            self.maintenance[sid] = maintenance
        return machine

    async def loaded(self, shard: object) -> Machine:
        """The shard's machine with its latest state (``InvalidUsage`` if there is no shard)."""
        machine = await self.machine(shard)
        if machine.loaded:
            await machine.refresh()  # only the diffs since the state it holds
        elif await machine.load() is None:
            raise InvalidUsage(f"shard {machine.shard_id} does not exist")
        return machine

    async def loaded_with(self, shard: object, handle_id: object, kind: str) -> tuple[Machine, str]:
        """The shard's machine, once its latest state has ``kind`` ``handle_id`` registered;
        this client heartbeats that handle from now on."""
        machine = await self.loaded(shard)
        hid = str(handle_id)
        state = machine.state
        if hid not in (state.writers if kind == "writer" else state.readers):
            raise LeaseExpired(f"{kind} {hid} is not registered (lease expired?)")
        machine.own.add(hid)
        return machine, hid

    async def open(self, shard: object, schema: object) -> tuple[Machine, pa.Schema, int]:
        """The shard's loaded machine, and the schema version opened with its schema. With
        ``schema`` a shard that does not exist is created (under a new name: created and named
        at once), and an existing one's schema must match one of its versions (the newest that
        it is exactly, else the newest it matches as ``casts.differences`` does); without, the
        shard must exist and its current version is opened."""
        if schema is None:
            # A finalized shard is refused by the registration that follows, as with a schema.
            machine = await self.loaded(shard)
            state = machine.state
            return machine, schema_from_bytes(state.schema), evo.current_version(state)
        checked = check_schema(schema)
        if cat.is_name(shard) and await self.named(str(shard)) is None:
            with contextlib.suppress(InvalidUsage):  # taken meanwhile: open that shard
                await self.create(str(shard), checked)
        machine = await self.machine(shard)
        state = await machine.load_or_create(checked.serialize().to_pybytes())
        known = evo.versions(state)
        number = evo.matching_version(state, checked)
        if number is None:
            loose = (
                n
                for n in sorted(known, reverse=True)
                if not differences(checked, evo.schema_of(known[n]))
            )
            number = next(loose, None)
        if number is None:
            problems = differences(checked, schema_from_bytes(state.schema))
            earlier = (
                f" (nor any of its {len(known) - 1} earlier versions)" if len(known) > 1 else ""
            )
            raise InvalidUsage(
                f"shard {machine.shard_id}'s schema{earlier} is not the one given: "
                + "; ".join(problems)
            )
        return machine, evo.schema_of(known[number]), number

    async def evolve(
        self,
        shard: object,
        schema: pa.Schema,
        renames: dict[str, str] | None,
        expected_version: int | None,
    ) -> int:
        """``PersistClient.evolve_schema`` (documented there), ``schema`` checked."""
        machine = await self.loaded(shard)
        token = new_id("e")

        def transition(s: State, now: Now) -> Outcome[int]:
            landed = landed_evolution(s, token)
            if landed is not None:  # an earlier try whose reply was lost
                return Break(result=landed)
            current = evo.current_version(s)
            if expected_version is not None and expected_version != current:
                return Break(error=SchemaChanged(expected_version, current))
            # Planned against each try's state: a race with another evolution is judged anew.
            new = evo.plan_evolution(s, schema, renames)
            return evolve_schema(s, evo.versions(s)[0], new, expected_version, now, token)

        version = await machine.apply(transition)
        log.info("persist: shard %s's schema is now version %d", machine.shard_id, version)
        return version

    # --- names ---------------------------------------------------------------------------------

    async def create(self, name: str, schema: pa.Schema) -> ShardId:
        """``PersistClient.create_shard`` (documented there)."""
        self.check_open()
        cat.check_name(name)
        checked = check_schema(schema)
        _, catalog = await read_catalog(self.consensus, self.config)
        if name in catalog.names:
            cat.add(catalog, name, "", 0)  # raises: taken
        sid = ShardId.new()
        machine = await self.machine(sid)
        await machine.load_or_create(checked.serialize().to_pybytes())
        try:
            await change_catalog(
                self.consensus, self.config, lambda c, now: cat.add(c, name, sid, now)
            )
        except InvalidUsage:
            await self.finalize(machine, lambda s, now: life.drop(s, True, now))
            raise
        return sid

    async def rename(self, old: str, new: str) -> None:
        """``PersistClient.rename_shard`` (documented there)."""
        self.check_open()
        cat.check_name(new)
        sid = await self.resolve(old)
        _, catalog = await read_catalog(self.consensus, self.config)
        current = cat.name_of(catalog, sid)
        if current is None:
            # An unnamed shard gets its first name (it must exist).
            await self.loaded(sid)
            await change_catalog(
                self.consensus, self.config, lambda c, now: cat.add(c, new, sid, now)
            )
            return
        await change_catalog(
            self.consensus, self.config, lambda c, _now: cat.rename(c, current, new, sid)
        )

    async def listed(self, prefix: str) -> list[dict[str, Any]]:
        """``PersistClient.list_shards`` (documented there)."""
        self.check_open()
        if not isinstance(prefix, str):
            raise InvalidUsage(f"prefix must be a str, not {type(prefix).__name__}")
        _, catalog = await read_catalog(self.consensus, self.config)
        named = sorted((n, e) for n, e in catalog.names.items() if n.startswith(prefix))
        gate = asyncio.Semaphore(self.config.io_concurrency)

        async def one(name: str, entry: cat.Entry) -> dict[str, Any]:
            listed: dict[str, Any] = {
                "name": name,
                "shard_id": entry.shard_id,
                "named_at": utc(entry.named_ms),
            }
            try:
                async with gate:
                    machine = await self.machine(ShardId(entry.shard_id))
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

    # --- a shard's end -------------------------------------------------------------------------

    async def drop(self, shard: str, force: bool) -> ShardId:
        """``PersistClient.drop_shard`` (documented there)."""
        machine = await self.loaded(shard)
        sid = machine.shard_id
        own = frozenset(machine.registered)
        await self.finalize(machine, lambda s, now: life.drop(s, force, now, own))
        machine.registered.difference_update(own)
        await change_catalog(self.consensus, self.config, lambda c, _now: cat.remove(c, sid))
        return ShardId(sid)

    async def finalize(
        self, machine: Machine, transition: Callable[[State, Now], Outcome[list[HollowBatch]]]
    ) -> None:
        """Commits ``transition`` (which seals the shard and names the batches it let go), then
        deletes every blob and consensus entry of the shard but the tombstone's."""
        dropped = await machine.apply(transition)
        await delete_parts(self.blob, dropped)
        # The tombstone is the finalized state; a rollup of it lets older rollups go.
        if machine.state.latest_rollup.seqno < machine.state.seqno:
            await machine.write_rollup()
        keep = machine.state.latest_rollup.key
        prefix = keys.shard_prefix(machine.shard_id)
        stale = [k for k in await self.blob.list_keys(prefix) if k != keep]
        await asyncio.gather(*(self.blob.delete(k) for k in stale))
        head = await self.consensus.head(machine.shard_id)
        if head is not None:
            await self.consensus.truncate(machine.shard_id, head.seqno)

    # --- the client's end ----------------------------------------------------------------------

    async def close(self) -> None:
        """``PersistClient.close`` (documented there)."""
        if self.closed:
            return
        self.closed = True
        # From here handles refuse use as closed (a read woken by its reader's expiry too),
        # and nothing new starts in the background.
        self.tasks.closed = True
        if self._cleanups:
            # A handle whose call failed is let go for real, not left to its lease.
            await asyncio.wait(list(self._cleanups), timeout=_CLEANUP_GRACE_S)
        await self._expire_registered()
        for machine in self.machines.values():
            if machine.stop_watching is not None:
                machine.stop_watching()
        await self.tasks.close()
        if self.worker is not None:
            await self.worker.close()
        await asyncio.gather(self.blob.close(), self.consensus.close(), return_exceptions=True)

    async def _expire_registered(self) -> None:
        """Expires every shard's ``registered`` handles, a commit per shard, all at once and
        for at most ``_EXPIRE_ON_CLOSE_S``; logs those left registered."""
        machines = [m for m in self.machines.values() if m.registered and m.loaded]
        if not machines:
            return

        async def expire(machine: Machine) -> None:
            ids = frozenset(machine.registered)
            # Housekeeping: nothing for maintenance to do about it as the client goes.
            await machine.apply(lambda s, now: life.expire_handles(s, ids, now), housekeeping=True)
            machine.registered.difference_update(ids)

        tries = [asyncio.ensure_future(expire(m)) for m in machines]
        for t in tries:
            # One that outlives its cancellation fails later, unawaited: its failure is logged
            # below (or was), not again by asyncio.
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        _, pending = await asyncio.wait(tries, timeout=_EXPIRE_ON_CLOSE_S)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for machine, t in zip(machines, tries, strict=True):
            if not machine.registered:
                continue
            failure = None if t in pending or t.cancelled() else t.exception()
            log.warning(
                "persist: close could not expire %s of shard %s (%s); they stay registered "
                "until their leases run out",
                ", ".join(sorted(machine.registered)),
                machine.shard_id,
                f"no answer within {_EXPIRE_ON_CLOSE_S:g} s"
                if failure is None
                else f"{type(failure).__name__}: {failure}",
            )
