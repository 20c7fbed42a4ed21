"""Reads over Flight: what ``GetFlightInfo`` hands out (grants and their signed tickets) and
what a ``DoGet`` of a ticket streams (a snapshot split's updates, or a listen's events).

A **grant** is one ``GetFlightInfo``'s reader, holding the shard's since at ``as_of`` until its
tickets expire and no ``DoGet`` of them runs. Grants live in memory only: a restarted server
signs with a new key, so the tickets of an earlier run fail their check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from persist.client import PersistClient
from persist.core.arrow.updates import full_schema
from persist.core.frontier import check_since, newest_readable
from persist.flight._metrics import Metrics
from persist.flight._protocol import ListenCommand, SnapshotCommand, TicketInvalid
from persist.flight._tickets import TicketBody, TicketSigner
from persist.ids import new_id
from persist.internal.fetch import Split
from persist.plain import split_rows
from persist.read import ReadHandle

__all__ = ["Grant", "Info", "Reads"]

# A DoGet of a snapshot decodes about this much of its split at a time (bounded memory).
_CHUNK_BYTES = 16 << 20
# A path descriptor (no "splits") gets an endpoint per this many bytes of parts.
_PATH_SPLIT_BYTES = 128 << 20
# A listen moves its reader's since up to what it delivered at most this often (each move is a
# consensus write); in between, compaction may be held back by at most this long.
_DOWNGRADE_EVERY_S = 1.0

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class Grant:
    """What one GetFlightInfo handed out: its tickets name it, and its reader holds the since
    at ``as_of`` until the tickets expire and no DoGet of them is running."""

    id: str
    shard: str
    reader: ReadHandle
    schema: pa.Schema  # full: data columns + _time + _diff
    expires_ms: int
    splits: tuple[Split, ...] = ()
    listen: ListenCommand | None = None
    # DoGet streams the contents (data columns, rows repeated by multiplicity), not updates.
    contents: bool = False
    streams: int = 0
    expired: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Info:
    schema: pa.Schema
    tickets: list[bytes]
    expires_ms: int
    total_bytes: int
    total_records: int = -1  # -1: unknown


class Reads:
    """The server's grants, on its event loop."""

    def __init__(
        self, client: PersistClient, metrics: Metrics, spawn: Spawn, ticket_ttl_ms: int
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._spawn = spawn
        self._ttl_ms = ticket_ttl_ms
        self._signer = TicketSigner()
        self._grants: dict[str, Grant] = {}

    async def flight_info(self, command: SnapshotCommand | ListenCommand) -> Info:
        """Opens a reader holding ``as_of``, cuts the snapshot (or sets up the listen) and signs
        a ticket per endpoint."""
        # A name is looked up once: the grant, and every DoGet of its tickets, hold the id.
        command = dataclasses.replace(command, shard=await self._client.shard_id(command.shard))
        if isinstance(command, SnapshotCommand) and command.as_of_at is not None:
            as_of = await self._client.as_of_at(command.shard, command.as_of_at)
            command = dataclasses.replace(command, as_of=as_of)
        if isinstance(command, ListenCommand):
            reader = await self._listen_reader(command)
            return self._grant(command.shard, reader, full_schema(reader.schema), (), command)
        # The shard must exist (else InvalidUsage); as_of defaults to upper - 1 (InvalidUsage
        # while the upper is 0) and as_of >= upper waits, cancellable; the since moves up to
        # as_of only after that wait.
        plan = await self._client.plan_snapshot(
            command.shard,
            as_of=command.as_of,
            splits=command.splits,
            split_bytes=_PATH_SPLIT_BYTES,
            drop_empty_splits=True,
            purpose="persist flight tickets",
        )
        schema = plan.schema if command.contents else full_schema(plan.schema)
        if plan.reader is None:  # empty contents: no endpoint, nothing held
            return Info(schema, [], _now_ms() + self._ttl_ms, 0, 0)
        info = self._grant(command.shard, plan.reader, schema, plan.splits, None, command.contents)
        if not command.contents:
            return info
        return dataclasses.replace(info, total_records=_contents_rows(plan.splits, plan.as_of))

    async def _listen_reader(self, command: ListenCommand) -> ReadHandle:
        """A reader holding ``min(as_of, upper - 1)``: the listen may start past the upper."""
        client = self._client
        # The shard must exist: opening a reader without a schema says so (InvalidUsage).
        reader = await client.open_leased_reader(command.shard, purpose="persist flight tickets")
        try:
            as_of = command.as_of
            check_since(as_of, reader.since)
            _, upper = await client.frontiers(command.shard)
            newest = newest_readable(upper)
            # Sealed (upper None): as_of is final already. Nothing written (upper 0): 0, where
            # every since starts, so nothing moves.
            hold = as_of if upper is None else min(as_of, 0 if newest is None else newest)
            if reader.since is not None and reader.since < hold:
                await reader.downgrade_since(hold)
        except BaseException:
            self._spawn(reader.expire())
            raise
        return reader

    def _grant(
        self,
        shard: str,
        reader: ReadHandle,
        schema: pa.Schema,
        splits: tuple[Split, ...],
        listen: ListenCommand | None,
        contents: bool = False,
    ) -> Info:
        """Keeps ``reader`` as a grant until its tickets expire; a ticket per endpoint."""
        expires_ms = _now_ms() + self._ttl_ms
        grant = Grant(new_id("g"), shard, reader, schema, expires_ms, splits, listen, contents)
        self._grants[grant.id] = grant
        self._metrics.readers_held.inc()
        grant.timer = asyncio.get_running_loop().call_later(
            self._ttl_ms / 1000, self._grant_expired, grant
        )
        n = max(1, len(splits))
        tickets = [self._signer.sign(TicketBody(grant.id, i, expires_ms)) for i in range(n)]
        self._metrics.tickets.labels(self._metrics.shard(shard)).inc(n)
        return Info(schema, tickets, expires_ms, sum(s.size for s in splits))

    def _grant_expired(self, grant: Grant) -> None:
        grant.expired = True
        if grant.streams == 0:
            self._drop_grant(grant)

    def _drop_grant(self, grant: Grant) -> None:
        if self._grants.pop(grant.id, None) is not None:
            self._metrics.readers_held.dec()
            self._spawn(grant.reader.expire())

    async def open_ticket(self, ticket: bytes) -> tuple[Grant, int]:
        """The grant a ticket names, now counted as streaming (``release_ticket`` undoes it)."""
        body = self._signer.verify(ticket, _now_ms())
        grant = self._grants.get(body.grant)
        if grant is None or grant.expired:
            raise TicketInvalid("the ticket's reader was released; ask GetFlightInfo again")
        if body.index >= max(1, len(grant.splits)):
            raise TicketInvalid("the ticket names no endpoint of its flight")
        grant.streams += 1
        return grant, body.index

    def release_ticket(self, grant: Grant) -> None:
        grant.streams -= 1
        if grant.expired and grant.streams == 0:
            self._drop_grant(grant)

    async def snapshot_batches(
        self, grant: Grant, index: int
    ) -> AsyncIterator[tuple[pa.RecordBatch, bytes | None]]:
        # The updates as stored, unmerged: the spec promises that the union of all endpoints,
        # consolidated, is the contents, not that each row comes once. Row group by row group,
        # so the first batch leaves early and memory holds a chunk, not the split.
        split = grant.splits[index]
        async for batch in self._client.fetch_split_batches(
            split, _CHUNK_BYTES, consolidate="never"
        ):
            yield batch, None

    async def contents_batches(
        self, grant: Grant, index: int
    ) -> AsyncIterator[tuple[pa.RecordBatch, bytes | None]]:
        async for rows in split_rows(self._client, grant.splits[index], _CHUNK_BYTES):
            for out in rows.to_batches():
                yield out, None

    async def listen_batches(self, grant: Grant) -> AsyncIterator[tuple[pa.RecordBatch, bytes]]:
        """A listen under its own reader, which follows what it delivered (it never holds back
        compaction for longer than ``_DOWNGRADE_EVERY_S``); the grant's reader keeps ``as_of``
        readable for other DoGets of the ticket until it expires."""
        listen = grant.listen
        assert listen is not None
        try:
            # At the grant's version (its schema): the stream's schema was handed out with
            # the ticket, whatever evolved since.
            reader = await self._client.open_leased_reader(
                grant.shard, grant.reader.schema, purpose="persist flight listen"
            )
        finally:
            # From here the listen's own reader holds what it needs: the grant's may expire
            # on time, not pin as_of for as long as the listen runs.
            self.release_ticket(grant)
        try:
            check_since(listen.as_of, reader.since)
            moved = time.monotonic()
            async for event in reader.listen(listen.as_of):
                metadata = json.dumps({"upper": event.upper}).encode()
                yield _one_batch(event.updates, grant.schema), metadata
                if event.upper is None or (
                    listen.until is not None and event.upper >= listen.until
                ):
                    return
                if time.monotonic() - moved >= _DOWNGRADE_EVERY_S:
                    await reader.downgrade_since(event.upper - 1)
                    moved = time.monotonic()
        finally:
            self._spawn(reader.expire())

    def close(self) -> None:
        """Releases every grant's reader (the drain)."""
        for grant in list(self._grants.values()):
            if grant.timer is not None:
                grant.timer.cancel()
            self._drop_grant(grant)


def _contents_rows(splits: Sequence[Split], as_of: int | None) -> int:
    """How many rows the contents hold, when the parts tell without reading them (every
    update +1, none past ``as_of``: each row once per update); else -1 (unknown). The splits
    cut the keys into disjoint ranges, so each part's rows count once however many splits
    name it."""
    parts = {p.key: p for s in splits for p in s.parts}.values()
    if as_of is None or any(
        p.min_diff != 1 or p.max_diff != 1 or p.max_time > as_of for p in parts
    ):
        return -1
    return sum(p.rows for p in parts)


def _one_batch(table: pa.Table, schema: pa.Schema) -> pa.RecordBatch:
    """A listen event's rows as one message (its upper covers all of them)."""
    if table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    batches = table.combine_chunks().to_batches()
    batch = batches[0]
    return (
        batch
        if batch.schema == schema
        else pa.RecordBatch.from_arrays(batch.columns, schema=schema)
    )
